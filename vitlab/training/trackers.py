"""Experiment trackers through Accelerate (``train.log_with``): which are asked for and installed, and
starting them so that a resumed run continues the tracker runs it began."""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from ..config import Config, config_to_flat
from ..errors import ConfigError

__all__ = ["TRACKERS", "resolve_trackers", "start_trackers"]

TRACKERS = ("tensorboard", "wandb", "mlflow", "aim")  # each the name of its pip package too


def resolve_trackers(log_with: str) -> list[str]:
    """The trackers ``train.log_with`` names (``all``: every one installed; ``none``: none).

    Raises:
        ConfigError: naming the package, if a tracker asked for by name is not installed (Accelerate
            would leave it out without a word).
    """
    from accelerate.tracking import get_available_trackers

    available = {str(t) for t in get_available_trackers()}
    if log_with == "all":
        return [name for name in TRACKERS if name in available]
    if log_with == "none":
        return []
    if log_with not in available:
        raise ConfigError(f"train.log_with={log_with}: the {log_with} package is not installed; pip install "
                          f"{log_with}, or choose train.log_with=tensorboard or none")
    return [log_with]


def start_trackers(accelerator: Accelerator, trackers: list[str], run_dir: Path, cfg: Config, state: dict[str, Any],
                   resumed: bool) -> None:
    """Start the experiment trackers: a new run gets new tracker runs and its config as
    hyperparameters; a resumed run continues the tracker runs its checkpoint names (``trackers`` in
    ``trainer_state.json``: MLflow's run id, the W&B id, Aim's run hash), so a job requeued 20 times
    is one run in each (kept in ``state``). (TensorBoard appends to its directory by itself.) MLflow writes
    a file store in the run directory unless ``MLFLOW_TRACKING_URI`` says otherwise."""
    acc, ids = accelerator, dict(state.get("trackers") or {})
    if "mlflow" in trackers and not os.environ.get("MLFLOW_TRACKING_URI") and acc.is_main_process:
        import mlflow

        # A file store in the run, no server (MLflow 3 keeps it in maintenance mode, behind this switch).
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
    kwargs: dict[str, dict[str, Any]] = {}
    if "mlflow" in trackers and ids.get("mlflow"):
        kwargs["mlflow"] = {"run_id": ids["mlflow"]}
    if "wandb" in trackers:
        ids.setdefault("wandb", secrets.token_hex(4))  # W&B run ids: [a-z0-9]
        kwargs["wandb"] = {"id": ids["wandb"], "resume": "allow"}
    if "aim" in trackers and ids.get("aim"):
        kwargs["aim"] = {"run_hash": ids["aim"]}
    # A continued run keeps the hyperparameters it started with (MLflow refuses a changed one).
    acc.init_trackers(run_dir.resolve().name, config=None if resumed else config_to_flat(cfg),
                      init_kwargs=kwargs)
    if acc.is_main_process:
        if "mlflow" in trackers:
            ids["mlflow"] = acc.get_tracker("mlflow", unwrap=True).info.run_id
        if "aim" in trackers:
            ids["aim"] = acc.get_tracker("aim", unwrap=True).hash
        state["trackers"] = {k: v for k, v in ids.items() if k in trackers}
