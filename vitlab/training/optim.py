"""The optimizer and its schedule: AdamW over parameter groups (no weight decay on norms, biases and the
tokens a model names; timm's layer-wise decay), at the peak learning rate, warmed up then decayed."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..config import OptimConfig
from ..errors import ConfigError

__all__ = ["param_groups", "lr_multiplier", "create_optimizer", "create_scheduler"]


def param_groups(model: nn.Module, weight_decay: float, lr: float = 1.0,
                 layer_decay: float = 0.0) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on norms, biases, embeddings tables named by ``no_weight_decay()``
    (the ViT's CLS token and positional embedding) and other 1-d parameters.

    With ``layer_decay`` in (0, 1), timm's layer-wise decay (``param_groups_layer_decay``, over the
    model's ``group_matcher``): the head keeps ``lr``, each block below gets ``layer_decay`` times the
    one above, the embeddings the least; each group's ``lr`` is set, so the schedule scales them all.
    """
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    if 0 < layer_decay < 1:
        from timm.optim import param_groups_layer_decay

        if not hasattr(model, "group_matcher"):
            raise ConfigError(f"optim.layer_decay needs a model with layers by depth (a ViT, a timm model), not "
                              f"{type(model).__name__}")
        try:
            groups = param_groups_layer_decay(model, weight_decay, no_weight_decay_list=skip, layer_decay=layer_decay)
        except ValueError as e:  # a timm model without layer groups
            raise ConfigError(f"optim.layer_decay: {e}; set optim.layer_decay=0") from None
        return [{**g, "lr": lr * g["lr_scale"]} for g in groups]
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, min_ratio: float, schedule: str = "cosine") -> float:
    """Learning-rate factor at optimizer step ``step``: linear warmup to 1 over ``warmup_steps``, then
    ``'cosine'`` decay to ``min_ratio`` at ``total_steps``, or ``'inverse_sqrt'``: ``sqrt(warmup / step)``
    (the schedule of Vaswani et al. 2017 with ``optim.lr`` as its peak)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "inverse_sqrt":
        return max(min_ratio, math.sqrt(warmup_steps / (step + 1)))
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def create_optimizer(model: nn.Module, optim: OptimConfig, batch_size: int, device: torch.device) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups` at the peak learning rate (``optim.lr``, or scaled from ``optim.lr_base``
    by the global ``batch_size``), fused on CUDA."""
    lr = optim.peak_lr(batch_size)
    return torch.optim.AdamW(param_groups(model, optim.weight_decay, lr, optim.layer_decay), lr=lr, betas=optim.betas,
                             fused=device.type == "cuda" or None)


def create_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig, batch_size: int, steps_per_epoch: int,
                     epochs: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate of every optimizer step (:func:`lr_multiplier` of the peak): ``optim.warmup_epochs``
    of linear warmup, then ``optim.schedule`` to ``optim.min_lr`` at the end of ``epochs``."""
    lr = optim.peak_lr(batch_size)
    total_steps, warmup_steps = steps_per_epoch * epochs, max(1, round(optim.warmup_epochs * steps_per_epoch))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(
        s, warmup_steps, total_steps, optim.min_lr / lr, optim.schedule))
