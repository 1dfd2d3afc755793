"""A run set up before its first step: the task of its config (its registry entry's: image classification,
sequence-to-sequence, language model, MAE or DINO pretraining), LoRA's adapters, the metric ``best/`` is chosen on, and the line that
says what will run."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from ..config import Config, TrainConfig
from ..errors import ConfigError
from ..models.hub import read_json
from ..tasks import TaskSetup
from ..tasks.base import Resumed
from ..tasks.registry import get_task

__all__ = ["read_resumed", "setup_task", "add_lora", "choose_best_metric", "run_header"]


def read_resumed(resume_from: Path) -> Resumed:
    """What the checkpoint a run goes on from holds for its task: its ``config.json`` and the data's state of its
    ``trainer_state.json``, read once (the loop takes the last evaluation from the same ``config.json``)."""
    return Resumed(resume_from, read_json(resume_from / "config.json"),
                   read_json(resume_from / "trainer_state.json").get("data", {}))


def setup_task(cfg: Config, accelerator: Accelerator, micro_batch: int, run_dir: Path,
               resumed: Resumed | None) -> TaskSetup:
    """The task of ``cfg.task`` (its entry in :mod:`vitlab.tasks.registry`) built, given what it goes on from."""
    return get_task(cfg.task).build(cfg, accelerator, micro_batch, run_dir, resumed)


def add_lora(cfg: Config, task: TaskSetup, accelerator: Accelerator) -> None:
    """peft's LoRA layers into the task's model, now that it holds its pretrained weights and the data's head;
    its checkpoints then keep the adapters and head alone, with what rebuilds the rest (``lora``, ``base``)."""
    from ..models.lora import add_lora

    m = cfg.model
    total = sum(p.numel() for p in task.model.parameters())
    lora = {"r": m.lora_r, "alpha": m.lora_alpha, "dropout": m.lora_dropout, "targets": list(m.lora_targets)}
    trained = add_lora(task.model, **lora)
    task.meta = {**task.meta, "lora": lora,
                 "base": {"pretrained": m.pretrained, **({"pretrained_file": m.pretrained_file} if m.pretrained_file
                                                         else {})}}
    accelerator.print(f"LoRA r={m.lora_r} on {', '.join(m.lora_targets)} (alpha {m.lora_alpha:g}): {trained:,} of "
                      f"{total:,} parameters train ({100 * trained / total:.2f}%); adapters and head saved alone, "
                      f"the rest read from model.pretrained={m.pretrained!r}")


def choose_best_metric(t: TrainConfig, task: TaskSetup) -> None:
    """``train.best_metric`` (and ``train.greater_is_better``) over the task's own choice of the metric that
    picks ``best/``; a name the task does not report is one line, here where it declares its names."""
    if t.best_metric:
        name = t.best_metric.removeprefix("val_")
        if task.metrics and name not in task.metrics:
            raise ConfigError(f"train.best_metric={t.best_metric}: this task's validation metrics are "
                              f"{', '.join('val_' + m for m in task.metrics)}")
        task.select, task.select_lower = name, name.endswith("loss")
    if t.greater_is_better is not None:
        task.select_lower = not t.greater_is_better


def run_header(cfg: Config, acc: Accelerator, task: TaskSetup, model: nn.Module, steps_per_epoch: int, ema: bool,
               validation: bool, run_dir: Path, state: dict[str, Any], resumed: bool) -> str:
    """The run's first line: the model and what trains of it, the data, the steps, the processes, threads and
    workers, the precision, how ``best/`` is chosen, the run directory, where a resumed run goes on."""
    t = cfg.train
    n_params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = f": model.freeze={cfg.model.freeze}" if cfg.model.freeze != "none" else ""
    selection = (f"best/ chosen on {'ema_' if ema else ''}val_{task.select}"
                 if validation else "no validation split: no best/, the final epoch's test metric is the result")
    workers = getattr(task.train_loader, "num_workers", 0)
    return (f"model {cfg.model.name}: {n_params / 1e6:.2f}M params"
            + (f" ({trainable:,} trainable{frozen})" if trainable < n_params else "")
            + f" | train {task.train_size} examples, "
            f"{steps_per_epoch} steps/epoch x {t.epochs} epochs | {acc.num_processes} process(es) on "
            f"{acc.device}, {torch.get_num_threads()} torch thread(s) each"
            f"{f', {workers} DataLoader workers' if workers else ''} | mixed precision {t.mixed_precision} | "
            f"{selection} | run dir {run_dir}"
            + (f" | resumed at epoch {state['epoch'] + 1}, step {state['epoch_step']}" if resumed else ""))
