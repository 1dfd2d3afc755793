"""Converters between vitlab and the references (timm's ViT, transformers' ViT and DeiT,
``torch.nn.MultiheadAttention``, ``torch.nn.Transformer``): the public name of :mod:`vitlab.models.interop`, where
they are defined."""
from .models.interop import from_timm, from_transformers, mha_from_torch, to_timm, to_transformers, \
    transformer_from_torch

__all__ = ["from_timm", "to_timm", "from_transformers", "to_transformers", "mha_from_torch", "transformer_from_torch"]
