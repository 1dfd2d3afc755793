"""Checkpoints: safetensors for tensors, JSON/YAML for everything else — nothing is unpickled.

A checkpoint directory (``<run>/checkpoints/last`` or ``<run>/checkpoints/best``) holds::

    model.safetensors      the model's weights          config.json         how to rebuild the model, and
    ema.safetensors        EMA weights (if EMA is on)                       what the run measured so far
    optimizer.safetensors  + optimizer.json             run_config.yaml     the resolved run config
                                                        trainer_state.json  epoch, step (in the run and in
                                                        the epoch), best metric, scheduler, fp16 GradScaler,
                                                        processes, log lines, wall time

At an epoch's end no random-generator state is stored: every random draw of an epoch is seeded from
(seed, process, epoch) (:mod:`vitlab.seeding`), so a run resumed there draws what it would have drawn.
A checkpoint written inside an epoch (``train.save_every_steps``, a stop signal) adds, for each process,
``process_<rank>.json``: its global generators' state and its running loss sums.

Directories are written under a temporary name, flushed to the disk and swapped in by rename, so a
crash mid-write, or a power failure after it, never leaves a half-written checkpoint in place of a
good one (see :func:`replace_dir`).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from .errors import CheckpointError
from .models.hub import OLD_SUFFIX, load_tensors, load_weights, read_json, resolve_checkpoint, \
    write_json, write_model_files
from .models.registry import load_model

__all__ = ["resolve_checkpoint", "replace_dir", "keep_step_copy", "write_model_files", "load_model", "save_optimizer", "load_optimizer",
           "read_json", "write_json", "load_tensors", "load_weights"]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(tmp: Path, final: Path) -> None:
    """Swap a fully written directory ``tmp`` in as ``final``.

    ``tmp``'s files and ``tmp`` itself are first flushed to the disk (``fsync``): a rename can reach
    the disk before the data it names, and after a power or node failure ``final`` would hold
    truncated files. ``final`` is then renamed to ``final.old`` and removed only after ``tmp`` took its
    place (the parent directory flushed in between); if a crash falls between the two renames,
    :func:`resolve_checkpoint` finds ``final.old``.
    """
    for f in tmp.iterdir():
        if f.is_file():
            _fsync(f)
    _fsync(tmp)
    old = final.with_name(final.name + OLD_SUFFIX)
    if old.exists() and final.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(final.parent)
    if old.exists():
        shutil.rmtree(old)


def save_optimizer(optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Optimizer state as safetensors (per-parameter tensors, and a group's: timm's LAMB counts its steps in a
    tensor of the group, ``group.<i>.step``) + JSON (hyper-parameters)."""
    state = optimizer.state_dict()
    tensors, scalars, groups = {}, {}, []
    for idx, per_param in state["state"].items():
        for name, value in per_param.items():
            if isinstance(value, Tensor):
                tensors[f"{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    for i, group in enumerate(state["param_groups"]):
        for name, value in group.items():
            if isinstance(value, Tensor):
                tensors[f"group.{i}.{name}"] = value.detach().cpu().contiguous()
        groups.append({k: v for k, v in group.items() if not isinstance(v, Tensor)})
    save_file(tensors, str(directory / "optimizer.safetensors"))
    write_json(directory / "optimizer.json", {"param_groups": groups, "scalars": scalars})


def load_optimizer(optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Restore an optimizer's state (its moments, step counts) from ``directory`` into ``optimizer``, built by this
    run's config: its hyperparameters (weight decay, betas, eps, momentum, ...) are the config's, not the
    checkpoint's, so that a resumed run with ``optim.weight_decay=...`` runs with what its ``run_config.yaml``
    records. Taken from the checkpoint: each group's ``lr`` (a plateau schedule's lowered rate; other schedules
    set it again) and what the optimizer keeps in a group beyond its settings (LAMB's ``step``).

    Raises:
        CheckpointError: one line, if the parameter groups differ (another ``optim.layer_decay``, ``model.freeze``
            or set of trainable parameters), which leaves no state to match a parameter with.
    """
    meta = read_json(directory / "optimizer.json")
    state: dict[int, dict[str, Any]] = {}
    groups = meta["param_groups"]
    for key, value in {**load_tensors(directory / "optimizer.safetensors"), **meta["scalars"]}.items():
        idx, name = key.split(".", 1)
        if idx == "group":
            i, name = name.split(".", 1)
            groups[int(i)][name] = value
        else:
            state.setdefault(int(idx), {})[name] = value
    current = optimizer.state_dict()["param_groups"]
    sizes = lambda gs: [len(g["params"]) for g in gs]
    if sizes(groups) != sizes(current):
        raise CheckpointError(f"{directory}: the optimizer's parameter groups there hold {sizes(groups)} tensors, "
                              f"this run's {sizes(current)} (optim.layer_decay, model.freeze or the model's trainable "
                              f"parameters changed): its state matches no parameter; keep them as they were, or start "
                              f"a new run from the weights (model.pretrained=<the run>)")
    merged = [{**{k: v for k, v in saved.items() if k not in now}, **now, "lr": saved.get("lr", now["lr"])}
              for saved, now in zip(groups, current)]
    optimizer.load_state_dict({"state": state, "param_groups": merged})


def keep_step_copy(checkpoint: Path, checkpoints: Path, step: int, keep: int) -> None:
    """``checkpoints/step_<step>/`` as hard links to a written checkpoint's files (no second write;
    copies where the file system has no hard links); only the ``keep`` newest are kept."""
    copy = checkpoints / f"step_{step}"
    staging = copy.with_name(f".{copy.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        shutil.copytree(checkpoint, staging, copy_function=os.link)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(checkpoint, staging)
    replace_dir(staging, copy)
    steps = sorted(int(p.name[5:]) for p in checkpoints.glob("step_*") if p.name[5:].isdigit())
    for old in steps[:-keep]:
        shutil.rmtree(checkpoints / f"step_{old}")
