"""Frames without information planted in CIFAR-10, and what ``vitlab inspect`` calls them (issue 70, 9).

``plant`` links a class-balanced subset of CIFAR-10 (``--train`` images a class of the training split, ``--test`` of
the test split) into ``--out`` and files, under random classes of its training split, ``--noise`` images of uniform
noise and ``--two-tone`` frames of two flat colours (left and right halves, colours drawn at random), named
``junk_noise_*`` and ``junk_twotone_*``. ``count`` reads an inspection's ``issues.csv`` and counts, for each kind of
planted frame, the rows that name it by issue kind (a near-duplicate pair counts for both of its images)::

    python benchmarks/inspect_junk.py plant --cifar ../shared/data/cifar10 --out /tmp/junk
    vitlab inspect --checkpoint RUN --output /tmp/junk_report data.dataset=imagefolder data.root=/tmp/junk
    python benchmarks/inspect_junk.py count --report /tmp/junk_report
"""
from __future__ import annotations

import argparse
import csv
import json
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image


def plant(cifar: Path, out: Path, train: int, test: int, noise: int, two_tone: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    classes = sorted(p.name for p in (cifar / "train").iterdir() if p.is_dir())
    for split, per_class in (("train", train), ("test", test)):
        for c in classes:
            files = sorted((cifar / split / c).glob("*.png"))
            (out / split / c).mkdir(parents=True, exist_ok=True)
            for f in rng.choice(files, per_class, replace=False):
                (out / split / c / f.name).symlink_to(f.resolve())
    for i in range(noise):
        pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(out / "train" / classes[rng.integers(len(classes))] / f"junk_noise_{i}.png")
    for i in range(two_tone):
        pixels = np.zeros((32, 32, 3), np.uint8)
        pixels[:, :16], pixels[:, 16:] = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
        Image.fromarray(pixels).save(out / "train" / classes[rng.integers(len(classes))] / f"junk_twotone_{i}.png")


def count(report: Path) -> dict[str, dict[str, int]]:
    found: dict[str, Counter] = {"noise": Counter(), "twotone": Counter()}
    for row in csv.DictReader(open(report / "issues.csv", newline="")):
        for name in (row["image"], row["duplicate_of"].split(":", 1)[-1]):
            kind = next((k for k in found if f"junk_{k}_" in name), None)
            if kind is not None:
                found[kind][row["issue"]] += 1
    return {k: dict(v) for k, v in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plant")
    p.add_argument("--cifar", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--train", type=int, default=300, help="training images a class")
    p.add_argument("--test", type=int, default=100, help="test images a class")
    p.add_argument("--noise", type=int, default=30)
    p.add_argument("--two-tone", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("count")
    c.add_argument("--report", type=Path, required=True)
    args = parser.parse_args()
    if args.command == "plant":
        plant(args.cifar, args.out, args.train, args.test, args.noise, args.two_tone, args.seed)
    else:
        print(json.dumps(count(args.report), indent=1))


if __name__ == "__main__":
    main()
