"""Ablation of the seeds' variants on real CIFAR-10 at one budget: the CPU quick config, one seed.

Each row is ``python train.py --config configs/cifar10_cpu_quick.yaml <overrides>`` in its own run
directory; the table gives the final epoch's test top-1 (no model selection), parameters, training
throughput (images/s over the last epoch) and wall time.

    python benchmarks/ablation_cifar_cpu.py --data ../shared/data/cifar10 --out benchmarks/results/ablation
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROWS: dict[str, list[str]] = {
    "baseline (LayerNorm, MLP, dot softmax, learned pos, CLS)": [],
    "RMSNorm": ["model.norm_layer=rmsnorm"],
    "SwiGLU": ["model.mlp_layer=swiglu"],
    "sin-cos positions": ["model.pos_embed=sincos"],
    "no CLS + avg pooling": ["model.class_token=false", "model.global_pool=avg"],
    "linear attention": ["model.kernel=linear"],
    "argmax attention": ["model.kernel=argmax"],
    "MoE (4 experts, top-2)": ["model.mlp_layer=moe", "model.num_experts=4", "model.moe_top_k=2"],
    "additive score": ["model.score=additive"],
}


def run_row(name: str, overrides: list[str], data: str, out: Path, config: str) -> dict:
    run_dir = out / name.split(" (")[0].replace(" ", "_").replace("+", "").replace(",", "").lower()
    cmd = [sys.executable, "train.py", "--config", config, "data.dataset=imagefolder", f"data.root={data}",
           f"train.output_dir={run_dir}", *overrides]
    start = time.time()
    log = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - start
    if log.returncode != 0:
        return {"name": name, "overrides": overrides, "error": log.stderr.strip().splitlines()[-1:]}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["split"] == "eval"][-1]
    params = next(line for line in log.stdout.splitlines() if "M params" in line).split(": ")[1].split("M")[0]
    return {"name": name, "overrides": overrides, "test_top1": last["test_top1"], "params_M": float(params),
            "images_per_s": last["examples_per_s"], "wall_s": wall, "epochs": last["epoch"],
            "expert_utilization": last.get("expert_utilization")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="CIFAR-10 ImageFolder root")
    parser.add_argument("--out", default="benchmarks/results/ablation")
    parser.add_argument("--config", default="configs/cifar10_cpu_quick.yaml")
    parser.add_argument("--rows", nargs="*", help="only these rows (names as in the table)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "results.jsonl"
    for name, overrides in ROWS.items():
        if args.rows and name not in args.rows:
            continue
        result = run_row(name, overrides, args.data, out, args.config)
        print(json.dumps(result), flush=True)
        with results_file.open("a") as f:
            f.write(json.dumps(result) + "\n")
    print("| variant | overrides | test top-1 (final epoch) | params | images/s | wall |")
    print("|---|---|---|---|---|---|")
    for line in results_file.read_text().splitlines():
        r = json.loads(line)
        if "error" in r:
            print(f"| {r['name']} | `{' '.join(r['overrides'])}` | error: {r['error']} | | | |")
            continue
        print(f"| {r['name']} | `{' '.join(r['overrides']) or '-'}` | {100 * r['test_top1']:.2f}% | "
              f"{r['params_M']:.2f}M | {r['images_per_s']:.0f} | {r['wall_s']:.0f} s |")


if __name__ == "__main__":
    main()
