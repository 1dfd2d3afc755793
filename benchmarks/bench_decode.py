"""Decoding a split into memory: wall time and the process's peak RSS added, for one ImageFolder split.

    python benchmarks/bench_decode.py --data ../shared/data/cifar10 --split train

The figure is what ``vitlab.data.load_split`` costs on top of the interpreter and its imports: the
decoded images alone take N x 3 x H x W bytes (CIFAR-10's training split: 146.5 MiB).
"""
from __future__ import annotations

import argparse
import resource
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="an ImageFolder root (<split>/<class>/*.png)")
    parser.add_argument("--split", default="train")
    args = parser.parse_args()
    from vitlab.data import load_split

    def peak_mib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB

    before, started = peak_mib(), time.perf_counter()
    data = load_split("imagefolder", args.data, args.split)
    seconds = time.perf_counter() - started
    print(f"{len(data.labels):,} images, {data.images.numel() / 2 ** 20:.1f} MiB decoded, peak RSS "
          f"+{peak_mib() - before:.0f} MiB, {seconds:.1f} s")


if __name__ == "__main__":
    main()
