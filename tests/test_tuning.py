"""vitlab tune: an Optuna study whose trials are ordinary runs, chosen on validation data, continued by the same
command; its space checked against the config before any trial."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import reset_accelerate, tiny_overrides
from helpers import forked
from helpers.stand_in_trials import stand_in

pytest.importorskip("optuna")
ROOT = Path(__file__).resolve().parents[1]
STAND_IN = ROOT / "tests" / "helpers" / "stand_in_trials.py"
LR = "optim.lr: {low: 1.0e-3, high: 1.0e-2, log: true}"  # a learning rate, the space of most tests here

from vitlab.cli import main, train_main  # noqa: E402
from vitlab.errors import ConfigError  # noqa: E402
from vitlab.tuning import tune  # noqa: E402


def write_base(data: Path, path: Path, *extra: str) -> Path:
    """The tiny run of conftest as a YAML config, holding out 24 validation images."""
    raw: dict = {}
    for item in tiny_overrides(data, path.parent / "unused", "data.val_size=24", "train.log_every=100", *extra):
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(raw))
    return path


def searched(data: Path, tmp_path: Path, space: str, *extra: str) -> tuple[Path, Path, Path]:
    """A study's base config (the tiny run, ``extra`` keys), its space (``space``, YAML) and its directory."""
    (tmp_path / "space.yaml").write_text(space + "\n")
    return write_base(data, tmp_path / "base.yaml", *extra), tmp_path / "space.yaml", tmp_path / "study"


def tune_command(base: Path, space: Path, study: Path, trials: int, *extra: str,
                 stand_in: tuple[float, int] | None = None) -> list[str]:
    """``vitlab tune``'s arguments to ``python`` (after the interpreter); ``stand_in``: its trials stand-ins of
    (seconds an epoch, epochs)."""
    program = ["-m", "vitlab.cli"] if stand_in is None else [str(STAND_IN), *map(str, stand_in)]
    return [*program, "tune", "--config", str(base), "--space", str(space), "--study", str(study),
            "--trials", str(trials), *extra]


def rows(study: Path) -> list[dict]:
    with open(study / "trials.csv") as f:
        return list(csv.DictReader(f))


def last_eval(run: Path) -> dict:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == "eval"][-1]


@pytest.mark.slow
def test_a_study_trains_its_trials_as_runs_and_best_yaml_trains_the_best_again(tiny_imagefolder, tmp_path, capsys,
                                                                                 monkeypatch):
    # with a time budget: each trial chooses its epochs by it (here train.epochs=2 bounds them); best.yaml fixes them
    base, space, study = searched(tiny_imagefolder, tmp_path, f"{LR}\nmodel.embed_dim: [16, 32]",
                                  "train.budget_minutes=10")
    main(tune_command(base, space, study, 2, "--metric", "val_loss", "--pruner", "none")[2:])  # vitlab tune, here
    out = capsys.readouterr().out
    assert out.count("\ntrial ") + out.startswith("trial ") == 2  # a line a trial
    table = rows(study)
    assert [r["state"] for r in table] == ["COMPLETE"] * 2
    for r in table:  # each trial an ordinary run: its own config, metrics and checkpoint
        run = study / f"trial_{int(r['number']):04d}"
        assert float(r["val_loss"]) == last_eval(run)["val_loss"]
        assert (run / "checkpoints/last/model.safetensors").is_file()
        assert yaml.safe_load((run / "config.yaml").read_text())["model"]["embed_dim"] == int(
            r["model.embed_dim"])
    best = min(table, key=lambda r: float(r["val_loss"]))
    assert {p.name for p in study.glob("*.png")} == {"history.png", "importances.png", "slices.png"}
    # best.yaml: a whole config that trains the best trial again, the same validation loss to the last digit
    written = yaml.safe_load((study / "best.yaml").read_text())
    assert (written["train"]["epochs"], written["train"]["budget_minutes"]) == (2, 0)
    assert "budget_minutes chose its 2 epochs" in (study / "best.yaml").read_text()
    assert sorted(p.name for p in study.glob(".*")) == []  # each file written beside, then put in its place
    train_main(["--config", str(study / "best.yaml")])  # as train.py runs it, in this process
    reset_accelerate()
    assert last_eval(study / "best")["val_loss"] == float(best["val_loss"])
    # the same study with more trials (here through the Python API, the new trial a stand-in) continues it: only the
    # new one runs
    import vitlab.tuning.study

    before = {p: p.stat().st_mtime for p in study.glob("trial_*/metrics.jsonl")}
    monkeypatch.setattr(vitlab.tuning.study, "_command", stand_in())
    tune(base, space, 3, study=study, metric="val_loss", pruner="none")
    assert len(rows(study)) == 3 and (study / "trial_0002/metrics.jsonl").is_file()
    assert {p: p.stat().st_mtime for p in before} == before


@pytest.mark.slow
def test_a_trial_that_fails_is_recorded_with_its_reason_and_the_study_goes_on(tiny_imagefolder, tmp_path, capsys):
    # 3 heads do not divide a width of 32: the config's rules let it pass, the model refuses it when built
    import logging

    base = write_base(tiny_imagefolder, tmp_path / "base.yaml")
    space = tmp_path / "space.yaml"
    space.write_text("model.num_heads: [3]\n")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # what Optuna's loggers pass on to its handler (which writes to stderr)
    logging.getLogger("optuna").addHandler(handler)
    try:
        result = tune(base, space, 2, study=tmp_path / "study")
    finally:
        logging.getLogger("optuna").removeHandler(handler)
    assert result == {"best_trial": None}
    table = rows(tmp_path / "study")
    assert [r["state"] for r in table] == ["FAIL", "FAIL"]
    assert all("head" in r["reason"] and "\n" not in r["reason"] for r in table), table
    assert capsys.readouterr().out.count("-> failed: error: model") == 2  # one line a trial, its reason
    assert [r.getMessage() for r in records] == []  # not Optuna's two records a trial (one with vitlab's traceback)


def rows_of_db(study: Path) -> list[dict]:
    import optuna

    loaded = optuna.load_study(study_name=study.name, storage=f"sqlite:///{study / 'study.db'}")
    return [{"state": t.state.name} for t in loaded.trials]


@pytest.mark.parametrize("space, options, said", [
    ("optim.lrr: [0.1]", {}, r"optim\.lrr"),
    ("data.dataset: {low: 1, high: 2}", {}, r"^space: data\.dataset: a range, but the key holds str values"),
    ("train.epochs: {low: 1.5, high: 3}", {}, r"^space: train\.epochs holds integers"),
    ("optim.lr: {low: 1.0e-2, high: 1.0e-3}", {}, r"^space: optim\.lr: low=0\.01 must be below high=0\.001"),
    ("optim.weight_decay: {low: 0, high: 0.1, log: true}", {}, r"log range needs low > 0"),
    ("optim.lr: [0.001, -1.0]", {}, r"^space: optim\.lr=-1\.0 is refused by the config: optim\.lr=-1\.0 is invalid"),
    ("optim.lr: [0.001]", {"metric": "test_top1"}, r"^--metric test_top1: choices are made on validation data only"),
    ("optim.lr: [0.001]", {"overrides": ["data.val_size=0"]}, r"holds out no validation data.*data\.val_size"),
    ("optim.lr: [0.001]", {"pruner": "asha"}, r"^--pruner asha: give one of median, hyperband, none"),
    ("optim.lr: [0.001]", {"trials": 0}, r"^--trials 0"),
])
def test_what_a_study_cannot_take_is_one_line_before_any_trial(space, options, said, tiny_imagefolder, tmp_path):
    base = write_base(tiny_imagefolder, tmp_path / "base.yaml")
    (tmp_path / "space.yaml").write_text(space + "\n")
    trials = options.pop("trials", 2)
    with pytest.raises(ConfigError, match=said) as raised:
        tune(base, tmp_path / "space.yaml", trials, study=tmp_path / "study", **options)
    assert "\n" not in str(raised.value)
    assert not list(tmp_path.glob("study/trial_*"))


def test_a_missing_space_file_names_what_to_write(tiny_imagefolder, tmp_path):
    base = write_base(tiny_imagefolder, tmp_path / "base.yaml")
    with pytest.raises(ConfigError, match=r"^--space .*nowhere\.yaml: no such file; write a YAML of config keys"):
        tune(base, tmp_path / "nowhere.yaml", 2, study=tmp_path / "study")


@pytest.mark.parametrize("space", sorted((ROOT / "configs" / "spaces").glob("*.yaml")), ids=lambda p: p.stem)
def test_each_shipped_space_reads_against_the_config_of_its_name(space):
    """configs/spaces/NAME.yaml searches configs/NAME.yaml: every key is the config's and every end and choice passes
    its rules, so the study the docs give starts."""
    from vitlab.tuning.space import read_space

    keys = list(yaml.safe_load(space.read_text()))
    dimensions = read_space(space, ROOT / "configs" / space.name, [])
    assert [d.key for d in dimensions] == keys and len(keys) >= 5


@pytest.mark.slow
def test_the_median_pruner_judges_from_half_the_schedule_against_three_finished_trials(tiny_imagefolder, tmp_path,
                                                                                       monkeypatch):
    # Three trials at a learning rate that learns, then one that cannot (1e-7), asked in that order (enqueued), each
    # a stand-in run of 10 epochs: the fourth is pruned at epoch 5, not before (half its schedule; the trainer's
    # own handling of the SIGTERM that stops it is test_preemption's)
    import optuna

    import vitlab.tuning.study

    monkeypatch.setattr(vitlab.tuning.study, "_command", stand_in())
    base = write_base(tiny_imagefolder, tmp_path / "base.yaml", "train.epochs=10", "train.eval_every=1",
                      "optim.min_lr=0")
    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: [3.0e-3, 1.0e-7]\n")
    study = tmp_path / "study"
    study.mkdir()
    storage = f"sqlite:///{study / 'study.db'}"
    enqueued = optuna.create_study(study_name="study", storage=storage, direction="minimize")
    for lr in (3e-3, 3e-3, 3e-3, 1e-7):
        enqueued.enqueue_trial({"optim.lr": lr})
    tune(base, space, 4, study=study, metric="val_loss")
    assert [r["state"] for r in rows(study)] == ["COMPLETE"] * 3 + ["PRUNED"]
    trials = optuna.load_study(study_name="study", storage=storage).trials
    assert [sorted(t.intermediate_values) for t in trials] == [list(range(1, 11))] * 3 + [[1, 2, 3, 4, 5]]


class PrunedFromEpoch:
    """An Optuna trial's reporting side whose pruner says stop from ``epoch`` on."""

    def __init__(self, epoch: int):
        self.epoch, self.reported = epoch, {}

    def report(self, value: float, step: int) -> None:
        self.reported[step] = value

    def should_prune(self) -> bool:
        return max(self.reported) >= self.epoch


def test_a_pruned_trials_process_is_stopped_and_later_epochs_are_not_reported(tmp_path):
    # A stand-in for train.py that evaluates an epoch every 50 ms for 10 minutes and, as train.py does on SIGTERM,
    # writes what it has and exits: the study stops it within a look or two at its metrics after epoch 3
    import optuna

    from vitlab.tuning.study import _run_trial

    run = tmp_path / "run"
    script = (
        "import json, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        f"with open({str(run / 'metrics.jsonl')!r}, 'a') as f:\n"
        "    for epoch in range(1, 12001):\n"
        "        f.write(json.dumps({'split': 'eval', 'epoch': epoch, 'val_loss': 1.0}) + '\\n'); f.flush()\n"
        "        time.sleep(0.05)\n")
    trial, started = PrunedFromEpoch(3), time.monotonic()
    with pytest.raises(optuna.TrialPruned, match="pruned after epoch 3: val_loss 1.0000"):
        _run_trial(trial, [sys.executable, "-c", script], run, "val_loss", {})
    assert sorted(trial.reported) == [1, 2, 3]
    written = len((run / "metrics.jsonl").read_text().splitlines())
    assert 3 <= written < 100 and time.monotonic() - started < 30


def test_base_first_asks_the_base_configs_own_values_first_once_and_refuses_a_base_outside_the_space(
        tiny_imagefolder, tmp_path, monkeypatch, capsys):
    # --base-first: trial 0 is the recipe the study starts from (optim.lr=3e-3 and embed_dim 32 of the tiny config),
    # so the study's best is never below it on validation; the sampler's trials follow; a continued study does not
    # ask it again; a base value outside the space is one line before any trial
    import vitlab.tuning.study

    monkeypatch.setattr(vitlab.tuning.study, "_command", stand_in())
    base, space, study = searched(tiny_imagefolder, tmp_path, f"{LR}\nmodel.embed_dim: [16, 32, 64]")
    tune(base, space, 2, study=study, pruner="none", base_first=True)
    table = rows(study)
    assert float(table[0]["optim.lr"]) == 3e-3 and int(table[0]["model.embed_dim"]) == 32
    assert float(table[1]["optim.lr"]) != 3e-3
    assert "trial 0 (1/2), the base config: " in capsys.readouterr().out
    tune(base, space, 4, study=study, pruner="none", base_first=True)  # continued: the base is not asked again
    table = rows(study)
    assert len(table) == 4 and sum(float(r["optim.lr"]) == 3e-3 for r in table) == 1
    for spec, said in ((LR.replace("1.0e-3", "4.0e-3"), r"^--base-first: the base config's optim\.lr=0\.003 lies "
                        r"outside the space's range \[0\.004, 0\.01\]"),
                       ("model.embed_dim: [16, 64]", r"^--base-first: the base config's model\.embed_dim=32 is not "
                        r"among the space's choices \[16, 64\]"),
                       ("model.mlp_ratio: {low: 2.5, high: 3.0}", r"^--base-first: the base config's "  # the preset's
                        r"model\.mlp_ratio=2\.0 lies outside the space's range \[2\.5, 3\]")):
        (tmp_path / "other.yaml").write_text(spec + "\n")
        with pytest.raises(ConfigError, match=said):
            tune(base, tmp_path / "other.yaml", 2, study=tmp_path / "other", base_first=True)
        assert not (tmp_path / "other").exists()

def test_a_study_continued_with_another_space_base_or_metric_and_a_storage_that_cannot_be_opened_are_one_line(
        tiny_imagefolder, tmp_path, monkeypatch):
    import vitlab.tuning.study

    monkeypatch.setattr(vitlab.tuning.study, "_command", stand_in())  # trials of a few ms
    base = write_base(tiny_imagefolder, tmp_path / "base.yaml", "train.epochs=10", "train.eval_every=1",
                      "optim.min_lr=0")
    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: [3.0e-3, 1.0e-3]\n")
    study = tmp_path / "study"
    tune(base, space, 1, study=study, metric="val_loss", pruner="none")
    tune(base, space, 2, study=study, metric="val_loss", pruner="none")  # the same search: continued
    assert len(rows(study)) == 2
    other = tmp_path / "other.yaml"
    other.write_text("optim.lr: [3.0e-3, 2.0e-3]\n")
    for kwargs, said in ((dict(space=other), "space"), (dict(overrides=["optim.weight_decay=0.1"]), "base config"),
                         (dict(metric="val_top1"), "metric")):
        arguments = dict(config=base, space=space, trials=3, study=study, metric="val_loss", pruner="none") | kwargs
        with pytest.raises(ConfigError, match=rf"^--study .*study: its trials searched another {said}; give a new "
                                              rf"--study") as raised:
            tune(**arguments)
        assert "\n" not in str(raised.value)
    assert len(rows(study)) == 2
    with pytest.raises(ConfigError, match=r"^--storage postgresql://nobody@127\.0\.0\.1:1/none: cannot be opened \("):
        tune(base, space, 1, study=tmp_path / "s2", storage="postgresql://nobody@127.0.0.1:1/none")


@pytest.mark.slow
def test_a_study_stopped_or_killed_mid_trial_is_continued_by_the_same_command_and_the_trial_asked_again(
        tiny_imagefolder, tmp_path):
    # SIGTERM to the study when its first trial has written its first evaluation (5 epochs before its end): it stops,
    # saying how to continue. The same command asks that trial's values again, and is then killed with its trial
    # (kill -9 of the process group: the machine went away): the trial stays RUNNING in the database, its heartbeat
    # silent, aged past the minute of grace here rather than waited for. The same study then fails it as stale, asks
    # its values a third time and runs 2 trials in all. The trials are stand-ins of 6 epochs of 0.5 s (a real trial
    # stopped by SIGTERM is test_preemption's preempted run); the study's processes are forked from this one
    import os
    import sqlite3

    base, space, study = searched(tiny_imagefolder, tmp_path, LR, "train.epochs=6", "train.eval_every=1")
    command = tune_command(base, space, study, 2, "--pruner", "none", stand_in=(0.5, 6))

    def started_until_evaluated(trial: int) -> forked.Forked | subprocess.Popen:
        process = forked.start(command, cwd=ROOT, start_new_session=True)
        metrics = study / f"trial_{trial:04d}/metrics.jsonl"
        deadline = time.time() + 120
        while not (metrics.is_file() and '"split": "eval"' in metrics.read_text()) and time.time() < deadline:
            time.sleep(0.2)
        return process

    stopped = started_until_evaluated(0)
    stopped.send_signal(signal.SIGTERM)
    _, err = stopped.communicate(timeout=120)
    assert stopped.returncode != 0 and "the same command continues it" in err
    assert "Traceback" not in err and "failed with" not in err, err  # one line, not Optuna's records of a failure
    assert [r["state"] for r in rows_of_db(study)] == ["FAIL"]
    killed = started_until_evaluated(1)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.communicate(timeout=60)
    assert [r["state"] for r in rows_of_db(study)] == ["FAIL", "RUNNING"]
    with sqlite3.connect(study / "study.db") as db:
        db.execute("UPDATE trial_heartbeats SET heartbeat = datetime(heartbeat, '-5 minutes')")
    done = forked.start(command, cwd=ROOT)
    _, err = done.communicate(timeout=120)
    assert done.returncode == 0, err[-2000:]
    table = rows(study)
    assert [r["state"] for r in table] == ["FAIL", "FAIL", "COMPLETE", "COMPLETE"], table
    assert table[0]["optim.lr"] == table[1]["optim.lr"] == table[2]["optim.lr"]  # asked again with the same values
    assert table[3]["optim.lr"] != table[0]["optim.lr"]  # a new trial draws new values, not the first trial's again


def test_a_stopped_trial_asked_again_by_two_processes_at_once_runs_once(tiny_imagefolder, tmp_path, monkeypatch):
    # Two processes continuing a stopped study at the same moment both ask its stopped trial again (neither saw the
    # other's yet; seen once in `--devices`' test): the later copy is recorded as not run, not counted, and the study
    # runs its total with new values.
    import optuna
    from optuna.distributions import FloatDistribution
    from optuna.trial import TrialState

    import vitlab.tuning.study

    monkeypatch.setattr(vitlab.tuning.study, "_command", stand_in())
    base, space, study = searched(tiny_imagefolder, tmp_path, LR)
    tune(base, space, 1, study=study, pruner="none")
    loaded = optuna.load_study(study_name="study", storage=f"sqlite:///{study / 'study.db'}")
    loaded.enqueue_trial({"optim.lr": 5e-3})
    stopped = loaded.ask({"optim.lr": FloatDistribution(1e-3, 1e-2, log=True)})
    loaded.tell(stopped, state=TrialState.FAIL)  # trial 1: stopped with the study (no reason of its own)
    for _ in range(2):  # what each process's continuation asks at once
        loaded.enqueue_trial({"optim.lr": 5e-3}, user_attrs={"retry_of": 1}, skip_if_exists=False)
    tune(base, space, 3, study=study, pruner="none")
    table = rows(study)
    assert [r["state"] for r in table] == ["COMPLETE", "FAIL", "COMPLETE", "FAIL", "COMPLETE"], table
    assert table[3]["reason"] == "not run: trial 2 asks trial 1's values again"
    assert [float(r["optim.lr"]) for r in table if r["state"] == "COMPLETE"].count(5e-3) == 1


@pytest.mark.slow
def test_two_processes_share_one_study_and_run_its_trials_once_each(tiny_imagefolder, tmp_path):
    # The same command started twice at once on one SQLite study: the 3 trials split between the processes, each run
    # once (a trial one asked after the other had asked the 3rd is recorded as not run, and not counted). The trials
    # are stand-ins of 2 s (4 epochs of 0.5 s), as long as the tiny run's; the two processes are forked from this one.
    # Both ask the base config first (--base-first): it runs once
    import optuna

    base, space, study = searched(tiny_imagefolder, tmp_path, LR)
    study.mkdir()
    command = tune_command(base, space, study, 3, "--pruner", "none", "--base-first", stand_in=(0.5, 4))
    both = [forked.start(command, cwd=ROOT) for _ in range(2)]
    outputs = [p.communicate(timeout=600) for p in both]
    assert all(p.returncode == 0 for p in both), [err[-2000:] for _, err in outputs]
    trials = optuna.load_study(study_name="study", storage=f"sqlite:///{study / 'study.db'}").trials
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(complete) == 3 and all(t.state.name in ("COMPLETE", "FAIL") for t in trials)
    assert all(t.user_attrs.get("surplus") for t in trials if t.state.name == "FAIL")
    ran = [out.count("-> val_top1") for out, _ in outputs]
    assert sorted(ran) != [0, 3] and sum(ran) == 3, ran  # both ran trials, 3 in all
    assert all(len((study / f"trial_{t.number:04d}/metrics.jsonl").read_text().splitlines()) == 4 for t in complete)
    assert sum(t.params["optim.lr"] == 3e-3 for t in complete) == 1
    # each trial draws its own values: two processes seeded alike (the same command) do not draw the same ones in
    # turn (Optuna's seeded sampler, one per process, gave trial 2 the values of trial 1: half the study run twice)
    assert len({t.params["optim.lr"] for t in complete}) == 3, [t.params for t in complete]


@pytest.mark.slow
def test_devices_runs_one_trial_a_gpu_in_processes_of_its_own_stopped_and_continued_as_one_study(tiny_imagefolder,
                                                                                                 tmp_path):
    # `--devices all` on a machine showing 2 GPUs (CUDA_VISIBLE_DEVICES=3,5 names them): a process a GPU, each trial's
    # run shown its one GPU, the study shared, the trials side by side. SIGTERM to the command when both GPUs' first
    # trials have evaluated an epoch: it stops them both and says so in one line; the same command continues the study,
    # both trials asked again, 4 in all. No GPU here: the GPUs are given (STAND_IN_GPUS), the trials stand-ins of 3 s
    # (6 epochs of 0.5 s); the command is forked from this process, its processes a GPU fresh interpreters.
    import optuna

    base, space, study = searched(tiny_imagefolder, tmp_path, LR)
    command = tune_command(base, space, study, 4, "--pruner", "none", "--devices", "all", stand_in=(0.5, 6))
    env = {**os.environ, "STAND_IN_GPUS": "3,5"}
    stopped = forked.start(command, env, cwd=ROOT)
    deadline = time.time() + 120
    evaluated = lambda n: (study / f"trial_{n:04d}/metrics.jsonl").is_file() and (
        study / f"trial_{n:04d}/metrics.jsonl").read_text()
    while not (evaluated(0) and evaluated(1)) and time.time() < deadline:
        time.sleep(0.2)
    stopped.send_signal(signal.SIGTERM)
    _, err = stopped.communicate(timeout=120)
    assert stopped.returncode != 0 and err.strip().endswith("the study stopped; the same command continues it"), err
    assert "Traceback" not in err and "failed with" not in err, err
    assert [r["state"] for r in rows_of_db(study)] == ["FAIL", "FAIL"]  # both stopped, neither left running
    done = forked.start(command, env, cwd=ROOT)
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0, err[-2000:]
    trials = optuna.load_study(study_name="study", storage=f"sqlite:///{study / 'study.db'}").trials
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(complete) == 4 and all(t.state.name == "FAIL" for t in trials if t not in complete), trials
    assert {t.user_attrs["device"] for t in complete} == {"3", "5"}  # each trial's run shown one GPU, both used
    assert {t.user_attrs.get("retry_of") for t in complete} >= {0, 1}  # the stopped trials asked again
    assert len({t.params["optim.lr"] for t in complete}) == 4
    assert any(a.datetime_start < b.datetime_complete and b.datetime_start < a.datetime_complete for a in complete
               for b in complete if a.user_attrs["device"] != b.user_attrs["device"])  # the GPUs' trials side by side
    assert {r["device"] for r in rows(study)} == {"3", "5"} and (study / "best.yaml").is_file()  # written once, here
    assert out.count("best: trial") == 1 and sum(" on GPU " in line and "-> val_top1" in line for line in
                                                 out.splitlines()) == 4  # a retry asked twice at once: one is run


@pytest.mark.parametrize("devices, gpus, said", [
    ("all", [], r"^--devices all: this machine shows no CUDA GPU; leave --devices out to run one trial at a time$"),
    ("0,2", ["0", "1"], r"^--devices 0,2: give GPUs this process sees \(0-1\), each once, or 'all'$"),
    ("1,1", ["0", "1"], r"^--devices 1,1: give GPUs this process sees \(0-1\), each once, or 'all'$"),
    ("gpu0", ["0", "1"], r"^--devices gpu0: give GPUs this process sees \(0-1\), each once, or 'all'$"),
])
def test_devices_that_are_not_there_are_one_line_before_the_study_starts(tiny_imagefolder, tmp_path, monkeypatch,
                                                                           devices, gpus, said):
    import vitlab.tuning.devices

    monkeypatch.setattr(vitlab.tuning.devices, "_visible_gpus", lambda: gpus)
    base, space, study = searched(tiny_imagefolder, tmp_path, LR)
    with pytest.raises(ConfigError, match=said):
        tune(base, space, 2, study=study, devices=devices)
    assert not study.exists()


def test_visible_gpus_are_this_processs_cuda_visible_devices_or_their_numbers(monkeypatch):
    from vitlab.tuning.devices import _visible_gpus

    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5f1a, 3")
    assert _visible_gpus() == ["GPU-5f1a", "3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert _visible_gpus() == ["0", "1"]
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    assert _visible_gpus() == []


def test_without_optuna_the_study_says_which_extra_to_install(tiny_imagefolder, tmp_path, monkeypatch):
    base = write_base(tiny_imagefolder, tmp_path / "base.yaml")
    (tmp_path / "space.yaml").write_text("optim.lr: [0.001]\n")
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna raises ImportError
    with pytest.raises(ConfigError, match=r"^vitlab tune needs optuna, which is not installed: pip install "
                                          r"'vitlab\[tune\]'$"):
        tune(base, tmp_path / "space.yaml", 2, study=tmp_path / "study")
    assert not (tmp_path / "study").exists()
