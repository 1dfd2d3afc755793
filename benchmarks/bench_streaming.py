"""Streamed images (``data.in_memory=false``, ``data.dataset=wds``): the memory one epoch takes, and what
resuming inside an epoch costs.

1. Memory: one process iterates one epoch of N training images decoded at ``--size`` by 2 DataLoader
   workers (the training transform, batches of 64, no model), in a fresh subprocess for each N; the
   peak RSS of the main process and of its largest worker, for N = 1,000 and 10,000; from the
   ImageFolder, and with ``--shards`` from the same images as WebDataset shards.
2. Resume: the seconds until the first batch of an epoch resumed after k samples, for k = 0, half and
   nearly all of the split. ImageFolder: Accelerate's ``skip_first_batches`` (the sampler skips
   indices, nothing is decoded). Shards: each reader reads its part again and passes over, undecoded,
   the samples already given.

    vitlab shards ../shared/data/cifar10 /tmp/c10shards --shard-size 1000
    python benchmarks/bench_streaming.py --data ../shared/data/cifar10 --shards /tmp/c10shards --size 224
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _shard_loader(shards: str, size: int, images: int = 0, workers: int = 2):
    from vitlab.data.transforms import train_transform
    from vitlab.data.shard_stream import ShardLoader, ShardStream, spread
    from vitlab.data.shards import index_shards

    index = index_shards(shards, "train")
    take = spread(images, index.counts) if images else index.counts
    stream = ShardStream(index, [(s, 0, n) for s, n in enumerate(take)], train_transform((size, size)), 64, True,
                         (size, size), num_workers=workers)
    return ShardLoader(stream)


def one_epoch(data: str, images: int, size: int, shards: str | None) -> None:
    """Child process: one streamed epoch; prints its peak RSS (MiB) and its workers'."""
    from torch.utils.data import DataLoader

    from vitlab.data import index_split
    from vitlab.data.images import TensorImageDataset
    from vitlab.data.transforms import train_transform

    if shards:
        loader = _shard_loader(shards, size, images)
    else:
        split = index_split("imagefolder", data, "train").load((size, size), subset=images, in_memory=False)
        loader = DataLoader(TensorImageDataset(split, train_transform((size, size)), seed=0), batch_size=64,
                            shuffle=True, num_workers=2)
    for _ in loader:
        pass
    print(json.dumps({"main_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "worker_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))


def resume_cost(data: str, size: int) -> dict[int, float]:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from vitlab.data import index_split
    from vitlab.data.images import TensorImageDataset
    from vitlab.data.transforms import train_transform

    split = index_split("imagefolder", data, "train").load((size, size), in_memory=False)
    dataset = TensorImageDataset(split, train_transform((size, size)), seed=0)
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(dataset, batch_size=64, shuffle=True, drop_last=True, num_workers=2))
    seconds = {}
    for skip in (0, len(loader) // 2, len(loader) - 2):
        started = time.perf_counter()
        next(iter(accelerator.skip_first_batches(loader, skip) if skip else loader))
        seconds[skip * 64] = time.perf_counter() - started
    return seconds


def shard_resume_cost(shards: str, size: int) -> dict[int, float]:
    loader = _shard_loader(shards, size)
    seconds = {}
    for skip in (0, len(loader) // 2, len(loader) - 2):
        started = time.perf_counter()
        next(iter(loader.batches_from(skip)))
        seconds[skip * 64] = time.perf_counter() - started
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="an ImageFolder root (train/<class>/*)")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--shards", help="the same images as WebDataset shards (vitlab shards)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-shards", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return one_epoch(args.data, args.child, args.size, args.shards if args.child_shards else None)
    for source in ("ImageFolder", "shards") if args.shards else ("ImageFolder",):
        for images in (1000, 10000):
            done = subprocess.run([sys.executable, __file__, "--data", args.data, "--size", str(args.size), "--child",
                                   str(images), *(["--shards", args.shards, "--child-shards"] if source == "shards"
                                                  else [])], capture_output=True, text=True, check=True)
            rss = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{source}: one streamed epoch of {images:,} images at {args.size} px: peak RSS "
                  f"{rss['main_mib']:.0f} MiB (main process), {rss['worker_mib']:.0f} MiB (largest worker)", flush=True)
    for skipped, seconds in resume_cost(args.data, args.size).items():
        print(f"ImageFolder: first batch of an epoch resumed after {skipped:,} samples: {seconds:.2f} s", flush=True)
    if args.shards:
        for skipped, seconds in shard_resume_cost(args.shards, args.size).items():
            print(f"shards: first batch of an epoch resumed after {skipped:,} samples: {seconds:.2f} s", flush=True)


if __name__ == "__main__":
    main()
