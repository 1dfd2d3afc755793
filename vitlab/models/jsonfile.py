"""A checkpoint's ``config.json`` and the names of its files: JSON read with one clear line for a missing or corrupt
file, written strict (no ``NaN``), for the checkpoint modules (:mod:`vitlab.models.hub`,
:mod:`vitlab.models.calibrated`) and every reader of a run's records."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "strict_json", "write_json", "read_json"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def strict_json(obj: Any) -> Any:
    """``obj`` with every float that JSON has no literal for (NaN, infinities; Python writes them as ``NaN``,
    which strict parsers such as JavaScript's ``JSON.parse`` and Go's reject) made ``None`` (``null``): the
    average precision of a class without positives, say, is undefined, not a number."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as strict JSON (:func:`strict_json`), indented."""
    path.write_text(json.dumps(strict_json(obj), indent=2, allow_nan=False) + "\n")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing; the checkpoint is incomplete") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint file {str(path)!r} is corrupt: {e}") from None
