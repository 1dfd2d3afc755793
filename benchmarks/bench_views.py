"""Pretraining's views in the loader against a batch at a time on the device (``data.views``): the shipped
``configs/mae_cifar10_cpu.yaml`` (``--task dino``: ``configs/dino_cifar10_cpu.yaml``) for one epoch on a CIFAR-10
ImageFolder, each setting in a process of its own, alternating, ``--repeats`` times; the epoch's seconds, the
seconds it waited for the loader, and the views' own
cost an image (the per-image view under its seeded generator, against the parameters drawn an image and the batch
made at once). Medians printed and written as JSON.

    python benchmarks/bench_views.py --data ../shared/data/cifar10

``--task classification``: the quick config (``configs/cifar10_cpu_quick.yaml``) with random resized crops
(``data.train_crop=rrc`` of the images kept at 40 px), the DataLoader's per-image crops (``data.loader=torch``) against the device loader's
batch (``data.loader=gpu``).

``--gpu DIR`` (issue 75): pretraining images/s on a GPU, views in the loader against a batch at a time on the
device, for MAE and DINO with the shipped CPU configs' models (32 px) and with ViT-S/16 at 224 px, each run two
epochs in a process of its own (bf16, ``--workers`` loader workers for both paths), the second epoch's figure
reported. The images are made in DIR first (random pixels: throughput does not depend on them): ``--images``
PNGs at 32 px, ``--images-224`` JPEGs at 256 px kept in memory at that size.

    python benchmarks/bench_views.py --gpu /tmp/w/views --output $OUT/views_gpu.json
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


def one_epoch(data: str, views: str, images: int, out_dir: Path, task: str = "mae",
              extra: tuple[str, ...] = ()) -> dict[str, float]:
    if task == "classification":  # the views of random resized crops: the DataLoader's or the device loader's
        config, setting = "configs/cifar10_cpu_quick.yaml", ["data.train_crop=rrc", "data.decode_size=40",
                                                             f"data.loader={'gpu' if views == 'device' else 'torch'}"]
    else:
        config, setting = f"configs/{task}_cifar10_cpu.yaml", [f"data.views={views}"]
    subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / config),
                    "data.dataset=imagefolder", f"data.root={data}", f"data.train_subset={images}", "train.epochs=1",
                    *setting, *extra, "train.log_with=none", f"train.output_dir={out_dir}"],
                   check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    epoch = next(r for r in records if r["split"] == "eval")
    return {"epoch_time": epoch["epoch_time"], "data_time": epoch["data_time"], "images_per_s": epoch["examples_per_s"]}


GPU_RUNS = {  # name: (images, the config: a shipped one's path, or its sections)
    "mae_cpu_config": ("c32", "configs/mae_cifar10_cpu.yaml"),
    "dino_cpu_config": ("c32", "configs/dino_cifar10_cpu.yaml"),
    "mae_vit_s16_224": ("p256", {"task": "mae", "model": {"name": "mae_vit_small_patch16_224"},
                                 "data": {"decode_size": 256, "train_crop": "rrc", "scale": [0.2, 1.0]},
                                 "optim": {"lr": 1.5e-4, "betas": [0.9, 0.95], "weight_decay": 0.05},
                                 "train": {"batch_size": 256}}),
    "dino_vit_s16_224": ("p256", {"task": "dino", "model": {"name": "dino_vit_small_patch16_224"},
                                  "data": {"decode_size": 256}, "optim": {"lr": 5e-4, "weight_decay": 0.04},
                                  "train": {"batch_size": 128}}),
}


def make_images(folder: Path, count: int, size: int, suffix: str) -> None:
    """``count`` images of random smooth-and-noisy pixels, ``size`` px square, in ``folder``."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (count // 64 + 1, size, size, 3), dtype=np.uint8)
    for i in range(count):
        noise = rng.integers(-20, 21, (size, size, 3))
        pixels = np.clip(base[i // 64].astype(np.int16) + noise, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:06d}{suffix}", quality=90)


def gpu_epoch(name: str, views: str, data: Path, workers: int, out_dir: Path, extra: list[str]) -> dict[str, float]:
    _, config = GPU_RUNS[name]
    if isinstance(config, dict):
        import yaml

        path = data.parent / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        config = str(path)
    task = "dino" if "dino" in name else "mae"
    extra = [e for e in extra if e.split(".")[0] not in {"mae", "dino"} - {task}]  # a key of the other task's section
    command = [sys.executable, str(ROOT / "train.py"), "--config", config, "data.dataset=imagefolder",
               f"data.root={data}",
               "data.download=false", f"data.views={views}", f"data.num_workers={workers}", "train.epochs=2",
               "train.mixed_precision=bf16", "train.eval_every=0", "train.log_with=none", "optim.warmup_epochs=1",
               f"train.output_dir={out_dir}", *extra]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          cwd=ROOT)
    if done.returncode:
        return {"error": done.stderr[-1500:], "command": " ".join(command)}
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    epoch = [r for r in records if "examples_per_s" in r][-1]
    return {"images_per_s": epoch["examples_per_s"], "epoch_time": epoch["epoch_time"],
            "data_time": epoch["data_time"], "wall_s": time.perf_counter() - start, "command": " ".join(command)}


def gpu_main(folder: Path, names: list[str], workers: int, counts: dict[str, int], output: Path,
             extra: list[str]) -> None:
    made = {"c32": (counts["c32"], 32, ".png"), "p256": (counts["p256"], 256, ".jpg")}
    for kind, (count, size, suffix) in made.items():
        if any(GPU_RUNS[n][0] == kind for n in names) and not (folder / kind / "done").exists():
            make_images(folder / kind / "images", count, size, suffix)
            (folder / kind / "done").touch()
    result = json.loads(output.read_text()) if output.exists() else {}  # runs done before are kept: re-runnable
    for name in names:
        for views in ("loader", "device"):
            key = f"{name}/{views}"
            if key in result and "error" not in result[key]:
                continue
            with tempfile.TemporaryDirectory() as tmp:
                result[key] = gpu_epoch(name, views, folder / GPU_RUNS[name][0], workers, Path(tmp) / "run", extra)
            print(key, {k: v for k, v in result[key].items() if k != "command"}, flush=True)
            output.write_text(json.dumps(result, indent=1) + "\n")
        loader, device = (result[f"{name}/{v}"].get("images_per_s") for v in ("loader", "device"))
        if loader and device:
            print(f"{name}: device/loader images/s {device / loader:.2f}", flush=True)


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
    parser.add_argument("--data", help="a CIFAR-10 ImageFolder (train/<class>/*.png)")
    parser.add_argument("--task", choices=("mae", "dino", "classification"), default="mae",
                        help="the shipped CPU config of this task (classification: the quick config, with rrc)")
    parser.add_argument("--gpu", type=Path, help="the GPU runs (see above), their images made in this folder")
    parser.add_argument("--runs", default=",".join(GPU_RUNS), help="--gpu: which of " + ", ".join(GPU_RUNS))
    parser.add_argument("--workers", type=int, default=12, help="--gpu: DataLoader workers")
    parser.add_argument("--set", action="append", default=[],
                        help="a key=value for every run (e.g. data.in_memory=false: streamed images; smoke tests)")
    parser.add_argument("--images-224", type=int, default=4096, help="--gpu: images of the 224-px runs")
    parser.add_argument("--images", type=int, default=50000, help="training images an epoch (--gpu: 32-px ones)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/views_cpu.json"))
    args = parser.parse_args()
    if args.gpu:
        return gpu_main(args.gpu, args.runs.split(","), args.workers, {"c32": args.images, "p256": args.images_224},
                        Path(args.output), args.set)
    runs: dict[str, list[dict[str, float]]] = {"loader": [], "device": []}
    for _ in range(args.repeats):
        for views in runs:
            with tempfile.TemporaryDirectory() as tmp:
                runs[views].append(one_epoch(args.data, views, args.images, Path(tmp) / "run", args.task,
                                             tuple(args.set)))
                print(views, runs[views][-1], flush=True)
    result = {"runs": runs, "medians": {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                                        for v, rs in runs.items()},
              "view_costs": view_costs() if args.task == "mae" else None,
              "threads": os.environ.get("OMP_NUM_THREADS", "torch's default"),
              "command": " ".join(sys.argv)}
    print(json.dumps(result["medians"], indent=1), json.dumps(result["view_costs"], indent=1))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
