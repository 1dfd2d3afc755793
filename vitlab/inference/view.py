"""The one evaluation view: what a model sees of an image at evaluation, in training's evaluations, ``vitlab
eval``, ``calibrate``, ``predict``, ``embed``, k-NN and test-time augmentation alike. A model trained on random
resized crops (``crop_pct`` kept with it) sees the center crop timm's evaluation cuts; any other model its image
resized to its input size, only where the images are stored at another size. Five-crop TTA reads a larger view
(:func:`crops_view_size`) and cuts its crops on the device (:mod:`.tta`).

A single image outside a batch job goes through :func:`vitlab.data.transforms.create_transform`, the same
choice as a PIL transform."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torch import nn
from torch.utils.data import Dataset
from torchvision.transforms import v2

from ..data.images import ImageData, TensorImageDataset
from ..data.transforms import center_crop_transform, decode_size, eval_transform

if TYPE_CHECKING:
    from ..data.split import SplitIndex

__all__ = ["eval_view", "eval_dataset", "model_dataset", "crops_view_size"]


def _view(size: tuple[int, int], stored: tuple[int, int] | None, crop_pct: float | None) -> v2.Transform:
    """With ``crop_pct`` (``data.train_crop=rrc``) the center crop of
    :func:`~vitlab.data.transforms.center_crop_transform`, else a resize to the model's input ``size`` (only if
    the images are ``stored`` at another size); uint8 out."""
    if crop_pct is not None:
        return center_crop_transform(tuple(size), crop_pct)
    return eval_transform(tuple(size) if stored != tuple(size) else None)


def eval_view(size: tuple[int, int], stored: tuple[int, int] | None, crop_pct: float | None,
              tta: str = "none") -> v2.Transform:
    """Evaluation's transform of an image ``stored`` at a size (None: each its own) for a model of input ``size``;
    for ``tta='crops'`` the larger view :func:`~vitlab.inference.tta.five_crops_tta` cuts from
    (:func:`crops_view_size`)."""
    if tta == "crops":
        size, crop_pct = crops_view_size(size, crop_pct), (1.0 if crop_pct is not None else None)
    return _view(size, stored, crop_pct)


def eval_dataset(data: ImageData, size: tuple[int, int], crop_pct: float | None = None,
                 tta: str = "none") -> TensorImageDataset:
    """Images as the model sees them in evaluation (:func:`eval_view`), before normalization. Streamed image
    files reach the center crop undecoded, which decodes them at the scale it needs (where ``data.scaled_decode``
    is on)."""
    stored = tuple(data.images.shape[-2:]) if crop_pct is None else None
    return TensorImageDataset(data, eval_view(size, stored, crop_pct, tta), lazy=crop_pct is not None)


def model_dataset(model: nn.Module, index: SplitIndex, tta: str = "none") -> Dataset:
    """A split's images as a trained model's evaluation sees them, from its ``pretrained_cfg``: streamed (decoded
    when read, a JPEG only as large as the model needs) at the size its training stored them, through
    :func:`eval_dataset`; uint8 out."""
    cfg = model.pretrained_cfg
    size, crop_pct = tuple(cfg["input_size"][1:]), cfg.get("crop_pct")
    stored = None if crop_pct else (decode_size(model) or size)  # a center crop decodes each file at its own size
    return eval_dataset(index.load(stored, in_memory=False, scaled=True), size, crop_pct, tta)


def crops_view_size(size: tuple[int, int], crop_pct: float | None) -> tuple[int, int]:
    """The view five-crop TTA cuts from: ``floor(size / crop_pct)`` (the model's ``crop_pct``, timm's 0.875 for a
    model evaluated on the whole image): the image evaluation center-crops, whole (its shorter side at that size,
    its center square), or the whole image resized to it."""
    return tuple(math.floor(s / (crop_pct or 0.875)) for s in size)
