"""Shared fixtures. A run in which no test passed is a failure, not a green build."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from helpers.forked import TORCHRUN_2, run_two  # re-exported for the tests

__all__ = ["TORCHRUN_2", "run_two"]  # and the fixtures and helpers below

if TYPE_CHECKING:
    import subprocess


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist (make test runs one worker per core) each worker, and what it starts, gets one
    # core's share of threads: two workers with torch's default of a thread per core would spin against
    # each other (3x slower here).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    passed = len(reporter.stats.get("passed", [])) if reporter is not None else 0
    if exitstatus == 0 and passed == 0:
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def cifar10_dir() -> Path:
    """The real CIFAR-10 in ImageFolder layout (``VITLAB_CIFAR10_DIR``); skip if absent."""
    root = os.environ.get("VITLAB_CIFAR10_DIR")
    if not root or not (Path(root) / "train").is_dir():
        pytest.skip("real CIFAR-10 not available: set VITLAB_CIFAR10_DIR to its ImageFolder root")
    return Path(root)


# Exactness is a CPU property. CPU kernels sum in a fixed order; on CUDA, cuDNN's convolution backward
# (the patch embedding) and atomics-based reductions may sum in another order on every run (on an H100 a
# resumed run's weights differed from the uninterrupted run's by 1e-7, a 2-step accumulation from one big
# batch by 1e-5). Tests that compare weights bit for bit, or to 1e-5, therefore train on the CPU (as
# `accelerate launch --cpu` does, through ACCELERATE_USE_CPU) also where a GPU is present: what they
# check, the loop's bookkeeping, is the same on every device.


# Two processes under torchrun (helpers.forked.TORCHRUN_2). --standalone: a rendezvous on a free port of localhost, so
# that launches of several pytest workers (``-n 4 --dist load`` builds a module's launch fixture in each) or of two
# suites on one machine never meet on a fixed --master_port (on a 16-core GPU machine two of them did: EADDRINUSE).
# Tests of what two processes compute fork them from the test's process instead (helpers.forked.run_two).


def launch_env(processes: int = 1, *, exact: bool = False) -> dict[str, str]:
    """The environment for a training subprocess of ``processes`` processes on this machine: on the CPU
    (gloo) when the machine has fewer GPUs than processes (NCCL needs a GPU for each), or when the test
    compares results exactly (``exact``, see above)."""
    env = dict(os.environ)
    if exact or (processes > 1 and torch.cuda.device_count() < processes):
        env["ACCELERATE_USE_CPU"] = "true"
    return env


def eval_on_two_processes(run: Path, predictions: Path, output: Path) -> None:
    """``vitlab eval --checkpoint run`` on 2 CPU processes (sharded and gathered; :func:`run_two`), writing
    ``predictions`` (CSV) and ``output`` (JSON), batches of 8."""
    launched = run_two(["-m", "vitlab.cli", "eval", "--checkpoint", str(run), "--predictions", str(predictions),
                        "--batch-size", "8", "--output", str(output)], launch_env(2, exact=True))
    assert launched.returncode == 0, launched.stderr[-3000:]


@pytest.fixture
def on_cpu(monkeypatch) -> None:
    """Train on the CPU in this test, in this process and the processes it starts (see above)."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")


def reset_accelerate() -> None:
    """Accelerate keeps process-wide singletons; call between in-process training runs."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    yield
    reset_accelerate()


def make_imagefolder(root: Path, per_class: dict[str, int], size: int = 32, seed: int = 0) -> Path:
    """Write a learnable ImageFolder set: each class a distinct colour plus noise, as PNGs."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, count in per_class.items():
        for c in range(3):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            base = np.zeros(3)
            base[c] = 200
            for i in range(count):
                pixels = np.clip(base + rng.normal(0, 40, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i:04d}.png")
    return root


@pytest.fixture(scope="session")
def tiny_imagefolder(tmp_path_factory) -> Path:
    """3 classes, 32 train and 12 test images each."""
    return make_imagefolder(tmp_path_factory.mktemp("tiny"), {"train": 32, "test": 12})


def train_tiny(data_root: Path, run_dir: Path, *extra: str) -> Path:
    """The tiny run of :func:`tiny_overrides` (``extra`` keys after its own) trained in this process: ``run_dir``."""
    from vitlab.config import load_config
    from vitlab.training import train

    train(load_config(None, tiny_overrides(data_root, run_dir, *extra)))
    reset_accelerate()
    return run_dir


@pytest.fixture(scope="session")
def _tiny_classifier_run(tiny_imagefolder, tmp_path_factory) -> Path:
    return train_tiny(tiny_imagefolder, tmp_path_factory.mktemp("tiny_run") / "run", "train.epochs=1",
                      "data.loader=torch")


@pytest.fixture(scope="module")
def tiny_run(_tiny_classifier_run, tmp_path_factory) -> Path:
    """A trained tiny classifier of the tiny data set (one epoch), trained once a session and copied for each module
    that asks (its tests may calibrate it or write beside it)."""
    import shutil

    return Path(shutil.copytree(_tiny_classifier_run, tmp_path_factory.mktemp("tiny_run_copy") / "run",
                                symlinks=True))


def tiny_overrides(data_root: Path, output_dir: Path, *extra: str) -> list[str]:
    """A run that takes a few seconds on a CPU: a 1-block ViT on the tiny data set, without ``curves.png`` (its
    figure was half of such a run's time; test_training's ``trained_run`` draws it)."""
    return [
        "model.name=vit_cifar_tiny_patch4_32", "model.depth=1", "model.embed_dim=32", "model.num_heads=2",
        "model.num_classes=3", "data.dataset=imagefolder", f"data.root={data_root}", "data.num_workers=0",
        "train.batch_size=16", "train.epochs=2", "optim.warmup_epochs=1", "optim.lr=3e-3", "train.log_every=2",
        "train.curves=false", f"train.output_dir={output_dir}", *extra,
    ]


def max_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| over two state dicts, leaving out the key third of each ``attn.qkv.bias``.

    That bias has an exactly zero gradient (softmax is invariant to adding ``q . b_k`` to every score
    of a query), so what it receives is rounding noise, which Adam's normalisation turns into steps
    of size ~lr: it differs between any two summation orders and says nothing about the training.
    """
    assert a.keys() == b.keys()
    worst = 0.0
    for name in a:
        diff = (a[name].float() - b[name].float()).abs()
        if name.endswith("attn.qkv.bias"):
            third = diff.numel() // 3
            diff = torch.cat([diff[:third], diff[2 * third:]])
        worst = max(worst, diff.max().item() if diff.numel() else 0.0)
    return worst


def signal_at_step(monkeypatch: pytest.MonkeyPatch, step: int, signum: int = 15) -> None:
    """Send this process ``signum`` (SIGTERM) as optimizer step ``step`` (1-based, counted over the run)
    begins, as a scheduler would: the loop is to finish that step, then stop."""
    from helpers.signals import signalling_step
    from vitlab import training

    monkeypatch.setattr(training.Loop, "step", signalling_step(step, signum))


def train_until_signal(monkeypatch: pytest.MonkeyPatch, cfg, step: int) -> None:
    """Train ``cfg`` in this process until SIGTERM comes as optimizer step ``step`` begins
    (:func:`signal_at_step`): the run finishes that step, checkpoints and raises ``Preempted``."""
    from vitlab.errors import Preempted
    from vitlab.training import train

    with monkeypatch.context() as m:
        signal_at_step(m, step)
        with pytest.raises(Preempted):
            train(cfg)
    reset_accelerate()


def same_run_records(a: Path, b: Path) -> bool:
    """Whether two runs' ``metrics.jsonl`` hold the same records, timings left out."""
    import json

    timings = {"epoch_time", "data_time", "examples_per_s", "eval_time"}
    read = lambda run: [{k: v for k, v in json.loads(line).items() if k not in timings}
                        for line in (run / "metrics.jsonl").read_text().splitlines()]
    return read(a) == read(b)


def torchrun_worker(launcher: subprocess.Popen[str], rank: int) -> int:
    """The pid of the worker of ``rank`` that ``launcher`` (torchrun) started."""
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == launcher.pid and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    raise AssertionError(f"no worker of rank {rank}")
