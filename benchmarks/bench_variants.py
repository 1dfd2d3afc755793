"""Training throughput of each ablation variant, side by side in one process (the ablation's images/s).

Each variant of ``ablation_cifar_cpu.ROWS`` is built from the quick CPU config and takes ``--steps``
AdamW steps on a random batch of 128 32x32 images (forward, loss + MoE balancing loss, backward,
update); the figure is 128 / median step time, after ``--warmup`` steps. Rounds alternate over the
variants so that machine noise spreads evenly.

    python benchmarks/bench_variants.py --out benchmarks/results/variants_throughput.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ablation_cifar_cpu import ROWS  # noqa: E402

from vitlab.config import load_config  # noqa: E402
from vitlab.layers import moe_aux_loss  # noqa: E402
from vitlab.tasks import build_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/cifar10_cpu_quick.yaml")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/variants_throughput.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    x, y = torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,))
    setups = {}
    for name, overrides in ROWS.items():
        model = build_model(load_config(args.config, overrides))
        setups[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(name: str) -> float:
        model, opt = setups[name]
        start = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        aux = moe_aux_loss(model)
        (loss if aux is None else loss + aux).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in ROWS}
    for i in range(args.warmup + args.steps):
        for name in ROWS:
            t = step(name)
            if i >= args.warmup:
                times[name].append(t)
    results = [{"name": name, "images_per_s": 128 / statistics.median(ts),
                "params_M": sum(p.numel() for p in setups[name][0].parameters()) / 1e6} for name, ts in times.items()]
    Path(args.out).write_text(json.dumps(results, indent=1))
    base = results[0]["images_per_s"]
    for r in results:
        print(f"{r['name']:58s} {r['params_M']:.3f}M  {r['images_per_s']:6.0f} img/s  ({r['images_per_s'] / base:.2f}x)")


if __name__ == "__main__":
    main()
