"""A multi-label data set from the real CIFAR-10 images (issue 50): 2 x 2 mosaics at 64 px, each showing 1 to 4
distinct CIFAR-10 classes, its labels the classes present. Written in the csv layout of ``data.dataset=csv``
(``OUT/train.csv``, ``OUT/test.csv``: columns ``image`` and ``labels``, the names separated by spaces), the
mosaics as PNGs under ``OUT/images``. Training mosaics are cut from CIFAR-10's training split only, test mosaics
from its test split only, so no image is on both sides.

Each mosaic draws its number of classes k uniformly from 1-4 and k distinct classes, then fills its four tiles:
each of the k classes once, the other tiles from those k at random, every tile a random image of its class, in
random places. Seeded:

    python benchmarks/make_cifar10_mosaic.py --data ../shared/data/cifar10 --out data/cifar10_mosaic
    python train.py --config configs/cifar10_mosaic_cpu.yaml
"""
from __future__ import annotations

import argparse
import csv
import random
from pathlib import Path

import numpy as np
from PIL import Image


def make_mosaics(data: Path, out: Path, counts: dict[str, int], seed: int = 0) -> dict[str, int]:
    """Write the mosaics of each split in ``counts`` (its name in ``data`` -> how many) under ``out``; returns
    the labels written per split."""
    classes = sorted(p.name for p in (data / "train").iterdir() if p.is_dir())
    rng = random.Random(seed)
    (out / "images").mkdir(parents=True, exist_ok=True)
    labels_written = {}
    for split, n in counts.items():
        files = {c: sorted((data / split / c).iterdir()) for c in classes}
        rows, total = [], 0
        for i in range(n):
            k = rng.randint(1, 4)
            present = rng.sample(classes, k)
            tiles = present + [rng.choice(present) for _ in range(4 - k)]
            rng.shuffle(tiles)
            pixels = np.zeros((64, 64, 3), np.uint8)
            for t, c in enumerate(tiles):
                tile = np.asarray(Image.open(rng.choice(files[c])).convert("RGB"))
                pixels[32 * (t // 2):32 * (t // 2) + 32, 32 * (t % 2):32 * (t % 2) + 32] = tile
            name = f"images/{split}_{i:05d}.png"
            Image.fromarray(pixels).save(out / name)
            rows.append((name, " ".join(sorted(present))))
            total += k
        with (out / f"{split}.csv").open("w", newline="") as f:
            csv.writer(f).writerows([("image", "labels"), *rows])
        labels_written[split] = total
    return labels_written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/cifar10"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--train", type=int, default=10000, help="training mosaics")
    parser.add_argument("--test", type=int, default=2000, help="test mosaics")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    written = make_mosaics(args.data, args.out, {"train": args.train, "test": args.test}, args.seed)
    print(f"wrote {args.train} training and {args.test} test mosaics ({written} labels) to {args.out}")


if __name__ == "__main__":
    main()
