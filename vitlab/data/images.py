"""Images in memory: a decoded split (:class:`ImageData`), the rows a run takes of it (:func:`balanced_indices`,
:func:`stratified_indices`), and the two in-memory loaders (a per-image ``Dataset`` for a DataLoader, whose
transforms are :mod:`.transforms`', and the device-resident :class:`DeviceImageLoader`, which crops, flips and
runs RandAugment a batch at a time).

Images are decoded a single time into one ``uint8`` tensor ``(N, C, H, W)`` (:mod:`.sources`); every
epoch then only indexes and augments it, so decoding never dominates CPU training. This module
knows no model.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms import v2

from ..errors import DataError
from ..seeding import process_seed
from .batch_views import resized_crops, rrc_boxes
from .transforms import resize_images

__all__ = ["ImageData", "TensorImageDataset", "balanced_indices", "stratified_indices", "DeviceImageLoader",
           "rand_augment", "seeded_sample", "seeded_transform"]



@dataclass
class ImageData:
    """A split: ``images`` uint8 ``(N, C, H, W)`` (a tensor in memory, or a
    :class:`~vitlab.data.split.StreamedImages` decoded when read, indexed alike), ``labels`` int64
    ``(N,)`` (multi-label data: bool ``(N, K)`` multi-hot rows), class names, and where the source names its
    images, ``key(i)``: what names image ``i`` (a file's path under the split's folder, a row's number), looked up
    only when asked for."""

    images: Tensor
    labels: Tensor
    classes: list[str]
    key: Callable[[int], str] | None = None

    def subset(self, index: Tensor) -> "ImageData":
        key = None if self.key is None else Picked(self.key, index.clone())
        return ImageData(self.images[index], self.labels[index], self.classes, key)


class Picked:
    """``fn(ids[i])``: a source's reader on a subset of it; a plain object, so it pickles (DataLoader workers)."""

    def __init__(self, fn: Callable[[int], Any], ids: Tensor) -> None:
        self.fn, self.ids = fn, ids

    def __call__(self, i: int) -> Any:
        return self.fn(int(self.ids[i]))


class TensorImageDataset(Dataset):
    """Indexes decoded images and applies a per-sample transform (uint8 CHW tensor in).

    With ``seed`` (training), the random transform of image ``i`` in epoch ``e`` (``set_epoch``) draws
    from torch's generator seeded by :func:`vitlab.seeding.process_seed` ``(seed, 0, e, 'samples', i)``,
    inside ``fork_rng`` (the caller's generator is left as it was): the augmentation of an image is a
    function of (seed, epoch, image), whichever worker or process loads it and wherever an epoch
    resumes. Without ``seed`` the transform draws from the global generator (evaluation draws nothing).

    The epoch is held in shared memory, so DataLoader workers that live across epochs
    (``persistent_workers``) read the one the main process set before the epoch's batches were asked for.

    A transform whose ``draws_from`` is ``'generator'`` (views made a batch at a time on the device) is given a
    generator of its own seeded so (:func:`seeded_sample`).

    With ``lazy`` (streamed images and a transform that decodes what it needs, ``data.scaled_decode``),
    the transform is given each image's file undecoded (:meth:`StreamedImages.lazy`).
    """

    def __init__(self, data: ImageData, transform: v2.Transform | None = None, seed: int | None = None,
                 lazy: bool = False) -> None:
        self.data = data
        self.transform = transform
        self.seed = seed
        self.lazy = lazy and transform is not None and hasattr(data.images, "lazy")
        self._epoch = torch.zeros((), dtype=torch.long).share_memory_()

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)

    def __len__(self) -> int:
        return len(self.data.labels)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        """The images once each (``for image, label in dataset``): without it, Python's sequence protocol would go on
        past the end, where :meth:`__getitem__` serves repeated augmentation's copies, for ever."""
        return (self[i] for i in range(len(self)))

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        """Image ``i`` (``i % len(self)``: the copies of repeated augmentation, :mod:`vitlab.data.repeat`,
        are ``i + copy * len(self)``, each seeded by its own ``i``)."""
        j = i % len(self)
        image, label = self.data.images.lazy(j) if self.lazy else self.data.images[j], self.data.labels[j]
        if self.transform is None:
            return image, label
        if self.seed is None:
            return self.transform(image), label
        return seeded_sample(self.transform, image, self.seed, self.epoch, int(i)), label


def seeded_sample(transform: Callable[..., Any], image: Any, seed: int, epoch: int, i: int) -> Any:
    """Sample ``i``'s augmentation in ``epoch``, a function of (seed, epoch, sample): a transform whose
    ``draws_from`` is ``'generator'`` (views made a batch at a time on the device, :mod:`vitlab.data.batch_views`:
    their uniforms drawn here, the views made later) is called ``transform(image, generator)`` with a generator of
    its own seeded by :func:`vitlab.seeding.process_seed` ``(seed, 0, epoch, 'samples', i)``, cheaper than torch's
    under ``fork_rng``; any other transform draws from torch's, seeded alike (:func:`seeded_transform`)."""
    if getattr(transform, "draws_from", None) == "generator":
        return transform(image, torch.Generator().manual_seed(process_seed(seed, 0, epoch, "samples", i)))
    return seeded_transform(transform, image, seed, epoch, i)


def seeded_transform(transform: v2.Transform, image: Any, seed: int, epoch: int, i: int) -> Tensor:
    """``transform(image)`` drawing from torch's generator seeded by :func:`vitlab.seeding.process_seed`
    ``(seed, 0, epoch, 'samples', i)`` for image ``i``, inside ``fork_rng`` (the caller's generator is left
    as it was): an image's augmentation is a function of (seed, epoch, image) wherever it is loaded."""
    with torch.random.fork_rng(devices=[]):
        # The CPU generator alone (the transforms run on the CPU): torch.manual_seed also seeds every
        # other backend, which costs far more than the transform of a small image.
        torch.random.default_generator.manual_seed(process_seed(seed, 0, epoch, "samples", i))
        return transform(image)


def balanced_indices(labels: Tensor, n: int, seed: int = 0) -> Tensor:
    """``n`` indices spread evenly over the classes (the first classes get the remainder), random
    within each class but fixed by ``seed``; sorted. ``n`` >= the data size returns everything. Multi-label
    ``labels`` (bool ``(N, K)``) have no classes to spread over: ``n`` of them at random, fixed by ``seed``."""
    if n <= 0 or n >= len(labels):
        return torch.arange(len(labels))
    g = torch.Generator().manual_seed(seed)
    if labels.ndim == 2:
        return torch.randperm(len(labels), generator=g)[:n].sort().values
    classes = labels.unique()
    per_class, extra = divmod(n, len(classes))
    chosen = []
    for i, c in enumerate(classes):
        members = (labels == c).nonzero().flatten()
        take = min(len(members), per_class + (1 if i < extra else 0))
        chosen.append(members[torch.randperm(len(members), generator=g)[:take]])
    return torch.cat(chosen).sort().values


def stratified_indices(labels: Tensor, n: int, seed: int, classes: Sequence[str], what: str) -> Tensor:
    """About ``n`` indices taken from every class in proportion to its size, as scikit-learn's
    ``train_test_split(stratify=labels)`` and ``datasets``' ``stratify_by_column`` do: ``n * c_k / N``
    images of a class of ``c_k``, rounded by largest remainders (so that they add up to ``n``), then kept
    between 1 and ``c_k - 1``, so that every class is on both sides of the split. Those bounds can move
    the total (``n`` below the number of classes: one of each); the length of the result is the real
    count. Random within each class, fixed by ``seed`` (equal classes and ``n`` a multiple of their number
    give the images :func:`balanced_indices` gives); sorted.

    Multi-label ``labels`` (bool ``(N, K)``) are held out as :func:`_kept_positives` does.

    Args:
        labels: int64 ``(N,)`` class indices, or bool ``(N, K)`` multi-hot rows.
        n: How many to take, ``0 < n < N``.
        seed: Chooses the images within each class.
        classes: The class names, for the message.
        what: The split in words, for the message (``"data.test_size=0.2 of ..."``).

    Raises:
        DataError: one line, if a class has a single image (it cannot be on both sides).
    """
    if labels.ndim == 2:
        return _kept_positives(labels, n, seed)
    counts = torch.bincount(labels, minlength=len(classes))
    present = counts.nonzero().flatten()
    single = [classes[int(k)] for k in present if counts[k] == 1]
    if single:
        raise DataError(f"{what}: class(es) {single[:10]}{' ...' if len(single) > 10 else ''} have a single image, "
                        f"which cannot be both trained on and held out; add images of them, or remove their folders")
    sizes = counts[present]
    take, remainder = (n * sizes).div(len(labels), rounding_mode="floor"), (n * sizes) % len(labels)
    # The largest remainders round up (ties: the larger class, then the first), so the takes add up to n.
    order = sorted(range(len(sizes)), key=lambda i: (-int(remainder[i]), -int(sizes[i]), i))
    take[order[:n - int(take.sum())]] += 1
    take = torch.minimum(take.clamp(min=1), sizes - 1)
    g = torch.Generator().manual_seed(seed)
    by_class = torch.sort(labels, stable=True).indices.split(sizes.tolist())  # each class's indices, ascending
    chosen = [members[torch.randperm(len(members), generator=g)[:k]] for members, k in zip(by_class, take.tolist())]
    return torch.cat(chosen).sort().values


def _kept_positives(labels: Tensor, n: int, seed: int) -> Tensor:
    """``n`` of the multi-hot rows ``labels`` (bool ``(N, K)``) to hold out, at random (fixed by ``seed``), but
    never the last image left in training of one of its classes: every class with a positive keeps one on
    the training side (held out, it could not be learnt). Fewer than ``n`` where the classes leave no more
    to take; sorted."""
    import numpy as np

    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed)).numpy()
    hot = labels.numpy()
    left = hot.sum(0)  # each class's positives still on the training side
    chosen = []
    for i in order:
        row = hot[i]
        if (left[row] > 1).all():
            left[row] -= 1
            chosen.append(i)
            if len(chosen) == n:
                break
    return torch.from_numpy(np.sort(np.asarray(chosen, dtype=np.int64)))


# torchvision's RandAugment ops that move pixels (nearest sampling, zero fill): each is a fixed pixel map.
_GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")


@lru_cache(maxsize=128)
def _pixel_map(name: str, magnitude: float, h: int, w: int, device: torch.device) -> Tensor:
    """Where torchvision's geometric RandAugment op ``name`` at ``magnitude`` takes each output pixel of an
    ``(h, w)`` image from: flat indices + 1, and 0 where it fills with zeros. Computed once, by
    torchvision's own op on an image of pixel numbers (exact in float32), so gathering with it is the op;
    on a GPU the op itself would copy its affine matrix from the host, waiting for the device, every call."""
    reference = v2.RandAugment()
    numbers = torch.arange(1, h * w + 1, dtype=torch.float32).reshape(1, 1, h, w)
    moved = reference._apply_image_or_video_transform(numbers, name, magnitude, interpolation=reference.interpolation,
                                                      fill=reference._fill)
    return moved.reshape(h * w).round().long().to(device)


def _move_pixels(x: Tensor, pixel_map: Tensor) -> Tensor:
    """A batch ``(b, C, H, W)`` through a :func:`_pixel_map`."""
    b, c, h, w = x.shape
    flat = torch.cat([x.new_zeros(b, c, 1), x.reshape(b, c, h * w)], dim=2)
    return flat[:, :, pixel_map].reshape(b, c, h, w)


@lru_cache(maxsize=16)
def _sharpness_kernel(channels: int, device: torch.device) -> Tensor:
    """torchvision's smoothing kernel of ``adjust_sharpness`` (1s around a 5, over 13), made once a device."""
    a, b = 1.0 / 13.0, 5.0 / 13.0
    return torch.tensor([[a, a, a], [a, b, a], [a, a, a]], dtype=torch.float32).to(device).expand(channels, 1, 3, 3)


def _sharpen(x: Tensor, factor: float) -> Tensor:
    """torchvision's ``adjust_sharpness`` of a uint8 batch ``(b, C, H, W)``: its arithmetic, step by step, with
    its kernel made once a device (torchvision copies it from the host, waiting for the device, every call)."""
    if x.shape[-1] <= 2 or x.shape[-2] <= 2:
        return x
    output = x.to(torch.float32, copy=True)
    blurred = torch.nn.functional.conv2d(output, _sharpness_kernel(x.shape[1], x.device), groups=x.shape[1]).round_()
    inner = output[..., 1:-1, 1:-1]  # the border keeps its pixels
    inner.add_(blurred.sub_(inner), alpha=1.0 - factor)
    return output.clamp_(0, 255).to(x.dtype)


def _draws(draw: Callable[[int], Tensor], b: int, within: tuple[int, int] | None) -> Tensor:
    """``draw(n)`` for the ``b`` images of a batch; with ``within = (start, total)`` they are images
    ``start`` to ``start + b`` of a batch of ``total``, and get those images' draws of the whole batch's
    (a batch split over processes is augmented as it would be whole)."""
    if within is None:
        return draw(b)
    start, total = within
    return draw(total)[start:start + b]


def rand_augment(x: Tensor, num_ops: int = 2, magnitude: int = 9, generator: torch.Generator | None = None,
                 within: tuple[int, int] | None = None) -> Tensor:
    """torchvision's ``v2.RandAugment(num_ops, magnitude)`` for a uint8 batch ``(b, C, H, W)``, each image
    drawing its own ops and signs, without a host round trip. ``within``: ``x`` is part of a larger
    batch (:func:`_draws`).

    ``v2.RandAugment`` given a batch applies one draw to all of it. Here every image draws an op
    (uniform over torchvision's 14) and a sign per round from ``generator``; each (op, sign) is then
    applied to the whole batch by torchvision's own op code and kept where it was drawn (``torch.where``),
    so the result is torchvision's per-image RandAugment and the draws stay on the device. That costs
    about 23 batched ops per round, cheap next to a training step on a GPU. The geometric ops go through
    their pixel maps (:func:`_pixel_map`, torchvision's own result) and sharpness through :func:`_sharpen`,
    so no op waits for the host.
    """
    reference = v2.RandAugment(num_ops=num_ops, magnitude=magnitude)
    space = reference._AUGMENTATION_SPACE  # name -> (magnitudes(bins, h, w), signed); torchvision's table
    b, (h, w) = x.shape[0], x.shape[-2:]
    for _ in range(num_ops):
        op = _draws(lambda n: torch.randint(len(space), (n,), device=x.device, generator=generator), b, within)
        negative = _draws(lambda n: torch.rand(n, device=x.device, generator=generator), b, within) <= 0.5
        out = x
        for i, (name, (magnitudes, signed)) in enumerate(space.items()):
            if name == "Identity":
                continue
            values = magnitudes(reference.num_magnitude_bins, h, w)
            m = float(values[magnitude]) if values is not None else 0.0
            for sign in ((1.0, -1.0) if signed and values is not None else (1.0,)):
                chosen = op == i
                if signed and values is not None:
                    chosen &= negative if sign < 0 else ~negative
                # Two kinds of op copy a constant from the host in torchvision: done here as it does, without.
                if name in _GEOMETRIC:
                    y = _move_pixels(x, _pixel_map(name, sign * m, h, w, x.device))
                elif name == "Sharpness":
                    y = _sharpen(x, 1.0 + sign * m)
                else:
                    y = reference._apply_image_or_video_transform(x, name, sign * m,
                                                                  interpolation=reference.interpolation,
                                                                  fill=reference._fill)
                out = torch.where(chosen[:, None, None, None], y, out)
        x = out
    return x


class DeviceImageLoader:
    """The whole uint8 data set on the device, augmented batch-wise there: no DataLoader workers.

    The technique of the fastest CIFAR-10 training runs: each epoch one ``randperm`` (seeded by
    ``seed + epoch``, identical on every process), then per batch a gather, a random crop with zero
    padding and a horizontal flip for the whole batch at once, RandAugment (``augment='randaugment'``,
    :func:`rand_augment`), and normalization. The crops, flips and RandAugment draws are the global
    batch's, from a generator of the loader's own seeded for each batch (:func:`vitlab.seeding.process_seed`
    of ``seed``, the epoch, the ``'augment'`` stream and the batch), each process taking its images'
    draws: an image's augmentation does not depend on the number of processes (elastic, as
    :class:`~vitlab.data.plan.EpochPlan`), dropout's numbers are left alone, and :meth:`batches_from`
    starts an epoch at any batch as if the ones before it had been drawn.

    With ``train_crop='rrc'`` a random resized crop (``scale``, ``ratio``; bicubic with antialiasing, rounded to
    uint8) to ``size`` replaces the padded crop: the global batch's boxes drawn at once
    (:func:`~vitlab.data.batch_views.rrc_boxes`: torchvision's distribution of boxes, not its draws), the crops
    made as two batched matrix products (:func:`~vitlab.data.batch_views.resized_crops`). Its evaluation images
    are the DataLoader's center crops, made once (:func:`vitlab.tasks.image_data.device_eval_data`).

    With a ``sampler`` (:class:`~vitlab.data.balance.ClassSampler`, ``data.sampler``) an epoch is its draws
    instead of a permutation.

    With ``size`` (the model's input) other than the stored images', each batch is resized there after
    the augmentation (:func:`resize_images`, the per-image transforms' rule), so small images stay small
    in memory.

    ``batch_size`` is global. Each batch is cut into ``num_processes`` contiguous parts and this
    process takes its own; for evaluation (``train=False``) the parts of the last batch may differ
    in size by one and nothing is repeated, so gathering the results gives every image exactly once
    (``exact_shards``).

    Yields ``(images, labels)``: uint8 ``(b, C, H, W)``, int64 ``(b,)``, as every image loader does
    (:class:`~vitlab.data.transforms.ModelInput` normalizes them).
    """

    exact_shards = True

    def __init__(self, data: ImageData, batch_size: int, device: torch.device | str, train: bool = True,
                 crop_padding: int = 4, hflip: bool = True, seed: int = 0, num_processes: int = 1,
                 process_index: int = 0, size: tuple[int, int] | None = None, augment: str = "none",
                 randaugment_ops: int = 2, randaugment_magnitude: int = 9, sampler: Any = None,
                 train_crop: str = "pad", scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        if augment not in ("none", "randaugment"):
            raise ValueError(f"augment={augment!r}: the device loader does 'none' or 'randaugment'")
        if train_crop not in ("pad", "rrc"):
            raise ValueError(f"train_crop={train_crop!r}: the device loader does 'pad' or 'rrc'")
        self.images = data.images.to(device)
        self.size = tuple(size) if size is not None and tuple(size) != tuple(data.images.shape[-2:]) else None
        # rrc: a random resized crop of the stored image to the model's input (size), in place of the padded crop
        self.rrc = (tuple(size or data.images.shape[-2:]), tuple(scale), tuple(ratio)) \
            if train and train_crop == "rrc" else None
        self.labels = data.labels.to(device)
        self.batch_size, self.train, self.seed = batch_size, train, seed
        self.crop_padding, self.hflip = (crop_padding, hflip) if train else (0, False)
        self.randaugment = (randaugment_ops, randaugment_magnitude) if train and augment == "randaugment" else None
        self.num_processes, self.process_index = num_processes, process_index
        self.sampler = sampler if train else None
        self.epoch = 0
        if train and batch_size % num_processes:
            raise ValueError(f"batch size {batch_size} is not divisible by {num_processes} processes")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        n = len(self.labels)
        return n // self.batch_size if self.train else -(-n // self.batch_size)

    def _augment(self, x: Tensor, within: tuple[int, int]) -> Tensor:
        """Random crop with zero padding (or a random resized crop), flips and RandAugment for a uint8 batch
        ``(b, C, H, W)``, per image, ``x`` being images ``within = (start, total)`` of the global batch
        (:func:`_draws`)."""
        b, _, h, w = x.shape
        g = self._generator
        if self.rrc is not None:
            size, scale, ratio = self.rrc
            uniforms = _draws(lambda n: torch.rand(n, 22, device=x.device, generator=g), b, within)
            x = resized_crops(x, rrc_boxes(uniforms, h, w, scale, ratio), size, uint8=True)
        elif self.crop_padding:
            p = self.crop_padding
            padded = torch.nn.functional.pad(x, (p, p, p, p))
            dy = _draws(lambda n: torch.randint(0, 2 * p + 1, (n,), device=x.device, generator=g), b, within)
            dx = _draws(lambda n: torch.randint(0, 2 * p + 1, (n,), device=x.device, generator=g), b, within)
            rows = (dy[:, None] + torch.arange(h, device=x.device))[:, None, :, None]  # (b, 1, h, 1)
            cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, None, :]  # (b, 1, 1, w)
            batch = torch.arange(b, device=x.device)[:, None, None, None]
            chans = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
            x = padded[batch, chans, rows, cols]
        if self.hflip:
            flip = _draws(lambda n: torch.rand(n, device=x.device, generator=g), b, within) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        if self.randaugment is not None:
            x = rand_augment(x, *self.randaugment, generator=g, within=within)
        return x

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self.batches_from(0)

    def batches_from(self, start: int) -> Iterator[tuple[Tensor, Tensor]]:
        """The epoch's batches from batch ``start`` on (what a resumed epoch needs), equal to those of
        a whole epoch."""
        n, device = len(self.labels), self.labels.device
        shared = torch.Generator(device=device).manual_seed(self.seed + self.epoch)  # the same on every process
        self._generator = torch.Generator(device=device)
        if self.sampler is not None:  # drawn by class (data.sampler), the same on every process
            self.sampler.set_epoch(self.epoch)
            order = self.sampler.draws().to(device)
        else:
            order = (torch.randperm(n, device=device, generator=shared) if self.train
                     else torch.arange(n, device=device))
        for i in range(start, len(self)):
            batch = order[i * self.batch_size:(i + 1) * self.batch_size]
            part = torch.tensor_split(batch, self.num_processes)[self.process_index]
            x = self.images[part]
            if self.train:  # the global batch's draws, whichever process augments its part
                self._generator.manual_seed(process_seed(self.seed, 0, self.epoch, "augment", i))
                x = self._augment(x, (len(part) * self.process_index, len(batch)))
            if self.size is not None and self.rrc is None:  # rrc's crops are made at the size (training only)
                x = resize_images(x, self.size)
            yield x, self.labels[part]
