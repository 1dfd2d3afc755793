"""The loaders of an image classification run: its images held in memory or streamed (a quarter of the memory
this job may use decides, :func:`in_memory`), training's per-image transform, and the device-resident loader or
the DataLoader (:func:`resolve_loader`, :func:`build_loaders`)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from ...data.balance import ClassSampler
from ...data.images import DeviceImageLoader, ImageData, TensorImageDataset
from ...data.repeat import RepeatAugSampler
from ...data.rules import device_loader_problems
from ...data.split import SplitIndex
from ...data.transforms import CIFAR10_MEAN, rrc_train_transform, src_train_transform, train_transform
from ...errors import ConfigError
from ...inference.view import eval_dataset
from .splits import decode_size_of

if TYPE_CHECKING:
    from ...schema import DataConfig

__all__ = ["in_memory", "resolve_loader", "train_transform_of", "device_eval_data", "build_loaders"]


def in_memory(d: DataConfig, train: SplitIndex, test: SplitIndex, size: tuple[int, int]) -> tuple[bool, str]:
    """Whether the images are decoded into memory (``data.in_memory``; ``auto``: when the decoded
    training and test splits fit a quarter of the memory here (:func:`_memory_bytes`: a cgroup's limit
    where one is set), shared by the processes started on it, and unless ImageNet-style crops want files
    at their own sizes), and a line that says which and why."""
    h, w = decode_size_of(d, size)
    if d.in_memory == "auto" and d.train_crop != "pad" and not d.decode_size and train.pixels is None:
        return False, (f"data: streamed, decoded at their own sizes by {d.num_workers} DataLoader worker(s): "
                       f"data.train_crop={d.train_crop} crops each image at its own size, and in memory the images would be "
                       f"stored at one size, {h} x {w} (data.in_memory=auto; set data.decode_size to keep them in memory "
                       f"at that size)")
    count = (min(d.train_subset + d.val_size, len(train)) if d.train_subset else len(train)) + \
        (min(d.test_subset, len(test)) if d.test_subset else len(test))
    need = count * 3 * h * w
    if d.in_memory != "auto":
        where = "in memory" if d.in_memory else f"streamed (decoded by {d.num_workers} DataLoader worker(s))"
        at = "their own sizes" if decode_size_of(d, size, bool(d.in_memory)) is None else f"{h} x {w}"
        return bool(d.in_memory), f"data: {count:,} images at {at}, {where} (data.in_memory={d.in_memory})"
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    budget = _memory_bytes() / 4 / processes
    fits = need <= budget
    return fits, (f"data: {count:,} images at {h} x {w} take {need / 2 ** 30:.2f} GiB decoded, "
                  f"{'within' if fits else 'over'} the budget of {budget / 2 ** 30:.1f} GiB a process (a quarter of "
                  f"the memory this job may use, the machine's or its cgroup's limit, over {processes} process(es)): "
                  + ("in memory" if fits else f"streamed, decoded by {d.num_workers} DataLoader worker(s)")
                  + " (data.in_memory=auto; true or false to choose)")


def _memory_bytes(proc_cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """The memory this process may use: this machine's (POSIX's page count, else psutil's, an Accelerate
    dependency; Windows), or less where a cgroup limits it (a container's, a SLURM job's ``--mem``):
    :func:`_cgroup_memory_limits` of ``proc_cgroup`` under ``cgroup_root``."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        import psutil

        physical = psutil.virtual_memory().total
    return min([physical, *_cgroup_memory_limits(proc_cgroup, cgroup_root)])


def _cgroup_memory_limits(proc_cgroup: Path, root: Path) -> list[int]:
    """The memory limits set on the cgroups of ``proc_cgroup`` (``/proc/self/cgroup``'s lines
    ``ID:CONTROLLERS:PATH``) and on every cgroup above them: cgroup v2's ``memory.max`` (under ``root``, or
    ``root/unified`` beside v1), v1's ``memory/…/memory.limit_in_bytes``. "max" and v1's near-2^63 mean none."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            places = [(base, "memory.max") for base in (root, root / "unified")]
        elif "memory" in controllers.split(","):
            places = [(root / "memory", "memory.limit_in_bytes")]
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for base, name in places:
            for depth in range(len(parts) + 1):  # the group itself and each group above it
                try:
                    value = (base.joinpath(*parts[:depth]) / name).read_text().strip()
                except OSError:
                    continue
                if value.isdigit() and int(value) < 2 ** 60:
                    found.append(int(value))
    return found


def train_transform_of(d: DataConfig, size: tuple[int, int], stored: tuple[int, int] | None,
                       mean: tuple[float, ...] = CIFAR10_MEAN) -> v2.Transform:
    """Training's per-image transform for images ``stored`` at a size (``'pad'``) or their own (``'rrc'``, ``'src'``);
    uint8 out. ``mean``: the run's normalization (timm's augmentations fill with it)."""
    augment = dict(hflip=d.hflip, augment=d.augment, randaugment_ops=d.randaugment_ops,
                   randaugment_magnitude=d.randaugment_magnitude, autoaugment_policy=d.autoaugment_policy, mean=mean,
                   color_jitter=d.color_jitter)
    if d.train_crop == "rrc":
        return rrc_train_transform(tuple(size), d.scale, d.ratio, **augment)
    if d.train_crop == "src":
        return src_train_transform(tuple(size), **augment)
    return train_transform(stored, d.crop_padding, out_size=size if stored != tuple(size) else None, **augment)


def resolve_loader(loader: str, augment: str, device: torch.device, streamed: bool = False,
                   train_crop: str = "pad", color_jitter: float = 0.0, aug_repeats: int = 1) -> str:
    """``data.loader`` made concrete: ``'auto'`` is the device-resident loader on a CUDA device unless
    the transforms need the DataLoader (AutoAugment, TrivialAugment, timm's augmentations, color jitter,
    repeated augmentation) or the images are streamed, else ``'torch'`` (why: docs/performance.md,
    measured on an H100). Random resized crops take the device loader when asked (``'gpu'``); ``'auto'`` leaves
    them to the DataLoader until the device's crops are measured on a GPU.

    Raises:
        ConfigError: if ``'gpu'`` is asked for images that ``data.in_memory=auto`` chose to stream.
    """
    if loader == "gpu" and streamed and train_crop != "pad":
        raise ConfigError(f"data.loader=gpu holds the whole data set on the device, and data.train_crop={train_crop} "
                          f"streams the images to crop each at its own size: set data.decode_size (e.g. a little "
                          f"larger than the model's input) to keep them in memory at that size, or use data.loader=torch")
    if loader == "gpu" and streamed:
        raise ConfigError("data.loader=gpu holds the whole data set on the device, and data.in_memory=auto chose to "
                          "stream it (it is larger than the memory budget): use data.loader=torch, or "
                          "data.in_memory=true to keep it in memory anyway")
    if loader != "auto":
        return loader
    on_device = not streamed and train_crop == "pad" and not device_loader_problems(augment, train_crop,
                                                                                     color_jitter, aug_repeats)
    return "gpu" if device.type == "cuda" and on_device else "torch"


def device_eval_data(data: ImageData, size: tuple[int, int], crop_pct: float | None) -> ImageData:
    """``data`` as the device loader evaluates it: itself (resized there, as the DataLoader's evaluation resizes),
    or with ``crop_pct`` (an ``rrc`` run) each image's center crop made once, as the DataLoader makes it every
    evaluation (:func:`~vitlab.inference.view.eval_dataset`: timm's, through PIL), uint8 ``(N, C, *size)``."""
    if crop_pct is None:
        return data
    view = eval_dataset(data, size, crop_pct)
    return ImageData(torch.stack([view[i][0] for i in range(len(view))]), data.labels, data.classes, data.key)


def build_loaders(d: DataConfig, seed: int, accelerator: Any, micro_batch: int, train_data: ImageData,
                  eval_sets: dict[str, ImageData], size: tuple[int, int], mean: tuple[float, ...], keep_in_memory: bool,
                  features: bool = False) -> tuple[Any, dict[str, Any], Any, bool]:
    """The training loader, the evaluation loaders of ``eval_sets``, a loader of the training images as evaluation
    shows them (``features``: for the cached-feature probe, else None), and whether they are the device-resident
    loaders (:func:`resolve_loader`): the data set on the device, crop and flip a batch at a time, each process
    taking its part of the global batch; else DataLoaders of per-image transforms (their workers kept for the run),
    which Accelerate shards. ``micro_batch``: the global batch of a step."""
    on_device = resolve_loader(d.loader, d.augment, accelerator.device, not keep_in_memory, d.train_crop,
                               d.color_jitter, d.aug_repeats) == "gpu"
    sampler = ClassSampler(train_data.labels, d.sampler, seed) if d.sampler != "uniform" else None
    if on_device:
        shard = dict(device=accelerator.device, seed=seed, num_processes=accelerator.num_processes,
                     process_index=accelerator.process_index, size=size)
        train_loader: Any = DeviceImageLoader(train_data, micro_batch, crop_padding=d.crop_padding, hflip=d.hflip,
                                              augment=d.augment, randaugment_ops=d.randaugment_ops,
                                              randaugment_magnitude=d.randaugment_magnitude, sampler=sampler,
                                              train_crop=d.train_crop, scale=d.scale, ratio=d.ratio, **shard)
        crop_pct = d.crop_pct if d.train_crop == "rrc" else None
        eval_loaders = {name: DeviceImageLoader(device_eval_data(data, size, crop_pct), micro_batch, train=False,
                                                **shard) for name, data in eval_sets.items()}
        feature_loader = DeviceImageLoader(device_eval_data(train_data, size, crop_pct), micro_batch, train=False,
                                           **shard) if features else None
    else:
        stored = tuple(train_data.images.shape[-2:]) if d.train_crop == "pad" else None
        transform = train_transform_of(d, size, stored, mean)
        # rrc's crop decodes a streamed file itself, at the scale the crop needs (data.scaled_decode).
        train_set = TensorImageDataset(train_data, transform, seed=seed, lazy=d.train_crop == "rrc")
        # Workers live for the whole run, reading the epoch (which seeds each image's augmentation with
        # (seed, epoch, image)) from shared memory: not forked again every epoch from a process whose threads
        # (gloo's, the last iterator's queue feeders) may hold locks a fork copies.
        loader_args: dict[str, Any] = dict(num_workers=d.num_workers, pin_memory=accelerator.device.type == "cuda",
                                           persistent_workers=d.num_workers > 0)
        order: dict[str, Any] = dict(shuffle=True)  # Accelerate's seedable sampler
        if d.aug_repeats > 1:
            order = dict(sampler=RepeatAugSampler(len(train_set), d.aug_repeats, seed, micro_batch))
        elif sampler is not None:
            order = dict(sampler=sampler)
        train_loader = DataLoader(train_set, batch_size=micro_batch, drop_last=True, **order, **loader_args)
        crop_pct = d.crop_pct if d.train_crop != "pad" else None
        eval_loaders = {name: DataLoader(eval_dataset(data, size, crop_pct), batch_size=micro_batch,
                                         shuffle=False, **loader_args) for name, data in eval_sets.items()}
        feature_loader = DataLoader(eval_dataset(train_data, size, crop_pct), batch_size=micro_batch, shuffle=False,
                                    num_workers=d.num_workers, pin_memory=loader_args["pin_memory"]) \
            if features else None
    return train_loader, eval_loaders, feature_loader, on_device
