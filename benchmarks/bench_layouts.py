"""How far apart two uninterrupted runs on different process layouts end (docs/clusters.md): the quick config on
real CIFAR-10 images for whole epochs on 1 gloo process and on 2 (the same global batches: the same samples and
augmentations every step), with nothing drawn per process (no mixup, cutmix or drop path), and a second 1-process
run as the control. Reports the largest weight difference, against the learning rate, and each logged step's
training loss difference::

    python benchmarks/bench_layouts.py --data ../shared/data/cifar10 --epochs 1 [--train-subset 2000]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def run(processes: int, out: Path, data: str, epochs: int, subset: int) -> None:
    keys = ["--config", str(ROOT / "configs/cifar10_cpu_quick.yaml"), "data.dataset=imagefolder", f"data.root={data}",
            f"data.train_subset={subset}", "data.test_subset=200", f"train.epochs={epochs}", "data.mixup_alpha=0",
            "data.cutmix_alpha=0", "model.drop_path_rate=0", "train.log_every=1", "data.loader=torch",
            "data.num_workers=0", f"train.output_dir={out}"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--standalone"] \
        if processes > 1 else [sys.executable]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    subprocess.run([*launch, str(ROOT / "train.py"), *keys], check=True, env=env, stdout=subprocess.DEVNULL)


def steps(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["split"] == "train"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--train-subset", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        outs = {name: Path(tmp) / name for name in ("one", "one_again", "two")}
        for name, out in outs.items():
            run(2 if name == "two" else 1, out, args.data, args.epochs, args.train_subset)
        weights = {n: load_file(str(o / "checkpoints/last/model.safetensors")) for n, o in outs.items()}
        losses = {n: steps(o) for n, o in outs.items()}
    lr = 3e-3
    for other in ("one_again", "two"):
        diff = max((weights["one"][k] - weights[other][k]).abs().max().item() for k in weights["one"])
        worst_loss = max(abs(a - b) for a, b in zip(losses["one"], losses[other]))
        first = next((i for i, (a, b) in enumerate(zip(losses["one"], losses[other])) if a != b), None)
        print(f"1 process vs {other}: {len(losses['one'])} logged steps, largest weight difference {diff:.3g} "
              f"({diff / lr:.2f} x the peak lr {lr}); step losses: largest difference {worst_loss:.3g}, the first that "
              f"differs: {'none' if first is None else f'step {first + 1}'} (step 1: "
              f"{abs(losses['one'][0] - losses[other][0]):.3g})")


if __name__ == "__main__":
    main()
