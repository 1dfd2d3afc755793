"""The end of a study (:func:`vitlab.tuning.tune`): ``trials.csv`` (every trial), ``best.yaml`` (a whole config that
trains the best trial again) and Optuna's pictures, in the study's directory."""
from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import yaml

from ..checkpoint import read_json
from ..config.loading import apply_overrides
from ..files import replaced
from .space import overrides_of

__all__ = ["write_report", "merged"]


def write_report(study: Any, study_dir: Path, config: str | Path, overrides: list[str], metric: str) -> dict:
    """Write ``trials.csv``, ``best.yaml`` and the pictures of ``study`` (one reading of its trials) into
    ``study_dir``, each whole or not at all: processes sharing the study's directory may write them at once."""
    from optuna.trial import TrialState

    trials = study.trials
    with replaced(study_dir / "trials.csv") as tmp, open(tmp, "w", newline="") as f:
        keys = sorted({k for t in trials for k in t.params})
        device = ["device"] if any("device" in t.user_attrs for t in trials) else []  # the GPUs its run saw
        writer = csv.writer(f)
        writer.writerow(["number", "state", metric, "seconds", *keys, *device, "reason"])
        for t in trials:
            seconds = (t.datetime_complete - t.datetime_start).total_seconds() \
                if t.datetime_complete and t.datetime_start else ""
            writer.writerow([t.number, t.state.name, "" if t.value is None else t.value, seconds,
                             *(t.params.get(k, "") for k in keys), *(t.user_attrs.get(k, "") for k in device),
                             t.user_attrs.get("reason", "")])
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if not complete:
        print(f"no trial completed: {study_dir / 'trials.csv'} says why", flush=True)
        return {"best_trial": None}
    best = (max if study.direction.name == "MAXIMIZE" else min)(complete, key=lambda t: t.value)
    pinned = _pinned_length(study_dir / f"trial_{best.number:04d}")
    whole = merged(config, [*overrides, *overrides_of(best.params), *pinned, f"train.output_dir={study_dir / 'best'}"])
    with replaced(study_dir / "best.yaml") as tmp:
        tmp.write_text(
            f"# vitlab tune: the best of {len(trials)} trials on {metric} (trial {best.number}: {best.value:.6g})\n"
            + (f"# the trial's train.budget_minutes chose its {pinned[0].split('=')[1]} epochs: written here as "
               f"train.epochs, so that this config trains the same run on any machine\n" if pinned else "")
            + yaml.safe_dump(whole))
    _pictures(study, study_dir)
    print(f"best: trial {best.number}, {metric} {best.value:.4f}, {best.params} | {study_dir / 'best.yaml'} trains it "
          f"again: train.py --config {study_dir / 'best.yaml'}", flush=True)
    return {"best_trial": best.number, "best_value": best.value, "best_params": best.params,
            "best_config": str(study_dir / "best.yaml")}


def _pinned_length(run_dir: Path) -> list[str]:
    """The overrides that fix a trial's length where its ``train.budget_minutes`` chose it
    (:mod:`vitlab.training.budget`): the epochs its checkpoints keep, the budget off; none for a trial without one."""
    state = run_dir / "checkpoints" / "last" / "trainer_state.json"
    chosen = read_json(state).get("budget_epochs") if state.is_file() else None
    return [f"train.epochs={chosen}", "train.budget_minutes=0"] if chosen else []


def merged(config: str | Path, overrides: list[str]) -> dict[str, Any]:
    """The YAML of ``config`` with ``overrides`` written into it, as the trial's command gave them."""
    return apply_overrides(yaml.safe_load(Path(config).read_text()) or {}, overrides)


def _pictures(study: Any, study_dir: Path) -> None:
    """Optuna's matplotlib plots as PNG: the optimization history, the parameters' importances (two completed
    trials or more) and the metric against each parameter."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    for name, plot in (("history", plots.plot_optimization_history), ("importances", plots.plot_param_importances),
                       ("slices", plots.plot_slice)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
                axes = plot(study)
        except (ValueError, RuntimeError) as e:  # e.g. importances of one completed trial
            print(f"{name}.png not drawn: {e}", flush=True)
            continue
        figure = (axes.flat[0] if hasattr(axes, "flat") else axes).figure
        with replaced(study_dir / f"{name}.png") as tmp:
            figure.savefig(tmp, dpi=100, bbox_inches="tight", format="png")
        plt.close(figure)

