"""The training loop end to end on small generated data: learning, checkpoints, resume, errors, CLI."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vitlab
import vitlab.training.budget as budget
from conftest import launch_env, max_weight_diff, reset_accelerate, run_two, tiny_overrides
from vitlab import checkpoint as ckpt
from vitlab.cli import main
from vitlab.config import load_config
from vitlab.errors import CheckpointError, ConfigError, TrainingError
from vitlab.training import train

ROOT = Path(__file__).resolve().parents[1]


def _weights(run_dir: Path, which: str = "last", name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / which / name))


@pytest.fixture(scope="module")
def trained_run(tiny_imagefolder, tmp_path_factory) -> tuple[Path, dict]:
    """3 epochs with 15 of the 96 training images held out for validation (best/ is chosen on them)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    summary = train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=3", "data.val_size=15",
                                                     "train.curves=true")))
    reset_accelerate()
    return run_dir, summary


def _evals(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["split"] == "eval"]


def test_training_learns_and_writes_the_run_directory(trained_run):
    run_dir, summary = trained_run
    assert summary["epochs_done"] == 3
    assert summary["test_top1"] >= 0.9  # colour classes: learnable in a few steps
    evals = _evals(run_dir)
    for name in ("config.yaml", "metrics.jsonl", "curves.png"):
        assert (run_dir / name).is_file(), name
    from PIL import Image

    assert Image.open(run_dir / "curves.png").size == (1500, 400)  # three panels, 15 x 4 inches at 100 dpi
    assert any((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in evals] == [1, 2, 3]
    trains = [r for r in records if r["split"] == "train"]
    assert trains[-1]["loss"] < trains[0]["loss"]
    for which in ("best", "last"):
        files = {p.name for p in (run_dir / "checkpoints" / which).iterdir()}
        assert {"model.safetensors", "config.json", "optimizer.safetensors", "optimizer.json",
                "trainer_state.json", "run_config.yaml"} <= files
    # best/ is the epoch with the highest validation top-1 (the first of equals), never chosen on test.
    val = [r["val_top1"] for r in evals]
    assert summary["best_metric"] == max(val) and summary["best_epoch"] == val.index(max(val)) + 1
    assert ckpt.read_json(run_dir / "checkpoints/best/trainer_state.json")["epoch"] == summary["best_epoch"]
    assert not list((run_dir / "checkpoints").glob("*.pt*")) and not list(run_dir.rglob("*.bin"))


def test_without_a_validation_split_no_best_is_kept_and_the_run_means_its_last_epoch(tiny_imagefolder, tmp_path,
                                                                                     capsys):
    run_dir = tmp_path / "run"
    summary = train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.eval_every=0")))
    assert summary["best_metric"] is None and summary["best_epoch"] is None
    assert not (run_dir / "checkpoints" / "best").exists()
    assert ckpt.resolve_checkpoint(run_dir) == run_dir / "checkpoints" / "last"
    evals = _evals(run_dir)
    assert summary["test_top1"] == evals[-1]["test_top1"]  # the figure is the final epoch's
    # eval_every=0: nothing to select, so the test set is evaluated once, after the last epoch.
    assert [r["epoch"] for r in evals if "test_top1" in r] == [2] and "eval_time" not in evals[0]
    assert 0 < evals[0]["data_time"] < evals[0]["epoch_time"]
    # An epoch without evaluation still prints its line, with the epoch's mean training loss: the mean
    # of the logged losses (6 steps, logged every 2, so three equal-sized windows).
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r["loss"] for r in records if r["split"] == "train" and r["epoch"] == 1]
    assert len(logged) == 3 and evals[0]["train_loss"] == pytest.approx(sum(logged) / 3, rel=1e-6)
    assert f"epoch 1: train_loss {evals[0]['train_loss']:.4f} | " in capsys.readouterr().out


def test_load_model_and_its_transform_reproduce_the_reported_accuracy(trained_run, tiny_imagefolder):
    from PIL import Image

    run_dir, summary = trained_run
    model = vitlab.load_model(run_dir)
    assert not model.training and model.pretrained_cfg["label_names"] == ["class_0", "class_1", "class_2"]
    transform = vitlab.create_transform(model)
    files = sorted((tiny_imagefolder / "test").rglob("*.png"))
    batch = torch.stack([transform(Image.open(f)) for f in files])
    labels = torch.tensor([int(f.parent.name[-1]) for f in files])
    with torch.no_grad():
        acc = (model(batch).argmax(-1) == labels).float().mean().item()
    best_epoch = _evals(run_dir)[summary["best_epoch"] - 1]
    assert acc == pytest.approx(best_epoch["test_top1"], abs=1e-6)  # run dir -> best/ -> that epoch's weights


# Each variant of the two-process test: no randomness beyond the (shared, seeded) shuffling, so the same
# global batches give the same updates. The device loader shards evaluation itself (35 test images over 2
# processes, gathered unevenly). "moe": a mixture of experts under DDP (balancing loss off: it is computed
# per process). "torch-streamed": each process's images decoded when read, by 2 DataLoader workers (2 x 2).
# "budget": train.budget_minutes, its steps timed on those workers' batches and undone, the processes agreeing on the
# slowest's times (here train.epochs bounds the number).
AGREE = {"torch": ("data.loader=torch",), "gpu": ("data.loader=gpu",),
         "moe": ("data.loader=torch", "model.mlp_layer=moe", "model.num_experts=3", "model.moe_aux_loss_weight=0"),
         "torch-streamed": ("data.loader=torch", "data.in_memory=false", "data.num_workers=2"),
         "budget": ("data.loader=torch", "data.in_memory=false", "data.num_workers=2", "train.budget_minutes=30")}
AGREE_KEYS = ("data.crop_padding=0", "data.hflip=false", "train.epochs=1", "train.label_smoothing=0.0",
              "train.batch_size=24", "data.test_subset=35")  # eval: 6 + 5 batches of 35 images


@pytest.fixture(scope="module")
def mislabelled_run(tiny_imagefolder, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny set with a test split where a third of each class's images are its neighbour's (a model that tells
    the colours apart gets them wrong whatever it learned), and a run of one epoch trained on it: (data, run)."""
    root = tmp_path_factory.mktemp("mislabelled")
    data = root / "data"
    data.mkdir()
    (data / "train").symlink_to(tiny_imagefolder / "train")
    for k in range(3):
        folder = data / "test" / f"class_{k}"
        folder.mkdir(parents=True)
        for i, own in enumerate(sorted((tiny_imagefolder / "test" / f"class_{k}").iterdir())):
            source = own if i < 8 else tiny_imagefolder / "test" / f"class_{(k + 1) % 3}" / own.name
            (folder / own.name).symlink_to(source)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("ACCELERATE_USE_CPU", "true")
        train(load_config(None, tiny_overrides(data, root / "run", "train.epochs=1")))
    reset_accelerate()
    return data, root / "run"


@pytest.fixture(scope="module")
def two_process_launch(tiny_imagefolder, identical_imagefolder, mislabelled_run,
                       tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The file's two-process runs and commands, one after the other in one launch of two processes (started once,
    not once a run): every variant of :data:`AGREE` on the quick config (``<root>/<variant>``), each loader's
    first training batch and random draws (``<root>/draws``), the linear probe (``<root>/probe/run``) and ``vitlab
    eval`` of :func:`mislabelled_run` (``<root>/eval/two.csv`` and ``two.json``)."""
    root, argv = tmp_path_factory.mktemp("two"), []
    for name, extra in AGREE.items():
        argv += [*(["--then"] if argv else []), "--config", str(ROOT / "configs/cifar10_cpu_quick.yaml"),
                 *tiny_overrides(tiny_imagefolder, root / name, *AGREE_KEYS, *extra)]
    for loader in ("torch", "gpu"):
        argv += ["--then", "--record", str(root / "draws" / f"{loader}.draws"), "--stop-after-epoch", "1",
                 *tiny_overrides(identical_imagefolder, root / "draws" / loader, f"data.loader={loader}",
                                 "data.crop_padding=4", "data.hflip=true")]
    (root / "draws").mkdir()
    with pytest.MonkeyPatch.context() as m:  # the linear probe's backbone, trained here on the CPU
        m.setenv("ACCELERATE_USE_CPU", "true")
        train(load_config(None, tiny_overrides(tiny_imagefolder, root / "probe" / "source", "train.epochs=1")))
    reset_accelerate()
    argv += ["--then", *tiny_overrides(tiny_imagefolder, root / "probe" / "run", *PROBE_KEYS,
                                       f"model.pretrained={root / 'probe' / 'source'}")]
    with pytest.MonkeyPatch.context() as m:  # a budget run begun on one process, stopped after its first epoch
        m.setenv("ACCELERATE_USE_CPU", "true")
        m.setattr(budget, "measure", lambda loop: budget.Timing(3.0, 2.0))
        train(load_config(ROOT / "configs/cifar10_cpu_quick.yaml",
                          tiny_overrides(tiny_imagefolder, root / "budget_resumed", *BUDGET_RESUME_KEYS)),
              stop_after_epoch=1)
    reset_accelerate()
    argv += ["--then", "--config", str(ROOT / "configs/cifar10_cpu_quick.yaml"),  # the same command, on two
             *tiny_overrides(tiny_imagefolder, root / "budget_resumed", *BUDGET_RESUME_KEYS)]
    (root / "eval").mkdir()
    argv += ["--then", "vitlab", "eval", "--checkpoint", str(mislabelled_run[1]), "--predictions",
             str(root / "eval" / "two.csv"), "--batch-size", "8", "--output", str(root / "eval" / "two.json")]
    return root, _two_processes(str(HELPER), *argv, exact=True)


# A budget run that binds: 4 steps an epoch of 3 s stood in, an evaluation of 2 s at the end, 60 s: 4 of the 10 epochs.
BUDGET_RESUME_KEYS = (*AGREE_KEYS[:2], *AGREE_KEYS[3:], "data.loader=torch", "train.epochs=10",
                      "train.budget_minutes=1")


@pytest.mark.multiprocess
def test_a_budget_run_continued_on_two_processes_keeps_the_epochs_it_chose_on_one(two_process_launch,
                                                                                  tiny_imagefolder, tmp_path, on_cpu):
    # The number comes from the checkpoint, whatever the processes measure: timed again on 2 processes, the tiny
    # run's real steps would fit all 10 epochs.
    root, launch = two_process_launch
    assert launch.returncode == 0, launch.stderr[-3000:]
    run = root / "budget_resumed"
    assert "train.budget_minutes=1:" not in launch.stdout and f"run dir {run}" in launch.stdout
    assert ckpt.read_json(run / "checkpoints/last/trainer_state.json")["budget_epochs"] == 4
    assert [r["epoch"] for r in _evals(run)] == [1, 2, 3, 4]
    fixed = tmp_path / "fixed"
    keys = [k for k in BUDGET_RESUME_KEYS if not k.startswith(("train.epochs", "train.budget_minutes"))]
    train(load_config(ROOT / "configs/cifar10_cpu_quick.yaml",
                      tiny_overrides(tiny_imagefolder, fixed, *keys, "train.epochs=4")))
    assert max_weight_diff(_weights(fixed), _weights(run)) < 1e-5


# The linear probe on cached features, its L2 strength chosen on 12 validation images (gathered from 2 processes).
PROBE_KEYS = ("model.freeze=backbone", "train.cache_features=true", "data.val_size=12", "data.loader=torch")


@pytest.mark.multiprocess
def test_a_linear_probe_on_two_processes_fits_the_head_one_process_fits(two_process_launch, tiny_imagefolder,
                                                                         tmp_path, on_cpu):
    # Each process reads half of every batch of features; gathered, the fit is the one of all the images.
    root, launch = two_process_launch
    assert launch.returncode == 0, launch.stderr[-3000:]
    one = tmp_path / "one"
    train(load_config(None, tiny_overrides(tiny_imagefolder, one, *PROBE_KEYS,
                                           f"model.pretrained={root / 'probe' / 'source'}")))
    last = lambda run: [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()][-1]
    two = root / "probe" / "run"
    assert last(two)["probe_l2"] == last(one)["probe_l2"]
    assert last(two)["probe_val_top1_by_l2"] == last(one)["probe_val_top1_by_l2"]
    assert last(two)["test_top1"] == last(one)["test_top1"]
    heads = [load_file(str(run / "checkpoints/last/model.safetensors")) for run in (one, two)]
    assert (heads[0]["head.weight"] - heads[1]["head.weight"]).abs().max() < 1e-4


@pytest.fixture(scope="module")
def two_process_runs(two_process_launch) -> tuple[Path, subprocess.CompletedProcess]:
    """Every variant of :data:`AGREE` trained on 2 processes (:func:`two_process_launch`)."""
    return two_process_launch


@pytest.mark.multiprocess
@pytest.mark.parametrize("loader", list(AGREE))
def test_two_processes_agree_with_one_on_the_same_global_batch(tiny_imagefolder, tmp_path, loader, on_cpu,
                                                               two_process_runs):
    train(load_config(ROOT / "configs/cifar10_cpu_quick.yaml",
                      tiny_overrides(tiny_imagefolder, tmp_path / "one", *AGREE_KEYS, *AGREE[loader])))
    root, launch = two_process_runs
    assert launch.returncode == 0, launch.stderr[-3000:]
    two = root / loader
    assert launch.stdout.count("| 2 process(es) on") == len(AGREE) + 4 and f"run dir {two}" in launch.stdout  # + draws,
    # the probe, the budget run continued
    assert max_weight_diff(_weights(tmp_path / "one"), _weights(two)) < 1e-5
    # Evaluation shards the test set and gathers it back: same accuracy over all 35 images.
    last = lambda run: [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last(tmp_path / "one")["test_top1"] == last(two)["test_top1"]
    assert last(tmp_path / "one")["test_loss"] == pytest.approx(last(two)["test_loss"], abs=1e-5)
    assert last(tmp_path / "one")["train_samples"] == last(two)["train_samples"] == 96  # 4 steps of 24
    if loader == "budget":  # timed on both processes, undone on both, one number chosen
        assert "train.budget_minutes=30: 1 epoch (train.epochs bounds them)" in launch.stdout
    if loader == "moe":  # expert use is counted over every process's tokens
        assert last(tmp_path / "one")["expert_utilization"] == last(two)["expert_utilization"]


def test_non_finite_loss_stops_and_leaves_checkpoints_as_they_were(tiny_imagefolder, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=3"))
    train(cfg, stop_after_epoch=1)
    reset_accelerate()
    before = {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    monkeypatch.setattr(torch.nn.CrossEntropyLoss, "forward", lambda self, x, y: x.sum() * float("nan"))
    with pytest.raises(TrainingError, match=r"the training loss became nan at epoch 2, step \d+; training stopped"):
        train(cfg, resume=run_dir)
    after = {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    assert after == before


def test_a_crash_while_writing_a_checkpoint_keeps_the_previous_one(tiny_imagefolder, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=2"))
    train(cfg, stop_after_epoch=1)
    reset_accelerate()
    before = _weights(run_dir)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_optimizer", crash)
    with pytest.raises(OSError, match="disk full"):
        train(cfg, resume=run_dir)
    after = _weights(run_dir)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert ckpt.read_json(run_dir / "checkpoints/last/trainer_state.json")["epoch"] == 1
    vitlab.load_model(run_dir / "checkpoints" / "last")


def test_replace_dir_survives_a_crash_between_the_renames(tmp_path):
    final = tmp_path / "last"
    final.mkdir()
    (final / "config.json").write_text("{}")
    # A crash after `final` was moved aside but before the new one was moved in:
    os.replace(final, tmp_path / "last.old")
    assert ckpt.resolve_checkpoint(tmp_path / "last") == tmp_path / "last.old"


def test_a_checkpoint_reaches_the_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    # Every file and the directory are fsynced before the rename, the parent after it: a power failure
    # then leaves either the old checkpoint or the whole new one, never truncated files.
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))), real_replace(a, b)))
    final, tmp = tmp_path / "last", tmp_path / ".last.tmp"
    final.mkdir()
    tmp.mkdir()
    for name in ("model.safetensors", "config.json"):
        (tmp / name).write_text(name)
    ckpt.replace_dir(tmp, final)
    synced = [e[1] for e in events[:events.index(("replace", str(final), str(final) + ".old"))] if e[0] == "fsync"]
    assert sorted(synced) == sorted([str(tmp), str(tmp / "config.json"), str(tmp / "model.safetensors")])
    assert events[-1] == ("fsync", str(tmp_path)) and events[-2] == ("replace", str(tmp), str(final))
    assert (final / "config.json").read_text() == "config.json" and not (tmp_path / "last.old").exists()


def test_more_processes_than_gpus_is_one_line_before_any_process_group(monkeypatch):
    # Two processes on a one-GPU machine would both take cuda:0, and NCCL stops with "invalid usage".
    from vitlab.training import create_accelerator

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    with pytest.raises(ConfigError) as e:
        create_accelerator()
    message = str(e.value)
    assert "\n" not in message and message.startswith("2 processes were started on this machine, which has 1 GPU(s)")
    assert "--nproc_per_node 1" in message and "ACCELERATE_USE_CPU=1" in message


def test_missing_and_corrupt_checkpoints_are_named(trained_run, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        vitlab.load_model(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        vitlab.load_model(tmp_path)
    run_dir, _ = trained_run
    broken = tmp_path / "broken"
    import shutil

    shutil.copytree(run_dir / "checkpoints" / "best", broken)
    (broken / "model.safetensors").write_bytes((broken / "model.safetensors").read_bytes()[:64])
    with pytest.raises(CheckpointError, match=r"model\.safetensors' is corrupt"):
        vitlab.load_model(broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors' is missing"):
        vitlab.load_model(broken)


def test_eval_command_writes_metrics_and_confusion_matrix(trained_run, tmp_path, capsys):
    run_dir, summary = trained_run
    out = tmp_path / "eval" / "metrics.json"
    main(["eval", "--checkpoint", str(run_dir), "--output", str(out)])  # in this process: no interpreter start-up
    stdout = capsys.readouterr().out
    metrics = json.loads(out.read_text())
    assert set(metrics) >= {"top1", "top5", "loss", "per_class"}
    best_epoch = _evals(run_dir)[summary["best_epoch"] - 1]
    assert metrics["top1"] == pytest.approx(best_epoch["test_top1"], abs=1e-6)
    assert metrics["loss"] == pytest.approx(best_epoch["test_loss"], abs=1e-5)
    assert metrics["top5"] == 1.0  # 3 classes
    matrix = json.loads((out.parent / "confusion_matrix.json").read_text())["matrix"]
    assert sum(map(sum, matrix)) == 36
    # Per-class accuracy is the confusion matrix's diagonal over its row sums.
    assert list(metrics["per_class"].values()) == pytest.approx([matrix[i][i] / sum(matrix[i]) for i in range(3)])
    assert (out.parent / "confusion_matrix.png").stat().st_size > 1000
    assert (out.parent / "mistakes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "top-1 " in stdout and "%" in stdout and "class_2" in stdout
    # precision, recall and F1 from the same confusion matrix: recall is the per-class accuracy
    precision = [matrix[i][i] / max(1, sum(row[i] for row in matrix)) for i in range(3)]
    assert list(metrics["per_class_precision"].values()) == pytest.approx(precision)
    assert metrics["macro_recall"] == pytest.approx(sum(metrics["per_class"].values()) / 3)
    assert metrics["balanced_top1"] == pytest.approx(metrics["macro_recall"]) and "balanced top-1 " in stdout


@pytest.mark.parametrize("split, size", [("val", 15), ("train", 81)])
def test_eval_split_val_and_train_score_exactly_the_examples_training_used(trained_run, tmp_path, split, size):
    # --split val must be the 15 held-out images (same seed, same indices): its numbers equal the
    # validation record of the checkpoint's epoch in metrics.jsonl.
    run_dir, summary = trained_run
    out = tmp_path / "m.json"
    main(["eval", "--checkpoint", str(run_dir / "checkpoints/last"), "--split", split, "--output", str(out)])
    metrics = json.loads(out.read_text())
    assert metrics["num_images"] == size
    if split == "val":
        last = _evals(run_dir)[-1]
        assert metrics["top1"] == last["val_top1"] and metrics["top5"] == last["val_top5"]
        assert metrics["loss"] == pytest.approx(last["val_loss"], abs=1e-5)


@pytest.fixture(scope="module")
def imagefolder_48px(tmp_path_factory) -> Path:
    from conftest import make_imagefolder

    return make_imagefolder(tmp_path_factory.mktemp("px48"), {"train": 32, "test": 12}, size=48)


@pytest.mark.parametrize("loader", ["torch", "gpu"])
def test_eval_and_predict_preprocess_as_training_did_when_images_are_stored_at_another_size(
        imagefolder_48px, tmp_path, loader):
    # 48-pixel files, stored at 32 x 32 (data.decode_size), seen by the model at 16 x 16: training's
    # loaders resize each batch; `vitlab eval` and `predict` must give the model the same pixels.
    from vitlab.cli import main

    run_dir = tmp_path / "run"
    train(load_config(None, tiny_overrides(imagefolder_48px, run_dir, "train.epochs=1", "data.val_size=15",
                                           "data.decode_size=32", "model.img_size=16", f"data.loader={loader}")))
    reset_accelerate()
    out = tmp_path / "m.json"
    main(["eval", "--checkpoint", str(run_dir), "--split", "val", "--output", str(out)])
    metrics, logged = json.loads(out.read_text()), _evals(run_dir)[-1]
    assert metrics["num_images"] == 15
    assert metrics["top1"] == logged["val_top1"]
    assert metrics["loss"] == pytest.approx(logged["val_loss"], abs=1e-5)
    # `vitlab predict` and `attention` read a file as `read_image(path, decode_size(model))`, then
    # `create_transform(model)`: the pixels evaluation gave that image (not those of a direct 48 -> 16).
    from vitlab.data import load_split
    from vitlab.data.decode import read_image
    from vitlab.data.transforms import create_transform, decode_size, eval_transform
    from vitlab.data.transforms import ModelInput

    model = vitlab.load_model(run_dir)
    assert decode_size(model) == (32, 32)
    first = sorted((imagefolder_48px / "test" / "class_0").iterdir())[0]
    stored = load_split("imagefolder", imagefolder_48px, "test", size=(32, 32)).images[0]
    expected = ModelInput(model.pretrained_cfg["mean"], model.pretrained_cfg["std"])(eval_transform((16, 16))(stored))
    assert torch.equal(create_transform(model)(read_image(first, decode_size(model))), expected)
    assert not torch.equal(create_transform(model)(read_image(first)), expected)
    main(["predict", "--checkpoint", str(run_dir), "--topk", "1", str(first)])


def test_device_loader_resizes_as_the_dataloader_does():
    # One resize rule (bicubic, antialiased, on uint8) for both loaders: the same pixels for the model.
    from vitlab.data.images import DeviceImageLoader, ImageData, TensorImageDataset
    from vitlab.data.transforms import eval_transform

    g = torch.Generator().manual_seed(0)
    data = ImageData(torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=g), torch.arange(8), [])
    for size in ((16, 16), (56, 56)):
        device = next(iter(DeviceImageLoader(data, 8, "cpu", train=False, size=size)))[0]
        dataset = TensorImageDataset(data, eval_transform(size))
        torch.testing.assert_close(device, torch.stack([dataset[i][0] for i in range(8)]), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_eval_split_val_of_a_run_without_validation_is_refused(tiny_imagefolder, tmp_path):
    # A real `python -m vitlab.cli` process (the other command tests call main() in this one): its exit
    # status and stderr as a user sees them, without a traceback.
    run_dir = tmp_path / "run"
    train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=1")))
    result = subprocess.run([sys.executable, "-m", "vitlab.cli", "eval", "--checkpoint", str(run_dir), "--split", "val"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "held out no validation images (data.val_size=0)" in result.stderr and "Traceback" not in result.stderr


def test_predict_command_prints_top_classes_and_names_unreadable_files(trained_run, tiny_imagefolder, tmp_path,
                                                                       capsys):
    run_dir, _ = trained_run
    image = next((tiny_imagefolder / "test" / "class_2").glob("*.png"))
    main(["predict", "--checkpoint", str(run_dir), "--topk", "2", str(image)])
    assert capsys.readouterr().out.startswith(f"{image}: class_2 ")
    bad = tmp_path / "bad.jpg"
    bad.write_text("nope")
    main(["predict", "--checkpoint", str(run_dir), str(bad), str(image)])  # the job goes on past it
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith(f"{bad}: error: cannot read image '{bad}'") and lines[1].startswith(f"{image}: class_2 ")
    assert err == "2 images; 1 could not be read (their rows give the error)\n"


@pytest.mark.parametrize("loader", ["torch", "gpu"])
def test_gradient_accumulation_takes_the_same_steps_as_one_big_batch(tiny_imagefolder, tmp_path, loader, on_cpu):
    # Global batch 24 as 1 x 24 and as 3 x 8: same optimizer steps, same schedule, same weights.
    # 96 images: 4 steps per epoch either way (the 12 left over are dropped in both).
    extra = ("data.crop_padding=0", "data.hflip=false", "train.batch_size=24", f"data.loader={loader}")
    runs = {}
    for k in (1, 3):
        run_dir = tmp_path / f"k{k}"
        train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, *extra, f"train.grad_accum_steps={k}")))
        reset_accelerate()
        runs[k] = run_dir
    for k, run_dir in runs.items():
        assert ckpt.read_json(run_dir / "checkpoints/last/trainer_state.json")["global_step"] == 8, k
        lrs = [r["lr"] for r in _evals(run_dir)]
        assert lrs == [r["lr"] for r in _evals(runs[1])]
    assert max_weight_diff(_weights(runs[1]), _weights(runs[3])) < 1e-5


def test_best_checkpoint_survives_a_resume_whatever_save_every_is(tiny_imagefolder, tmp_path):
    # With save_every=2, last/ can be older than best/. A resume must keep best/'s metric, so a
    # worse later epoch cannot overwrite it.
    run_dir = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=3", "data.val_size=15",
                                           "train.save_every=2"))
    train(cfg, stop_after_epoch=1)
    reset_accelerate()
    best_state = run_dir / "checkpoints/best/trainer_state.json"
    state = ckpt.read_json(best_state)
    state.update(best_metric=1.5, best_epoch=7)  # as if a later epoch, not yet in last/, had scored 1.5
    ckpt.write_json(best_state, state)
    before = {p.name: p.read_bytes() for p in (run_dir / "checkpoints/best").iterdir()}
    summary = train(cfg, resume=run_dir)
    assert summary["best_metric"] == 1.5 and summary["best_epoch"] == 7
    assert {p.name: p.read_bytes() for p in (run_dir / "checkpoints/best").iterdir()} == before


def test_grad_scaler_state_is_checkpointed_and_restored(tiny_imagefolder, tmp_path, monkeypatch, on_cpu):
    # fp16 runs only on accelerators, but the GradScaler's bookkeeping is device-independent: give the
    # CPU run a real scaler (growing its scale every 2 steps) and check a resume continues its state.
    from vitlab.training import loop

    def with_scaler(*args, **kwargs):
        accelerator = original(*args, **kwargs)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
        return accelerator

    original = loop.create_accelerator
    monkeypatch.setattr(loop, "create_accelerator", with_scaler)
    extra = ("train.epochs=3",)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(load_config(None, tiny_overrides(tiny_imagefolder, whole, *extra)))
    reset_accelerate()
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, parts, *extra))
    train(cfg, stop_after_epoch=1)
    reset_accelerate()
    assert ckpt.read_json(parts / "checkpoints/last/trainer_state.json")["grad_scaler"]["scale"] == 2.0 ** 11  # 6 steps
    train(cfg, resume=parts)
    final = ckpt.read_json(whole / "checkpoints/last/trainer_state.json")["grad_scaler"]
    assert final["scale"] == 2.0 ** 17  # 18 steps: doubled 9 times
    assert ckpt.read_json(parts / "checkpoints/last/trainer_state.json")["grad_scaler"] == final
    assert max_weight_diff(_weights(whole), _weights(parts)) == 0.0


def test_a_failed_cifar10_download_is_one_line_naming_the_way_out(tmp_path, monkeypatch):
    import urllib.error

    from torchvision.datasets import CIFAR10

    from vitlab.data import load_split
    from vitlab.errors import DataError

    def offline(self):
        raise urllib.error.URLError(OSError(-3, "Temporary failure in name resolution"))

    monkeypatch.setattr(CIFAR10, "download", offline)
    with pytest.raises(DataError) as e:
        load_split("cifar10", tmp_path, "train", download=True)
    message = str(e.value)
    assert "\n" not in message and "could not download CIFAR-10" in message
    assert "Temporary failure in name resolution" in message
    assert "data.dataset=imagefolder data.root=" in message


@pytest.mark.slow
def test_epoch_lines_reach_a_pipe_while_training_runs(tiny_imagefolder, tmp_path):
    # Block-buffered stdout would hold the first epoch lines (~150 bytes each) until ~8 KB or exit.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as in a plain shell
    process = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--config",
                                str(ROOT / "configs/cifar10_cpu_quick.yaml"), *tiny_overrides(
        tiny_imagefolder, tmp_path / "run", "train.epochs=500")], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, env=env)
    try:
        lines = [process.stdout.readline() for _ in range(5)]
        assert lines[0].startswith("data: 132 images at 32 x 32") and lines[1].startswith("decoding 96 images")
        assert lines[2].startswith("decoding 36") and lines[3].startswith("model ") and lines[4].startswith("epoch 1: ")
        # The line came as it was printed: a few epochs later at most, not once ~50 had filled a buffer.
        assert len(_evals(tmp_path / "run")) <= 5
    finally:
        process.kill()
        process.wait()


HELPER = ROOT / "tests" / "helpers" / "dist_train.py"


def _two_processes(*args: str, exact: bool = False) -> subprocess.CompletedProcess:
    return run_two(list(args), launch_env(2, exact=exact))


@pytest.fixture(scope="module")
def identical_imagefolder(tmp_path_factory) -> Path:
    """3 classes x 16 copies of one noise image: augmented copies differ only by their augmentation."""
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("same")
    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    for split in ("train", "test"):
        for c in range(3):
            (root / split / f"class_{c}").mkdir(parents=True)
            for i in range(16):
                Image.fromarray(pixels).save(root / split / f"class_{c}" / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def two_process_draws(two_process_launch) -> tuple[Path, subprocess.CompletedProcess]:
    """Each loader's first training batch and random draws on 2 processes (:func:`two_process_launch`)."""
    root, launch = two_process_launch
    return root / "draws", launch


@pytest.mark.multiprocess
@pytest.mark.parametrize("loader", ["torch", "gpu"])
def test_two_processes_draw_different_augmentation_dropout_and_mixup(two_process_draws, loader):
    # Every training image is the same picture, so two processes' batches can differ only through
    # their crops and flips. The same stream on both would give the same image in every slot.
    root, result = two_process_draws
    assert result.returncode == 0, result.stderr[-3000:]
    draws = [json.loads((root / f"{loader}.draws.{rank}.json").read_text()) for rank in (0, 1)]
    images = [torch.tensor(d["images"]) for d in draws]
    assert images[0].shape == images[1].shape == (8, 3, 32, 32)  # global batch 16 over 2 processes
    same_slots = sum(torch.equal(a, b) for a, b in zip(*images))
    assert same_slots <= 2, f"{same_slots} of 8 slots got the same crop and flip on both processes"
    for stream in ("torch", "numpy", "python"):
        assert draws[0][stream] != draws[1][stream], stream


@pytest.mark.slow
@pytest.mark.parametrize("option", ["train.mixed_precision=bf16", "train.compile=true"])
def test_gpu_only_paths_train_evaluate_and_reload_on_the_cpu(tiny_imagefolder, tmp_path, option):
    # bf16 runs as CPU autocast, compile as inductor on the CPU: one step, one evaluation, a checkpoint
    # that reloads and scores what the run recorded.
    import math

    from vitlab.cli import main
    from vitlab.training import create_accelerator

    run_dir = tmp_path / "run"
    summary = train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, option, "train.epochs=1",
                                                     "data.train_subset=16", "data.test_subset=16")))
    reset_accelerate()
    assert ckpt.read_json(run_dir / "checkpoints/last/trainer_state.json")["global_step"] == 1
    assert math.isfinite(summary["test_loss"])
    assert not any("_orig_mod" in k for k in _weights(run_dir))  # plain names, compiled or not
    out = tmp_path / "m.json"
    main(["eval", "--checkpoint", str(run_dir), "--output", str(out)])
    reset_accelerate()
    metrics = json.loads(out.read_text())
    assert metrics["top1"] == summary["test_top1"]
    assert metrics["loss"] == pytest.approx(summary["test_loss"], abs=1e-5)
    if "bf16" in option:
        accelerator = create_accelerator("bf16")  # its autocast is for its device: the model goes there
        with accelerator.autocast():
            model = vitlab.load_model(run_dir).to(accelerator.device)
            assert model(torch.randn(2, 3, 32, 32, device=accelerator.device)).dtype == torch.bfloat16


def test_mixture_of_experts_trains_with_its_balancing_loss_and_logs_expert_use(tiny_imagefolder, tmp_path):
    run_dir = tmp_path / "moe"
    train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "model.mlp_layer=moe", "model.num_experts=4",
                                           "model.moe_top_k=2", "model.moe_aux_loss_weight=0.1")))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    aux = [r["moe_aux_loss"] for r in records if r["split"] == "train"]
    assert aux and all(0.0 < a < 0.1 * 4 for a in aux)  # weight x E x sum f P lies in (0, weight x E]
    use = [r["expert_utilization"] for r in records if r["split"] == "eval"]
    assert len(use) == 2 and all(len(layers) == 1 and len(layers[0]) == 4 for layers in use)  # 1 block, 4 experts
    assert all(abs(sum(layers[0]) - 1) < 1e-3 for layers in use)
    assert ckpt.load_model(run_dir).config["mlp_layer"] == "moe"


def test_trackers_record_the_runs_scalars_and_config_and_a_missing_one_is_one_line(tiny_imagefolder, tmp_path,
                                                                                monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="mlflow not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "my_run"
    summary = train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.log_with=all",
                                                     "train.epochs=1")))
    reset_accelerate()
    # MLflow: a file store in the run directory, an experiment named after it, the epoch's scalars and
    # the whole config as parameters.
    client = mlflow.tracking.MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("my_run").experiment_id])
    assert run.data.metrics["test_top1"] == pytest.approx(summary["test_top1"])
    assert run.data.metrics["train_loss"] == pytest.approx(summary["train_loss"])
    assert run.data.params["model.embed_dim"] == "32" and run.data.params["optim.lr"] == "0.003"
    # TensorBoard: the same scalars.
    scalars = EventAccumulator(str(run_dir / "tensorboard" / "my_run")).Reload()
    assert scalars.Scalars("test_top1")[-1].value == pytest.approx(summary["test_top1"])
    for tracker, package in (("wandb", "wandb"), ("aim", "aim")):
        if importlib.util.find_spec(package) is None:
            with pytest.raises(ConfigError, match=rf"train.log_with={tracker}: the {package} package is not installed; "
                                                  rf"pip install {package}"):
                train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / tracker, f"train.log_with={tracker}")))
            assert not (tmp_path / tracker).exists()  # refused before anything was written
    train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "quiet", "train.log_with=none",
                                           "train.epochs=1")))
    assert not (tmp_path / "quiet" / "tensorboard").exists() and not (tmp_path / "quiet" / "mlruns").exists()


def test_the_model_card_states_what_the_run_measured_and_the_evaluations_recorded(trained_run, tmp_path):
    import shutil

    from vitlab.cli import main

    run_dir, summary = tmp_path / "run", trained_run[1]
    shutil.copytree(trained_run[0], run_dir)
    main(["eval", "--checkpoint", str(run_dir), "--split", "val", "--record"])
    reset_accelerate()
    model = vitlab.load_model(run_dir)
    training = model.pretrained_cfg["training"]  # load_model reads best/: the model of the best epoch
    epoch = summary["best_epoch"]
    assert training["epochs"] == epoch and training["steps"] == 5 * epoch  # 5 steps an epoch
    assert training["dataset"].startswith("imagefolder (") and 0 < training["wall_time"] < summary["wall_time"]
    best = _evals(run_dir)[epoch - 1]
    assert training["evaluation"] == {k: best[k] for k in training["evaluation"]} and best["epoch"] == epoch
    model.save_pretrained(tmp_path / "hub")
    card = (tmp_path / "hub" / "README.md").read_text()
    assert f"for {epoch} epochs ({5 * epoch} optimizer\nsteps)" in card
    assert f"| test_top1 | {best['test_top1']:.4f} |" in card
    (evaluation,) = model.pretrained_cfg["evaluations"]
    assert evaluation["metrics"]["top1"] == best["val_top1"]  # the recorded val split is the run's own
    assert f"| val | top1 | {best['val_top1']:.4f} | `vitlab eval --checkpoint {run_dir} --split val` |" in card


def test_processes_launched_on_the_cpu_do_not_see_the_gpus(monkeypatch):
    # Accelerate's wait_for_everyone hands the local rank to torch.distributed.barrier(device_ids=...), and
    # torch then names cuda:<rank> wherever CUDA is visible: on an H100 machine the rank-1 process of every
    # `accelerate launch --cpu` / ACCELERATE_USE_CPU run died there. Such processes must not see the GPUs.
    import vitlab.runtime as runtime

    seen = []
    monkeypatch.setattr(runtime, "Accelerator", lambda **kwargs: seen.append(os.environ.get("CUDA_VISIBLE_DEVICES")))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # as in a freshly launched process
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    runtime.create_accelerator()
    assert seen == [""]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "false")  # launched on the GPUs: nothing hidden
    runtime.create_accelerator()
    assert seen == ["", None]


def test_the_plain_model_of_a_compiled_ddp_model_leaves_ddp_in_the_training_path(tmp_path):
    # The model is compiled after accelerator.prepare: compile(DDP(model)). Accelerate's unwrap_model, given
    # that, writes the bare module into the compiled wrapper (compiled._orig_mod = model): every step after
    # the first EMA update, save or seq2seq evaluation would run without DDP's gradient all-reduce.
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.nn.parallel import DistributedDataParallel

    from vitlab.runtime import bare_model

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(3, 2)
        wrapped = DistributedDataParallel(model)
        compiled = torch.compile(wrapped)
        assert bare_model(compiled, Accelerator(cpu=True)) is model
        assert compiled._orig_mod is wrapped  # DDP still runs the steps
        assert bare_model(wrapped, Accelerator(cpu=True)) is model and bare_model(model, Accelerator(cpu=True)) is model
    finally:
        dist.destroy_process_group()


def test_lr_base_scales_the_learning_rate_by_the_global_batch_as_timm_and_deit_do(tiny_imagefolder, tmp_path):
    # lr = lr_base * global batch / lr_base_size (DeiT: 5e-4 * batch / 512), or its square root (timm's
    # rule for Adam-like optimizers), so a recipe keeps its meaning on another number of GPUs.
    from vitlab.training import Loop

    for batch, scale, expected in ((16, "linear", 5e-4 * 16 / 512), (32, "linear", 5e-4 * 32 / 512),
                                   (32, "sqrt", 5e-4 * (32 / 512) ** 0.5)):
        overrides = tiny_overrides(tiny_imagefolder, tmp_path / f"{batch}{scale}", f"train.batch_size={batch}",
                                   "optim.lr_base=5e-4", "optim.lr_base_size=512", f"optim.lr_base_scale={scale}",
                                   "optim.min_lr=0")
        cfg = load_config(None, [o for o in overrides if not o.startswith("optim.lr=")])  # an optim.lr would win
        loop = Loop(cfg, tmp_path / f"{batch}{scale}", None)
        reset_accelerate()
        peaks = loop.scheduler.scheduler.base_values  # timm's scheduler's: the peak of each group
        assert peaks == pytest.approx([expected] * len(peaks))
    with pytest.raises(ConfigError, match=r"optim.min_lr=0.001 is invalid; expected a number in \[0, the peak "
                                          r"learning rate 1.5625e-05\]"):
        load_config(None, ["train.batch_size=16", "optim.lr_base=5e-4", "optim.lr_base_size=512", "optim.min_lr=1e-3"])


@pytest.mark.parametrize("mixing", [False, True])
@pytest.mark.parametrize("thresh", [None, 0.2])
def test_the_bce_loss_is_binary_cross_entropy_on_smoothed_or_mixed_targets_as_timms_recipe(mixing, thresh):
    # train.loss=bce (DeiT III; timm's train.py with --bce-loss): without mixup, one-hot targets smoothed
    # (off = s / K, on = 1 - s + off); with mixup, its soft targets; binarized above bce_target_thresh.
    import torch.nn.functional as F

    from vitlab.tasks.classification import classification_criterion

    torch.manual_seed(0)
    logits, k, s = torch.randn(6, 5), 5, 0.1
    labels = torch.randint(0, k, (6,))
    soft = torch.softmax(torch.randn(6, k), -1)  # what Mixup gives (it applies the smoothing itself)
    targets = soft if mixing else torch.full((6, k), s / k).scatter_(1, labels[:, None], 1 - s + s / k)
    if thresh is not None:
        targets = (targets > thresh).float()
    got = classification_criterion(mixing, s, "bce", thresh)(logits, soft if mixing else labels)
    torch.testing.assert_close(got, F.binary_cross_entropy_with_logits(logits, targets))
    ce = classification_criterion(mixing, s, "ce", None)
    assert type(ce).__name__ == ("SoftTargetCrossEntropy" if mixing else "CrossEntropyLoss")


def test_best_metric_chooses_best_on_any_validation_metric_in_its_direction(tiny_imagefolder, tmp_path, capsys):
    # transformers' metric_for_best_model: a name ending in "loss" is lower-better, any other higher-better.
    for metric, pick in (("val_loss", min), ("val_macro_f1", max)):
        run_dir = tmp_path / metric
        summary = train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "data.val_size=12",
                                                         "train.epochs=3", f"train.best_metric={metric}")))
        reset_accelerate()
        evals = _evals(run_dir)
        assert {"val_balanced_top1", "val_macro_f1", "test_macro_f1"} <= set(evals[0])
        values = [e[metric] for e in evals]
        assert summary["best_epoch"] == values.index(pick(values)) + 1 and summary["best_metric"] == pick(values)
        assert f"best/ chosen on {metric}" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"^train.best_metric=val_f1: this task's validation metrics are val_top1, "):
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "x", "data.val_size=12",
                                               "train.best_metric=val_f1")))
    reset_accelerate()
    with pytest.raises(ConfigError, match=r"^train.early_stop_patience=2 reads the validation split, and this run "
                                          r"holds out none: set data.val_size=N"):
        load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "y", "train.early_stop_patience=2"))


def _scripted_top1(monkeypatch, values: list[float], done: int = 0) -> None:
    """Evaluations that report ``values[e]`` as epoch ``e + 1``'s validation top-1 (from epoch ``done + 1``)."""
    from vitlab.tasks.classification import task as classification

    calls = [2 * done]  # a validation and a test evaluation an epoch

    def scripted(net, loader, acc, num_classes, model_input=None, keep_probs=False, **kwargs):
        epoch, calls[0] = calls[0] // 2, calls[0] + 1
        return {"top1": values[epoch], "top5": 1.0, "loss": 1.0 - values[epoch], "balanced_top1": values[epoch],
                "macro_f1": values[epoch]}

    monkeypatch.setattr(classification, "evaluate_classifier", scripted)


def test_early_stopping_stops_after_patience_epochs_without_improvement_and_survives_a_resume(
        tiny_imagefolder, tmp_path, monkeypatch, capsys, on_cpu):  # weights compared bit for bit: conftest.py
    top1 = [0.5, 0.7, 0.6, 0.65, 0.9, 0.95]  # best at epoch 2; patience 2: stop after epoch 4 of 6
    keys = ("data.val_size=12", "train.epochs=6", "train.early_stop_patience=2")
    whole = tmp_path / "whole"
    _scripted_top1(monkeypatch, top1)
    summary = train(load_config(None, tiny_overrides(tiny_imagefolder, whole, *keys)))
    reset_accelerate()
    out = capsys.readouterr().out
    assert "stopped early after epoch 4: val_top1 has not improved for 2 epochs, its best at epoch 2 " \
           "(train.early_stop_patience=2)" in out and "finished 4 epochs" in out
    assert summary["epochs_done"] == 4 and summary["best_epoch"] == 2 and summary["stopped_early"] == 4
    assert json.loads((whole / "summary.json").read_text())["stopped_early"] == 4
    assert ckpt.read_json(whole / "checkpoints/last/trainer_state.json")["epoch"] == 4
    # run again: finished, nothing to train
    train(load_config(None, tiny_overrides(tiny_imagefolder, whole, *keys)))
    reset_accelerate()
    assert "holds a finished run (4 epochs, stopped early): nothing to train" in capsys.readouterr().out
    # stopped by an interruption after epoch 3, continued: the same stop, the same weights
    parts = tmp_path / "parts"
    _scripted_top1(monkeypatch, top1)
    train(load_config(None, tiny_overrides(tiny_imagefolder, parts, *keys)), stop_after_epoch=3)
    reset_accelerate()
    _scripted_top1(monkeypatch, top1, done=3)
    resumed = train(load_config(None, tiny_overrides(tiny_imagefolder, parts, *keys)))
    assert resumed["stopped_early"] == 4 and resumed["best_epoch"] == 2
    assert all(torch.equal(a, b) for a, b in zip(_weights(whole).values(), _weights(parts).values()))


@pytest.mark.multiprocess
def test_eval_predictions_file_recomputes_every_metric_as_scikit_learn_on_one_and_two_processes(
        mislabelled_run, two_process_launch, tmp_path, capsys, on_cpu):
    # A test split where a third of each class's images are its neighbour's; every image once, in the split's order,
    # on 1 process and on 2 (whose evaluation is sharded and gathered: the file's launch).
    import csv

    from sklearn.metrics import accuracy_score, balanced_accuracy_score, precision_recall_fscore_support

    from vitlab.cli import main

    tiny_imagefolder, run = mislabelled_run
    root, launch = two_process_launch
    assert launch.returncode == 0, launch.stderr[-3000:]
    out, one = tmp_path / "m.json", tmp_path / "one.csv"
    main(["eval", "--checkpoint", str(run), "--output", str(out), "--predictions", str(one), "--batch-size", "8"])
    reset_accelerate()
    metrics = json.loads(out.read_text())
    rows = list(csv.DictReader(one.open()))
    files = sorted(str(p.relative_to(tiny_imagefolder / "test")) for p in (tiny_imagefolder / "test").rglob("*.png"))
    assert sorted(r["image"] for r in rows) == files and len(rows) == metrics["num_images"] == 36
    y, p = [r["label"] for r in rows], [r["prediction"] for r in rows]
    assert 0 < accuracy_score(y, p) < 1  # wrong on some images, so the metrics say something
    assert metrics["top1"] == pytest.approx(accuracy_score(y, p), abs=1e-6)
    assert metrics["balanced_top1"] == pytest.approx(balanced_accuracy_score(y, p), abs=1e-6)
    for average in ("macro", "weighted"):
        expected = precision_recall_fscore_support(y, p, average=average, zero_division=0)[:3]
        assert [metrics[f"{average}_{m}"] for m in ("precision", "recall", "f1")] == pytest.approx(expected, abs=1e-6)
    probs = torch.tensor([[float(r[f"prob_class_{k}"]) for k in range(3)] for r in rows])
    assert torch.allclose(probs.sum(1), torch.ones(36), atol=1e-6)
    assert [f"class_{k}" for k in probs.argmax(1).tolist()] == p
    two = root / "eval" / "two.csv"
    on_two = json.loads((root / "eval" / "two.json").read_text())  # no image counted twice, none dropped
    counted = [k for k, v in metrics.items() if isinstance(v, (int, float)) and k not in ("loss", "ece")]
    assert on_two["num_images"] == 36 and [on_two[k] for k in counted] == pytest.approx([metrics[k] for k in counted])
    rows_two = list(csv.DictReader(two.open()))
    assert [(r["image"], r["label"], r["prediction"]) for r in rows_two] == [(r["image"], r["label"], r["prediction"])
                                                                             for r in rows]
    probs_two = torch.tensor([[float(r[f"prob_class_{k}"]) for k in range(3)] for r in rows_two])
    assert torch.allclose(probs_two, probs, atol=1e-5)
    with pytest.raises(SystemExit):
        main(["eval", "--checkpoint", str(run), "--predictions", str(tmp_path / "p.json")])
