"""Data pipeline, two measurements.

``--data`` (CIFAR-10): images/s each loader delivers against images/s the model consumes. Loaders: the
DataLoader path (per-image torchvision transforms; crop + flip, and with RandAugment) at several worker
counts, each with the per-image seeding training uses and without it, and the device-resident loader
(``data.loader: gpu``). The model's rate is its training-step throughput at the same batch size. A
loader must deliver well above what the model consumes, or training waits for data.

    python benchmarks/bench_data.py --device cpu --data ../shared/data/cifar10
    python benchmarks/bench_data.py --device cuda --data ../shared/data/cifar10 --workers 0,4,8

``--root`` (an ImageFolder of JPEGs at ImageNet sizes, e.g. from ``make_photos.py``): the ImageNet-style
training pipeline (random resized crop to ``--size``, bicubic, flip, normalization) streamed from the
files, vitlab's against timm's ``create_loader`` (same files, transforms and workers; its prefetcher
normalizing uint8 batches, on the CPU here), both as normalized float batches in the main process.
Also the steps between (what each lever paid) and the in-memory path. Loaders alternate, each timed
over ``--images`` images after its first two batches, median of ``--rounds``.

    python benchmarks/make_photos.py --out /tmp/photos
    python benchmarks/bench_data.py --root /tmp/photos --size 224
    python benchmarks/bench_data.py --root /tmp/photos --size 224 --stages   # where an image's time goes

``--shards DIR`` with ``--root``: the same photos written once at a training resolution (``vitlab shards ROOT DIR
--split train --max-size 512``) and streamed by vitlab's training loader for shards (``data.dataset=wds``,
random resized crops), against timm's ``create_loader`` on the original files; and the PSNR of the model's
evaluation input (the 0.875 center crop) from the shards against the full decode of the originals.

    python benchmarks/make_photos.py --phone --out /tmp/phone --train 22 --test 0
    vitlab shards /tmp/phone /tmp/phone512 --split train --max-size 512
    python benchmarks/bench_data.py --root /tmp/phone --shards /tmp/phone512 --size 224 --batch 32 --images 256
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import vitlab
from vitlab.data import load_split
from vitlab.data.images import DeviceImageLoader, ImageData, TensorImageDataset
from vitlab.data.transforms import train_transform


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


def _streamed_rate(make_loader, images: int, to_input=None) -> float:
    """images/s of a fresh loader (workers started), after its first two batches, as model inputs."""
    batches = iter(make_loader())
    for _ in range(2):
        next(batches)
    seen, start = 0, time.perf_counter()
    for x, _ in batches:
        if to_input is not None:
            x = to_input(x, train=True)
        seen += len(x)
        if seen >= images:
            break
    return seen / (time.perf_counter() - start)


class _Opened:
    """A split's files opened by PIL when indexed (8-bit RGB PIL images), as timm's ImageDataset opens them."""

    def __init__(self, index) -> None:
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        return self.index.open(int(i))


class _DecodeOnly:
    """Each file decoded whole by libjpeg-turbo (upright), handed on as one pixel: decoding's cost alone."""

    def __init__(self, index) -> None:
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        return self.index.read(int(i))[:, :1, :1], 0


def crop_psnr(args: argparse.Namespace) -> None:
    """``--psnr N``: N random resized crops (and N evaluation center crops) of the photos under ``--root``,
    decoded at the scale they need against decoded whole and cropped by torchvision (training) or PIL as
    timm (evaluation): the PSNR of the model's input, its median and lowest."""
    import math
    from statistics import median

    from torchvision.transforms import v2

    from vitlab.data import index_split
    from vitlab.data.decode import EncodedImage
    from vitlab.data.transforms import RandomResizedCropDecode, center_crop_transform

    index = index_split("imagefolder", args.root, "train")
    size = (args.size, args.size)
    resize = dict(interpolation=v2.InterpolationMode.BICUBIC, antialias=True)
    scaled, whole = RandomResizedCropDecode(size, **resize), v2.RandomResizedCrop(size, **resize)
    evaluation = center_crop_transform(size, 0.875)

    def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
        mse = ((a.double() - b.double()) ** 2).mean().item()
        return 10 * math.log10(255 ** 2 / mse) if mse else math.inf

    values: dict[str, list[float]] = {"training crops": [], "evaluation crops": []}
    for k in range(args.psnr):
        i = k % len(index)
        encoded = EncodedImage(index.encoded(i), str(i))
        full = index.read(i)
        torch.manual_seed(k)
        want = whole(full)
        torch.manual_seed(k)
        values["training crops"].append(psnr(scaled(encoded), want))
        values["evaluation crops"].append(psnr(evaluation(encoded), evaluation(full)))
    for name, v in values.items():
        finite = [x for x in v if math.isfinite(x)]
        print(f"{name}: {len(v)} of {len(index)} photos under {args.root}, {args.size} px: PSNR against the full decode "
              f"median {median(v):.1f} dB, lowest {min(v):.1f} dB ({len(v) - len(finite)} equal)")


def stage_costs(args: argparse.Namespace) -> None:
    """``--stages``: where a streamed image's time goes, stage by stage, on one core (torch threads 1, as
    in a DataLoader worker): ms an image, medians of 3 passes over ``--images`` photos (at most the
    folder's) under ``--root``."""
    from statistics import median

    from torch.utils.data import default_collate
    from torchvision.transforms import v2

    from vitlab.data import index_split
    from vitlab.data.decode import decode_image, jpeg_size
    from vitlab.data.transforms import normalize, rrc_train_transform

    torch.set_num_threads(1)
    index = index_split("imagefolder", args.root, "train")
    n = min(args.images, len(index))
    files = [index.encoded(i) for i in range(n)]
    decoded = [decode_image(f, "x") for f in files]  # as libjpeg-turbo lays it out: channels last
    size = (args.size, args.size)
    crop = v2.RandomResizedCrop(size, interpolation=v2.InterpolationMode.BICUBIC, antialias=True)
    cropped = [crop(x).contiguous() for x in decoded]
    dataset = TensorImageDataset(index.load(None, in_memory=False, scaled=True), rrc_train_transform(size), seed=0,
                                 lazy=True)
    batch = [dataset[i] for i in range(min(n, args.batch))]
    stacked = torch.stack([x for x, _ in batch])
    stages = {
        "read the file": lambda i: index.encoded(i),
        "headers and EXIF orientation": lambda i: jpeg_size(files[i]),
        "decode whole (libjpeg-turbo)": lambda i: decode_image(files[i], "x"),
        "random resized crop (torch, bicubic)": lambda i: crop(decoded[i]),
        "horizontal flip": lambda i: cropped[i].flip(-1),
        "all of it, as a training worker (seeded)": lambda i: dataset[i],
        "collation (per image of a batch)": lambda i: default_collate(batch) if i % len(batch) == 0 else None,
        "normalization (main process, per image of a batch)": lambda i: normalize(
            stacked, (0.5,) * 3, (0.25,) * 3) if i % len(batch) == 0 else None,
    }
    print(f"{n} photos under {args.root}/train, {args.size} px, one core: ms an image, median of 3 passes")
    for name, fn in stages.items():
        passes = []
        for _ in range(3):
            start = time.perf_counter()
            for i in range(n):
                fn(i)
            passes.append((time.perf_counter() - start) / n * 1e3)
        print(f"  {name:52s} {median(passes):7.3f}")


def photo_pipeline(args: argparse.Namespace) -> None:
    from statistics import median

    from timm.data import ImageDataset, create_loader
    from timm.data.constants import IMAGENET_DEFAULT_MEAN as MEAN, IMAGENET_DEFAULT_STD as STD
    from torchvision.transforms import v2

    from vitlab.data import index_split
    from vitlab.data.transforms import ModelInput, rrc_train_transform

    size, batch, workers = (args.size, args.size), args.batch, int(args.workers.split(",")[-1])
    index = index_split("imagefolder", args.root, "train")
    # as training streams: each JPEG decoded by libjpeg-turbo at the scale its crop needs (data.scaled_decode)
    streamed = index.load(None, in_memory=False, scaled=True)
    whole = index.load(None, in_memory=False)  # data.scaled_decode=false: each decoded at full size
    by_pil = ImageData(_Opened(index), index.labels, index.classes)  # each file opened by PIL, as timm's
    to_input = ModelInput(MEAN, STD)
    pil_rrc = [v2.RandomResizedCrop(size, interpolation=v2.InterpolationMode.BICUBIC, antialias=True),
               v2.RandomHorizontalFlip()]
    variants = {
        # vitlab as training builds it: libjpeg-turbo decodes, torch crops uint8 tensors in the workers,
        # the main process normalizes the batch
        "vitlab": (streamed, rrc_train_transform(size), to_input),
        # the levers taken away one at a time, down to vitlab before them
        "vitlab, decoded whole (data.scaled_decode=false)": (whole, rrc_train_transform(size), to_input),
        "vitlab, PIL decode": (by_pil, rrc_train_transform(size), to_input),
        "vitlab, PIL decode, PIL crop": (by_pil, v2.Compose([*pil_rrc, v2.ToImage(), v2.ToPureTensor()]), to_input),
        "vitlab, PIL decode, PIL crop, float out of workers": (
            by_pil, v2.Compose([*pil_rrc, v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]),
            None),
    }

    def ours(data, transform):
        dataset = TensorImageDataset(data, transform, seed=0, lazy=True)
        return lambda: DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True, num_workers=workers)

    def decode_only():  # libjpeg-turbo at full size, nothing else: the limit of a pipeline that decodes whole
        return DataLoader(_DecodeOnly(index), batch_size=batch, shuffle=True, drop_last=True, num_workers=workers)

    def timm_loader():
        return create_loader(ImageDataset(str(Path(args.root) / "train")), (3, *size), batch, is_training=True,
                             scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), hflip=0.5, color_jitter=None,
                             interpolation="bicubic", mean=MEAN, std=STD, num_workers=workers,
                             device=torch.device("cpu"), use_prefetcher=True, persistent_workers=False)

    start = time.perf_counter()
    memory = index.load((args.memory_size,) * 2, scaled=True)
    decoded = time.perf_counter() - start
    start = time.perf_counter()
    index.load((args.memory_size,) * 2)
    decoded_whole = time.perf_counter() - start
    rates: dict[str, list[float]] = {name: [] for name in ("timm", *variants, "vitlab in memory", "decode only")}
    for r in range(args.rounds):
        rates["timm"].append(_streamed_rate(timm_loader, args.images))
        rates["decode only"].append(_streamed_rate(decode_only, args.images))
        for name, (data, transform, after) in variants.items():
            rates[name].append(_streamed_rate(ours(data, transform), args.images, after))
        rates["vitlab in memory"].append(_streamed_rate(ours(memory, rrc_train_transform(size)), args.images, to_input))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items()), flush=True)
    print(f"{len(index)} JPEGs under {args.root}/train, {args.size} px, batch {batch}, {workers} workers, "
          f"torch threads {torch.get_num_threads()}; median images/s of {args.rounds} rounds:")
    for name, values in rates.items():
        print(f"  {name:52s} {median(values):8.0f}" + (f"   (decoded once at {args.memory_size} px in {decoded:.1f} s)"
                                                      if name == "vitlab in memory" else ""))
    print("  (decode only: libjpeg-turbo decoding each file whole, the same files, workers and cores)")
    print(f"vitlab/timm images/s ratio: {median(rates['vitlab']) / median(rates['timm']):.2f}; vitlab is "
          f"{median(rates['vitlab']) / median(rates['decode only']):.2f}x the decode-only rate")
    print(f"in memory at {args.memory_size} px: decoded in {decoded:.1f} s ({len(index) / decoded:.0f} images/s) scaled, "
          f"{decoded_whole:.1f} s ({len(index) / decoded_whole:.0f} images/s) decoded whole")


def shard_pipeline(args: argparse.Namespace) -> None:
    """``--shards``: vitlab's loader on shards written at a training resolution against timm's on the files."""
    import math
    from statistics import median

    from timm.data import ImageDataset, create_loader
    from timm.data.constants import IMAGENET_DEFAULT_MEAN as MEAN, IMAGENET_DEFAULT_STD as STD

    from vitlab.config import load_config
    from vitlab.data import index_split
    from vitlab.data.decode import EncodedImage
    from vitlab.data.shard_stream import ShardLoader
    from vitlab.data.shards import read_samples
    from vitlab.data.transforms import ModelInput, center_crop_transform
    from vitlab.tasks.image_data import shard_streams

    size, batch, workers = (args.size, args.size), args.batch, int(args.workers.split(",")[-1])
    d = load_config(None, ["data.dataset=wds", f"data.root={args.shards}", "data.train_crop=rrc",
                           f"data.num_workers={workers}", "data.scaled_decode=true"]).data
    to_input = ModelInput(MEAN, STD)

    def vitlab_loader():
        streams, _ = shard_streams(d, 0, size, batch, splits=("train",), mean=MEAN)
        loader = ShardLoader(streams["train"])

        def epochs():
            for epoch in range(10 ** 6):
                loader.set_epoch(epoch)
                yield from loader
        return epochs()

    def timm_loader():
        return create_loader(ImageDataset(str(Path(args.root) / "train")), (3, *size), batch, is_training=True,
                             scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), hflip=0.5, color_jitter=None,
                             interpolation="bicubic", mean=MEAN, std=STD, num_workers=workers,
                             device=torch.device("cpu"), use_prefetcher=True, persistent_workers=False)

    rates: dict[str, list[float]] = {"timm on the files": [], "vitlab on the shards": []}
    for r in range(args.rounds):
        rates["timm on the files"].append(_streamed_rate(timm_loader, args.images))
        rates["vitlab on the shards"].append(_streamed_rate(vitlab_loader, args.images, to_input))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), flush=True)
    # The evaluation input from a shard's image against the full decode of the file it was written from.
    index = index_split("imagefolder", args.root, "train")
    evaluation = center_crop_transform(size, 0.875)
    values = []
    for url in sorted(Path(args.shards).glob("train-*.tar")):
        for sample in read_samples(str(url)):
            i = int(sample["__key__"].rsplit("_", 1)[1])  # vitlab shards names a sample <split>_<index>
            encoded = next(v for k, v in sample.items() if k in ("jpg", "jpeg", "png", "webp"))
            ours, theirs = evaluation(EncodedImage(encoded, str(i))), evaluation(index.read(i))
            mse = ((ours.double() - theirs.double()) ** 2).mean().item()
            values.append(10 * math.log10(255 ** 2 / mse) if mse else math.inf)
    files = len(index)
    print(f"{files} photos under {args.root}/train against their shards under {args.shards}, {args.size} px, batch "
          f"{batch}, {workers} workers; median images/s of {args.rounds} rounds:")
    for name, v in rates.items():
        print(f"  {name:24s} {median(v):8.1f}")
    ratio = median(rates["vitlab on the shards"]) / median(rates["timm on the files"])
    print(f"vitlab on the shards / timm on the files: {ratio:.1f}x")
    print(f"evaluation input (center crop 0.875) from the shards against the full decode: PSNR median "
          f"{median(values):.1f} dB, lowest {min(values):.1f} dB over {len(values)} photos")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--data", help="CIFAR-10 in ImageFolder layout; default: 50,000 random images")
    parser.add_argument("--model", default="vit_cifar_small_patch4_32")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--images", type=int, default=10240, help="images timed per loader")
    parser.add_argument("--root", help="an ImageFolder of JPEGs (train/<class>/*.jpg): the ImageNet-style pipeline, "
                                       "vitlab against timm")
    parser.add_argument("--size", type=int, default=224, help="--root: the crops' size")
    parser.add_argument("--memory-size", type=int, default=256, help="--root: the size the in-memory path decodes at")
    parser.add_argument("--rounds", type=int, default=3, help="--root: rounds, loaders alternating")
    parser.add_argument("--psnr", type=int, default=0, help="--root: measure the scaled decode's PSNR on this many "
                                                            "crops instead of timing")
    parser.add_argument("--shards", help="--root: shards of its photos written by vitlab shards --max-size: vitlab's "
                                         "loader on them against timm's on the files, and the PSNR of the input")
    parser.add_argument("--stages", action="store_true", help="--root: time each stage of a streamed image on one "
                                                              "core instead")
    args = parser.parse_args()
    if args.root:
        if args.batch == 256 and args.images == 10240:  # the CIFAR defaults: smaller for photographs
            args.batch, args.images = 64, 1024
        if args.shards:
            return shard_pipeline(args)
        return crop_psnr(args) if args.psnr else stage_costs(args) if args.stages else photo_pipeline(args)
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
