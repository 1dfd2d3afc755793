"""Normalisation layers, chosen by name: ``layernorm`` (Ba et al. 2016) or ``rmsnorm`` (Zhang & Sennrich 2019).

RMSNorm drops LayerNorm's centring and bias: ``x / sqrt(mean(x^2) + eps) * weight``. Its parameter
is ``weight`` as in timm's ``RmsNorm`` and ``torch.nn.RMSNorm``, so checkpoints map one to one.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Literal

from torch import nn

__all__ = ["LayerNorm", "RmsNorm", "NormName", "NORMS", "create_norm"]

NormName = Literal["layernorm", "rmsnorm"]
NORMS: tuple[str, ...] = ("layernorm", "rmsnorm")

#: LayerNorm as in timm's and Google's ViT: eps 1e-6 (PyTorch's default is 1e-5).
LayerNorm: Callable[..., nn.LayerNorm] = partial(nn.LayerNorm, eps=1e-6)
#: RMSNorm with timm's default eps 1e-6.
RmsNorm: Callable[..., nn.RMSNorm] = partial(nn.RMSNorm, eps=1e-6)


def create_norm(name: str, dim: int, eps: float = 1e-6) -> nn.Module:
    """A norm over the last dimension ``dim`` of ``(..., dim)`` by name."""
    if name == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    if name == "rmsnorm":
        return nn.RMSNorm(dim, eps=eps)
    raise ValueError(f"unknown norm_layer {name!r}; expected one of {', '.join(NORMS)}")
