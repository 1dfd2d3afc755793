"""Data pipeline: images/s each loader delivers against images/s the model consumes.

Loaders: the DataLoader path (per-image torchvision transforms; crop + flip, and with RandAugment)
at several worker counts, each with the per-image seeding training uses and without it, and the
device-resident loader (``data.loader: gpu``). The model's rate is
its training-step throughput at the same batch size. A loader must deliver well above what the
model consumes, or training waits for data.

    python benchmarks/bench_data.py --device cpu --data ../shared/data/cifar10
    python benchmarks/bench_data.py --device cuda --data ../shared/data/cifar10 --workers 0,4,8
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import vitlab
from vitlab.data import load_split
from vitlab.data.images import DeviceImageLoader, ImageData, TensorImageDataset, train_transform


def loader_rate(loader, device: torch.device, max_images: int) -> float:
    seen = 0
    start = time.perf_counter()
    for images, _ in loader:
        images = images.to(device, non_blocking=True)
        seen += len(images)
        if seen >= max_images:
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
    return seen / (time.perf_counter() - start)


def model_rate(name: str, batch: int, device: torch.device, dtype: torch.dtype | None, steps: int = 10) -> float:
    model = vitlab.create_model(name).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda" or None)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--data", help="CIFAR-10 in ImageFolder layout; default: 50,000 random images")
    parser.add_argument("--model", default="vit_cifar_small_patch4_32")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--images", type=int, default=10240, help="images timed per loader")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.data:
        start = time.perf_counter()
        data = load_split("imagefolder", args.data, "train")
        print(f"decoded {len(data.labels)} images once in {time.perf_counter() - start:.1f}s")
    else:
        data = ImageData(torch.randint(0, 256, (50000, 3, 32, 32), dtype=torch.uint8), torch.randint(0, 10, (50000,)),
                         [str(i) for i in range(10)])
    dtype = torch.bfloat16 if device.type == "cuda" else None
    consumes = model_rate(args.model, args.batch, device, dtype)
    print(f"device {device}; model {args.model} ({'bf16' if dtype else 'fp32'}) consumes {consumes:,.0f} images/s "
          f"at batch {args.batch}")
    print(f"{'loader':62s} {'images/s':>10s} {'x model':>8s}")
    rows = []
    for augment in ("none", "randaugment"):
        for workers in map(int, args.workers.split(",")):
            for seed in (0, None):  # 0: as training does (each image's augmentation seeded); None: unseeded
                ds = TensorImageDataset(data, train_transform((32, 32), augment=augment), seed=seed)
                dl = DataLoader(ds, batch_size=args.batch, shuffle=True, drop_last=True, num_workers=workers,
                                pin_memory=device.type == "cuda", persistent_workers=workers > 0)
                name = f"torch DataLoader, crop+flip{'+RandAugment' if augment != 'none' else ''}, {workers} workers"
                rows.append((name + ("" if seed is not None else ", unseeded"), loader_rate(dl, device, args.images)))
    gpu_loader = DeviceImageLoader(data, args.batch, device)
    loader_rate(gpu_loader, device, args.batch * 2)  # warm-up (kernels, allocator)
    rows.append((f"device loader (data.loader=gpu) on {device.type}", loader_rate(gpu_loader, device, args.images * 4)))
    for label, rate in rows:
        print(f"{label:62s} {rate:10,.0f} {rate / consumes:8.1f}")


if __name__ == "__main__":
    main()
