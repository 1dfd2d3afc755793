"""vitlab predict over a folder against timm's inference pipeline (issue 51, 1), on this machine's CPU.

Both read the same PNG/JPEG files with 2 DataLoader workers, batches of 256, and run the same weights in eval
mode: vitlab's checkpoint through ``vitlab.prediction.predict_images`` (into a CSV file), and the model converted
by ``vitlab.interop.to_timm`` through timm's ``create_dataset`` + ``create_loader`` (its evaluation transform at
the checkpoint's input size, mean and std, crop_pct 1: a plain resize, as the checkpoint was trained) with a
softmax top-5, as timm's ``inference.py`` does. Timed alternately, each arm ``--repeats`` times; images/s are
medians. The peak memory (RSS, of the process and its workers) of ``vitlab predict`` is measured in fresh
processes on the first 1,000 and on all the images, and the top-1 of the output file against the folder's
classes is compared with ``vitlab eval``'s::

    python benchmarks/bench_predict.py --checkpoint RUN --root ../shared/data/cifar10/test --json benchmarks/results/predict_cpu.json

``--stages`` also times each pipeline's parts alone, alternately, medians of ``--repeats``: its loader (2 workers,
batches of 256, iterated with no model) and its forward pass on 10,000 images already in memory (vitlab's
BatchPredictor, cache-sized chunks side by side; timm's model on batches of 256 at torch's threads), and the rows and
CSV lines of 10,000 predictions. Every result records the versions it was measured with.

Run it alone on the machine: the arms are timed.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def vitlab_arm(checkpoint: str, root: Path, out: Path, batch: int, workers: int) -> float:
    from vitlab import load_model
    from vitlab.prediction import predict_images

    model = load_model(checkpoint)
    start = time.perf_counter()
    result = predict_images(model, [str(root)], out, batch_size=batch, num_workers=workers)
    return result["images"] / (time.perf_counter() - start)


def timm_arm(checkpoint: str, root: Path, batch: int, workers: int) -> float:
    from timm.data import create_dataset, create_loader

    from vitlab import load_model
    from vitlab.interop import to_timm

    model = load_model(checkpoint)
    cfg = model.pretrained_cfg
    net = to_timm(model).eval()
    start = time.perf_counter()
    dataset = create_dataset("", root=str(root))
    loader = create_loader(dataset, input_size=tuple(cfg["input_size"]), batch_size=batch, use_prefetcher=False,
                           num_workers=workers, crop_pct=1.0, mean=tuple(cfg["mean"]), std=tuple(cfg["std"]),
                           interpolation="bicubic")
    n = 0
    with torch.no_grad():
        for images, _ in loader:
            net(images).softmax(-1).topk(5)
            n += len(images)
    return n / (time.perf_counter() - start)


def versions() -> dict[str, str]:
    import numpy
    import PIL
    import timm
    import torchvision

    return {"torch": torch.__version__, "torchvision": torchvision.__version__, "timm": timm.__version__,
            "Pillow": PIL.__version__, "numpy": numpy.__version__, "python": sys.version.split()[0]}


def stages(checkpoint: str, root: Path, batch: int, workers: int, repeats: int) -> dict[str, float]:
    """Images/s of each pipeline's parts alone (see the module's docstring), medians of ``repeats``."""
    from timm.data import create_dataset, create_loader
    from torch.utils.data import DataLoader

    from vitlab import load_model
    from vitlab.inference.files import columns, csv_lines, rows
    from vitlab.inference.forward import cpu_chunk
    from vitlab.interop import to_timm
    from vitlab.prediction import BatchPredictor, image_dataset, list_images

    model = load_model(checkpoint)
    cfg, files = model.pretrained_cfg, list_images([str(root)])
    size = tuple(cfg["input_size"][1:])
    loaders = {
        "vitlab loader": lambda: DataLoader(image_dataset(model, None, files, list(range(len(files))), batch, "none"),
                                            batch_size=batch, num_workers=workers),
        "timm loader": lambda: create_loader(create_dataset("", root=str(root)), input_size=tuple(cfg["input_size"]),
                                             batch_size=batch, use_prefetcher=False, num_workers=workers,
                                             crop_pct=1.0, mean=tuple(cfg["mean"]), std=tuple(cfg["std"]),
                                             interpolation="bicubic"),
    }
    images = torch.randint(0, 256, (10_000, 3, *size), dtype=torch.uint8)
    net = to_timm(model).eval()
    names = list(cfg["label_names"])
    timed: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, make in loaders.items():
            start, n = time.perf_counter(), 0
            for batch_images, _ in make():
                n += len(batch_images)
            timed.setdefault(name, []).append(n / (time.perf_counter() - start))
        predictor = BatchPredictor(model, device=torch.device("cpu"), chunk=cpu_chunk(model, (3, *size)), names=names,
                                   k=5)
        start = time.perf_counter()
        for i in range(0, len(images), batch):
            predictor.probabilities(images[i:i + batch])
        timed.setdefault("vitlab forward", []).append(len(images) / (time.perf_counter() - start))
        predictor.close()
        x = images[:batch].float() / 255
        start = time.perf_counter()
        with torch.no_grad():
            for i in range(0, len(images), batch):
                net(x[:min(batch, len(images) - i)]).softmax(-1).topk(5)
        timed.setdefault("timm forward", []).append(len(images) / (time.perf_counter() - start))
        layout, probs = columns(names, 5, False), torch.rand(len(images), len(names)).softmax(-1)
        start = time.perf_counter()
        for i in range(0, len(images), batch):
            part = files[i:i + batch]
            csv_lines(rows(part, [""] * len(part), probs[i:i + len(part)], names, 5, None), layout)
        timed.setdefault("vitlab rows and CSV lines", []).append(len(images) / (time.perf_counter() - start))
    return {name: statistics.median(v) for name, v in timed.items()}


def peak_rss(checkpoint: str, inputs: list[str], out: Path, batch: int, workers: int) -> float:
    """Peak RSS in MiB of `vitlab predict` and its workers, in a fresh process."""
    code = ("import sys, resource; from vitlab import load_model; from vitlab.prediction import predict_images; "
            f"predict_images(load_model({checkpoint!r}), {inputs!r}, {str(out)!r}, batch_size={batch}, "
            f"num_workers={workers}); r = resource.getrusage; "
            "print(max(r(resource.RUSAGE_SELF).ru_maxrss, r(resource.RUSAGE_CHILDREN).ru_maxrss))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--root", type=Path, required=True, help="a folder of class folders")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--stages", action="store_true", help="also time each pipeline's parts alone")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    mine, theirs = [], []
    for r in range(args.repeats):
        mine.append(vitlab_arm(args.checkpoint, args.root, tmp / f"p{r}.csv", args.batch_size, args.workers))
        theirs.append(timm_arm(args.checkpoint, args.root, args.batch_size, args.workers))
        print(f"repeat {r}: vitlab {mine[-1]:.0f} images/s, timm {theirs[-1]:.0f} images/s", flush=True)
    files = sorted(str(p) for p in args.root.rglob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    few = tmp / "few"
    few.mkdir()
    for f in files[:1000]:
        (few / f"{Path(f).parent.name}_{Path(f).name}").symlink_to(Path(f).resolve())
    rss_few = peak_rss(args.checkpoint, [str(few)], tmp / "few.csv", args.batch_size, args.workers)
    rss_all = peak_rss(args.checkpoint, [str(args.root)], tmp / "all.csv", args.batch_size, args.workers)
    rows = list(csv.DictReader((tmp / "p0.csv").open()))
    top1 = sum(r["class_1"] == Path(r["image"]).parent.name for r in rows) / len(rows)
    result = {"vitlab_images_per_s": statistics.median(mine), "timm_images_per_s": statistics.median(theirs),
              "ratio": statistics.median(mine) / statistics.median(theirs), "runs": {"vitlab": mine, "timm": theirs},
              "rss_mib_1000": rss_few, f"rss_mib_{len(files)}": rss_all, "rss_ratio": rss_all / rss_few,
              "top1_from_file": top1, "images": len(files), "versions": versions(),
              "threads": torch.get_num_threads()}
    if args.stages:
        result["stages_images_per_s"] = stages(args.checkpoint, args.root, args.batch_size, args.workers,
                                               args.repeats)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
