"""MAE's views in the loader against a batch at a time on the device (``data.views``): the shipped
``configs/mae_cifar10_cpu.yaml`` for one epoch on a CIFAR-10 ImageFolder, each setting in a process of its own,
alternating, ``--repeats`` times; the epoch's seconds, the seconds it waited for the loader, and the views' own
cost an image (the per-image view under its seeded generator, against the parameters drawn an image and the batch
made at once). Medians printed and written as JSON.

    python benchmarks/bench_views.py --data ../shared/data/cifar10
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_epoch(data: str, views: str, images: int, out_dir: Path) -> dict[str, float]:
    subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/mae_cifar10_cpu.yaml"),
                    "data.dataset=imagefolder", f"data.root={data}", f"data.train_subset={images}", "train.epochs=1",
                    f"data.views={views}", "train.log_with=none", f"train.output_dir={out_dir}"],
                   check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    epoch = next(r for r in records if r["split"] == "eval")
    return {"epoch_time": epoch["epoch_time"], "data_time": epoch["data_time"], "images_per_s": epoch["examples_per_s"]}


def view_costs(n: int = 2048, batch: int = 256) -> dict[str, float]:
    """Microseconds an image: the loader's view (crop, flip, mask noise under the image's seeded torch generator)
    against the device path's parameters drawn an image and its batched crops (here, on the CPU)."""
    import torch

    from vitlab.data.batch_views import BatchedResizedCrop
    from vitlab.data.images import seeded_transform
    from vitlab.data.transforms import rrc_train_transform
    from vitlab.tasks.pretraining import MaskedDeviceView, MaskedView

    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    loader_view = MaskedView(rrc_train_transform((32, 32), scale=(0.2, 1.0)), 64)
    device_view = MaskedDeviceView(BatchedResizedCrop((32, 32), scale=(0.2, 1.0)), 64)
    start = time.perf_counter()
    for i in range(n):
        seeded_transform(loader_view, image, 0, 1, i)
    loader = (time.perf_counter() - start) / n
    start = time.perf_counter()
    drawn = [device_view(image, torch.Generator().manual_seed(i)) for i in range(n)]
    draws = (time.perf_counter() - start) / n
    images = torch.stack([d[0] for d in drawn[:batch]])
    params = torch.stack([d[1] for d in drawn[:batch]])
    start = time.perf_counter()
    for _ in range(n // batch):
        device_view.apply(images, params)
    applied = (time.perf_counter() - start) / n
    return {"loader_view_us": 1e6 * loader, "device_draws_us": 1e6 * draws, "device_batch_us": 1e6 * applied}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a CIFAR-10 ImageFolder (train/<class>/*.png)")
    parser.add_argument("--images", type=int, default=50000, help="training images an epoch")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/views_cpu.json"))
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"loader": [], "device": []}
    for _ in range(args.repeats):
        for views in runs:
            with tempfile.TemporaryDirectory() as tmp:
                runs[views].append(one_epoch(args.data, views, args.images, Path(tmp) / "run"))
                print(views, runs[views][-1], flush=True)
    result = {"runs": runs, "medians": {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                                        for v, rs in runs.items()},
              "view_costs": view_costs(), "threads": os.environ.get("OMP_NUM_THREADS", "torch's default"),
              "command": " ".join(sys.argv)}
    print(json.dumps(result["medians"], indent=1), json.dumps(result["view_costs"], indent=1))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
