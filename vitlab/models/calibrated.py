"""What ``vitlab calibrate`` fits on a set of weights, kept in the checkpoint's ``config.json``: the temperature, a
multi-label model's thresholds and the ``unknown`` rule (with ``open_set.<weights file>`` beside the weights for a
feature score), under the weights file they were fitted on (``calibration``), with the weights' digest
(:func:`weights_digest`) and the file's size and time: other weights under that name do not take them
(:func:`still_fitted`).
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..errors import CheckpointError
from ..files import replaced
from .jsonfile import CONFIG_NAME, WEIGHTS_NAME, read_json, write_json

__all__ = ["CALIBRATED", "open_set_name", "open_set_file", "weights_digest", "still_fitted", "calibration_of",
           "weights_name", "update_config", "set_calibration"]


def open_set_name(weights: str) -> str:
    """The file beside the weights file ``weights`` holding what ``vitlab calibrate --unknown`` fitted on them (a
    feature score's bank or statistics)."""
    return f"open_set.{weights}"


def open_set_file(directory: str | Path, record: dict[str, Any]) -> Path:
    """The file an ``unknown`` rule's ``record`` (``config.json``'s) names in the checkpoint ``directory``.

    Raises:
        CheckpointError: one line, if it is not there.
    """
    path = Path(directory) / record["state"]
    if not path.is_file():
        raise CheckpointError(f"{str(directory)!r}'s unknown threshold ({record['score']}) needs {record['state']} "
                              f"beside its weights, and it is missing: copy it back or calibrate again (vitlab "
                              f"calibrate --checkpoint RUN --unknown {record['score']}); predict and serve take "
                              f"--unknown off")
    return path


CALIBRATED = ("temperature", "thresholds", "unknown")  # what vitlab calibrate fits on a set of weights


def weights_digest(model: nn.Module) -> str:
    """sha256 of ``model``'s weights: each tensor's name and bytes, in name order, whatever file holds them. What a
    calibration was fitted on, and what a prediction job wrote its rows with."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _stamp(weights: Path) -> list[int]:
    """The weights file's size and modification time (ns): unchanged, the file holds what it held."""
    stat = weights.stat()
    return [stat.st_size, stat.st_mtime_ns]


def still_fitted(fitted: dict[str, Any], model: nn.Module, weights: Path) -> dict[str, Any]:
    """``fitted`` (:func:`calibration_of`) if the model holds the weights it was fitted on (or it records none: a
    calibration of before the digest), else {} and one line saying so: the file changed under its name. The weights
    are read for their digest only where the file's size or time differ from those calibrate saw (a copy, a change)."""
    kept = fitted.get("weights_sha256")
    if kept is None or fitted.get("weights_stamp") == _stamp(weights) or kept == weights_digest(model):
        return fitted
    print(f"{weights}: not the weights vitlab calibrate fitted its {', '.join(k for k in CALIBRATED if k in fitted)} "
          f"on (the file changed since), which are not used: run vitlab calibrate --checkpoint {weights.parent} "
          f"again", file=sys.stderr)
    return {}


def calibration_of(meta: dict[str, Any], weights: str) -> dict[str, Any]:
    """What ``vitlab calibrate`` fitted on the weights file ``weights`` of a checkpoint (``config.json``'s
    ``meta``): its ``temperature``, or a multi-label model's ``thresholds``, and the ``unknown`` rule; {} if none was
    fitted on them. A temperature belongs to the weights it was fitted on: the EMA's is not the raw weights'. A
    checkpoint of before ``calibration`` (and a ``save_pretrained`` copy) keeps them at the top, fitted on the weights
    calibrate then read (the EMA's where there were)."""
    kept = (meta.get("calibration") or {}).get(weights)
    if kept is not None:
        return dict(kept)
    legacy = weights_name(meta, True)
    return {k: meta[k] for k in (*CALIBRATED, "weights_sha256") if meta.get(k) is not None} \
        if weights == legacy and any(meta.get(k) is not None for k in CALIBRATED) else {}


def weights_name(meta: dict[str, Any], use_ema: bool) -> str:
    """The weights file a checkpoint (``config.json``'s ``meta``) is loaded from: the EMA's where asked for and
    kept, else the model's."""
    return "ema.safetensors" if use_ema and meta.get("has_ema") else WEIGHTS_NAME


def update_config(directory: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite ``directory``'s ``config.json`` after ``change(meta)`` (in place): written whole to a temporary
    file, then renamed into place, so that a reader never sees half of it."""
    meta = read_json(directory / CONFIG_NAME)
    change(meta)
    with replaced(directory / CONFIG_NAME) as tmp:
        write_json(tmp, meta)


def set_calibration(directory: Path, weights: str, digest: str | None = None, **fitted: Any) -> None:
    """Keep ``fitted`` (``temperature=...`` or ``thresholds=[...]``) for the weights file ``weights`` in
    ``directory``'s ``config.json``, under ``calibration`` (:func:`update_config`), with ``digest``, the
    :func:`weights_digest` of the weights it was fitted on: what was kept for other weights under that name goes."""
    def change(meta: dict[str, Any]) -> None:
        calibration = meta.setdefault("calibration", {})
        legacy = {k: meta.pop(k) for k in (*CALIBRATED, "weights_sha256") if k in meta}
        if legacy:  # a checkpoint of before: what it kept at the top moves under the weights it was fitted on
            calibration.setdefault(weights_name(meta, True), legacy)
        kept = calibration.get(weights, {})
        if digest is not None and kept.get("weights_sha256", digest) != digest:
            kept = {}  # fitted on other weights kept under this name
        known = {"weights_sha256": digest, "weights_stamp": _stamp(directory / weights)} if digest else {}
        calibration[weights] = {**kept, **fitted, **known}

    update_config(directory, change)
