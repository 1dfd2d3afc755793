"""The transform rules, in one home: how an image becomes the model's input in training (the DataLoader's
per-image transforms), in evaluation (training's loaders and ``vitlab eval``), and in ``vitlab predict``,
``vitlab attention`` and :func:`create_transform`.

Two families, chosen by ``data.train_crop``:

- ``'pad'`` (CIFAR-style, the default): images stored at one size; training crops at random with zero
  padding; evaluation resizes to the model's input only if the images are stored at another size.
- ``'rrc'`` (ImageNet-style, named as timm's ``train.py`` names them): training takes a random resized
  crop (``scale``, ``ratio``) of each image at its own size; evaluation resizes the shorter side to
  ``floor(img_size / crop_pct)`` and crops the center, as ``timm.data.create_transform(is_training=False,
  crop_pct=..., interpolation='bicubic')``, through PIL as timm (a tensor is made a PIL image first).
  Training crops are torch's (antialiased bicubic on uint8 tensors, faster than PIL's: benchmarks/RESULTS.md,
  "The ImageNet-style pipeline against timm's loader").

Both flip and augment (``'randaugment'``, ``'trivialaugment'``, ``'autoaugment'`` with the CIFAR-10 or
ImageNet policy) with torchvision's v2 transforms, per image, in the loaders' workers, and hand over
uint8 ``(C, H, W)``: a quarter of float32's bytes to collate and pass between processes. A batch becomes
the model's input on the device (:class:`ModelInput`: normalization, and in ``'rrc'`` random erasing
with probability ``reprob``, per-pixel normal noise, as timm's ``PrefetchLoader`` does).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torchvision.transforms import v2

from .decode import EncodedImage, dct_scale, decode_region, jpeg_size

__all__ = ["CIFAR10_MEAN", "CIFAR10_STD", "AUGMENTS", "TIMM_AUGMENTS", "timm_augment_problem", "timm_augment_hparams",
           "TimmAugment", "src_train_transform", "resize_images", "normalize", "ModelInput", "train_transform",
           "eval_transform", "rrc_train_transform", "center_crop_transform", "image_transform", "model_view",
           "create_transform", "decode_size", "decode_upright", "RandomResizedCropDecode"]

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
AUGMENTS = ("none", "randaugment", "trivialaugment", "autoaugment")

# The one rule by which images are brought to the model's input size, in every path (the DataLoader's
# transforms, the device loader's batches, vitlab eval / predict / attention): bicubic with
# antialiasing (PIL's on a PIL image, torchvision's on uint8 tensors, rounded back to uint8).
_RESIZE = dict(interpolation=v2.InterpolationMode.BICUBIC, antialias=True)


def resize_images(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 images ``(..., C, H, W)`` -> ``(..., C, *size)`` by the package's one resize rule (above)."""
    return v2.functional.resize(x, list(size), **_RESIZE)


def _to_normalized(mean: tuple[float, ...], std: tuple[float, ...]) -> list[v2.Transform]:
    return [v2.ToImage(), v2.ToPureTensor(), v2.Lambda(functools.partial(normalize, mean=tuple(mean), std=tuple(std)))]


def normalize(x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 images ``(..., C, H, W)`` -> float32 ``(x - 255 mean) / (255 std)``: the one normalization of
    every path (training's and evaluation's batches, :func:`create_transform`'s single images), the
    operations of timm's ``PrefetchLoader``; two passes over the batch (torchvision's ``ToDtype`` then
    ``Normalize`` make three, and take twice as long: benchmarks/RESULTS.md, "The ImageNet-style pipeline against timm's
    loader")."""
    m, s = _scaled(tuple(mean), tuple(std), x.device)
    return x.to(torch.float32).sub_(m).div_(s)


@functools.lru_cache(maxsize=16)
def _scaled(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``255 mean`` and ``255 std`` as ``(C, 1, 1)`` float32 on ``device``, made once: a tensor made from a
    list on a CUDA device is a blocking copy, which every batch would otherwise wait on."""
    return (torch.tensor([v * 255 for v in mean], device=device).view(-1, 1, 1),
            torch.tensor([v * 255 for v in std], device=device).view(-1, 1, 1))


class ModelInput:
    """A batch of uint8 images -> the model's input, on the batch's device: :func:`normalize`, then in
    training random erasing with probability ``reprob`` per image (timm's ``RandomErasing``, ``mode='pixel'``:
    per-pixel normal noise, on the normalized batch, where timm's ``PrefetchLoader`` erases; its draws come
    from torch's generator on that device, as mixup's and dropout's do)."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...], reprob: float = 0.0) -> None:
        self.mean, self.std, self.reprob = tuple(mean), tuple(std), reprob
        self._erasing: Any = None

    def __call__(self, images: torch.Tensor, train: bool = False) -> torch.Tensor:
        x = normalize(images, self.mean, self.std)
        if train and self.reprob > 0:
            if self._erasing is None or self._erasing.device != x.device:
                from timm.data.random_erasing import RandomErasing

                self._erasing = RandomErasing(self.reprob, mode="pixel", device=x.device)
            x = self._erasing(x)
        return x


def _resize(out_size: tuple[int, int] | None) -> list[v2.Transform]:
    return [v2.Resize(out_size, **_RESIZE)] if out_size else []


# timm's augmentation specs by their first part (timm.data.auto_augment): RandAugment, AugMix, and the
# AutoAugment policies (3a: DeiT III's 3-Augment).
TIMM_AUGMENTS = ("rand", "augmix", "v0", "v0r", "original", "originalr", "3a")


def timm_augment_problem(augment: str) -> str | None:
    """Why ``augment`` is not a timm spec string timm can build (``rand-m9-mstd0.5-inc1``, ``augmix-m5-w3``,
    ``original``, ``3a``), or None if it is one: checked when the config is read, before any data."""
    if augment.split("-")[0] not in TIMM_AUGMENTS:
        return f"not a timm spec (it starts with one of {', '.join(TIMM_AUGMENTS)})"
    try:
        TimmAugment(augment, {})
    except Exception as e:  # noqa: BLE001 (timm asserts, or fails to read a number)
        return f"timm cannot read it ({type(e).__name__}: {e})"
    return None


def timm_augment_hparams(size: tuple[int, int], mean: tuple[float, ...]) -> dict[str, Any]:
    """The hparams timm's ``create_transform`` gives its auto-augmentations: translations up to 45% of the
    shorter side, fills of the mean colour (0-255), bicubic resampling (timm's ViT recipes' interpolation)."""
    from PIL import Image

    return dict(translate_const=int(min(size) * 0.45), img_mean=tuple(min(255, round(255 * x)) for x in mean),
                interpolation=Image.BICUBIC)


class TimmAugment:
    """timm's RandAugment, AugMix or AutoAugment from a spec string, on a uint8 ``(C, H, W)`` image (through
    PIL, as timm), uint8 out. timm's ops draw from Python's and NumPy's generators: here both are seeded,
    for each image, from a number drawn from torch's generator, and left as they were after, so the
    per-image seeding of :func:`~vitlab.data.images.seeded_transform` holds for them too."""

    def __init__(self, spec: str, hparams: dict[str, Any]) -> None:
        from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, rand_augment_transform

        kind = spec.split("-")[0]
        factory = (rand_augment_transform if kind == "rand" else augment_and_mix_transform if kind == "augmix"
                   else auto_augment_transform)
        self.spec, self.transform = spec, factory(spec, dict(hparams))
        for op in [*getattr(self.transform, "ops", []), *(o for sub in getattr(self.transform, "policy", []) for o in sub)]:
            if op.name.startswith("Posterize"):
                op.aug_fn = _posterize

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        import random

        import numpy as np

        seed = int(torch.randint(0, 2 ** 31 - 1, ()))
        python_state, numpy_state = random.getstate(), np.random.get_state()
        random.seed(seed)
        np.random.seed(seed)
        try:
            out = self.transform(v2.functional.to_pil_image(image.as_subclass(torch.Tensor)))
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
        return torch.from_numpy(np.array(out, dtype=np.uint8)).permute(2, 0, 1).contiguous()

    def __repr__(self) -> str:
        return f"TimmAugment({self.spec!r})"


def _posterize(image: Any, bits_to_keep: int, **_: Any) -> Any:
    """timm's posterize, also at 0 bits: the black image Pillow gave there before 11 (Pillow 11 refuses 0
    bits, which timm's increasing posterize reaches at magnitude 10, e.g. RandAugment m9 plus noise)."""
    from PIL import Image, ImageOps

    if bits_to_keep >= 8:
        return image
    if bits_to_keep <= 0:
        return Image.new(image.mode, image.size)
    return ImageOps.posterize(image, bits_to_keep)


def _augment(augment: str, randaugment_ops: int, randaugment_magnitude: int,
             autoaugment_policy: str, size: tuple[int, int] = (224, 224),
             mean: tuple[float, ...] = CIFAR10_MEAN, color_jitter: float = 0.0) -> list[Any]:
    """``augment``'s transform, then ``ColorJitter(color_jitter, color_jitter, color_jitter)`` if > 0 (DeiT III
    jitters after its 3-Augment; timm's create_transform jitters only without an auto-augmentation)."""
    ops = _auto_augment(augment, randaugment_ops, randaugment_magnitude, autoaugment_policy, size, mean)
    return ops + ([v2.ColorJitter(color_jitter, color_jitter, color_jitter)] if color_jitter > 0 else [])


def _auto_augment(augment: str, randaugment_ops: int, randaugment_magnitude: int, autoaugment_policy: str,
                  size: tuple[int, int], mean: tuple[float, ...]) -> list[Any]:
    if augment.split("-")[0] in TIMM_AUGMENTS:
        return [TimmAugment(augment, timm_augment_hparams(size, mean))]
    if augment == "randaugment":
        return [v2.RandAugment(num_ops=randaugment_ops, magnitude=randaugment_magnitude)]
    if augment == "trivialaugment":
        return [v2.TrivialAugmentWide()]
    if augment == "autoaugment":
        return [v2.AutoAugment(v2.AutoAugmentPolicy(autoaugment_policy))]
    if augment != "none":
        raise ValueError(f"augment={augment!r}; expected one of {', '.join(AUGMENTS)}, or a timm spec "
                         f"(rand-m9-mstd0.5-inc1, augmix-m5-w3, original, 3a)")
    return []


def train_transform(size: tuple[int, int], crop_padding: int = 4, hflip: bool = True, augment: str = "none",
                    randaugment_ops: int = 2, randaugment_magnitude: int = 9, out_size: tuple[int, int] | None = None,
                    autoaugment_policy: str = "cifar10", mean: tuple[float, ...] = CIFAR10_MEAN,
                    color_jitter: float = 0.0) -> v2.Compose:
    """``'pad'``: random crop of ``size`` with zero padding, horizontal flip, ``augment``, a bicubic
    resize to ``out_size`` (the model's input, if it differs from the stored images); uint8 ``(C, H, W)``
    in and out (:class:`ModelInput` normalizes the batch). ``mean``: the normalization's, the fill colour
    of timm's augmentations (:func:`timm_augment_hparams`)."""
    ops: list[v2.Transform] = []
    if crop_padding > 0:
        ops.append(v2.RandomCrop(size, padding=crop_padding))
    if hflip:
        ops.append(v2.RandomHorizontalFlip())
    ops += _augment(augment, randaugment_ops, randaugment_magnitude, autoaugment_policy, size, mean, color_jitter)
    return v2.Compose(ops + _resize(out_size) + [v2.ToPureTensor()])


class RandomResizedCropDecode(v2.RandomResizedCrop):
    """torchvision's ``RandomResizedCrop`` (the same draws, the same pixels on a decoded image) that, given
    an :class:`~vitlab.data.decode.EncodedImage`, decodes only the crop at the scale it needs
    (:func:`~vitlab.data.decode.decode_region`: a JPEG by libjpeg-turbo's DCT scaling, to the rounding of a
    resize)."""

    def forward(self, *inputs: Any) -> Any:
        if len(inputs) == 1 and isinstance(inputs[0], EncodedImage):
            image = inputs[0]
            found = jpeg_size(image.data, image.exif_transpose)
            if found is None:  # a PNG, a CMYK JPEG: decoded whole, torchvision's crop, as without scaling
                return super().forward(image.decode())
            params = getattr(self, "make_params", None) or self._get_params  # torchvision < 0.21: _get_params

            def region(height: int, width: int) -> tuple[float, float, float, float]:
                p = params([torch.empty(()).expand(3, height, width)])  # the draws need only the size
                return p["top"], p["left"], p["height"], p["width"]

            return decode_region(image.data, image.where, region, tuple(self.size), image.exif_transpose, found)
        return super().forward(*inputs)


class _DecodeResized(v2.Transform):
    """Evaluation's first step on an :class:`~vitlab.data.decode.EncodedImage`: a JPEG decoded at the size
    the resize of its shorter side to ``scale`` gives (:func:`~vitlab.data.decode.decode_region` of the
    whole image, at the smallest DCT scale that leaves it larger), which makes that resize a no-op; any
    other file decoded whole. Everything else passes through."""

    def __init__(self, scale: int | tuple[int, int]) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, *inputs: Any) -> Any:
        if len(inputs) != 1 or not isinstance(inputs[0], EncodedImage):
            return inputs[0] if len(inputs) == 1 else inputs
        image = inputs[0]
        found = jpeg_size(image.data, image.exif_transpose)
        if found is None:
            return image.decode()
        height, width = found[:2]
        size = (self.scale if isinstance(self.scale, tuple) else
                tuple(v2.functional._geometry._compute_resized_output_size((height, width), size=[self.scale])))
        if dct_scale(height, width, size) == 1:  # too small to scale: decoded whole, then timm's resize
            return image.decode()
        return decode_region(image.data, image.where, lambda h, w: (0, 0, h, w), size, image.exif_transpose, found)


def rrc_train_transform(size: tuple[int, int], scale: tuple[float, float] = (0.08, 1.0),
                        ratio: tuple[float, float] = (3 / 4, 4 / 3), hflip: bool = True, augment: str = "none",
                        randaugment_ops: int = 2, randaugment_magnitude: int = 9,
                        autoaugment_policy: str = "imagenet", mean: tuple[float, ...] = CIFAR10_MEAN,
                        color_jitter: float = 0.0) -> v2.Compose:
    """``'rrc'``: a random resized crop to ``size`` (an area of ``scale`` of the image, an aspect ratio in
    ``ratio``, bicubic), horizontal flip, ``augment``; a PIL image or uint8 ``(C, H, W)`` of any size in,
    uint8 ``(C, *size)`` out (:class:`ModelInput` normalizes the batch and erases at random). A PIL image
    is made a tensor first (laid out channels-last, as decoded): torch's uint8 resize there is faster than PIL's
    (benchmarks/RESULTS.md, "The ImageNet-style pipeline against timm's loader")."""
    ops: list[v2.Transform] = [v2.ToImage(), RandomResizedCropDecode(size, scale=scale, ratio=ratio, **_RESIZE)]
    if hflip:
        ops.append(v2.RandomHorizontalFlip())
    ops += _augment(augment, randaugment_ops, randaugment_magnitude, autoaugment_policy, size, mean, color_jitter)
    return v2.Compose(ops + [v2.ToPureTensor()])


def src_train_transform(size: tuple[int, int], hflip: bool = True, augment: str = "none", randaugment_ops: int = 2,
                        randaugment_magnitude: int = 9, autoaugment_policy: str = "imagenet",
                        mean: tuple[float, ...] = CIFAR10_MEAN, color_jitter: float = 0.0) -> v2.Compose:
    """``'src'``: DeiT III's simple random crop: the shorter side resized to the crop's longer side
    (bicubic), a random crop of ``size`` with 4 pixels of reflected padding, horizontal flip, ``augment``;
    a PIL image or uint8 ``(C, H, W)`` of any size in, uint8 ``(C, *size)`` out."""
    ops: list[Any] = [v2.ToImage(), v2.Resize(max(size), **_RESIZE),
                      v2.RandomCrop(size, padding=4, padding_mode="reflect")]
    if hflip:
        ops.append(v2.RandomHorizontalFlip())
    ops += _augment(augment, randaugment_ops, randaugment_magnitude, autoaugment_policy, size, mean, color_jitter)
    return v2.Compose(ops + [v2.ToPureTensor()])


def eval_transform(out_size: tuple[int, int] | None = None) -> v2.Compose:
    """``'pad'``: uint8 ``(C, H, W)`` -> resized to ``out_size``, if given; uint8 (:class:`ModelInput`
    normalizes the batch)."""
    return v2.Compose(_resize(out_size) + [v2.ToPureTensor()])


def center_crop_transform(size: tuple[int, int], crop_pct: float = 0.875) -> v2.Compose:
    """``'rrc'``'s evaluation: the shorter side resized to ``floor(size / crop_pct)`` (bicubic), the center
    ``size`` cropped: timm's ``create_transform(is_training=False, crop_pct=crop_pct, interpolation='bicubic')``
    before its normalization, pixel for pixel on a PIL image; uint8 ``(C, *size)`` out."""
    scale = math.floor(size[0] / crop_pct) if size[0] == size[1] else tuple(math.floor(s / crop_pct) for s in size)
    return v2.Compose([_DecodeResized(scale), _AsPIL(), v2.Resize(scale, **_RESIZE), v2.CenterCrop(size), v2.ToImage(),
                       v2.ToPureTensor()])


class _AsPIL(v2.Transform):
    """A uint8 tensor image as a PIL image (anything else as it is): evaluation resizes with PIL, as timm."""

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        if isinstance(inpt, torch.Tensor) and inpt.dtype == torch.uint8 and inpt.ndim == 3:
            return v2.functional.to_pil_image(inpt.as_subclass(torch.Tensor))
        return inpt

    _transform = transform  # torchvision < 0.21 calls it by this name


def image_transform(size: tuple[int, int], mean: tuple[float, ...] = CIFAR10_MEAN,
                    std: tuple[float, ...] = CIFAR10_STD) -> v2.Compose:
    """Any image (PIL, uint8 tensor or array; any size; gray or RGB) -> normalized float32 ``(3, *size)``."""
    return v2.Compose([v2.ToImage(), v2.RGB(), *_resize(size), *_to_normalized(mean, std)])


def decode_size(model: object) -> tuple[int, int] | None:
    """The size a model's training decoded its image files at (``data.decode_size``, kept in its
    ``pretrained_cfg``), or None (their own size): :func:`vitlab.data.open_image` at this size, then
    :func:`create_transform`, gives a file the pixels training and ``vitlab eval`` gave it."""
    size = (getattr(model, "pretrained_cfg", None) or {}).get("decode_size")
    return (size, size) if size else None


def decode_upright(model: object) -> bool:
    """Whether a model's training turned image files upright by their EXIF orientation
    (``data.exif_transpose``, kept in its ``pretrained_cfg`` when off): :func:`vitlab.data.open_image`'s
    ``exif_transpose`` for the same pixels."""
    return (getattr(model, "pretrained_cfg", None) or {}).get("exif_transpose", True)


def _pretrained_cfg(model: object) -> dict:
    cfg = getattr(model, "pretrained_cfg", None)
    if not cfg:
        raise ValueError("the model has no pretrained_cfg; load it with vitlab.load_model(path), or use "
                         "vitlab.data.image_transform(size, mean, std)")
    return cfg


def model_view(model: object) -> v2.Compose:
    """What a model from :func:`vitlab.load_model` sees of an image, before normalization: uint8
    ``(3, *input_size)``. A center crop at its ``crop_pct`` for a model trained with
    ``data.train_crop=rrc``, else a resize to its input size; any image in (PIL, uint8 tensor)."""
    cfg = _pretrained_cfg(model)
    size = tuple(cfg["input_size"][1:])
    if cfg.get("crop_pct"):
        return v2.Compose(center_crop_transform(size, cfg["crop_pct"]).transforms[:4] + [v2.ToImage(), v2.RGB()])
    return v2.Compose([v2.ToImage(), v2.RGB(), v2.Resize(size, **_RESIZE)])


def create_transform(model: object) -> v2.Compose:
    """The evaluation preprocessing of a model from :func:`vitlab.load_model` (its ``pretrained_cfg``):
    :func:`model_view`, then its normalization; any image in (PIL, uint8 tensor)."""
    cfg = _pretrained_cfg(model)
    return v2.Compose([model_view(model), *_to_normalized(tuple(cfg["mean"]), tuple(cfg["std"]))])
