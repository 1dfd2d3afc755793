"""``train.cache_features``: a linear probe in place of the training loop. The frozen backbone's features of every
training image are computed once (the evaluation transform: no augmentation, no mixup) and the head is fitted on
them by L-BFGS (:mod:`vitlab.tasks.linear_probe`); the run is then evaluated, written and reported as any run's one
epoch is, so ``vitlab eval``, ``predict`` and ``export`` read it as they read any other."""
from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..config import Config
from ..tasks.linear_probe import choose_l2, fit_linear_probe, probe_head

if TYPE_CHECKING:
    from .loop import Loop

__all__ = ["probe_config", "probe_header", "fit_head"]


def probe_config(cfg: Config) -> Config:
    """The run a probe is: one fit (``train.epochs=1``), no EMA, and a schedule that never steps (no warmup or
    cooldown); what it saves as its config, so the same command continues (finds) the same run."""
    cfg = copy.deepcopy(cfg)
    cfg.train.epochs, cfg.train.ema_decay, cfg.train.eval_every = 1, 0.0, 1
    cfg.optim.warmup_epochs, cfg.optim.cooldown_epochs, cfg.optim.schedule = 0, 0, "cosine"
    return cfg


def probe_header(train_images: int) -> str:
    return (f"train.cache_features: the features of the {train_images:,} training images are computed once (the "
            f"evaluation transform) and the head fitted on them by L-BFGS (multinomial logistic regression, "
            f"scikit-learn's objective); the optimizer, its schedule, augmentation, mixup, EMA and train.epochs do not "
            f"apply, nor the loss's settings (label smoothing, class weights, logit adjustment) or data.sampler: every "
            f"training image counts once")


def fit_head(loop: "Loop") -> None:
    """Fit the head of ``loop``'s model on its backbone's features of the training images, its L2 strength
    ``train.probe_l2``, or chosen on the validation split, or 1 / N; what the epoch's record reports (the
    training cross-entropy, the time, the strength) goes to the loop's meter and ``probe_record``."""
    acc, task, cfg = loop.accelerator, loop.task, loop.cfg
    started = time.time()
    model = loop.plain_model
    loader = acc.prepare(task.feature_loader) if task.prepare_eval_loaders else task.feature_loader
    features, labels = task.features(model, loader, acc)
    head = probe_head(model)
    l2, scores = cfg.train.probe_l2, None
    if l2 is None and "val" in loop.eval_loaders:
        val_features, val_labels = task.features(model, loop.eval_loaders["val"], acc)
        l2, scores = choose_l2(features, labels, val_features, val_labels, head.out_features)
        acc.print(f"linear probe: L2 strength chosen on the {len(val_labels):,} validation images: {l2:g} (validation "
                  f"top-1 by strength: {', '.join(f'{k:g} {100 * v:.1f}%' for k, v in scores.items())})")
    elif l2 is None:
        l2 = 1 / len(labels)
        acc.print(f"linear probe: no validation split: L2 strength 1/N = {l2:.3g} (scikit-learn's default C=1); "
                  f"set data.val_size to choose it, or train.probe_l2")
    weight, bias = fit_linear_probe(features, labels, head.out_features, l2)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    meter = loop.meter
    meter.total = F.cross_entropy(features @ weight.T + bias, labels).to(acc.device)  # the fitted head's, unpenalised
    meter.steps, meter.seconds = 1, time.time() - started
    meter.samples = torch.tensor(len(labels), device=acc.device)
    loop.probe_record = {"probe_l2": l2, **({"probe_val_top1_by_l2": {f"{k:g}": v for k, v in scores.items()}}
                                            if scores else {})}
