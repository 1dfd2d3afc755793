"""Runs that survive a cluster: stop on a signal, checkpoints inside an epoch, the same command resumes,
an elastic restart after a killed worker. Each is compared with the uninterrupted run, bit for bit (CPU)."""
from __future__ import annotations

import json
import re
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

from conftest import launch_env, reset_accelerate, run_two, same_run_records, signal_at_step, tiny_overrides, \
    torchrun_worker, train_until_signal
from vitlab import checkpoint as ckpt
from vitlab.config import load_config
from vitlab.data.images import ImageData, TensorImageDataset
from vitlab.data.transforms import train_transform
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


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["torch", "gpu", "gpu-rrc", "torch-streamed"])
def test_a_signal_inside_an_epoch_checkpoints_there_and_the_same_command_ends_bit_identical(
        tiny_imagefolder, tmp_path, monkeypatch, on_cpu, loader):
    # torch-streamed: each image decoded by a DataLoader worker when read; the resumed epoch's sampler
    # skips the batches before the checkpoint without decoding them. gpu-rrc: the device loader's random resized
    # crops of images kept larger than the model's input.
    extra = (*RANDOM, f"data.loader={loader.split('-')[0]}",
             *(("data.in_memory=false", "data.num_workers=2") if loader.endswith("streamed") else ()),
             *(("data.train_crop=rrc", "data.decode_size=40", "data.scale=[0.3,1.0]") if loader.endswith("rrc")
               else ()))
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


@pytest.mark.parametrize("optim", [("optim.opt=sgd", "optim.lr=0.05"), ("optim.opt=lamb",),
                                   ("optim.schedule=plateau", "optim.patience_epochs=0", "optim.decay_rate=0.5",
                                    "data.val_size=24", "train.epochs=5")],
                         ids=["sgd", "lamb", "plateau"])
def test_timms_optimizers_and_the_plateau_schedule_resume_bit_identical_after_a_signal(
        tiny_imagefolder, tmp_path, monkeypatch, on_cpu, optim):
    # The optimizer's state (SGD's momentum, LAMB's moments) and the schedule's (the plateau's best metric and
    # its count of evaluations without a better one, the rates it lowered) survive the stop, exactly.
    extra = (*RANDOM, *optim)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(load_config(None, tiny_overrides(tiny_imagefolder, whole, *extra)))
    reset_accelerate()
    plateau = "optim.schedule=plateau" in optim  # 5 epochs of 4 steps: stopped in the 4th; else 2 of 6
    train_until_signal(monkeypatch, load_config(None, tiny_overrides(tiny_imagefolder, parts, *extra)),
                       14 if plateau else 9)
    reset_accelerate()
    summary = train(load_config(None, tiny_overrides(tiny_imagefolder, parts, *extra)))
    assert summary["epochs_done"] == (5 if plateau else 2)
    for name in ("model.safetensors", "ema.safetensors"):
        assert _equal(_weights(whole, name), _weights(parts, name)), name
    assert same_run_records(whole, parts)
    if plateau:  # the EMA's validation top-1 reaches 1 at epoch 2: no better at 3 and at 4, the rate halves after
        # each (an epoch's record holds the rate it trained at); after 4 it would not, were the plateau's best lost
        rates = [r["lr"] for r in map(json.loads, (whole / "metrics.jsonl").read_text().splitlines())
                 if r["split"] == "eval"]
        assert rates == pytest.approx([3e-3, 3e-3, 3e-3, 1.5e-3, 7.5e-4]), rates


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

    from vitlab.tasks.classification import task as classification

    def no_data(*args, **kwargs):
        raise AssertionError("data was read before the config was checked")

    monkeypatch.setattr(classification, "index_splits", no_data)
    other = load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=1", "model.embed_dim=64"))
    with pytest.raises(ConfigError) as e:
        train(other)
    message = str(e.value)
    assert "\n" not in message and "holds a run with another config (model.embed_dim: 32 there, 64 now)" in message
    assert f"--resume {run_dir}" in message
    with pytest.raises(ConfigError, match="already holds a run and train.resume=no"):
        train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=1", "train.resume=no")))


def _die_at_step(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """The process dies (kill -9, a node failure) as optimizer step ``step`` begins: nothing more is written."""
    from vitlab import training

    original = training.Loop.step

    def step_or_die(self, group):
        if self.state["global_step"] + 1 == step:
            raise KeyboardInterrupt  # not an Exception: nothing in the loop handles it
        original(self, group)

    monkeypatch.setattr(training.Loop, "step", step_or_die)


def test_a_step_checkpoint_due_on_an_epochs_last_step_is_written_whatever_save_every_is(
        tiny_imagefolder, tmp_path, monkeypatch):
    # 6 steps an epoch: save_every_steps=6 falls on epoch ends, which save_every=3 alone would skip.
    run_dir = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=3", "train.save_every_steps=6",
                                           "train.save_every=3"))
    with monkeypatch.context() as m:
        _die_at_step(m, 9)
        with pytest.raises(KeyboardInterrupt):
            train(cfg)
    assert _state(run_dir)["global_step"] == 6


@pytest.mark.slow
def test_resume_auto_continues_from_best_when_last_was_never_written_and_refuses_another_config(
        tiny_imagefolder, tmp_path, monkeypatch, capsys, on_cpu):
    # save_every=3 with a validation split: the run dies in epoch 2 with best/ (epoch 1) and no last/.
    extra = ("train.epochs=3", "train.save_every=3", "data.val_size=12", *RANDOM[1:])
    run_dir, whole = tmp_path / "run", tmp_path / "whole"
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, run_dir, *extra))
    with monkeypatch.context() as m:
        _die_at_step(m, 8)
        with pytest.raises(KeyboardInterrupt):
            train(cfg)
    reset_accelerate()
    assert not (run_dir / "checkpoints/last").exists() and _state(run_dir, "best")["epoch"] == 1
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and "tensorboard" not in p.parts}
    other = load_config(None, tiny_overrides(tiny_imagefolder, run_dir, *extra, "optim.lr=1e-3"))
    with pytest.raises(ConfigError, match=r"holds a run with another config \(optim.lr: 0.003 there, 0.001 now\)"):
        train(other)
    reset_accelerate()
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and "tensorboard" not in p.parts} == before
    assert train(cfg)["epochs_done"] == 3  # the same command: from best/, the newest checkpoint
    assert "resumed at epoch 2, step 0" in capsys.readouterr().out
    reset_accelerate()
    train(load_config(None, tiny_overrides(tiny_imagefolder, whole, *extra)))
    for name in ("model.safetensors", "ema.safetensors"):
        assert _equal(_weights(whole, name), _weights(run_dir, name)), name
    assert same_run_records(whole, run_dir)


def test_a_run_that_died_before_its_first_checkpoint_is_not_reused_by_another_config(tiny_imagefolder, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    from vitlab.config import save_config

    # What a run that died in its first epoch leaves: its config.yaml (written first) and a log.
    save_config(load_config(None, tiny_overrides(tiny_imagefolder, run_dir)), run_dir / "config.yaml")
    (run_dir / "metrics.jsonl").write_text('{"split": "train", "epoch": 1, "step": 2, "loss": 9.0, "lr": 0.1}\n')
    with pytest.raises(ConfigError, match=r"holds a run with another config \(optim.lr: 0.003 there, 0.001 now\)"):
        train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "optim.lr=1e-3")))
    assert '"loss": 9.0' in (run_dir / "metrics.jsonl").read_text()


def test_resume_auto_continues_across_keys_that_do_not_change_the_result_and_says_which(
        tiny_imagefolder, tmp_path, monkeypatch, capsys, on_cpu):
    run_dir, whole = tmp_path / "run", tmp_path / "whole"
    with monkeypatch.context() as m:
        signal_at_step(m, 4)
        with pytest.raises(Preempted):
            train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, *RANDOM)))
    reset_accelerate()
    changed = ("train.log_with=none", "train.stop_signals=SIGTERM,SIGUSR1", "data.num_workers=1",
               "train.log_every=3", "train.keep_last=1")
    train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, *RANDOM, *changed)))
    out = capsys.readouterr().out
    assert "resumed at epoch 1, step 4" in out
    assert ("continuing with keys that do not change the result changed: data.num_workers 0 -> 1, train.keep_last "
            "0 -> 1, train.log_every 2 -> 3, train.log_with tensorboard -> none, train.stop_signals SIGTERM -> "
            "SIGTERM,SIGUSR1") in out
    reset_accelerate()
    train(load_config(None, tiny_overrides(tiny_imagefolder, whole, *RANDOM)))
    assert _equal(_weights(whole), _weights(run_dir))


def test_data_in_memory_is_continued_across_only_where_it_does_not_change_the_pixels(tiny_imagefolder, tmp_path):
    # ImageNet-style crops of files: in memory they are stored at the model's size first, streamed they
    # are cropped at their own sizes; a run is not continued across that. With decode_size both store alike.
    rrc = ("train.epochs=1", "data.loader=torch", "data.train_crop=rrc")
    train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "rrc", *rrc, "data.in_memory=false")))
    reset_accelerate()
    with pytest.raises(ConfigError, match=r"holds a run with another config \(data.in_memory: False there, True now\);"):
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "rrc", *rrc, "data.in_memory=true")))
    reset_accelerate()
    sized = (*rrc, "data.decode_size=32")
    train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "sized", *sized, "data.in_memory=false")))
    reset_accelerate()
    summary = train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "sized", *sized,
                                                     "data.in_memory=true")))
    assert summary["epochs_done"] == 1  # continued: the finished run, nothing more to train
    reset_accelerate()
    # whether the finished run draws curves.png changes no number either
    summary = train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "sized", *sized,
                                                     "data.in_memory=true", "train.curves=true")))
    assert summary["epochs_done"] == 1


def test_resume_from_a_step_checkpoint_continues_its_run_in_the_run_directory(tiny_imagefolder, tmp_path, on_cpu):
    from vitlab.cli import train_main

    run_dir = tmp_path / "run"
    train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.save_every_steps=4", "train.keep_last=3")))
    reset_accelerate()
    step_8 = run_dir / "checkpoints" / "step_8"
    assert _state(run_dir, "step_8")["global_step"] == 8
    (run_dir / "checkpoints" / "last").rename(run_dir / "checkpoints" / "last_of_the_first_run")
    train_main(["--resume", str(step_8)])  # from step 8, to the end of its run
    reset_accelerate()
    assert not (step_8 / "metrics.jsonl").exists() and not (step_8 / "checkpoints").exists()
    assert _state(run_dir)["global_step"] == 12
    assert _equal(_weights(run_dir), _weights(run_dir, which="last_of_the_first_run"))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "last", "last_of_the_first_run", "step_12", "step_6", "step_8"]  # keep_last=3 of 4, 6 (epoch), 8, 12


def test_a_resumed_run_continues_its_mlflow_run(tiny_imagefolder, tmp_path, monkeypatch, on_cpu):
    mlflow = pytest.importorskip("mlflow", reason="mlflow not installed")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "my_run"
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.log_with=mlflow", "train.log_every=1"))
    with monkeypatch.context() as m:
        signal_at_step(m, 5)
        with pytest.raises(Preempted):
            train(cfg)
    reset_accelerate()
    train(cfg)
    client = mlflow.tracking.MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("my_run").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(1, 13))
    assert _state(run_dir)["trackers"] == {"mlflow": run.info.run_id}


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


def test_a_worker_torchrun_may_restart_through_the_shared_store_names_the_launch_that_restarts(
        tiny_imagefolder, tmp_path, monkeypatch, capsys):
    # What torchrun --max-restarts 2 --master_port ... (static rendezvous) sets in each worker.
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "run", "train.epochs=1")))
    out = capsys.readouterr().out
    assert ("torchrun --max-restarts 2 shares its agent's rendezvous store with the workers, and restarted workers "
            "may then fail to reconnect; launch as TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone") in out
    # What --standalone with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 sets: nothing to say.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    from vitlab.preemption import elastic_restart_advice

    assert elastic_restart_advice() == ""


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


@pytest.mark.parametrize("loader", ["torch", "gpu"])
def test_every_process_augments_each_image_anew_every_epoch(loader):
    # Process `rank` of 2, built as Accelerate builds it: its DataLoaderShard.set_epoch leaves the
    # dataset's epoch alone when the sampler is sharded (any run of several processes), and the epoch
    # seeds each image's augmentation. Labels are the images' numbers here.
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from vitlab.data.images import DeviceImageLoader
    from vitlab.training import set_epoch

    # Crops, flips and RandAugment: two independent draws of an image coincide with odds of about 1 in 10^4.
    data = ImageData(torch.randint(0, 256, (64, 3, 16, 16), dtype=torch.uint8), torch.arange(64), list("ab"))
    for rank in (0, 1):
        if loader == "torch":
            dataset = TensorImageDataset(data, train_transform((16, 16), augment="randaugment"), seed=0)
            batches = prepare_data_loader(DataLoader(dataset, batch_size=8, shuffle=True, drop_last=True),
                                          num_processes=2, process_index=rank, split_batches=True,
                                          put_on_device=False, use_seedable_sampler=True, data_seed=0)
        else:
            batches = DeviceImageLoader(data, 8, "cpu", augment="randaugment", num_processes=2, process_index=rank)
        seen: dict[int, list[torch.Tensor]] = {}
        for epoch in (1, 2):
            set_epoch(batches, epoch)
            for images, labels in batches:
                for image, label in zip(images, labels.tolist()):
                    seen.setdefault(label, []).append(image)
        twice = [views for views in seen.values() if len(views) == 2]
        assert len(twice) >= 10  # images this process drew in both epochs
        assert not any(torch.equal(*views) for views in twice), f"process {rank}"


class _WithWorkerPid(torch.utils.data.Dataset):
    """A dataset's samples with the pid of the process that made them."""

    def __init__(self, dataset: TensorImageDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return (*self.dataset[i], os.getpid())


def test_dataloader_workers_live_across_epochs_and_augment_each_epoch_anew(tiny_imagefolder, tmp_path):
    # Forking new workers every epoch from a process with live threads (gloo's, the last iterator's queue
    # feeders) hung a 2-process run inside os.fork(). The workers now live for the run and read each epoch
    # from shared memory: the same workers every epoch, each epoch's draws those of a loader without
    # workers, and new draws every epoch.
    from torch.utils.data import DataLoader

    from vitlab.training import Loop

    data = ImageData(torch.randint(0, 256, (32, 3, 16, 16), dtype=torch.uint8), torch.arange(32), list("ab"))
    dataset = TensorImageDataset(data, train_transform((16, 16), augment="randaugment"), seed=0)
    loaders = {w: DataLoader(_WithWorkerPid(dataset), batch_size=8, num_workers=w, persistent_workers=w > 0)
               for w in (0, 2)}
    images: dict[tuple[int, int], list[torch.Tensor]] = {}
    pids: dict[int, set[int]] = {}
    for epoch in (1, 2, 3):
        for workers, loader in loaders.items():
            loader.dataset.set_epoch(epoch)
            batches = list(loader)
            images[epoch, workers] = [x for b in batches for x in b[0]]
            if workers:
                pids[epoch] = {int(pid) for b in batches for pid in b[2]}
        assert all(torch.equal(a, b) for a, b in zip(images[epoch, 0], images[epoch, 2]))
    assert len(pids[1]) == 2 and pids[1] == pids[2] == pids[3] and os.getpid() not in pids[1]
    assert not any(torch.equal(a, b) for a, b in zip(images[1, 2], images[2, 2]))
    # Training builds its DataLoaders so.
    loop = Loop(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "run", "data.num_workers=2",
                                                  "data.loader=torch")), tmp_path / "run", None)
    assert loop.train_loader.persistent_workers and all(v.persistent_workers for v in loop.eval_loaders.values())


# Two processes (gloo), launched as a user would. The signal and the kill come from outside, at a time
# the test does not choose exactly: what is checked holds wherever they land.
TWO = (*RANDOM, "train.epochs=3", "train.save_every_steps=2")  # 18 steps


def _launch(run_dir: Path, data: Path, *torchrun: str) -> subprocess.Popen:
    # A fresh store for each restart: in the agent's shared one, restarted gloo workers could read their
    # peers' addresses from the attempt before and fail to connect (2 restarts in 7 here, torch 2.14).
    env = {**launch_env(2, exact=True), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                             *torchrun, str(ROOT / "train.py"), "--config", str(ROOT / "configs/cifar10_cpu_quick.yaml"),
                             *tiny_overrides(data, run_dir, *TWO)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for(condition, launcher: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def _finish(launcher: subprocess.Popen) -> tuple[int, str, str]:
    out, err = launcher.communicate(timeout=300)
    return launcher.returncode, out, err


@pytest.fixture(scope="module")
def two_process_whole(tiny_imagefolder, tmp_path_factory) -> Path:
    """The same two-process run uninterrupted: the reference, in 2 processes forked as torchrun starts its workers
    (:func:`run_two`; the launcher's own behaviour is the test's subject, not the reference's)."""
    run_dir = tmp_path_factory.mktemp("two") / "whole"
    launched = run_two([str(ROOT / "train.py"), "--config", str(ROOT / "configs/cifar10_cpu_quick.yaml"),
                        *tiny_overrides(tiny_imagefolder, run_dir, *TWO)], launch_env(2, exact=True))
    assert launched.returncode == 0, launched.stderr[-3000:]
    return run_dir


@pytest.mark.multiprocess
def test_sigterm_to_one_of_two_processes_stops_both_and_the_same_command_ends_bit_identical_through_a_killed_worker(
        two_process_whole, tiny_imagefolder, tmp_path):
    run_dir = tmp_path / "run"
    launcher = _launch(run_dir, tiny_imagefolder)
    metrics = run_dir / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and '"split": "train"' in metrics.read_text(), launcher)
    os.kill(torchrun_worker(launcher, 1), signal.SIGTERM)  # only process 1 hears it: the all-reduce tells process 0
    code, out, err = _finish(launcher)
    assert code != 0 and err.count("exitcode  : 75") + err.count("exitcode: 75") >= 1, err[-3000:]
    assert "stopped by a signal to another process after step" in out  # process 0 prints
    state = _state(run_dir)
    assert 0 < state["global_step"] < 18 and (run_dir / "checkpoints/last/process_1.json").is_file() == bool(
        state["epoch_step"])
    # The same command continues it, here under torchrun --max-restarts 1 (one launch for both checks: each costs
    # two processes' imports): a worker killed (kill -9) after a newer step checkpoint is restarted by torchrun
    # with its peer, and they resume from that checkpoint by themselves.
    launcher = _launch(run_dir, tiny_imagefolder, "--max-restarts", "1", "--monitor-interval", "0.2")
    last = run_dir / "checkpoints" / "last" / "trainer_state.json"
    _wait_for(lambda: (lambda saved: saved["global_step"] > state["global_step"] and saved["epoch_step"] > 0)(
        ckpt.read_json(last)), launcher)
    os.kill(torchrun_worker(launcher, 1), signal.SIGKILL)
    code, out, err = _finish(launcher)
    assert code == 0, err[-3000:]
    assert f"resumed at epoch {state['epoch'] + 1}, step {state['epoch_step']}" in out
    assert out.count("resumed at epoch") == 2  # and once more, by the restarted workers, from the newer checkpoint
    for name in ("model.safetensors", "ema.safetensors"):
        assert _equal(_weights(two_process_whole, name), _weights(run_dir, name)), name
    assert same_run_records(two_process_whole, run_dir)


def test_a_run_ends_its_dataloader_workers_however_it_ends(tiny_imagefolder, tmp_path, monkeypatch, on_cpu):
    # Stopped inside an epoch, a run's loaders sat in a reference cycle; the garbage collector's torch shutdown
    # then waited 5 s for each of their 4 workers, in whatever ran next in the process (a notebook cell, a test).
    import gc
    import multiprocessing
    import time

    keys = ("data.in_memory=false", "data.num_workers=2", "train.log_with=none")
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "run", *keys))
    train_until_signal(monkeypatch, cfg, 4)
    assert multiprocessing.active_children() == []
    started = time.perf_counter()
    gc.collect()
    assert time.perf_counter() - started < 2.5
    train(cfg)  # resumed to its end: the same
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_with_dataloader_workers_still_checkpoints_and_exits_75(
        tiny_imagefolder, tmp_path):
    # SLURM signals every process of a job step, a terminal's Ctrl-C the whole group: the DataLoader's
    # workers get the signal too. They must leave the stop to the main process, not die under it.
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/cifar10_cpu_quick.yaml"),
         *tiny_overrides(tiny_imagefolder, run_dir, "data.loader=torch", "data.num_workers=2", "train.epochs=50")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and '"split": "train"' in metrics.read_text(), process)
    os.killpg(process.pid, signal.SIGTERM)
    code, out, err = _finish(process)
    assert code == 75, err[-3000:]
    assert "stopped by SIGTERM after step" in out and _state(run_dir)["global_step"] > 0


def test_persistent_workers_train_the_weights_of_a_run_without_workers(tiny_imagefolder, tmp_path, on_cpu):
    # Workers that live across epochs must not change what a run draws (crops, flips, mixup, drop path) from
    # epoch 2 on: data.num_workers is result-neutral (train.resume=auto continues across it).
    weights = {}
    for workers in (0, 2):
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / str(workers), "data.loader=torch",
                                               f"data.num_workers={workers}", "train.epochs=3", *RANDOM[1:])))
        reset_accelerate()
        weights[workers] = load_file(str(tmp_path / str(workers) / "checkpoints/last/model.safetensors"))
    assert all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])


def test_resume_with_other_optimizer_settings_runs_with_them_and_records_what_ran(tiny_imagefolder, tmp_path):
    from vitlab.cli import train_main

    run_dir = tmp_path / "run"
    train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=1")))
    reset_accelerate()
    train_main(["--resume", str(run_dir), "train.epochs=2", "optim.weight_decay=0.5", "optim.betas=[0.8,0.9]",
                "optim.eps=1e-6"])
    groups = json.loads((run_dir / "checkpoints/last/optimizer.json").read_text())["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]  # the decayed group and norms, biases, tokens
    assert all(g["betas"] == [0.8, 0.9] and g["eps"] == 1e-6 for g in groups)
    recorded = load_config(run_dir / "checkpoints/last/run_config.yaml", recorded=True).optim
    assert (recorded.weight_decay, list(recorded.betas), recorded.eps) == (0.5, [0.8, 0.9], 1e-6)


@pytest.mark.parametrize("change, said", [
    ("optim.opt=sgd", r"optim.opt 'adamw' -> 'sgd'"),
    ("optim.opt=adafactor", r"optim.opt 'adamw' -> 'adafactor'"),
    ("train.best_metric=val_top1", r"train.best_metric 'val_loss' -> 'val_top1'"),
])
def test_resume_that_changes_the_optimizer_or_the_best_metric_is_one_line(tiny_imagefolder, tmp_path, capsys, change,
                                                                          said):
    # SGD would read AdamW's state for its momentum (KeyError), and best/ would compare a top-1 with a loss
    from vitlab.cli import train_main

    run_dir = tmp_path / "run"
    train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=1", "data.val_size=6",
                                           "train.best_metric=val_loss")))
    reset_accelerate()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        train_main(["--resume", str(run_dir), "train.epochs=2", change])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1
    assert re.search(rf"^error: --resume {re.escape(str(run_dir))}: {said}: a run continues with the task, the "
                     rf"optimizer and the validation metric it began with .* model.pretrained={re.escape(str(run_dir))}$",
                     err.strip())


def test_resume_with_another_architecture_is_one_line_before_any_image_is_decoded(tiny_imagefolder, tmp_path, capsys,
                                                                                  monkeypatch):
    from vitlab.cli import train_main
    from vitlab.data.split import SplitIndex

    run_dir = tmp_path / "run"
    train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=1")))
    reset_accelerate()
    monkeypatch.setattr(SplitIndex, "decode", lambda *a, **k: pytest.fail("an image was decoded"))
    for change, said in (("model.img_size=64", "model.img_size None -> 64"), ("model.depth=2", "model.depth 1 -> 2")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            train_main(["--resume", str(run_dir), "train.epochs=2", change])
        err = capsys.readouterr().err.strip()
        assert exited.value.code == 2 and len(err.splitlines()) == 1
        assert err == (f"error: --resume {run_dir}: {said}: the checkpoint holds the weights of the model the run "
                       f"began with; keep its model.* keys, or start a new run from its weights: "
                       f"model.pretrained={run_dir}")
