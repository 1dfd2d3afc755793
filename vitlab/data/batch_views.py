"""Views made a batch at a time on the run's device: random resized crops, horizontal flips and DINO's colour
transforms, each image's parameters made from uniform numbers drawn for it (in the loader, from a generator seeded by
the run, the epoch and the image: one call an image) by torchvision's rules, a batch at once where the batch is, and
applied to the whole batch at once there.

Each transform says how many uniforms an image takes (``uniforms``) and turns a batch's ``(B, uniforms)`` into its
parameters (``params``): the box by :func:`rrc_boxes` (torchvision's ``RandomResizedCrop.make_params`` rule: 10 tries
of an area and a log-uniform ratio, the first that fits, else the central crop), a flip or any other coin where its
uniform is below the probability (torchvision's ``_RandomApplyTransform``, ``RandomApply``), the jitter's order the
ranks of four uniforms (a uniformly random order, as ``randperm``) and each factor uniform in torchvision's range. So
the parameters are distributed as torchvision's draws (tested over 10,000 draws), not drawn from its generator: the
views of an image in an epoch are a function of the run's seed, the epoch and the image, wherever they are made.

The crop's resize is torch's antialiased bicubic (``F.interpolate(mode='bicubic', antialias=True)``, PIL's filter):
separable, so each image's resize is two matrices of weights, the rows over its crop's pixels, and a batch of them two
batched matrix products. Given the same parameters, an image's view equals torchvision's of the float image (its
``functional`` ops in the same order) to 2e-5 (tested).

The device loader (``data.loader=gpu``, :class:`~vitlab.data.images.DeviceImageLoader`) draws a batch's uniforms at
once from its generator and rounds each crop to uint8 as torch's CPU kernel makes the DataLoader's (``uint8=True``).

Not kornia's ``RandomResizedCrop``: it resamples the crop by a bilinear warp without antialiasing (another
picture of a shrunk crop than torchvision's and PIL's), and draws from torch's global generator, which a run
resumed inside an epoch or on other processes could not redraw alike.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

__all__ = ["rrc_boxes", "resize_weights", "resized_crops", "BatchedResizedCrop", "BatchedColorJitter",
           "BatchedGrayscale", "BatchedGaussianBlur", "BatchedSolarize", "BatchedViews"]

BICUBIC_A = -0.5  # the antialiased bicubic filter's (PIL's and torch's antialias=True), not plain bicubic's -0.75


def _central_box(height: int, width: int, ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    """torchvision's fallback where no try fits: the central crop of the ratio in ``ratio`` nearest the image's."""
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def rrc_boxes(uniforms: Tensor, height: int, width: int, scale: tuple[float, float],
              ratio: tuple[float, float]) -> Tensor:
    """Random resized crops' boxes ``(top, left, height, width)``, int64 ``(n, 4)``, of images of ``height`` x
    ``width``, a batch at once from ``uniforms`` ``(n, 22)`` in ``[0, 1)``, where they are: torchvision's
    ``RandomResizedCrop.make_params`` rule (10 tries of an area of ``scale`` and a log-uniform ratio, the first that
    fits, else the central crop of the nearest ratio; the position uniform) in float32, so the boxes are distributed
    as torchvision's (tested over 10,000 draws), not drawn from its generator."""
    low, high = _log_ratio(tuple(ratio))
    target = (height * width) * (scale[0] + (scale[1] - scale[0]) * uniforms[:, :10])
    aspect = torch.exp(low + (high - low) * uniforms[:, 10:20])
    w, h = torch.round(torch.sqrt(target * aspect)), torch.round(torch.sqrt(target / aspect))
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)        # the first try that fits (0 where none does)
    fitted = fits.any(dim=1)
    fallback_top, fallback_left, fh, fw = _central_box(height, width, tuple(ratio))
    h = torch.where(fitted, h.gather(1, first)[:, 0], float(fh))
    w = torch.where(fitted, w.gather(1, first)[:, 0], float(fw))
    top = torch.where(fitted, torch.minimum(torch.floor(uniforms[:, 20] * (height - h + 1)), height - h),
                      float(fallback_top))
    left = torch.where(fitted, torch.minimum(torch.floor(uniforms[:, 21] * (width - w + 1)), width - w),
                       float(fallback_left))
    return torch.stack((top, left, h, w), dim=1).to(torch.long)


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


def resized_crops(images: Tensor, boxes: Tensor, size: tuple[int, int], uint8: bool = False) -> Tensor:
    """Each image's box resized to ``size``: ``images`` ``(B, C, H, W)`` (uint8 or float), ``boxes`` ``(B, 4)``
    integers ``(top, left, height, width)`` -> float32 ``(B, C, *size)`` in the images' range, unrounded; with
    ``uint8``, uint8 as torch's uint8 resize on the CPU makes them (the DataLoader's crops): the width resized
    first and rounded to uint8, then the height (to a level of it: its weights are fixed-point)."""
    _, _, height, width = images.shape
    boxes = boxes.to(images.device)
    rows = _weights(height, boxes[:, 0], boxes[:, 2], size[0])                 # (B, out_h, H)
    cols = _weights(width, boxes[:, 1], boxes[:, 3], size[1])                  # (B, out_w, W)
    if not uint8:
        return rows[:, None] @ (images.to(torch.float32) @ cols.transpose(1, 2)[:, None])
    level = lambda x: x.round_().clamp_(0, 255)
    return level(rows[:, None] @ level(images.to(torch.float32) @ cols.transpose(1, 2)[:, None])).to(torch.uint8)


class BatchedResizedCrop:
    """A random resized crop to ``size`` (``scale``, ``ratio``: torchvision's) and, with ``hflip``, a horizontal
    flip with probability 0.5: :meth:`params` makes a batch's parameters ``(top, left, height, width, flipped)``
    (int64 ``(B, 5)``) of its uniforms; calling it on a batch and its parameters gives the views, float32
    ``(B, C, *size)`` in ``[0, 255]``."""

    uniforms, width = 23, 5

    def __init__(self, size: tuple[int, int], scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), hflip: bool = True) -> None:
        self.size, self.scale, self.ratio, self.hflip = tuple(size), tuple(scale), tuple(ratio), hflip

    def params(self, u: Tensor, height: int, width: int) -> Tensor:
        """int64 ``(B, 5)`` of ``u`` ``(B, 23)``: the box of images of ``height`` x ``width`` (:func:`rrc_boxes`),
        flipped where the last uniform is below 0.5."""
        flipped = (u[:, 22] < 0.5) & self.hflip
        return torch.cat((rrc_boxes(u[:, :22], height, width, self.scale, self.ratio), flipped.long()[:, None]), 1)

    def __call__(self, images: Tensor, params: Tensor) -> Tensor:
        views = resized_crops(images, params[:, :4], self.size)
        flipped = params[:, 4].to(views.device).bool()[:, None, None, None]
        return torch.where(flipped, views.flip(-1), views)

    def __repr__(self) -> str:
        return f"BatchedResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, hflip={self.hflip})"


# Colour: torchvision's float kernels (transforms.v2.functional: adjust_brightness/contrast/saturation/hue,
# rgb_to_grayscale, gaussian_blur, solarize) with a factor an image; images float (B, 3, H, W) in [0, 1].

def _grey(x: Tensor) -> Tensor:
    """(B, 1, H, W): torchvision's luma (0.2989, 0.587, 0.114), unrounded."""
    r, g, b = x.unbind(dim=-3)
    return (r * 0.2989 + g * 0.587 + b * 0.114).unsqueeze(-3)


def _rgb_to_hsv(x: Tensor) -> Tensor:
    r, g, _ = x.unbind(dim=-3)
    low, high = torch.aminmax(x, dim=-3)
    flat = high == low
    ones = torch.ones_like(high)
    s = (high - low) / torch.where(flat, ones, high)
    rc, gc, bc = ((high.unsqueeze(-3) - x) / torch.where(flat, ones, high - low).unsqueeze(-3)).unbind(dim=-3)
    not_r, is_g = high != r, high == g
    h = (bc - gc) * ~not_r + (rc + 2.0 - bc) * (is_g & not_r) + (gc + 4.0 - rc) * (not_r & ~is_g)
    return torch.stack(((h * (1.0 / 6.0) + 1.0).fmod(1.0), s, high), dim=-3)


_HSV_SELECT = ((0, 2, 1, 1, 3, 0), (3, 0, 0, 2, 1, 1), (1, 1, 3, 0, 0, 2))  # (v, p, q, t) -> r, g, b by sector


@functools.lru_cache(maxsize=4)
def _hsv_select(device: torch.device) -> Tensor:
    return torch.tensor(_HSV_SELECT, device=device)  # made once a device: no copy from the host a batch


def _hsv_to_rgb(x: Tensor) -> Tensor:
    h, s, v = x.unbind(dim=-3)
    h6 = h * 6
    sector = torch.floor(h6)
    f = h6 - sector
    q = ((1.0 - s * f) * v).clamp(0.0, 1.0)
    t = ((s * f + (1.0 - s)) * v).clamp(0.0, 1.0)
    p = ((1.0 - s) * v).clamp(0.0, 1.0)
    select = _hsv_select(x.device)[:, sector.to(torch.long).remainder(6)].moveaxis(0, -3)
    return torch.stack((v, p, q, t), dim=-3).gather(-3, select)


def _hue(x: Tensor, factor: Tensor) -> Tensor:
    h, s, v = _rgb_to_hsv(x).unbind(dim=-3)
    return _hsv_to_rgb(torch.stack(((h + factor[:, None, None]).remainder(1.0), s, v), dim=-3))


def _coin(u: Tensor, p: float) -> Tensor:
    """torchvision's coin of ``RandomApply`` and its ``_RandomApplyTransform``s (applied unless ``rand >= p``),
    as 1.0 or 0.0."""
    return (u < p).to(torch.float64)


def _between(u: Tensor, low: float, high: float) -> Tensor:
    """Uniform in ``[low, high)``, as torchvision's ``uniform_(low, high)``."""
    return low + (high - low) * u.to(torch.float64)


class BatchedColorJitter:
    """``RandomApply([ColorJitter(brightness, contrast, saturation, hue)], p)``: per image applied or not, the four
    adjustments in a random order, each factor drawn as torchvision draws them (a factor of 0 is no adjustment and no
    draw). Parameters ``(applied, order (4), factors (4))`` of 9 uniforms (the coin, the order's ranks, the factors);
    the batch is made at once (each of the four rounds is one blend towards black, the image's mean grey or its grey,
    and a hue shift where an image's round is hue; an adjustment without a factor is numbered 4, none)."""

    uniforms, width = 9, 9

    def __init__(self, brightness: float, contrast: float, saturation: float, hue: float, p: float = 1.0) -> None:
        self.p = p
        self.ranges = [None if v == 0 else (max(0.0, 1 - v), 1 + v) for v in (brightness, contrast, saturation)]
        self.ranges.append(None if hue == 0 else (-hue, hue))

    def params(self, u: Tensor) -> Tensor:
        order = u[:, 1:5].argsort(dim=1)  # the ranks of four uniforms: every order alike, as randperm(4)
        for i, r in enumerate(self.ranges):  # an adjustment without a factor: none (no tensor made on the host)
            if r is None:
                order = torch.where(order == i, 4, order)
        order = order.to(torch.float64)
        neutral = (1.0, 1.0, 1.0, 0.0)
        factors = [torch.full_like(u[:, 0], neutral[i], dtype=torch.float64) if r is None else _between(u[:, 5 + i], *r)
                   for i, r in enumerate(self.ranges)]
        return torch.cat((_coin(u[:, :1], self.p), order, torch.stack(factors, 1)), 1)

    def __call__(self, x: Tensor, params: Tensor) -> Tensor:
        return self.apply(x, params, subset=x.device.type == "cpu")

    @staticmethod
    def apply(x: Tensor, params: Tensor, subset: bool) -> Tensor:
        """The four rounds on ``x`` ``(B, 3, H, W)``. ``subset``: a round's hue shift made of the images whose round
        is hue alone (about a fifth of them: on the CPU the shift is most of the jitter's cost), found on the host;
        else of every image and kept where it applies (no wait for the host: the GPU's way). The same values."""
        applied = params[:, 0] > 0.5
        order = params[:, 1:5].to(torch.long)
        factors = params[:, 5:9].to(torch.float32)
        view = lambda v: v[:, None, None, None]
        for step in range(4):
            op = order[:, step]
            f = view(factors.gather(1, op.clamp(max=3)[:, None])[:, 0])
            grey = _grey(x)
            towards = torch.where(view(op == 0), 0.0, torch.where(view(op == 1), grey.mean((-3, -2, -1), True), grey))
            blended = (x * f + towards * (1 - f)).clamp(0, 1)
            if subset:
                out = torch.where(view(applied & (op < 3)), blended, x)
                hue = (applied & (op == 3)).nonzero()[:, 0]
                x = out.index_copy(0, hue, _hue(x[hue], factors[hue, 3])) if len(hue) else out
            else:
                out = torch.where(view(op == 3), _hue(x, factors[:, 3]), blended)
                x = torch.where(view(applied & (op < 4)), out, x)
        return x


class BatchedGrayscale:
    """``RandomGrayscale(p)``: parameters ``(applied,)`` of a uniform."""

    uniforms, width = 1, 1

    def __init__(self, p: float) -> None:
        self.p = p

    def params(self, u: Tensor) -> Tensor:
        return _coin(u, self.p)

    def __call__(self, x: Tensor, params: Tensor) -> Tensor:
        return torch.where(params[:, 0, None, None, None] > 0.5, _grey(x).expand_as(x), x)


class BatchedGaussianBlur:
    """``RandomApply([GaussianBlur(kernel_size, sigma)], p)``: parameters ``(applied, sigma)`` of 2 uniforms;
    torchvision's kernel (a softmax over ``kernel_size`` points), reflected borders, applied as two 1-D passes a batch
    at once."""

    uniforms, width = 2, 2

    def __init__(self, kernel_size: int, sigma: tuple[float, float], p: float) -> None:
        self.kernel_size, self.sigma, self.p = kernel_size, tuple(sigma), p

    def params(self, u: Tensor) -> Tensor:
        return torch.stack((_coin(u[:, 0], self.p), _between(u[:, 1], *self.sigma)), 1)

    def __call__(self, x: Tensor, params: Tensor) -> Tensor:
        b, c, h, w = x.shape
        k = self.kernel_size
        lim = (k - 1) / (2.0 * math.sqrt(2.0))
        points = torch.linspace(-lim, lim, steps=k, device=x.device)
        kernel = torch.softmax(-(points / params[:, 1:2].to(torch.float32)).pow(2), dim=1)     # (B, k)
        weight = kernel.repeat_interleave(c, dim=0)[:, None]                                  # (B C, 1, k)
        padded = torch.nn.functional.pad(x, [k // 2] * 4, mode="reflect").reshape(1, b * c, h + k - 1, w + k - 1)
        rows = torch.nn.functional.conv2d(padded, weight[..., None], groups=b * c)            # vertical pass
        out = torch.nn.functional.conv2d(rows, weight[:, :, None], groups=b * c).reshape(b, c, h, w)
        return torch.where(params[:, 0, None, None, None] > 0.5, out, x)


class BatchedSolarize:
    """``RandomSolarize(threshold, p)`` of images in [0, 1] (``threshold`` in the same units: 128/255 for uint8's
    128): parameters ``(applied,)`` of a uniform."""

    uniforms, width = 1, 1

    def __init__(self, threshold: float, p: float) -> None:
        self.threshold, self.p = threshold, p

    def params(self, u: Tensor) -> Tensor:
        return _coin(u, self.p)

    def __call__(self, x: Tensor, params: Tensor) -> Tensor:
        return torch.where((params[:, 0, None, None, None] > 0.5) & (x >= self.threshold), 1.0 - x, x)


class BatchedViews:
    """A crop (and flip) followed by colour transforms, as torchvision's ``Compose`` of the same transforms:
    :meth:`params` makes a batch's float64 ``(B, width)`` of its ``(B, uniforms)``, each transform's from its own
    uniforms; calling it on uint8 ``(B, C, H, W)`` and the parameters gives float32 views ``(B, C, *size)`` in
    ``[0, 255]``, unrounded (the crop clamped to the images' range before its colour transforms, as a uint8 crop is)."""

    def __init__(self, crop: BatchedResizedCrop, *colour: BatchedColorJitter | BatchedGrayscale
                 | BatchedGaussianBlur | BatchedSolarize) -> None:
        self.crop, self.colour = crop, colour
        self.width = crop.width + sum(t.width for t in colour)
        self.uniforms = crop.uniforms + sum(t.uniforms for t in colour)

    def params(self, u: Tensor, height: int, width: int) -> Tensor:
        crop, *colour = u.split([self.crop.uniforms, *(t.uniforms for t in self.colour)], dim=1)
        return torch.cat([self.crop.params(crop, height, width).to(torch.float64),
                          *(t.params(c) for t, c in zip(self.colour, colour))], 1)

    def __call__(self, images: Tensor, params: Tensor) -> Tensor:
        params = params.to(images.device)
        # clamped, as the loader's uint8 crop is: the colour transforms' hue takes values in [0, 1] (a crop's bicubic
        # overshoot below 0 with a channel at 0 divides by 0 there)
        x = (self.crop(images, params[:, :5].to(torch.long)) / 255).clamp_(0, 1)
        at = 5
        for t in self.colour:
            x, at = t(x, params[:, at:at + t.width]), at + t.width
        return x * 255
