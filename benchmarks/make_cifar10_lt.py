"""CIFAR-10-LT (Cao et al. 2019; Menon et al. 2021): the long-tailed CIFAR-10 of the logit-adjustment
paper, from the ImageFolder copy of CIFAR-10 (``../shared/data/cifar10``).

Class ``i`` (in the folder's sorted order) keeps ``int(5000 * ratio ** (-i / 9))`` of its training images,
chosen at random by ``--seed``: 12,406 images at ratio 100, from 5,000 airplanes down to 50 trucks. The test
split is CIFAR-10's own, balanced (1,000 a class). Written as a folder of symbolic links (``OUT/train/<class>``,
``OUT/test`` -> the source's test folder), so ``data.dataset=imagefolder data.root=OUT`` trains on it:

    python benchmarks/make_cifar10_lt.py --data ../shared/data/cifar10 --out data/cifar10_lt
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path


def make_cifar10_lt(data: Path, out: Path, ratio: float = 100.0, seed: int = 0) -> dict[str, int]:
    """Write CIFAR-10-LT under ``out``; returns the training images kept for each class."""
    classes = sorted(p.name for p in (data / "train").iterdir() if p.is_dir())
    if len(classes) != 10:
        raise SystemExit(f"{data / 'train'} holds {len(classes)} class folders, not CIFAR-10's 10")
    rng, kept = random.Random(seed), {}
    for i, name in enumerate(classes):
        files = sorted((data / "train" / name).iterdir())
        keep = int(5000 * ratio ** (-i / (len(classes) - 1)))
        folder = out / "train" / name
        folder.mkdir(parents=True, exist_ok=True)
        for f in rng.sample(files, keep):
            (folder / f.name).symlink_to(f.resolve())
        kept[name] = keep
    (out / "test").symlink_to((data / "test").resolve())
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/cifar10"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ratio", type=float, default=100.0, help="the largest class over the smallest")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; give a new folder")
    kept = make_cifar10_lt(args.data, args.out, args.ratio, args.seed)
    print(f"{sum(kept.values()):,} training images: " + ", ".join(f"{k} {v}" for k, v in kept.items()))


if __name__ == "__main__":
    main()
