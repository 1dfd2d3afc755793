"""Elastic runs: a run stopped by SIGTERM inside epoch 2 continues, by the same command, on other numbers
of processes and DataLoader workers (2 -> 1 workers; 2 processes x 2 workers -> 1 x 1), for shards and
for a folder, and trains on the samples of the uninterrupted run, step by step, augmented alike; its
weights are the uninterrupted run's bit for bit on as many processes, and within the float order of the
gradient reduction on fewer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import launch_env, max_weight_diff, reset_accelerate, run_two, tiny_overrides, train_until_signal
from helpers.batch_record import global_batches, recording
from vitlab.config import load_config
from vitlab.data.transforms import ModelInput
from vitlab.errors import ConfigError
from vitlab.training import train

ROOT = Path(__file__).resolve().parents[1]
HELPER = ROOT / "tests" / "helpers" / "dist_train.py"
# Random where the data decides it (crops, flips, RandAugment, the order), none in the model: dropout,
# drop path and mixup draw from each process's generator (docs/clusters.md).
RUN = ("data.augment=randaugment", "train.ema_decay=0.9", "data.loader=torch", "train.log_every=1")
PARTITIONS = {"shards": ("data.partitions=4",), "folder": (), "repeats": ()}  # a folder's order needs none
SOURCES = {"shards": lambda shards, folder: ("data.dataset=wds", f"data.root={shards}"),
           "folder": lambda shards, folder: (f"data.root={folder}", "data.in_memory=false"),
           # repeated augmentation: its sampler orders the global batch, which Accelerate cuts per process
           "repeats": lambda shards, folder: (f"data.root={folder}", "data.in_memory=false", "data.aug_repeats=3")}


@pytest.fixture(scope="module")
def tiny_shards(tiny_imagefolder, tmp_path_factory) -> Path:
    pytest.importorskip("webdataset")
    from vitlab.cli import main

    out = tmp_path_factory.mktemp("shards")
    main(["shards", str(tiny_imagefolder), str(out), "--shard-size", "14"])
    return out


def _overrides(source: str, data: tuple[Path, Path], run_dir: Path, *extra: str) -> list[str]:
    return tiny_overrides(data[1], run_dir, *RUN, *SOURCES[source](*data), *extra)


@pytest.fixture(scope="module")
def uninterrupted(tiny_imagefolder, tiny_shards, tmp_path_factory) -> dict[str, tuple[Path, list[list[str]]]]:
    """Each source's run whole, on 1 process without workers (4 partitions for the shards), and the
    digests of its global batches."""
    runs = {}
    for source in SOURCES:
        run_dir = tmp_path_factory.mktemp("whole") / source
        prefix = run_dir.parent / "batches"
        with pytest.MonkeyPatch.context() as m:
            m.setenv("ACCELERATE_USE_CPU", "true")
            m.setattr(ModelInput, "__call__", recording(prefix))
            train(load_config(None, _overrides(source, (tiny_shards, tiny_imagefolder), run_dir, "data.num_workers=0",
                                               *PARTITIONS[source])))
        reset_accelerate()
        runs[source] = run_dir, global_batches(prefix)
    return runs


def _weights(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {name: load_file(str(run_dir / "checkpoints/last" / name)) for name in ("model.safetensors",
                                                                                  "ema.safetensors")}


@pytest.mark.slow
@pytest.mark.parametrize("source", ["shards", "folder"])
def test_two_workers_stopped_in_epoch_two_continue_on_one_with_the_same_batches_bit_for_bit(
        source, uninterrupted, tiny_imagefolder, tiny_shards, tmp_path, monkeypatch, on_cpu):
    whole, expected = uninterrupted[source]
    run_dir, prefix = tmp_path / "run", tmp_path / "batches"
    monkeypatch.setattr(ModelInput, "__call__", recording(prefix))
    extra = PARTITIONS[source]
    train_until_signal(monkeypatch, load_config(None, _overrides(source, (tiny_shards, tiny_imagefolder), run_dir,
                                                                 "data.num_workers=2", *extra)), 8)  # 6 steps an epoch
    train(load_config(None, _overrides(source, (tiny_shards, tiny_imagefolder), run_dir, "data.num_workers=1",
                                       *extra)))
    assert global_batches(prefix) == expected  # 8 steps on 2 workers, 4 on 1: the whole run's 12
    for name, tensors in _weights(run_dir).items():
        reference = _weights(whole)[name]
        assert all(torch.equal(tensors[k], reference[k]) for k in tensors), name


@pytest.fixture(scope="module")
def stopped_on_two(tiny_imagefolder, tiny_shards, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Each source's run on 2 processes x 2 workers, SIGTERM to rank 1 alone as step 8 begins (6 steps an epoch:
    a step the test chooses, however busy the machine; a signal sent from here after the 7th step's record came
    after the 12th under load): the three runs one after the other in one launch of 2 processes (forked: each
    start of a process costs 3.5 s of imports). Each source's run directory and the prefix of its batch records."""
    root = tmp_path_factory.mktemp("stopped_on_two")
    argv, where = [], {}
    for source in SOURCES:
        run_dir, prefix = root / source / "run", root / source / "batches"
        where[source] = run_dir, prefix
        argv += [*(["--then"] if argv else []), "--sigterm-at-step", "1", "8", "--record-batches", str(prefix),
                 *_overrides(source, (tiny_shards, tiny_imagefolder), run_dir), "data.num_workers=2"]
    done = run_two([str(HELPER), *argv], launch_env(2, exact=True))
    assert done.returncode == 75, done.stderr[-3000:]  # stopped by the signal, as every run
    return where


@pytest.mark.multiprocess
@pytest.mark.parametrize("source", list(SOURCES))
def test_two_processes_by_two_workers_stopped_in_epoch_two_continue_on_one_by_one_with_the_same_batches(
        source, uninterrupted, stopped_on_two, tiny_imagefolder, tiny_shards, monkeypatch, capsys, on_cpu):
    # The shards' partitions are left to the first launch (2 x 2 = 4) and kept in the checkpoint: the
    # continued run on 1 x 1 reads the same 4.
    whole, expected = uninterrupted[source]
    run_dir, prefix = stopped_on_two[source]
    state = json.loads((run_dir / "checkpoints/last/trainer_state.json").read_text())
    assert state["global_step"] == 8 and state["epoch_step"] == 2, state  # stopped inside epoch 2
    assert state.get("data", {}).get("partitions") == (4 if source == "shards" else None)
    stopped = global_batches(prefix)
    for f in prefix.parent.glob("batches.*.jsonl"):
        f.unlink()
    # The same command, on 1 process x 1 worker (here, in this process: a process fewer to start).
    monkeypatch.setattr(ModelInput, "__call__", recording(prefix))
    capsys.readouterr()
    train(load_config(None, [*_overrides(source, (tiny_shards, tiny_imagefolder), run_dir), "data.num_workers=1"]))
    out = capsys.readouterr().out
    assert f"resumed at epoch 2, step {state['epoch_step']}" in out
    assert "continuing with keys that do not change the result changed: data.num_workers 2 -> 1" in out
    assert "the checkpoint was written by 2 processes, not 1: the rest of epoch 2 reads the samples the run would have " \
           "read, augmented alike" in out
    assert stopped + global_batches(prefix) == expected  # every step's samples, augmented alike, in order
    for name, tensors in _weights(run_dir).items():
        assert max_weight_diff(tensors, _weights(whole)[name]) < 1e-5, name


def test_a_change_of_the_samples_inside_an_epoch_is_refused_in_one_line_and_allowed_at_its_end(
        tiny_imagefolder, tmp_path, monkeypatch, on_cpu):
    # --resume RUN key=value changes a run on purpose; another global batch from a checkpoint inside an
    # epoch would continue that epoch on other samples than it began with: refused, naming the key.
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=3")
    train_until_signal(monkeypatch, load_config(None, overrides), 8)  # epoch 2, step 2
    with pytest.raises(ConfigError) as e:
        train(load_config(None, [*overrides, "train.batch_size=8"]), resume=run_dir)
    assert str(e.value) == (f"--resume {run_dir}/checkpoints/last: train.batch_size 16 -> 8 inside epoch 2 (the "
                            f"checkpoint is at its step 2) would continue that epoch on other samples than it began "
                            f"with; finish epoch 2 as it was (--resume {run_dir}/checkpoints/last train.epochs=2), "
                            f"then change it")
    reset_accelerate()
    train(load_config(None, [*overrides, "train.epochs=2"]), resume=run_dir)  # as the line says
    reset_accelerate()
    summary = train(load_config(None, [*overrides, "train.batch_size=8"]), resume=run_dir)
    assert summary["epochs_done"] == 3
