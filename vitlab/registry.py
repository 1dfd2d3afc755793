"""Named model presets: ``create_model(name, **overrides)`` and ``list_models()``.

The ImageNet presets have timm's names and exactly timm's shapes and parameter counts. The CIFAR
presets run on 32x32 images cut into 4x4 patches (64 patch tokens + CLS = 65 tokens).
"""
from __future__ import annotations

import difflib
import fnmatch
import inspect
from typing import Any

from .vit import VisionTransformer

__all__ = ["create_model", "list_models", "model_args"]

_PRESETS: dict[str, dict[str, Any]] = {
    # timm's ImageNet ViTs (224x224, 16x16 patches, 1000 classes).
    "vit_tiny_patch16_224": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "vit_small_patch16_224": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "vit_base_patch16_224": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
    # CIFAR-sized ViTs (32x32, 4x4 patches, 10 classes).
    "vit_cifar_tiny_patch4_32": dict(img_size=32, patch_size=4, num_classes=10, embed_dim=96, depth=4,
                                     num_heads=3, mlp_ratio=2.0),
    "vit_lite_7_patch4_32": dict(img_size=32, patch_size=4, num_classes=10, embed_dim=256, depth=7,
                                 num_heads=4, mlp_ratio=2.0),
    "vit_cifar_small_patch4_32": dict(img_size=32, patch_size=4, num_classes=10, embed_dim=384, depth=7,
                                      num_heads=6, mlp_ratio=2.0),
}

_VIT_ARGS = tuple(inspect.signature(VisionTransformer).parameters)


def list_models(pattern: str = "*") -> list[str]:
    """Preset names matching a shell-style ``pattern`` (e.g. ``'*cifar*'``), sorted."""
    return sorted(n for n in _PRESETS if fnmatch.fnmatch(n, pattern))


def model_args(name: str, **overrides: Any) -> dict[str, Any]:
    """The full ``VisionTransformer`` arguments of preset ``name`` with ``overrides`` applied."""
    if name not in _PRESETS:
        close = difflib.get_close_matches(name, _PRESETS, n=3, cutoff=0.4)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(f"unknown model {name!r}; {hint}available: {', '.join(list_models())}")
    unknown = [k for k in overrides if k not in _VIT_ARGS]
    if unknown:
        raise ValueError(
            f"unknown model argument(s) {unknown} for {name!r}; VisionTransformer takes {', '.join(_VIT_ARGS)}")
    return {**_PRESETS[name], **overrides}


def create_model(name: str, pretrained: bool = False, **overrides: Any) -> VisionTransformer:
    """Build preset ``name`` (see :func:`list_models`), with any ``VisionTransformer`` argument overridden.

    Example: ``create_model('vit_small_patch16_224', num_classes=10, drop_path_rate=0.1)``.
    vitlab ships no pretrained weights: for timm's, use
    ``vitlab.interop.from_timm(timm.create_model(name, pretrained=True))``.
    """
    if pretrained:
        raise ValueError(
            "vitlab ships no pretrained weights (pretrained=True); load timm's instead: "
            f"vitlab.interop.from_timm(timm.create_model({name!r}, pretrained=True))")
    return VisionTransformer(**model_args(name, **overrides))
