"""``train.budget_minutes``: a run's length set by the time it may take, as budgeted training sets it (Li et al. 2020,
*Budgeted Training*: a schedule that ends at the budget beats a longer one stopped early at it), in whole epochs.

Before the first epoch of a new run :func:`measure` times optimizer steps on the run's own first batches (after ten
that warm up: lazy set-up, caches, compilation, the memory a run touches first) and one evaluation of every split the
run evaluates, then puts back everything the steps changed: the weights, the EMA's, the optimizer's state, the
schedule, the position, the experts' counts (the generators, the data's order and its augmentations are seeded anew by
each epoch). :func:`epochs_within` gives the most epochs, up to ``train.epochs``, whose projected time fits what is
left of the budget. The run is then the run of that many epochs given as ``train.epochs``, weight for weight; its
checkpoints keep the number (``budget_epochs``), so a resumed run has the length it began with whatever the machine
measures then.

The time counts from the start of :func:`~vitlab.training.train` (reading the data, the timed steps, every epoch
and evaluation); Python's start and imports before it, and the checkpoints' writing, are not projected.
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any

import torch

from ..config import Config
from ..config.rules import check_values
from ..errors import ConfigError
from ..layers import expert_utilization

if TYPE_CHECKING:
    from .loop import Loop

__all__ = ["Timing", "measure", "evaluations_in", "projected_seconds", "epochs_within", "fit_epochs",
           "typical_step_seconds"]

WARMUP_STEPS, TIMED_STEPS, BLOCK_STEPS = 10, 30, 5


@dataclass(frozen=True)
class Timing:
    """What :func:`measure` timed, in seconds: an optimizer step (waiting for its data included), an evaluation (every
    split the run evaluates, the EMA's model too), and what the last evaluation adds where it reads other splits."""

    step: float
    evaluation: float
    final_extra: float = 0.0


def evaluations_in(epochs: int, eval_every: int) -> int:
    """The evaluations of a run of ``epochs``: after every ``eval_every``-th epoch and after the last (0: the last)."""
    return epochs // eval_every + (epochs % eval_every != 0) if eval_every else 1


def projected_seconds(epochs: int, spent_seconds: float, epoch_seconds: float, timing: Timing,
                      eval_every: int) -> float:
    """The time a run of ``epochs`` is projected to take: ``spent_seconds`` before its first step, its epochs, its
    evaluations (:func:`evaluations_in`) and what the last one adds."""
    return (spent_seconds + epochs * epoch_seconds + evaluations_in(epochs, eval_every) * timing.evaluation
            + timing.final_extra)


def epochs_within(budget_seconds: float, spent_seconds: float, epoch_seconds: float, evaluation_seconds: float,
                  final_extra_seconds: float, eval_every: int, most: int) -> int:
    """The most epochs ``e <= most`` (0 if none) whose projected time (:func:`projected_seconds`) fits
    ``budget_seconds``."""
    timing = Timing(epoch_seconds, evaluation_seconds, final_extra_seconds)
    fitting = 0
    for epochs in range(1, most + 1):
        if projected_seconds(epochs, spent_seconds, epoch_seconds, timing, eval_every) > budget_seconds:
            break
        fitting = epochs
    return fitting


def measure(loop: Loop) -> Timing:
    """Time :data:`TIMED_STEPS` optimizer steps of ``loop`` on its first epoch's batches (after :data:`WARMUP_STEPS`;
    the median block of :data:`BLOCK_STEPS`) and one evaluation, then restore what they changed. Every process gets
    the slowest process's times."""
    acc = loop.accelerator
    saved = _snapshot(loop)
    try:
        step = _step_seconds(loop)
        evaluation = _evaluation_seconds(loop, loop.eval_loaders)
        final = _evaluation_seconds(loop, loop.final_eval_loaders)
    finally:
        _restore(loop, saved)
    final_extra = sum(final[name] - evaluation.get(name, 0.0) for name in final)
    times = torch.tensor([step, sum(evaluation.values()), final_extra], dtype=torch.float32, device=acc.device)
    slowest = acc.gather(times[None]).amax(0).tolist() if acc.num_processes > 1 else times.tolist()
    return Timing(*slowest)


def fit_epochs(loop: Loop, minutes: float, started: float) -> int:
    """The epochs of ``loop``'s run in ``minutes`` counted from ``started`` (:func:`measure`, :func:`epochs_within`),
    said in one line; ``loop.cfg``'s ``train.epochs`` bounds them.

    Raises:
        ConfigError: one line, before the first step, if not one epoch fits, or if the number breaks a rule of the
            config (``optim.cooldown_epochs`` within the epochs, say).
    """
    cfg, acc, steps = loop.cfg, loop.accelerator, loop.steps_per_epoch
    timing = measure(loop)
    spent = torch.tensor([time.time() - started], dtype=torch.float32, device=acc.device)
    spent_seconds = (acc.gather(spent).max().item() if acc.num_processes > 1 else spent.item())
    epoch_seconds = steps * timing.step
    epochs = epochs_within(60 * minutes, spent_seconds, epoch_seconds, timing.evaluation, timing.final_extra,
                           cfg.train.eval_every, cfg.train.epochs)
    if epochs == 0:
        raise ConfigError(f"train.budget_minutes={minutes:g}: one epoch is projected to take "
                          f"{epoch_seconds + timing.evaluation + timing.final_extra:.0f} s ({steps} steps of "
                          f"{timing.step:.3g} s and an evaluation of {timing.evaluation:.3g} s) after the "
                          f"{spent_seconds:.0f} s spent before it; give a larger budget, or a shorter epoch "
                          f"(data.train_subset, a smaller model)")
    budgeted = _with_epochs(cfg, epochs)
    try:
        check_values(budgeted)
    except ConfigError as e:
        raise ConfigError(f"train.budget_minutes={minutes:g} gives {epochs} epochs on this machine: {e}") from None
    evaluations = evaluations_in(epochs, cfg.train.eval_every)
    projected = projected_seconds(epochs, spent_seconds, epoch_seconds, timing, cfg.train.eval_every)
    acc.print(f"train.budget_minutes={minutes:g}: {epochs} epoch{'s' if epochs > 1 else ''}"
              + (" (train.epochs bounds them)" if epochs == cfg.train.epochs
                 else f" of train.epochs={cfg.train.epochs}")
              + f", {projected:.0f} s projected: {steps} steps of {timing.step:.3g} s an epoch, {evaluations} "
              f"evaluation(s) of {timing.evaluation:.3g} s, {spent_seconds:.1f} s before the first step")
    return epochs


def _with_epochs(cfg: Config, epochs: int) -> Config:
    budgeted = copy.deepcopy(cfg)
    budgeted.train.epochs = epochs
    return budgeted


def _snapshot(loop: Loop) -> dict[str, Any]:
    clone = lambda module: {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"model": clone(loop.plain_model), "ema": clone(loop.ema.module) if loop.ema is not None else None,
            "optimizer": copy.deepcopy(loop.optimizer.optimizer.state_dict()), "scheduler": loop.scheduler.state_dict(),
            "scaler": copy.deepcopy(loop.scaler.state_dict()) if loop.scaler is not None else None,
            "state": copy.deepcopy(loop.state), "training": loop.model.training}


def _restore(loop: Loop, saved: dict[str, Any]) -> None:
    from .meter import Meter

    loop.plain_model.load_state_dict(saved["model"])
    if loop.ema is not None:
        loop.ema.module.load_state_dict(saved["ema"])
    loop.optimizer.optimizer.load_state_dict(saved["optimizer"])
    loop.optimizer.zero_grad(set_to_none=True)
    loop.scheduler.load_state_dict(saved["scheduler"])
    if loop.scaler is not None:
        loop.scaler.load_state_dict(saved["scaler"])
    loop.state = saved["state"]
    loop.meter = Meter.start(loop.accelerator.device)
    expert_utilization(loop.model, reset=True)
    loop.model.train(saved["training"])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_seconds(loop: Loop) -> float:
    """Seconds an optimizer step of the first epoch takes after :data:`WARMUP_STEPS`, its data's waiting included:
    the median over blocks of :data:`BLOCK_STEPS` steps, each block timed whole (synchronized at its ends only, so a
    GPU's queue stays full), of the blocks' means. The median, not the mean: a pause of the host, a collection of
    Python's garbage or the first touch of memory in a few of the steps would otherwise stand for every step of the
    run (on 2 CPU cores the mean of 20 steps after 2 said 0.082-0.099 s where the epochs then took 0.071; 30 after 10,
    the median block, 0.075-0.079 against 0.072-0.079). A short epoch times the steps it has, in as many blocks as
    they fill (one block at least)."""
    device, accum = loop.accelerator.device, loop.accum
    warmup = min(WARMUP_STEPS, loop.steps_per_epoch - 1)
    timed = min(TIMED_STEPS, loop.steps_per_epoch - warmup)
    block = min(BLOCK_STEPS, timed)
    loop.model.train()
    batches = iter(islice(loop._batches(1, 0), (warmup + timed) * accum))
    for _ in range(warmup):
        loop.step([next(batches) for _ in range(accum)])
    blocks = []
    for _ in range(timed // block):
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(block):
            loop.step([next(batches) for _ in range(accum)])
        _synchronize(device)
        blocks.append((time.perf_counter() - start) / block)
    del batches  # a DataLoader's workers end with their iterator
    return typical_step_seconds(blocks)


def typical_step_seconds(block_means: list[float]) -> float:
    """The median of the blocks' mean step times (the mean of the middle two of an even number)."""
    return statistics.median(block_means)


def _evaluation_seconds(loop: Loop, loaders: dict[str, Any]) -> dict[str, float]:
    """Seconds each of ``loaders`` takes to evaluate, as the loop's epoch end evaluates it (the EMA's model too)."""
    nets = [loop.model] + ([loop.ema.module] if loop.ema is not None else [])
    seconds = {}
    for name, loader in loaders.items():
        start = time.perf_counter()
        for net in nets:
            loop.task.evaluate(net, loader, loop.accelerator)
        _synchronize(loop.accelerator.device)
        seconds[name] = time.perf_counter() - start
    return seconds
