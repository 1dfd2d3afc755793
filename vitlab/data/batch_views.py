"""Views made a batch at a time on the run's device: random resized crops and horizontal flips whose parameters
are drawn per image, on the CPU, from a generator seeded by the run, the epoch and the image (a few scalars an image,
in the loader), and applied to the whole batch at once where the batch is (:class:`BatchedResizedCrop`).

The crop is torchvision's ``RandomResizedCrop`` (its ``make_params`` drawn with an explicit generator: the same
algorithm, so the same distribution of boxes) and its resize torch's antialiased bicubic (``F.interpolate(mode=
'bicubic', antialias=True)``, PIL's filter): separable, so each image's resize is two matrices of weights, the
rows over its crop's pixels, and a batch of them two batched matrix products. Given the same box, an image's view equals
``torchvision.transforms.v2.functional.resized_crop`` of the float image to float32 rounding (tested).

Not kornia's ``RandomResizedCrop``: it resamples the crop by a bilinear warp without antialiasing (another
picture of a shrunk crop than torchvision's and PIL's), and draws from torch's global generator, which a run
resumed inside an epoch or on other processes could not redraw alike.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

__all__ = ["rrc_params", "resize_weights", "resized_crops", "BatchedResizedCrop"]

BICUBIC_A = -0.5  # the antialiased bicubic filter's (PIL's and torch's antialias=True), not plain bicubic's -0.75


def rrc_params(generator: torch.Generator, height: int, width: int, scale: tuple[float, float],
               ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    """``(top, left, height, width)`` of a random resized crop of an image of ``height`` x ``width``: torchvision's
    ``RandomResizedCrop.make_params`` (an area of ``scale`` of the image, a log-uniform aspect ratio in ``ratio``;
    10 tries, then the central crop of the nearest ratio), each draw from ``generator``, in its order and float32
    arithmetic (the same boxes from the same generator state: tested)."""
    area = height * width
    low, high = _log_ratio(tuple(ratio))
    draw = torch.empty(1)
    for _ in range(10):
        target_area = area * draw.uniform_(scale[0], scale[1], generator=generator).item()
        aspect = torch.exp(draw.uniform_(low, high, generator=generator)).item()
        w, h = int(round(math.sqrt(target_area * aspect))), int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,), generator=generator))
            left = int(torch.randint(0, width - w + 1, size=(1,), generator=generator))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


@functools.lru_cache(maxsize=8)
def _log_ratio(ratio: tuple[float, float]) -> tuple[float, float]:
    """torchvision's bounds of the log aspect ratio: float32 logs, as Python floats."""
    low, high = torch.log(torch.tensor(ratio)).tolist()
    return low, high


def _bicubic_aa(x: Tensor) -> Tensor:
    x = x.abs()
    a = BICUBIC_A
    return torch.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                       torch.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, torch.zeros_like(x)))


def resize_weights(size: int, start: Tensor, length: Tensor, out: int) -> Tensor:
    """``(B, out, size)`` float32: row ``i`` of image ``b`` holds the weights of output pixel ``i`` over the
    ``size`` input pixels when the span ``[start[b], start[b] + length[b])`` is resized to ``out`` pixels by torch's
    antialiased bicubic (``aten``'s ``compute_indices_weights_aa``: support ``2 scale`` when shrinking, 2 when
    growing, each output's weights summing to 1), zero outside the span. ``start``, ``length``: ``(B,)`` integers."""
    device = start.device
    length = length.to(torch.float32)[:, None, None]                          # (B, 1, 1)
    scale = length / out
    support = torch.where(scale >= 1, 2 * scale, torch.full_like(scale, 2.0))
    inverse = torch.where(scale >= 1, 1 / scale, torch.ones_like(scale))
    center = scale * (torch.arange(out, dtype=torch.float32, device=device)[None, :, None] + 0.5)  # (B, out, 1)
    low = torch.clamp(torch.trunc(center - support + 0.5), min=0)
    high = torch.minimum(torch.trunc(center + support + 0.5), length)
    j = torch.arange(size, dtype=torch.float32, device=device)[None, None, :] - start.to(torch.float32)[:, None, None]
    weights = _bicubic_aa((j - center + 0.5) * inverse) * ((j >= low) & (j < high))
    return weights / weights.sum(-1, keepdim=True)


TABLE_BUDGET = 2**22  # floats (16 MiB): a side of up to 45 pixels keeps every span's weights made once


@functools.lru_cache(maxsize=8)
def _weight_table(size: int, out: int, device: torch.device) -> Tensor:
    """Every span's :func:`resize_weights`, ``(size, size + 1, out, size)`` by ``[start, length]`` (the lengths
    that do not fit left zero): small images' weights are then looked up, not made a batch at a time."""
    table = torch.zeros(size, size + 1, out, size, device=device)
    start, length = torch.meshgrid(torch.arange(size, device=device), torch.arange(1, size + 1, device=device),
                                   indexing="ij")
    fits = (start + length <= size).flatten()
    starts, lengths = start.flatten()[fits], length.flatten()[fits]
    table[starts, lengths] = resize_weights(size, starts, lengths, out)
    return table


def _weights(size: int, start: Tensor, length: Tensor, out: int) -> Tensor:
    if size * (size + 1) * out * size <= TABLE_BUDGET:
        return _weight_table(size, out, start.device)[start, length]
    return resize_weights(size, start, length, out)


def resized_crops(images: Tensor, boxes: Tensor, size: tuple[int, int]) -> Tensor:
    """Each image's box resized to ``size``: ``images`` ``(B, C, H, W)`` (uint8 or float), ``boxes`` ``(B, 4)``
    integers ``(top, left, height, width)`` -> float32 ``(B, C, *size)`` in the images' range, unrounded."""
    _, _, height, width = images.shape
    boxes = boxes.to(images.device)
    rows = _weights(height, boxes[:, 0], boxes[:, 2], size[0])                 # (B, out_h, H)
    cols = _weights(width, boxes[:, 1], boxes[:, 3], size[1])                  # (B, out_w, W)
    return rows[:, None] @ (images.to(torch.float32) @ cols.transpose(1, 2)[:, None])


class BatchedResizedCrop:
    """A random resized crop to ``size`` (``scale``, ``ratio``: torchvision's) and, with ``hflip``, a horizontal
    flip with probability 0.5: :meth:`draw` gives an image's parameters ``(top, left, height, width, flipped)``
    (int64 ``(5,)``) from its generator, in the loader; calling it on a batch and its parameters gives the views,
    float32 ``(B, C, *size)`` in ``[0, 255]``, where the batch is."""

    def __init__(self, size: tuple[int, int], scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), hflip: bool = True) -> None:
        self.size, self.scale, self.ratio, self.hflip = tuple(size), tuple(scale), tuple(ratio), hflip

    def draw(self, generator: torch.Generator, height: int, width: int) -> Tensor:
        box = rrc_params(generator, height, width, self.scale, self.ratio)
        flipped = bool(self.hflip and torch.rand(1, generator=generator).item() < 0.5)
        return torch.tensor([*box, int(flipped)], dtype=torch.long)

    def __call__(self, images: Tensor, params: Tensor) -> Tensor:
        views = resized_crops(images, params[:, :4], self.size)
        flipped = params[:, 4].to(views.device).bool()[:, None, None, None]
        return torch.where(flipped, views.flip(-1), views)

    def __repr__(self) -> str:
        return f"BatchedResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, hflip={self.hflip})"
