"""Gradient checkpointing: trade compute for memory by recomputing activations in the backward pass.

A model that mixes in :class:`GradCheckpointing` has timm's ``model.set_grad_checkpointing(True)``;
its forward runs each block through :func:`checkpointed`, which stores only the block's inputs and
recomputes the rest when the gradient needs it (``torch.utils.checkpoint``, non-reentrant; the random
state is replayed, so dropout draws the same masks and the gradients are those of the plain forward).
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["GradCheckpointing", "checkpointed"]

T = TypeVar("T")


def checkpointed(enabled: bool, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``; when ``enabled`` and gradients are on, its activations are recomputed in
    the backward pass instead of kept."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return fn(*args, **kwargs)


class GradCheckpointing:
    """``set_grad_checkpointing(enable)`` (timm's name) for a model and every part of it that checkpoints."""

    grad_checkpointing: bool = False

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward pass (less memory, about one more forward)."""
        assert isinstance(self, nn.Module)
        for module in self.modules():
            if isinstance(module, GradCheckpointing):
                module.grad_checkpointing = enable
