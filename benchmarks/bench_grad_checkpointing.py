"""What gradient checkpointing saves and costs: peak memory and time of a training step with and without
``model.set_grad_checkpointing(True)``.

Each mode runs in a fresh process (so one mode's freed memory cannot hide the other's peak), and the
modes alternate over ``--rounds``. On the CPU the peak is the process's peak resident memory
(``ru_maxrss``) during the steps minus its resident memory before the first forward (model, optimizer-free
weights, batch); on CUDA ``torch.cuda.max_memory_allocated`` over the same span. Time: median step
(forward + backward) after one warm-up step.

    python benchmarks/bench_grad_checkpointing.py                     # ViT-S/16, 224 px, batch 32, CPU
    python benchmarks/bench_grad_checkpointing.py --device cuda --batch 128
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def run_one(model_name: str, batch: int, steps: int, device: str, checkpointing: bool) -> dict:
    import torch

    import vitlab

    torch.manual_seed(0)
    model = vitlab.create_model(model_name).to(device).train()
    model.set_grad_checkpointing(checkpointing)
    size = model.patch_embed.img_size
    x = torch.randn(batch, 3, *size, device=device)
    y = torch.randint(0, model.num_classes, (batch,), device=device)

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=False)  # gradients stay allocated, as in training

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = _rss_mib()
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i:  # the first step is a warm-up (and allocates the gradients)
            times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return {"checkpointing": checkpointing, "peak_mib": peak - base, "step_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_small_patch16_224")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per mode, alternating")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--one", choices=("on", "off"), help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.model, args.batch, args.steps, args.device, args.one == "on")))
        return
    results: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for mode in ("off", "on"):
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--model", args.model, "--batch",
                                  str(args.batch), "--steps", str(args.steps), "--device", args.device],
                                 check=True, capture_output=True, text=True).stdout
            results[mode].append(json.loads(out.strip().splitlines()[-1]))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("peak_mib", "step_s")} for m, rs in results.items()}
    print(f"{args.model}, batch {args.batch}, {args.device}: training-step peak memory above the weights and batch, "
          f"median of {args.rounds} processes x {args.steps} steps")
    print(f"{'grad checkpointing':20s} {'peak MiB':>10s} {'step s':>8s}")
    for mode in ("off", "on"):
        print(f"{mode:20s} {med[mode]['peak_mib']:10.0f} {med[mode]['step_s']:8.2f}")
    print(f"saving {1 - med['on']['peak_mib'] / med['off']['peak_mib']:.0%} of the peak memory for "
          f"{med['on']['step_s'] / med['off']['step_s']:.2f}x the step time")


if __name__ == "__main__":
    main()
