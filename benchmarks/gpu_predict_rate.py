"""``vitlab predict``'s rate on a GPU at bf16: a run's checkpoint over a folder of images, three passes (the first
warms the page cache, the workers and the kernels), each timed around ``predict_images`` and its CSV output::

    python benchmarks/gpu_predict_rate.py RUN ../shared/data/cifar10/test [--batch-size 1024 --workers 16]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from vitlab import load_model
from vitlab.prediction import predict_images


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("root", help="a folder of images (class folders or not)")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    model = load_model(args.checkpoint)
    print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.passes):
            start = time.perf_counter()
            result = predict_images(model, [args.root], Path(tmp) / f"pass{i}.csv", batch_size=args.batch_size,
                                    num_workers=args.workers, precision="bf16")
            seconds = time.perf_counter() - start
            print(f"pass {i}: {result['images']} images in {seconds:.2f} s, {result['images'] / seconds:.0f} "
                  f"images/s (bf16, batch {args.batch_size}, {args.workers} workers)")


if __name__ == "__main__":
    main()
