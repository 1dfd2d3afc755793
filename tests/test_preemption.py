"""Runs that survive a cluster: stop on a signal, checkpoints inside an epoch, the same command resumes,
an elastic restart after a killed worker. Each is compared with the uninterrupted run, bit for bit (CPU)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import launch_env, reset_accelerate, same_run_records, signal_at_step, tiny_overrides
from vitlab import checkpoint as ckpt
from vitlab.config import load_config
from vitlab.data.images import ImageData, TensorImageDataset, train_transform
from vitlab.errors import ConfigError, Preempted
from vitlab.preemption import StopSignals
from vitlab.training import train

ROOT = Path(__file__).resolve().parents[1]
# Augmentation (crops, flips, RandAugment), mixup (NumPy), drop path and EMA all draw random numbers.
RANDOM = ("train.epochs=2", "data.augment=randaugment", "data.mixup_alpha=0.2", "model.drop_path_rate=0.1",
          "train.ema_decay=0.9")


def _weights(run_dir: Path, name: str = "model.safetensors", which: str = "last") -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / which / name))


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _state(run_dir: Path, which: str = "last") -> dict:
    return ckpt.read_json(run_dir / "checkpoints" / which / "trainer_state.json")


@pytest.mark.parametrize("loader", ["torch", "gpu"])
def test_a_signal_inside_an_epoch_checkpoints_there_and_the_same_command_ends_bit_identical(
        tiny_imagefolder, tmp_path, monkeypatch, on_cpu, loader):
    extra = (*RANDOM, f"data.loader={loader}")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(load_config(None, tiny_overrides(tiny_imagefolder, whole, *extra)))
    reset_accelerate()
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, parts, *extra))
    with monkeypatch.context() as m:
        signal_at_step(m, 4)  # epoch 1 has 6 steps
        with pytest.raises(Preempted) as stopped:
            train(cfg)
    reset_accelerate()
    assert stopped.value.code == 75 and "stopped by SIGTERM after step 4 (epoch 1, step 4 of 6)" in str(stopped.value)
    assert {k: _state(parts)[k] for k in ("epoch", "epoch_step", "global_step")} == {
        "epoch": 0, "epoch_step": 4, "global_step": 4}
    assert (parts / "checkpoints/last/process_0.json").is_file()
    summary = train(cfg)  # the same command: train.resume=auto continues at step 5
    assert summary["epochs_done"] == 2
    for name in ("model.safetensors", "ema.safetensors"):
        assert _equal(_weights(whole, name), _weights(parts, name)), name
    # The log too: the epoch's training loss sums what was trained before and after the stop.
    assert same_run_records(whole, parts)


def test_checkpoints_every_n_steps_keep_the_k_newest_and_last_is_the_newest(tiny_imagefolder, tmp_path):
    run_dir = tmp_path / "run"
    train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.save_every_steps=4",
                                           "train.keep_last=2")))  # 12 steps: saved at 4, 6 (epoch), 8, 12 (end)
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last", "step_12", "step_8"]
    assert _state(run_dir, "step_8")["epoch_step"] == 2 and _state(run_dir, "step_12")["epoch_step"] == 0
    assert _equal(_weights(run_dir), _weights(run_dir, which="step_12"))
    # The copies are hard links to last/'s files: no second write.
    assert (checkpoints / "last/model.safetensors").stat().st_ino == (checkpoints / "step_12/model.safetensors").stat().st_ino


def test_a_signal_during_a_checkpoint_write_finishes_it_then_stops(tiny_imagefolder, tmp_path, monkeypatch, on_cpu):
    # The handler only sets a flag, so the write goes on to the end; a second signal changes nothing.
    run_dir = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.save_every_steps=2"))
    original, calls = ckpt.save_optimizer, []

    def save_while_signalled(optimizer, directory):
        calls.append(directory)
        if len(calls) in (2, 3):  # the step-4 checkpoint; then the one the stop writes, if any
            os.kill(os.getpid(), signal.SIGTERM)
        original(optimizer, directory)

    with monkeypatch.context() as m:
        m.setattr(ckpt, "save_optimizer", save_while_signalled)
        with pytest.raises(Preempted, match="after step 4"):
            train(cfg)
    reset_accelerate()
    assert len(calls) == 2  # step 4 was written once, completely, and the loop stopped right after it
    assert _state(run_dir)["global_step"] == 4 and not (run_dir / "checkpoints/.last.tmp").exists()
    train(cfg)
    reset_accelerate()
    whole = tmp_path / "whole"
    train(load_config(None, tiny_overrides(tiny_imagefolder, whole)))
    assert _equal(_weights(whole), _weights(run_dir))


def test_a_crash_during_a_checkpoint_write_keeps_the_previous_and_the_run_resumes_from_it(
        tiny_imagefolder, tmp_path, monkeypatch, on_cpu):
    # What a kill -9 in the middle of the write leaves: a half-written temporary directory, last/ as before.
    run_dir = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.save_every_steps=4"))
    original, calls = ckpt.save_optimizer, []

    def die_in_the_second_write(optimizer, directory):
        calls.append(directory)
        if len(calls) == 2:
            raise KeyboardInterrupt  # not an Exception: nothing in the loop handles it
        original(optimizer, directory)

    with monkeypatch.context() as m:
        m.setattr(ckpt, "save_optimizer", die_in_the_second_write)
        with pytest.raises(KeyboardInterrupt):
            train(cfg)
    reset_accelerate()
    assert _state(run_dir)["global_step"] == 4  # the step-6 (epoch end) write died; step 4's is intact
    assert (run_dir / "checkpoints/.last.tmp/model.safetensors").is_file()
    assert not (run_dir / "checkpoints/.last.tmp/optimizer.safetensors").exists()
    train(cfg)
    reset_accelerate()
    whole = tmp_path / "whole"
    train(load_config(None, tiny_overrides(tiny_imagefolder, whole)))
    assert _equal(_weights(whole), _weights(run_dir)) and same_run_records(whole, run_dir)


def test_resume_auto_starts_where_there_is_no_checkpoint_and_refuses_another_config_in_one_line(
        tiny_imagefolder, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    # A directory left by a run that died before its first checkpoint: started anew, its log restarted.
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"split": "train", "epoch": 1, "step": 2, "loss": 9.0, "lr": 0.1}\n')
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=1"))
    assert train(cfg)["epochs_done"] == 1
    reset_accelerate()
    assert '"loss": 9.0' not in (run_dir / "metrics.jsonl").read_text()

    from vitlab.data import images

    def no_data(*args, **kwargs):
        raise AssertionError("data was read before the config was checked")

    monkeypatch.setattr(images, "load_split", no_data)
    other = load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=1", "model.embed_dim=64"))
    with pytest.raises(ConfigError) as e:
        train(other)
    message = str(e.value)
    assert "\n" not in message and "holds a run with another config (model.embed_dim: 32 there, 64 now)" in message
    assert f"--resume {run_dir}" in message
    with pytest.raises(ConfigError, match="already holds a run and train.resume=no"):
        train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=1", "train.resume=no")))


def test_a_finished_run_run_again_trains_nothing_and_resume_run_dir_extends_it(tiny_imagefolder, tmp_path, capsys):
    run_dir = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=1"))
    first = train(cfg)
    reset_accelerate()
    before = {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    again = train(cfg)
    assert f"{run_dir} holds a finished run (1 epochs): nothing to train" in capsys.readouterr().out
    assert again["test_top1"] == first["test_top1"] and again["epochs_done"] == 1
    assert {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()} == before
    # --resume RUN_DIR continues it with the config changed on purpose: one more epoch.
    reset_accelerate()
    from vitlab.cli import train_main

    train_main(["--resume", str(run_dir), "train.epochs=2"])
    assert _state(run_dir)["epoch"] == 2


def test_stop_signals_restore_the_previous_handlers_and_a_bad_name_is_one_line(tiny_imagefolder, tmp_path):
    previous = signal.getsignal(signal.SIGUSR1)
    with StopSignals("SIGTERM, SIGUSR1") as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == "SIGUSR1" and stop.agreed()
    assert signal.getsignal(signal.SIGUSR1) is previous
    caught = []
    thread = threading.Thread(target=lambda: caught.append(StopSignals("SIGTERM").__enter__()._previous))
    thread.start()
    thread.join()
    assert caught == [{}]  # Python catches signals in the main thread only: elsewhere nothing is installed
    with pytest.raises(ConfigError, match=r"train.stop_signals='SIGTERM,SIGKIL' is invalid; expected comma-separated"):
        load_config(None, tiny_overrides(tiny_imagefolder, tmp_path, "train.stop_signals=SIGTERM,SIGKIL"))


def test_an_images_augmentation_is_a_function_of_seed_epoch_and_index_only():
    # Whatever the global generator's state, the worker or the order images are asked for in.
    data = ImageData(torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8), torch.arange(4), ["a", "b", "c", "d"])
    ds = TensorImageDataset(data, train_transform((16, 16), crop_padding=4, augment="randaugment"), seed=5)
    ds.set_epoch(2)
    first = [ds[i][0] for i in range(4)]
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    assert all(torch.equal(ds[i][0], first[i]) for i in reversed(range(4)))
    assert torch.equal(torch.rand(3), expected)  # the caller's generator (dropout's) is left as it was
    ds.set_epoch(3)
    assert not any(torch.equal(ds[i][0], first[i]) for i in range(4))  # a new epoch, new draws
