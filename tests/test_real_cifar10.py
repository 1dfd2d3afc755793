"""Real CIFAR-10 (``VITLAB_CIFAR10_DIR``, set by .ci/run): loading and a short training run."""
from __future__ import annotations

from pathlib import Path

import pytest

from vitlab.config import load_config
from vitlab.data import load_split
from vitlab.training import train

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def test_real_cifar10_loads_in_standard_label_order(cifar10_dir):
    test = load_split("imagefolder", cifar10_dir, "test", subset=200)
    assert test.classes == CLASSES
    assert test.images.shape == (200, 3, 32, 32)
    assert test.labels.bincount().tolist() == [20] * 10
    # Real photographs, not noise: channel means near CIFAR-10's published statistics.
    mean = (test.images.float() / 255).mean((0, 2, 3))
    assert all(abs(m - ref) < 0.06 for m, ref in zip(mean.tolist(), (0.4914, 0.4822, 0.4465)))


@pytest.mark.slow
def test_short_training_on_real_cifar10_beats_chance_clearly(cifar10_dir, tmp_path):
    cfg = load_config(ROOT / "configs/cifar10_cpu_quick.yaml", [
        "data.dataset=imagefolder", f"data.root={cifar10_dir}", "data.train_subset=2000", "data.test_subset=500",
        "train.epochs=3", "train.batch_size=64", f"train.output_dir={tmp_path / 'run'}", "optim.warmup_epochs=0.5",
    ])
    summary = train(cfg)
    # Chance is 10%; 500 test images put 3 sigma at about +4 points.
    assert summary["test_top1"] > 0.2, summary
