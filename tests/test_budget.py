"""train.budget_minutes: a run's length set by the time it may take. The epochs it chooses follow from the timed
steps and evaluation by arithmetic written out here by hand; the run it then trains is, weight for weight, the run of
that many epochs given as train.epochs; a resumed run keeps the number it chose."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vitlab.training.budget as budget
from conftest import reset_accelerate, tiny_overrides
from vitlab import checkpoint as ckpt
from vitlab.config import load_config
from vitlab.errors import ConfigError
from vitlab.training import train


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / "last" / "model.safetensors"))


def _evals(run: Path) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["split"] == "eval"]


@pytest.mark.parametrize("spent, every, final, expected", [
    # 100 s; 10 s spent; an epoch of 20 steps of 0.5 s = 10 s, an evaluation 2 s after each: 10 + 12 e <= 100 -> 7
    (10.0, 1, 0.0, 7),
    # the last evaluation reads a larger split, 5 s more: 10 + 12 e + 5 <= 100 -> 7 (94 + 5 = 99), 10 + 84 + 5 = 99
    (10.0, 1, 5.0, 7),
    (10.0, 1, 7.0, 6),  # 10 + 84 + 7 = 101 > 100 -> 6
    # evaluated every 3rd epoch and after the last: e = 8 has evaluations at 3, 6, 8: 10 + 80 + 6 = 96 -> 8
    (10.0, 3, 0.0, 8),
    # evaluated only after the last: 10 + 10 e + 2 <= 100 -> 8 (92); 9 would be 102
    (10.0, 0, 0.0, 8),
    (95.0, 1, 0.0, 0),  # not one epoch fits
])
def test_the_epochs_that_fit_are_counted_with_every_evaluation_and_the_last(spent, every, final, expected):
    assert budget.epochs_within(100.0, spent, epoch_seconds=20 * 0.5, evaluation_seconds=2.0,
                                final_extra_seconds=final, eval_every=every, most=50) == expected
    assert budget.epochs_within(100.0, 0.0, epoch_seconds=1.0, evaluation_seconds=0.0, final_extra_seconds=0.0,
                                eval_every=1, most=12) == 12  # train.epochs bounds it


def test_a_budget_run_is_the_run_of_the_epochs_it_chose(tiny_imagefolder, tmp_path, capsys):
    """Timing steps on the run's own batches leaves no trace: weights, optimizer, schedule, generators, data order."""
    keys = ("data.val_size=15", "data.crop_padding=4", "data.hflip=true", "train.epochs=3", "model.drop_path_rate=0.1")
    timed = train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "timed", *keys,
                                                   "train.budget_minutes=20")))
    reset_accelerate()
    said = capsys.readouterr().out
    assert "train.budget_minutes=20: " in said and "3 epochs" in said
    assert ckpt.read_json(tmp_path / "timed/checkpoints/last/trainer_state.json")["budget_epochs"] == 3
    fixed = train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "fixed", *keys)))
    reset_accelerate()
    a, b = _weights(tmp_path / "timed"), _weights(tmp_path / "fixed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["val_loss"] for r in _evals(tmp_path / "timed")] == [r["val_loss"] for r in _evals(tmp_path / "fixed")]
    assert timed["test_top1"] == fixed["test_top1"] and timed["epochs_done"] == 3
    # its config.yaml is the config as given (the same command continues it); train.epochs bounds the budget's
    assert load_config(tmp_path / "timed/config.yaml", recorded=True).train.epochs == 3


def test_a_pause_in_a_few_timed_steps_is_not_taken_for_every_step(tiny_imagefolder, tmp_path, monkeypatch):
    """The step's time is the median of blocks of steps: three steps that stall for 1 s (a pause of the host, a
    collection of garbage) among 30 of about 10 ms move it by nothing like the 0.1 s they would add to the mean."""
    import statistics
    import time

    from vitlab.training.loop import Loop

    calls, timings = [], []
    step = Loop.step

    def stalling(self, group):
        calls.append(len(calls))
        time.sleep(1.0 if len(calls) in (12, 13, 14) else 0.01)  # the 2nd-4th timed steps, after 10 that warm up
        return step(self, group)

    measure = budget.measure
    monkeypatch.setattr(Loop, "step", stalling)
    monkeypatch.setattr(budget, "measure", lambda loop: timings.append(measure(loop)) or timings[-1])
    # 66 training images in batches of 1: 66 steps an epoch, so all 10 + 30 steps are timed, in 6 blocks of 5
    train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "run", "data.val_size=15",
                                           "train.batch_size=1", "train.epochs=1", "train.budget_minutes=20")))
    reset_accelerate()
    assert len(calls) >= 40 and 0.01 <= timings[0].step < 0.05, timings
    assert budget.typical_step_seconds([0.3, 0.1, 0.2, 0.9]) == statistics.median([0.3, 0.1, 0.2, 0.9]) == 0.25
    assert budget.typical_step_seconds([0.3, 5.0, 0.2]) == statistics.median([0.3, 5.0, 0.2]) == 0.3


def _measured(step: float, evaluation: float, final: float = 0.0):
    """Stands in for the timing (seconds a step, an evaluation, what the last evaluation adds) so that the number of
    epochs is known here; the real timing is run by the test above."""
    return lambda loop: budget.Timing(step, evaluation, final)


def test_the_budget_binds_and_a_resumed_run_keeps_the_epochs_it_chose(tiny_imagefolder, tmp_path, monkeypatch,
                                                                       capsys):
    # 81 training images in batches of 16: 5 steps an epoch; 1 s a step, 2 s an evaluation after each: 7 s an epoch;
    # 60 s, less the second or so spent before: 8 epochs (56 s), not 9 (63 s), of the 100 train.epochs allows
    monkeypatch.setattr(budget, "measure", _measured(1.0, 2.0))
    cfg = lambda: load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "run", "data.val_size=15",
                                                   "train.epochs=100", "train.budget_minutes=1"))
    train(cfg(), stop_after_epoch=2)
    reset_accelerate()
    assert "train.budget_minutes=1: 8 epochs" in capsys.readouterr().out
    monkeypatch.setattr(budget, "measure", lambda loop: pytest.fail("a resumed run timed its steps again"))
    summary = train(cfg())  # the same command continues it: 8 epochs, not timed again
    reset_accelerate()
    assert summary["epochs_done"] == 8 and [r["epoch"] for r in _evals(tmp_path / "run")] == list(range(1, 9))
    train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "fixed", "data.val_size=15",
                                           "train.epochs=8")))
    reset_accelerate()
    a, b = _weights(tmp_path / "run"), _weights(tmp_path / "fixed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # continued with another budget: one line, naming how to change its length
    with pytest.raises(ConfigError, match=r"train.budget_minutes=0 train.epochs=N") as e:
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "run", "data.val_size=15",
                                               "train.epochs=100", "train.budget_minutes=2")), resume=tmp_path / "run")
    assert "\n" not in str(e.value)


def test_a_budget_without_room_for_one_epoch_is_one_line_before_the_first_step(tiny_imagefolder, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setattr(budget, "measure", _measured(30.0, 1.0))  # 6 steps of 30 s and an evaluation: 181 s
    with pytest.raises(ConfigError, match=r"train.budget_minutes=2: one epoch is projected to take 181 s") as e:
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "run", "train.budget_minutes=2")))
    reset_accelerate()
    assert "\n" not in str(e.value) and not (tmp_path / "run" / "checkpoints").exists()


def test_budget_rules_are_one_line(tiny_imagefolder, tmp_path):
    with pytest.raises(ConfigError, match="train.budget_minutes"):
        load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "a", "train.budget_minutes=-1"))
    with pytest.raises(ConfigError, match="train.budget_minutes"):
        load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "b", "train.budget_minutes=5",
                                         "train.cache_features=true", "model.freeze=backbone"))
