"""Test-time augmentation: a prediction as the mean of the model's on several views of each image, returned as
logits whose softmax (or sigmoids) is that mean, so every metric of logits (loss, calibration, top-k) reads it."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["tta_logits", "flip_tta", "five_crops_tta"]


def tta_logits(model: nn.Module, images: Tensor, tta: str = "none", multi_label: bool = False,
               size: tuple[int, int] | None = None) -> Tensor:
    """The logits of ``images`` (``tta='none'``), or of the mean prediction of :func:`flip_tta` or
    :func:`five_crops_tta` (which cuts crops of the model's input ``size``); float32."""
    if tta == "flip":
        return flip_tta(model, images, multi_label)
    if tta == "crops":
        return five_crops_tta(model, images, size, multi_label)
    return model(images).float()


def flip_tta(model: nn.Module, images: Tensor, multi_label: bool = False) -> Tensor:
    """Test-time augmentation by flipping: the logits ``(b, K)`` whose probabilities are the mean of the
    image's and its horizontal mirror's (softmax: the log of the mean; ``multi_label``: the logit of each
    class's mean sigmoid). ``images``: the model's input ``(b, C, H, W)``."""
    both = model(torch.cat([images, images.flip(-1)])).float()
    a, b = both.chunk(2)
    if multi_label:
        return torch.logit((a.sigmoid() + b.sigmoid()) / 2, eps=1e-7)
    return torch.logaddexp(a.log_softmax(-1), b.log_softmax(-1)) - math.log(2)


def five_crops_tta(model: nn.Module, views: Tensor, size: tuple[int, int], multi_label: bool = False) -> Tensor:
    """Test-time augmentation by five crops (torchvision's ``FiveCrop``: the four corners and the center, of the
    model's input ``size``) of ``views`` ``(b, C, H, W)`` (:func:`~vitlab.inference.view.crops_view_size`): the
    logits ``(b, K)`` whose probabilities are the mean of the crops' (softmax: the log of the mean; ``multi_label``:
    the logit of each class's mean sigmoid). The center crop is evaluation's own view of a center-cropped model."""
    (h, w), (height, width) = size, views.shape[-2:]
    top, left = int(round((height - h) / 2.0)), int(round((width - w) / 2.0))
    crops = [views[..., :h, :w], views[..., :h, width - w:], views[..., height - h:, :w],
             views[..., height - h:, width - w:], views[..., top:top + h, left:left + w]]
    parts = torch.stack(model(torch.cat(crops)).float().chunk(5))
    if multi_label:
        return torch.logit(parts.sigmoid().mean(0), eps=1e-7)
    return torch.logsumexp(parts.log_softmax(-1), 0) - math.log(5)
