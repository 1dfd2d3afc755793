"""Attention cost against sequence length: forward + backward time and peak memory of each kernel.

One process, CPU (or the GPU if asked), ``(B, H, L, D) = (1, 4, L, 32)``, non-causal, L = 64 ... 4096.
Each (kernel, L) runs in a fresh subprocess so that its peak resident memory (``ru_maxrss``, minus the
memory before the attention call) belongs to it alone; time is the median of ``--repeats``
forward + backward passes after one warm-up. A kernel's series stops at the first length that runs
out of memory or takes longer than ``--max-seconds``.

    python benchmarks/bench_attention_length.py --out benchmarks/results/attention_length.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

KERNELS = ["softmax (fused)", "softmax (explicit)", "streaming", "linear", "additive"]
LENGTHS = [64, 128, 256, 512, 1024, 2048, 4096]


def _child(kernel: str, length: int, repeats: int, device: str) -> dict:
    import resource
    import statistics
    import time

    import torch

    from vitlab.attention import (additive_attention, linear_attention, scaled_dot_product_attention,
                                  streaming_attention)

    torch.manual_seed(0)
    b, h, d = 1, 4, 32
    q, k, v = (torch.randn(b, h, length, d, device=device, requires_grad=True) for _ in range(3))
    w_q, w_k = (torch.randn(h, d, d, device=device, requires_grad=True) for _ in range(2))
    w_v = torch.randn(h, d, device=device, requires_grad=True)
    fns = {
        "softmax (fused)": lambda: scaled_dot_product_attention(q, k, v),
        "softmax (explicit)": lambda: scaled_dot_product_attention(q, k, v, need_weights=True)[0],
        "streaming": lambda: streaming_attention(q, k, v, block_size=128),
        "linear": lambda: linear_attention(q, k, v),
        "additive": lambda: additive_attention(q, k, v, w_q, w_k, w_v),
    }
    fn = fns[kernel]

    def step() -> None:
        fn().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    if device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # KiB -> MiB
    return {"kernel": kernel, "L": length, "ms": 1000 * statistics.median(times), "peak_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/attention_length.json")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-seconds", type=float, default=20.0)
    parser.add_argument("--max-gib", type=float, default=8.0, help="skip runs estimated to need more memory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(_child(args.child[0], int(args.child[1]), args.repeats, args.device)))
        return
    results = []
    for kernel in KERNELS:
        for length in LENGTHS:
            # Additive scores hold (B, H, L, L, D) floats several times over: skip what would not fit.
            estimate_gib = 3 * 4 * length ** 2 * 32 * 4 / 2 ** 30 if kernel == "additive" else 0.0
            if estimate_gib > args.max_gib:
                results.append({"kernel": kernel, "L": length,
                                "error": f"skipped: needs ~{estimate_gib:.0f} GiB > --max-gib {args.max_gib}"})
                print(json.dumps(results[-1]), flush=True)
                break
            cmd = [sys.executable, __file__, "--child", kernel, str(length), "--repeats", str(args.repeats),
                   "--device", args.device, "--threads", str(args.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                results.append({"kernel": kernel, "L": length, "error": (proc.stderr.strip().splitlines() or
                                                                          [f"exit {proc.returncode}"])[-1]})
                print(json.dumps(results[-1]), flush=True)
                break
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
            if results[-1]["ms"] / 1000 > args.max_seconds:
                break
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print("\n| L | " + " | ".join(KERNELS) + " |")
    print("|---" * (len(KERNELS) + 1) + "|")
    for length in LENGTHS:
        cells = []
        for kernel in KERNELS:
            r = next((r for r in results if r["kernel"] == kernel and r["L"] == length), None)
            cells.append("-" if r is None else "skipped (memory)" if "skipped" in r.get("error", "")
                         else "OOM" if "error" in r else f"{r['ms']:.1f} ms / {r['peak_mib']:.0f} MiB")
        print(f"| {length} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
