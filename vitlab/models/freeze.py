"""Freezing part of an image classifier for fine-tuning (``model.freeze``): the frozen parameters stop
requiring gradients, so they get neither a gradient nor optimizer state.

- ``backbone``: only the head trains (a linear probe);
- ``blocks:N``: the embeddings (everything before the first block: patch embedding, CLS and register tokens,
  positions) and the first ``N`` blocks are frozen, the rest trains;
- ``attn_only``: only the attention layers, the positional embedding and the head train, as DeiT's
  ``--attn-only`` sets them (Touvron et al. 2022, "Three things everyone should know about Vision
  Transformers": fine-tuning the attention alone); the norms, tokens, patch embedding and MLPs stay frozen.
"""
from __future__ import annotations

from torch import nn

from ..errors import ConfigError

__all__ = ["FREEZE_CHOICES", "check_freeze", "freeze_parameters"]

FREEZE_CHOICES = "none, backbone, blocks:N (the embeddings and the first N blocks) or attn_only"


def check_freeze(spec: str) -> None:
    """``spec`` is one of :data:`FREEZE_CHOICES`, or one line saying what is."""
    count = spec.removeprefix("blocks:")
    if spec in ("none", "backbone", "attn_only") or (spec.startswith("blocks:") and count.isdigit() and int(count)):
        return
    raise ConfigError(f"model.freeze={spec!r} is not one of {FREEZE_CHOICES}, e.g. blocks:6")


def _head(model: nn.Module) -> set[int]:
    if not hasattr(model, "get_classifier"):
        raise ConfigError(f"model.freeze needs a classifier with a head (get_classifier), not {type(model).__name__}")
    heads = model.get_classifier()
    return {id(p) for head in (heads if isinstance(heads, tuple) else (heads,)) for p in head.parameters()}


def _blocks(model: nn.Module, count: int) -> tuple[str, int]:
    """The name of the model's stack of blocks and how many it has."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "blocks" and isinstance(module, (nn.Sequential, nn.ModuleList)):
            if count > len(module):
                raise ConfigError(f"model.freeze=blocks:{count}: the model has {len(module)} blocks; freeze at most "
                                  f"{len(module)}, or backbone")
            return name, len(module)
    raise ConfigError(f"model.freeze=blocks:{count} needs a model with a stack of blocks (a ViT); "
                      f"{type(model).__name__} has none: use backbone or attn_only")


def freeze_parameters(model: nn.Module, spec: str) -> int:
    """Freeze ``model``'s parameters as ``spec`` says (see the module); returns how many scalars still train.
    A head made later (``reset_classifier``) trains: its parameters are new."""
    check_freeze(spec)
    params = list(model.named_parameters())
    if spec == "none":
        return sum(p.numel() for _, p in params)
    head = _head(model)
    if spec == "backbone":
        trains = {name for name, p in params if id(p) in head}
    elif spec == "attn_only":
        trains = {name for name, p in params  # DeiT's main.py: '.attn.' in the name, the head, pos_embed
                  if ".attn." in f".{name}" or name.rsplit(".", 1)[-1] == "pos_embed" or id(p) in head}
    else:
        count = int(spec.removeprefix("blocks:"))
        stack, _ = _blocks(model, count)
        first = next(i for i, (name, _) in enumerate(params) if name.startswith(f"{stack}."))
        frozen = {name for name, _ in params[:first]} | {
            name for name, _ in params if any(name.startswith(f"{stack}.{i}.") for i in range(count))}
        trains = {name for name, _ in params} - frozen
    for name, p in params:
        p.requires_grad_(name in trains)
    return sum(p.numel() for name, p in params if name in trains)
