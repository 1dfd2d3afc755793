"""The training loop end to end on small generated data: learning, checkpoints, resume, errors, CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vitlab
from conftest import max_weight_diff, reset_accelerate, tiny_overrides
from vitlab import checkpoint as ckpt
from vitlab.config import load_config
from vitlab.errors import CheckpointError, ConfigError, TrainingError
from vitlab.training import lr_multiplier, train

ROOT = Path(__file__).resolve().parents[1]


def _weights(run_dir: Path, which: str = "last", name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / which / name))


@pytest.fixture(scope="module")
def trained_run(tiny_imagefolder, tmp_path_factory) -> tuple[Path, dict]:
    """3 epochs with 15 of the 96 training images held out for validation (best/ is chosen on them)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    summary = train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=3", "data.val_size=15")))
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


def test_without_a_validation_split_no_best_is_kept_and_the_run_means_its_last_epoch(tiny_imagefolder, tmp_path):
    run_dir = tmp_path / "run"
    summary = train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir)))
    assert summary["best_metric"] is None and summary["best_epoch"] is None
    assert not (run_dir / "checkpoints" / "best").exists()
    assert ckpt.resolve_checkpoint(run_dir) == run_dir / "checkpoints" / "last"
    assert summary["test_top1"] == _evals(run_dir)[-1]["test_top1"]  # the figure is the final epoch's


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


def test_warmup_cosine_schedule():
    assert lr_multiplier(0, 10, 100, 0.01) == pytest.approx(0.1)
    assert lr_multiplier(9, 10, 100, 0.01) == pytest.approx(1.0)
    assert lr_multiplier(55, 10, 100, 0.01) == pytest.approx(0.01 + 0.99 * 0.5)
    assert lr_multiplier(100, 10, 100, 0.01) == pytest.approx(0.01)


def test_inverse_sqrt_schedule_is_the_papers():
    # Vaswani et al.: lr = d^-0.5 * min(step^-0.5, step * warmup^-1.5), peak at step = warmup.
    d, warmup = 512, 4000
    paper = lambda step: d ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
    peak = paper(warmup)
    for step in (1, 100, 3999, 4000, 10000, 100000):
        assert peak * lr_multiplier(step - 1, warmup, 10 ** 6, 0.0, "inverse_sqrt") == pytest.approx(paper(step))


def test_interrupted_and_resumed_run_ends_with_the_same_weights(tiny_imagefolder, tmp_path):
    # Augmentation, mixup (NumPy RNG), stochastic depth and EMA all draw random numbers: resuming
    # must restore every RNG, the optimizer, the schedule and the EMA to end bit-identical.
    extra = ("train.epochs=3", "data.mixup_alpha=0.2", "model.drop_path_rate=0.1", "train.ema_decay=0.9")
    whole = tmp_path / "whole"
    train(load_config(None, tiny_overrides(tiny_imagefolder, whole, *extra)))
    reset_accelerate()
    parts = tmp_path / "parts"
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, parts, *extra))
    assert train(cfg, stop_after_epoch=1)["epochs_done"] == 1
    reset_accelerate()
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--resume", str(parts)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("model.safetensors", "ema.safetensors"):
        a, b = _weights(whole, name=name), _weights(parts, name=name)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert ckpt.read_json(parts / "checkpoints/last/trainer_state.json")["epoch"] == 3



@pytest.mark.parametrize("loader", ["torch", "gpu"])
def test_two_processes_agree_with_one_on_the_same_global_batch(tiny_imagefolder, tmp_path, loader):
    # No randomness beyond the (shared, seeded) shuffling: same global batches, same updates. The
    # device loader shards evaluation itself (36 test images over 2 processes, gathered unevenly).
    extra = ("data.crop_padding=0", "data.hflip=false", "train.epochs=1", "train.label_smoothing=0.0",
             f"data.loader={loader}", "train.batch_size=24", "data.test_subset=35")  # last eval batch: 6 + 5
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/cifar10_cpu_quick.yaml"),
                          *tiny_overrides(tiny_imagefolder, tmp_path / "one", *extra)],
                         capture_output=True, text=True, env=env)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(29533 + (loader == "gpu")), str(ROOT / "train.py"), "--config", str(ROOT / "configs/cifar10_cpu_quick.yaml"),
                          *tiny_overrides(tiny_imagefolder, tmp_path / "two", *extra)],
                         capture_output=True, text=True, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 process(es)" in two.stdout
    assert max_weight_diff(_weights(tmp_path / "one"), _weights(tmp_path / "two")) < 1e-5
    # Evaluation shards the test set and gathers it back: same accuracy over all 35 images.
    last = lambda run: [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last(tmp_path / "one")["test_top1"] == last(tmp_path / "two")["test_top1"]
    assert last(tmp_path / "one")["test_loss"] == pytest.approx(last(tmp_path / "two")["test_loss"], abs=1e-5)


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


def test_existing_run_directory_is_not_overwritten(trained_run, tiny_imagefolder):
    run_dir, _ = trained_run
    with pytest.raises(ConfigError, match=r"already holds a run; continue it with --resume"):
        train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir)))


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


def test_eval_command_writes_metrics_and_confusion_matrix(trained_run, tmp_path):
    run_dir, summary = trained_run
    out = tmp_path / "eval" / "metrics.json"
    result = subprocess.run([sys.executable, "-m", "vitlab.cli", "eval", "--checkpoint", str(run_dir),
                             "--output", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
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
    assert "top1" in result.stdout and "class_2" in result.stdout


@pytest.mark.parametrize("split, size", [("val", 15), ("train", 81)])
def test_eval_split_val_and_train_score_exactly_the_examples_training_used(trained_run, tmp_path, split, size):
    # --split val must be the 15 held-out images (same seed, same indices): its numbers equal the
    # validation record of the checkpoint's epoch in metrics.jsonl.
    run_dir, summary = trained_run
    out = tmp_path / "m.json"
    result = subprocess.run([sys.executable, "-m", "vitlab.cli", "eval", "--checkpoint", str(run_dir / "checkpoints/last"),
                             "--split", split, "--output", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = json.loads(out.read_text())
    assert metrics["num_images"] == size
    if split == "val":
        last = _evals(run_dir)[-1]
        assert metrics["top1"] == last["val_top1"] and metrics["top5"] == last["val_top5"]
        assert metrics["loss"] == pytest.approx(last["val_loss"], abs=1e-5)


def test_eval_split_val_of_a_run_without_validation_is_refused(tiny_imagefolder, tmp_path):
    run_dir = tmp_path / "run"
    train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=1")))
    result = subprocess.run([sys.executable, "-m", "vitlab.cli", "eval", "--checkpoint", str(run_dir), "--split", "val"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "held out no validation images (data.val_size=0)" in result.stderr and "Traceback" not in result.stderr


def test_predict_command_prints_top_classes_and_names_unreadable_files(trained_run, tiny_imagefolder, tmp_path):
    run_dir, _ = trained_run
    image = next((tiny_imagefolder / "test" / "class_2").glob("*.png"))
    ok = subprocess.run([sys.executable, "-m", "vitlab.cli", "predict", "--checkpoint", str(run_dir), "--topk", "2",
                         str(image)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.startswith(f"{image}: class_2 ")
    bad = tmp_path / "bad.jpg"
    bad.write_text("nope")
    fail = subprocess.run([sys.executable, "-m", "vitlab.cli", "predict", "--checkpoint", str(run_dir), str(bad)],
                          capture_output=True, text=True)
    assert fail.returncode == 1
    assert fail.stderr.startswith(f"error: cannot read image '{bad}'") and "Traceback" not in fail.stderr
