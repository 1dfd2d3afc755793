"""``vitlab tune``: an Optuna study over a config's keys, each trial an ordinary run (``STUDY/trial_0007/``) trained
in a process of its own by the same command as ``train.py``, chosen on a validation metric.

The study is kept in a database (a SQLite file in the study's directory unless ``storage`` names another: any URL
Optuna's ``RDBStorage`` takes, or ``journal:PATH``, a journal file several machines can share), so the same command
continues a stopped study and several processes started with the same study and storage share it. A trial's
evaluated epochs feed the pruner (the trial's process is sent SIGTERM when pruned: it stops as a preempted run does);
a trial that fails (a nan loss, out of memory, a config rule) is recorded as failed with its one-line reason and the
study goes on. A trial stopped with the study (SIGTERM, Ctrl-C) is run again by the command that continues it; one
whose process died (kill -9) is, once its heartbeat is a minute old (SQLite and other databases). ``trials`` counts
trials that completed, were pruned or failed for a reason of their own.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from ..config.loading import load_config
from ..errors import ConfigError
from ..tasks.registry import get_task
from .devices import chosen_gpus, run_workers
from .report import merged, write_report
from .space import base_values, overrides_of, read_space, suggest

__all__ = ["tune"]

PRUNERS = ("median", "hyperband", "none")


class TrialFailed(Exception):
    """A trial's run ended with an error of its own (its one line is the message)."""


def _storage(study_dir: Path, storage: str | None) -> Any:
    """Where the study is kept: ``journal:PATH`` (a journal file), a database URL, or by default a SQLite file in
    the study's directory. A database's trials beat every 20 s: one silent for a minute (its process died) is
    failed, and then asked again (:func:`_retry_interrupted`)."""
    import warnings

    import optuna
    from optuna.storages import RDBStorage

    if storage and storage.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(storage.removeprefix("journal:")))
    url = storage or f"sqlite:///{(study_dir / 'study.db').resolve()}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna calls the heartbeat experimental
        return RDBStorage(url, heartbeat_interval=20, grace_period=60)


def _pruner(name: str, epochs: int) -> Any:
    import optuna

    if name == "median":  # from half the schedule on, against the median of 3 finished trials or more: an early
        # epoch's metric says more of the warm-up than of the end (the quick recipe: every trial pruned at epoch 2)
        return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=max(1, epochs // 2))
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max(epochs, 1))
    return optuna.pruners.NopPruner()


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ConfigError("vitlab tune needs optuna, which is not installed: pip install 'vitlab[tune]'") from None
    return optuna


def _metric(cfg: Any, metric: str | None) -> str:
    """The metric chosen on: ``metric``, else ``train.best_metric``'s validation metric, else a classifier's
    ``val_top1``; one line for another task without one."""
    if not metric and cfg.train.best_metric:
        metric = "val_" + cfg.train.best_metric.removeprefix("val_")
    if not metric and cfg.task != "classification":
        raise ConfigError(f"--metric: give the validation metric to choose on (task: {cfg.task}), e.g. val_loss")
    return metric or "val_top1"


def _check(cfg: Any, base: str, metric: str, pruner: str, trials: int) -> None:
    if pruner not in PRUNERS:
        raise ConfigError(f"--pruner {pruner}: give one of {', '.join(PRUNERS)}")
    if trials < 1:
        raise ConfigError(f"--trials {trials}: give the number of trials the study runs in all, 1 or more")
    if not metric.startswith("val_"):
        raise ConfigError(f"--metric {metric}: choices are made on validation data only; give a val_ metric "
                          f"(e.g. val_top1, val_loss)")
    fix = (get_task(cfg.task).validation or (lambda c: "hold out a validation split"))(cfg)
    if fix:
        raise ConfigError(f"--config {base} holds out no validation data, which the study chooses on: {fix}")


def _reason(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("error:")]
    return (said or lines or ["exited without a message"])[-1][:500]


def _run_trial(trial: Any, command: list[str], run_dir: Path, metric: str, stop: dict[str, Any]) -> float:
    """Train one trial in a process of its own, reporting each evaluated epoch's ``metric`` to the pruner."""
    import optuna

    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "tune.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.PIPE, text=True)
        stop["process"] = process
        reported, value, pruned = set(), None, False
        metrics = run_dir / "metrics.jsonl"
        while True:
            done = process.poll() is not None
            # epochs the run finished after it was told to stop are not reported: the pruner judged the trial at
            # the epoch it was pruned, whether the process was still running then or had already ended
            for record in ([] if pruned else _records(metrics)):
                if metric in record and record["epoch"] not in reported:
                    reported.add(record["epoch"])
                    value = record[metric]
                    trial.report(value, record["epoch"])
                    if trial.should_prune():
                        pruned = True
                        if not done:
                            process.send_signal(signal.SIGTERM)  # it saves last/ and exits, as on a preemption
                        break
            if done:
                break
            time.sleep(0.5)
        stderr = process.stderr.read()
        stop["process"] = None
    if stop.get("signal"):
        raise KeyboardInterrupt
    if pruned:
        raise optuna.TrialPruned(f"pruned after epoch {max(reported)}: {metric} {value:.4f}")
    if process.returncode != 0:
        trial.set_user_attr("reason", _reason(stderr))
        raise TrialFailed(_reason(stderr))
    if value is None:
        trial.set_user_attr("reason", f"the run reported no {metric}")
        raise TrialFailed(f"the run reported no {metric}: set train.eval_every so its epochs are evaluated")
    return value


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return [r for r in records if r.get("split") == "eval"]


def _counted(study: Any) -> int:
    """Trials that completed, were pruned, or failed for a reason of their own (not those stopped with the study or
    whose process died: those are run again; nor those asked beyond the total by processes sharing the study)."""
    return sum(_counts(t) for t in study.trials)


def _counts(trial: Any) -> bool:
    from optuna.trial import TrialState

    return trial.state in (TrialState.COMPLETE, TrialState.PRUNED) or (
        trial.state == TrialState.FAIL and "reason" in trial.user_attrs and not trial.user_attrs.get("surplus"))


def _heartbeat(study: Any) -> bool:
    from optuna.storages._heartbeat import is_heartbeat_enabled

    return is_heartbeat_enabled(study._storage)


def _wait_for_others(study: Any, trials: int) -> bool:
    """With the trials running (other processes' sharing the study) the total would be reached: fail those whose
    heartbeat went silent (their process died; they are asked again), wait 2 s and say so."""
    import warnings

    import optuna
    from optuna.trial import TrialState

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experimental
        optuna.storages.fail_stale_trials(study)
    if _counted(study) + sum(t.state == TrialState.RUNNING for t in study.trials) < trials:
        return False
    time.sleep(2)
    return True


def _surplus(study: Any, number: int, trials: int) -> bool:
    """Whether trial ``number`` is beyond the study's total: the trials that count and those running (other processes'
    sharing the study, this one), in the order they were asked, ``number`` among them after the first ``trials``."""
    from optuna.trial import TrialState

    ahead = [t.number for t in study.trials if _counts(t) or t.state == TrialState.RUNNING]
    return number in ahead[trials:]


def _surplus_reason(study: Any, trial: Any, trials: int, shared: bool) -> str | None:
    """Why ``trial`` is not to be run, if it is not: beyond the study's total, its processes sharing it having asked
    the last one; or a second copy of the base config's trial or of a stopped trial's retry, two processes having
    asked it at once (the first asked is the one run)."""
    if shared and _surplus(study, trial.number, trials):
        return f"not run: the study's {trials} trials were asked by its processes"
    if trial.user_attrs.get("base") and any(t.user_attrs.get("base") and t.number < trial.number for t in study.trials):
        return "not run: the base config's trial was asked by another process"
    retry_of = trial.user_attrs.get("retry_of")
    first = min((t.number for t in study.trials if retry_of is not None and t.user_attrs.get("retry_of") == retry_of),
                default=trial.number)
    return f"not run: trial {first} asks trial {retry_of}'s values again" if first < trial.number else None


def _retry_interrupted(study: Any) -> None:
    """A trial stopped with the study (recorded failed without a reason of its own) is asked again, once."""
    from optuna.trial import TrialState

    retried = {t.user_attrs.get("retry_of") for t in study.trials}
    for t in study.trials:
        if t.state == TrialState.FAIL and "reason" not in t.user_attrs and t.number not in retried:
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number}, skip_if_exists=False)


def _open_study(study_dir: Path, storage: str | None, direction: str, sampler: Any, pruner: Any) -> Any:
    """The Optuna study of ``study_dir`` (created, or loaded where it exists), or one line saying why its storage
    cannot be opened."""
    import optuna

    attempt = 0
    while True:
        try:
            return optuna.create_study(study_name=study_dir.name, storage=_storage(study_dir, storage),
                                       load_if_exists=True, direction=direction, sampler=sampler, pruner=pruner)
        except Exception as e:  # noqa: BLE001  (whatever the database's driver raises)
            # processes started together on a new database: one creates its tables, the others find them half made
            if attempt == 4 or not any(w in str(e) for w in ("UNIQUE constraint", "already exists", "is locked")):
                raise ConfigError(f"--storage {storage or study_dir / 'study.db'}: cannot be opened "
                                  f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
            attempt += 1
            time.sleep(attempt)


class _SaidByTheStudy(logging.Filter):
    """Leaves out Optuna's two records of a trial that failed (its "failed with parameters ... because of" with the
    traceback, then "failed with value None") where the study says it itself: a run's one-line error, or a surplus
    trial, on the trial's progress line; a stop (KeyboardInterrupt) in one line, its values asked again when
    continued."""

    def __init__(self) -> None:
        super().__init__()
        self.said: set[str] = set()  # the numbers of the trials whose first record was left out

    def filter(self, record: logging.LogRecord) -> bool:
        words = record.getMessage().split(maxsplit=2)
        if record.exc_info and isinstance(record.exc_info[1], (KeyboardInterrupt, TrialFailed)):
            self.said.add(words[1])  # "Trial 7 failed with parameters: ..."
            return False
        return not (len(words) == 3 and words[1] in self.said and words[2].startswith("failed with value"))


def _sampler(seed: int, number: int | None = None) -> Any:
    """Optuna's TPE sampler seeded by the study's ``seed`` and the trial's ``number``: each trial draws its own values
    however many processes share the study (a sampler seeded once a process draws the same values in each process, in
    turn: two processes started by the same command ran every trial twice)."""
    import numpy as np
    import optuna

    return optuna.samplers.TPESampler(seed=int(np.random.SeedSequence([seed, number or 0]).generate_state(1)[0]))


def _direction(metric: str, greater_is_better: bool | None) -> str:
    if greater_is_better is not None:
        return "maximize" if greater_is_better else "minimize"
    return "minimize" if metric.endswith("loss") else "maximize"  # the training loop's rule for best/


def _command(base: str, overrides: list[str], values: dict[str, Any], run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "vitlab.cli", "train", "--config", str(base), *overrides, *overrides_of(values),
            f"train.output_dir={run_dir}", "train.resume=no"]


def tune(config: str | Path, space: str | Path, trials: int, study: str | Path | None = None,
         storage: str | None = None, pruner: str = "median", metric: str | None = None,
         timeout_minutes: float | None = None, overrides: list[str] | tuple[str, ...] = (), seed: int = 0,
         base_first: bool = False, devices: str | None = None, _worker: bool = False) -> dict:
    """Search ``space`` (:func:`~vitlab.tuning.space.read_space`) over the config ``config`` with ``overrides``:
    ``trials`` trials in all (those run before by the same study counted), each a run in ``study/trial_NNNN/``,
    chosen on ``metric`` (a validation metric; default ``train.best_metric``'s, else ``val_top1`` for a classifier)
    by Optuna's TPE sampler (each trial's draw seeded by ``seed`` and the trial's number) and ``pruner`` ('median',
    'hyperband', 'none'), for at most ``timeout_minutes``; ``base_first``: the first trial is the base config's own
    values of the space's keys (Optuna's ``enqueue_trial``, once a study), so that the best is never below the recipe
    searched from, on validation; ``devices`` ('all' or GPU numbers, '0,1'): one trial a GPU at once, each GPU's in a
    process of its own sharing the study (:mod:`vitlab.tuning.devices`). Writes ``best.yaml`` (a whole config that
    trains the best trial again), ``trials.csv`` and the study's pictures into ``study`` (``_worker``: a process
    :mod:`~vitlab.tuning.devices` started, which leaves them to the one that started it). Returns the best trial's
    number, values and metric.

    Raises:
        ConfigError: one line, before any trial: Optuna not installed, or what :func:`_check`, :func:`read_space`,
            :func:`~vitlab.tuning.devices.chosen_gpus`, the storage and :func:`_same_study` refuse.
    """
    optuna = _optuna()
    overrides = list(overrides)
    cfg = load_config(config, overrides)
    metric = _metric(cfg, metric)
    _check(cfg, str(config), metric, pruner, trials)
    dimensions = read_space(space, config, overrides)
    first = base_values(dimensions) if base_first else None
    gpus = chosen_gpus(devices) if devices else None
    study_dir = Path(study or f"runs/tune_{Path(config).stem}")
    study_dir.mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    the_study = _open_study(study_dir, storage, _direction(metric, cfg.train.greater_is_better),
                            _sampler(seed), _pruner(pruner, cfg.train.epochs))
    _same_study(the_study, study_dir, merged(config, overrides), space, metric)
    if first is not None and not any(t.user_attrs.get("base") for t in the_study.trials):  # once a study
        the_study.enqueue_trial(first, user_attrs={"base": True}, skip_if_exists=True)
    if gpus:
        run_workers(gpus, {"config": config, "space": space, "trials": trials, "study": study_dir, "storage": storage,
                           "pruner": pruner, "metric": metric, "timeout": timeout_minutes, "seed": seed,
                           "base-first": base_first}, overrides)
        return write_report(the_study, study_dir, config, overrides, metric)
    stop: dict[str, Any] = {}

    def on_signal(signum: int, frame: Any) -> None:
        stop["signal"] = signum
        if stop.get("process") is not None:
            stop["process"].send_signal(signal.SIGTERM)

    def objective(trial: Any) -> float:
        stop["number"] = trial.number  # this process's (the study's last may be another process's)
        if os.environ.get("CUDA_VISIBLE_DEVICES"):
            trial.set_user_attr("device", os.environ["CUDA_VISIBLE_DEVICES"])  # the GPUs its run was shown
        surplus = _surplus_reason(the_study, trial, trials, shared)
        if surplus:
            trial.set_user_attr("surplus", True)
            trial.set_user_attr("reason", surplus)
            raise TrialFailed(surplus)
        the_study.sampler = _sampler(seed, trial.number)  # before its values are drawn
        values = suggest(trial, dimensions)
        run_dir = study_dir / f"trial_{trial.number:04d}"
        return _run_trial(trial, _command(str(config), overrides, values, run_dir), run_dir, metric, stop)

    start, deadline = time.time(), time.time() + 60 * timeout_minutes if timeout_minutes else None
    shared = _heartbeat(the_study)  # a running trial is alive (its heartbeat) or failed as stale: it can be counted
    previous = signal.signal(signal.SIGTERM, on_signal)
    optimize_log, quiet = logging.getLogger("optuna.study._optimize"), _SaidByTheStudy()  # where Optuna logs them
    optimize_log.addFilter(quiet)
    try:
        while _counted(the_study) < trials and (deadline is None or time.time() < deadline):
            if shared and _wait_for_others(the_study, trials):
                continue
            _retry_interrupted(the_study)
            the_study.optimize(objective, n_trials=1, catch=(TrialFailed,))
            _progress(the_study, stop["number"], trials, metric, start, deadline)
    except KeyboardInterrupt:
        raise SystemExit(f"the study stopped; {study_dir} keeps it: the same command continues it") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        optimize_log.removeFilter(quiet)
    return {} if _worker else write_report(the_study, study_dir, config, overrides, metric)


def _progress(study: Any, number: int, trials: int, metric: str, start: float, deadline: float | None) -> None:
    from optuna.trial import TrialState

    last = study.trials[number]
    said = {TrialState.COMPLETE: f"{metric} {last.value:.4f}" if last.value is not None else "",
            TrialState.PRUNED: "pruned", TrialState.FAIL: f"failed: {last.user_attrs.get('reason', 'stopped')}"}
    best = ""
    if any(t.state == TrialState.COMPLETE for t in study.trials):
        best = f" | best {study.best_value:.4f} (trial {study.best_trial.number})"
    left = f" | {max(0.0, (deadline - time.time()) / 60):.1f} min left" if deadline else ""
    params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in last.params.items())
    base = ", the base config" if last.user_attrs.get("base") else ""
    gpu = f" on GPU {last.user_attrs['device']}" if "device" in last.user_attrs else ""
    print(f"trial {last.number} ({_counted(study)}/{trials}){gpu}{base}: {params} -> "
          f"{said.get(last.state, last.state.name)}{best} | {time.time() - start:.0f} s{left}", flush=True)






def _same_study(study: Any, study_dir: Path, base: dict[str, Any], space: str | Path, metric: str) -> None:
    """A new study records what it searches (the base config with its overrides, the space, the metric); one
    continued with another of them is refused: its trials would not be comparable."""
    import hashlib

    said = {"base config": base, "space": yaml.safe_load(Path(space).read_text()), "metric": metric}
    digests = {k: hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:16]
               for k, v in said.items()}
    kept = study.user_attrs.get("vitlab")
    if kept is None:
        study.set_user_attr("vitlab", digests)
        return
    differ = [k for k in digests if kept.get(k) != digests[k]]
    if differ:
        raise ConfigError(f"--study {study_dir}: its trials searched another {' and '.join(differ)}; give a new --study "
                          f"for this search, or the {differ[0]} the study was started with to continue it")



