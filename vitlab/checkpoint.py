"""Checkpoints: safetensors for tensors, JSON/YAML for everything else — nothing is unpickled.

A checkpoint directory (``<run>/checkpoints/last`` or ``<run>/checkpoints/best``) holds::

    model.safetensors      the model's weights          config.json         how to rebuild the model
    ema.safetensors        EMA weights (if EMA is on)   run_config.yaml     the resolved run config
    optimizer.safetensors  + optimizer.json             trainer_state.json  epoch, step, best metric,
                                                        scheduler, fp16 GradScaler

No random-generator state is stored: every random draw of an epoch is seeded from (seed, process,
epoch) (:mod:`vitlab.seeding`), so a run resumed at an epoch boundary draws what it would have drawn.

Directories are written under a temporary name and swapped in by rename, so a crash mid-write
never leaves a half-written checkpoint in place of a good one (see :func:`replace_dir`).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .errors import CheckpointError
from .models import VisionTransformer, create_model

__all__ = ["resolve_checkpoint", "replace_dir", "save_model", "load_model", "save_optimizer", "load_optimizer",
           "read_json", "write_json", "load_tensors", "load_weights"]

_OLD_SUFFIX = ".old"


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing; the checkpoint is incomplete") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint file {str(path)!r} is corrupt: {e}") from None


def load_tensors(path: Path) -> dict[str, Tensor]:
    """A safetensors file's tensors; a missing or corrupt file raises :class:`CheckpointError`."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing; the checkpoint is incomplete")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {str(path)!r} is corrupt: {e}") from None


def replace_dir(tmp: Path, final: Path) -> None:
    """Swap a fully written directory ``tmp`` in as ``final``.

    ``final`` is first renamed to ``final.old`` and removed only after ``tmp`` took its place; if a
    crash falls between the two renames, :func:`resolve_checkpoint` finds ``final.old``.
    """
    old = final.with_name(final.name + _OLD_SUFFIX)
    if old.exists() and final.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def resolve_checkpoint(path: str | Path, which: str = "best") -> Path:
    """A checkpoint directory from a run directory (its ``which`` checkpoint) or a checkpoint directory.

    Raises:
        CheckpointError: if there is no checkpoint there.
    """
    path = Path(path)
    candidates = [path, path / "checkpoints" / which, path / "checkpoints" / "last"]
    for c in candidates:
        for d in (c, c.with_name(c.name + _OLD_SUFFIX)):
            if (d / "config.json").is_file():
                return d
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    raise CheckpointError(f"no checkpoint in {str(path)!r}: expected a run directory with checkpoints/{which}/ "
                          f"or a checkpoint directory with config.json and model.safetensors")


def save_model(model: nn.Module, directory: Path, preset: str, meta: dict[str, Any],
               ema: nn.Module | None = None) -> None:
    """Write the weights (and EMA weights) with ``config.json``: enough to rebuild the model alone.

    ``meta`` adds what inference needs besides the architecture (class names and normalization for
    a ViT; the task and tokenizer for a text model).
    """
    save_file(_state_dict(model), str(directory / "model.safetensors"))
    if ema is not None:
        save_file(_state_dict(ema), str(directory / "ema.safetensors"))
    model = getattr(model, "_orig_mod", model)
    write_json(directory / "config.json", {
        "architecture": type(model).__name__, "preset": preset,
        "model_args": {k: list(v) if isinstance(v, tuple) else v for k, v in model.config.items()},
        "has_ema": ema is not None, **meta,
    })


def _state_dict(model: nn.Module) -> dict[str, Tensor]:
    # torch.compile wraps the model; checkpoints always hold the plain names. Tied weights are
    # stored once (safetensors refuses shared storage); load_state_dict ties them again.
    model = getattr(model, "_orig_mod", model)
    state, seen = {}, set()
    for k, v in model.state_dict().items():
        if v.data_ptr() in seen:
            continue
        seen.add(v.data_ptr())
        state[k] = v.detach().contiguous()
    return state


def load_weights(model: nn.Module, path: Path) -> None:
    """Load a safetensors state dict saved by :func:`save_model` into ``model`` (tied weights included)."""
    model = getattr(model, "_orig_mod", model)
    try:
        missing, unexpected = model.load_state_dict(load_tensors(path), strict=False)
    except RuntimeError as e:
        raise CheckpointError(f"weights in {str(path)!r} do not fit the model: {str(e).splitlines()[0]}") from None
    tied = {name for name, p in model.named_parameters(remove_duplicate=False)} - {
        name for name, p in model.named_parameters()}  # second names of shared parameters
    if unexpected or set(missing) - tied:
        raise CheckpointError(f"weights in {str(path)!r} do not fit the model: missing "
                              f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")


def load_model(path: str | Path, use_ema: bool = True, map_location: str | torch.device = "cpu") -> nn.Module:
    """Load a trained model from a run directory (its best checkpoint) or a checkpoint directory.

    The model comes back in eval mode with ``model.pretrained_cfg`` describing its input: for a ViT
    the input size, normalization and class names (``vitlab.create_transform(model)`` gives the
    preprocessing); for a text Transformer the task and tokenizer file.

    Args:
        path: Run directory or checkpoint directory.
        use_ema: Load the EMA weights when the run kept them.
        map_location: Device for the weights.

    Raises:
        CheckpointError: if the checkpoint is missing, incomplete or corrupt.
    """
    directory = resolve_checkpoint(path)
    meta = read_json(directory / "config.json")
    if meta.get("architecture") not in ("VisionTransformer", "Seq2SeqTransformer", "RNNSeq2Seq", "GPT") or "model_args" not in meta:
        raise CheckpointError(f"{str(directory / 'config.json')!r} does not describe a vitlab model")
    args = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["model_args"].items()}
    try:
        model = create_model(meta["preset"], **args)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{str(directory / 'config.json')!r} holds invalid model arguments: {e}") from None
    load_weights(model, directory / ("ema.safetensors" if use_ema and meta.get("has_ema") else "model.safetensors"))
    if isinstance(model, VisionTransformer):
        model.pretrained_cfg = {
            "input_size": (model.patch_embed.in_chans, *model.patch_embed.img_size),
            "mean": tuple(meta["mean"]), "std": tuple(meta["std"]), "label_names": list(meta["classes"]),
            "checkpoint": str(directory),
        }
    else:  # text models: the task and the tokenizer saved beside the weights
        tokenizer = directory / "tokenizer.json"
        model.pretrained_cfg = {"task": meta.get("task"), "tokenizer": str(tokenizer) if tokenizer.is_file() else None,
                                "checkpoint": str(directory)}
    return model.to(map_location).eval()


def save_optimizer(optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Optimizer state as safetensors (per-parameter tensors) + JSON (hyper-parameters)."""
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, per_param in state["state"].items():
        for name, value in per_param.items():
            if isinstance(value, Tensor):
                tensors[f"{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    save_file(tensors, str(directory / "optimizer.safetensors"))
    write_json(directory / "optimizer.json", {"param_groups": state["param_groups"], "scalars": scalars})


def load_optimizer(optimizer: torch.optim.Optimizer, directory: Path) -> None:
    meta = read_json(directory / "optimizer.json")
    state: dict[int, dict[str, Any]] = {}
    for key, value in {**load_tensors(directory / "optimizer.safetensors"), **meta["scalars"]}.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
