"""JPEG decoding on the GPU (nvJPEG, through ``torchvision.io.decode_jpeg(device="cuda")`` on batches of
files) against libjpeg-turbo on the CPU's cores (simplejpeg, as vitlab's streamed pipeline decodes), on
the same files held in memory as bytes. Also the GPU decode followed by a random resized crop to
``--size`` on the GPU (one ``resized_crop`` per image, as the images differ in size).

    python benchmarks/make_photos.py --out /tmp/photos
    python benchmarks/bench_gpu_decode.py --root /tmp/photos --workers 1,16
"""
from __future__ import annotations

import argparse
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch


def _decode_all(blobs: list[bytes]) -> int:
    import simplejpeg

    for blob in blobs:
        simplejpeg.decode_jpeg(blob, colorspace="RGB")
    return len(blobs)


def cpu_rate(blobs: list[bytes], workers: int) -> float:
    chunks = [blobs[i::workers * 4] for i in range(workers * 4)]
    with Pool(workers) as pool:
        pool.map(_decode_all, [blobs[:workers]] * workers)  # start the workers
        start = time.perf_counter()
        done = sum(pool.map(_decode_all, chunks))
    return done / (time.perf_counter() - start)


def gpu_rate(data: list[torch.Tensor], batch: int, size: int | None, repeats: int = 3) -> float:
    from torchvision.io import decode_jpeg
    from torchvision.transforms.v2 import RandomResizedCrop
    from torchvision.transforms.v2 import functional as F

    def run() -> int:
        for i in range(0, len(data), batch):
            images = decode_jpeg(data[i:i + batch], device="cuda")
            if size is not None:
                crops = []
                for image in images:
                    top, left, h, w = RandomResizedCrop.get_params(image, (0.08, 1.0), (3 / 4, 4 / 3))
                    crops.append(F.resized_crop(image, top, left, h, w, [size, size], antialias=True))
                torch.stack(crops)
        torch.cuda.synchronize()
        return len(data)

    run()  # warm-up: nvJPEG's handles and buffers
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        rates.append(run() / (time.perf_counter() - start))
    return float(np.median(rates))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="a folder of JPEGs (searched recursively)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--workers", default="1,16")
    parser.add_argument("--limit", type=int, default=4096)
    args = parser.parse_args()
    files = sorted(p for p in Path(args.root).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))[:args.limit]
    blobs = [f.read_bytes() for f in files]
    tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
    print(f"{len(files)} JPEGs, {sum(map(len, blobs)) / len(blobs) / 1024:.0f} KiB each, {torch.cuda.get_device_name()}")
    for w in map(int, args.workers.split(",")):
        print(f"  libjpeg-turbo (simplejpeg), {w:2d} CPU processes: {cpu_rate(blobs, w):9.0f} images/s", flush=True)
    print(f"  nvJPEG, batches of {args.batch}:                  {gpu_rate(tensors, args.batch, None):9.0f} images/s",
          flush=True)
    print(f"  nvJPEG + random resized crop to {args.size} on the GPU: {gpu_rate(tensors, args.batch, args.size):9.0f} "
          f"images/s", flush=True)


if __name__ == "__main__":
    main()
