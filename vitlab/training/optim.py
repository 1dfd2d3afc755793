"""The optimizer and its schedule, from timm's factories.

:func:`create_optimizer`: any of timm's optimizers (``timm.optim.create_optimizer_v2``: AdamW, SGD, LAMB,
LARS, Lion, Adafactor, ...) over :func:`param_groups` (no weight decay on norms, biases and the tokens a model
names; timm's layer-wise decay). :func:`create_scheduler`: the learning rate of every optimizer step, from
timm's schedulers (``timm.scheduler.create_scheduler_v2``: cosine with cycles, step, multistep, poly), the
inverse square root of Vaswani et al. 2017, or torch's ``ReduceLROnPlateau`` on the validation metric; warmed
up from ``optim.warmup_lr``, held at ``optim.min_lr`` for ``optim.cooldown_epochs`` at the end.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from timm.scheduler.scheduler import Scheduler
from torch import nn

from ..config import OptimConfig
from ..errors import ConfigError

__all__ = ["param_groups", "create_optimizer", "create_scheduler", "LRSchedule", "InverseSqrtLRScheduler"]


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float = 0.0) -> list[dict[str, Any]]:
    """The optimizer's groups of trainable parameters: no weight decay on norms, biases, embedding tables named
    by ``no_weight_decay()`` (the ViT's CLS token and positional embedding) and other 1-d parameters, as timm's
    ``param_groups_weight_decay`` splits them; the decayed group first, as checkpoints have always had it (the
    layout is vitlab's, not the installed timm's, so that a checkpoint loads under any timm release).

    With ``layer_decay`` in (0, 1), timm's layer-wise decay (``param_groups_layer_decay``, over the model's
    ``group_matcher``): each group carries its ``lr_scale`` (the head 1, each block below ``layer_decay`` times
    the one above, the embeddings the least), which timm's schedulers multiply into its learning rate.
    """
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    if 0 < layer_decay < 1:
        from timm.optim import param_groups_layer_decay

        if not hasattr(model, "group_matcher"):
            raise ConfigError(f"optim.layer_decay needs a model with layers by depth (a ViT, a timm model), not "
                              f"{type(model).__name__}")
        try:
            return param_groups_layer_decay(model, weight_decay, no_weight_decay_list=skip, layer_decay=layer_decay)
        except ValueError as e:  # a timm model without layer groups
            raise ConfigError(f"optim.layer_decay: {e}; set optim.layer_decay=0") from None
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 or name.endswith(".bias") or name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def create_optimizer(model: nn.Module, optim: OptimConfig, batch_size: int,
                     device: torch.device) -> torch.optim.Optimizer:
    """timm's ``optim.opt`` (``create_optimizer_v2``) over :func:`param_groups` at the peak learning rate
    (``optim.lr``, or scaled from ``optim.lr_base`` by the global ``batch_size``); ``optim.betas``, ``optim.eps``
    and ``optim.momentum`` where the optimizer takes them. AdamW and Adam are fused on CUDA."""
    from timm.optim import create_optimizer_v2

    extra: dict[str, Any] = {k: v for k, v in (("betas", optim.betas), ("eps", optim.eps)) if v is not None}
    if device.type == "cuda" and optim.opt in ("adamw", "adam"):
        extra["fused"] = True
    return create_optimizer_v2(param_groups(model, optim.weight_decay, optim.layer_decay), opt=optim.opt,
                               lr=optim.peak_lr(batch_size), weight_decay=optim.weight_decay, momentum=optim.momentum,
                               **extra)


class InverseSqrtLRScheduler(Scheduler):
    """Vaswani et al. 2017's schedule as a timm scheduler of the paper's ``step_num`` ``t`` (from 1: optimizer
    step ``s`` runs at ``t = s + 1``): linear warmup from ``warmup_lr_init`` to ``lr`` at ``t = warmup_t``, then
    ``lr * sqrt(warmup_t / t)``, never below ``lr_min``."""

    counts_from_one = True

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_t: int, warmup_lr_init: float = 0.0,
                 lr_min: float = 0.0) -> None:
        super().__init__(optimizer, "lr", t_in_epochs=False)
        self.warmup_t, self.warmup_lr_init, self.lr_min = warmup_t, warmup_lr_init, lr_min
        self.update_groups(warmup_lr_init)

    def _get_lr(self, t: int) -> list[float]:
        if t <= self.warmup_t:
            return [self.warmup_lr_init + t * (v - self.warmup_lr_init) / self.warmup_t for v in self.base_values]
        return [max(self.lr_min, v * math.sqrt(self.warmup_t / t)) for v in self.base_values]


class LRSchedule:
    """The learning rate of every optimizer step: :meth:`step` after each one, :meth:`evaluated` with the
    validation metric of each evaluated epoch (``plateau`` only). State: the steps taken (and the plateau's).

    Optimizer step ``s`` (from 0) runs at timm's ``t = s + 1`` during the ``warmup`` steps and at ``t = s``
    after: the first step is one warmup step above ``optim.warmup_lr`` (a step at ``warmup_lr = 0`` would
    learn nothing), the last warmup step and the first after it are at the peak, and a schedule's epochs are
    counted from step 0 (timm's, with the warmup inside them; cosine and poly start after it). A scheduler
    whose ``counts_from_one`` is set (:class:`InverseSqrtLRScheduler`) runs at ``t = s + 1`` throughout.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Scheduler, warmup: int,
                 plateau: torch.optim.lr_scheduler.ReduceLROnPlateau | None = None) -> None:
        self.optimizer, self.scheduler, self.warmup, self.plateau = optimizer, scheduler, warmup, plateau
        self.after = int(getattr(scheduler, "counts_from_one", False))  # t - s after the warmup
        self.steps = 0
        self._apply()

    def _apply(self) -> None:
        if self.plateau is None or self.steps < self.warmup:  # after warmup, the plateau's reductions hold
            self.scheduler.step_update(self.steps + (1 if self.steps < self.warmup else self.after))

    def step(self) -> None:
        self.steps += 1
        self._apply()

    def evaluated(self, metric: float) -> None:
        """An evaluated epoch's validation metric: ``plateau`` lowers the rate after its patience runs out."""
        if self.plateau is not None and self.steps >= self.warmup:
            self.plateau.step(metric)

    def get_last_lr(self) -> list[float]:
        """The learning rate of each group for the next step."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, **({"plateau": self.plateau.state_dict()} if self.plateau is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore after the optimizer (whose groups hold a plateau's lowered rates). A checkpoint written before
        timm's schedulers holds torch's ``LambdaLR`` state: its ``last_epoch`` counted the same steps."""
        self.steps = state["steps"] if "steps" in state else state["last_epoch"]
        if self.plateau is not None and "plateau" in state:
            self.plateau.load_state_dict(state["plateau"])
        self._apply()


def create_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig, steps_per_epoch: int, epochs: int,
                     lower_is_better: bool = False) -> LRSchedule:
    """The schedule of ``epochs`` of ``steps_per_epoch`` optimizer steps (every length given to timm in steps), from
    the peak learning rate the optimizer's groups start at (:func:`create_optimizer`):
    ``optim.warmup_epochs`` of linear warmup (at least one step), then ``optim.schedule``, its last
    ``optim.cooldown_epochs`` at ``optim.min_lr`` (inside ``epochs``: unlike timm, which adds them, and fits
    cosine's ``optim.cycle_limit`` cycles into them rather than lengthen the run).
    ``plateau``: ``ReduceLROnPlateau`` on the validation metric (``lower_is_better``: its direction).
    """
    from timm.scheduler import create_scheduler_v2

    steps = lambda e: round(e * steps_per_epoch)
    total, warmup, cooldown = steps_per_epoch * epochs, max(1, steps(optim.warmup_epochs)), steps(optim.cooldown_epochs)
    if optim.schedule == "inverse_sqrt":
        return LRSchedule(optimizer, InverseSqrtLRScheduler(optimizer, warmup, optim.warmup_lr, optim.min_lr), warmup)
    if optim.schedule == "plateau":  # timm deprecates its own (its state is not checkpointed); torch's is
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="min" if lower_is_better else "max", factor=optim.decay_rate,
            patience=optim.patience_epochs, min_lr=optim.min_lr)
        constant, _ = create_scheduler_v2(optimizer, "step", num_epochs=total, decay_epochs=total, decay_rate=1.0,
                                          warmup_lr=optim.warmup_lr, warmup_epochs=warmup, step_on_epochs=False,
                                          updates_per_epoch=1)
        return LRSchedule(optimizer, constant, warmup, plateau)
    cycles = max(1, total - warmup - cooldown)  # cosine, poly: after the warmup, before the cooldown
    mul, limit = optim.cycle_mul, optim.cycle_limit
    first = cycles / limit if mul == 1 else cycles * (1 - mul) / (1 - mul ** limit)
    scheduler, _ = create_scheduler_v2(
        optimizer, optim.schedule, num_epochs=first, decay_epochs=steps(optim.decay_epochs),
        decay_milestones=[steps(m) for m in optim.decay_milestones], decay_rate=optim.decay_rate, min_lr=optim.min_lr,
        warmup_lr=optim.warmup_lr, warmup_epochs=warmup, warmup_prefix=optim.schedule in ("cosine", "poly"),
        cycle_mul=mul, cycle_decay=optim.cycle_decay, cycle_limit=limit, step_on_epochs=False, updates_per_epoch=1)
    return LRSchedule(optimizer, scheduler, warmup)
