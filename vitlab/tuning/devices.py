"""``vitlab tune --devices``: one trial a GPU on a machine with several. A process of its own a GPU (the same study
command, its ``CUDA_VISIBLE_DEVICES`` that one GPU) shares the study's database as processes started by hand do
(:mod:`vitlab.tuning.study`); the process that started them waits for them and writes the study's report.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

from ..errors import ConfigError

__all__ = ["chosen_gpus", "run_workers"]


def _visible_gpus() -> list[str]:
    """The CUDA GPUs this process sees, each as ``CUDA_VISIBLE_DEVICES`` names it (its entry there where set, else its
    number): what a process shown only that GPU must be given."""
    import torch

    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [name.strip() for name in visible.split(",")][:count]
    return [str(i) for i in range(count)]


def chosen_gpus(devices: str) -> list[str]:
    """The GPUs ``devices`` names ('all', or this process's GPU numbers: '0,2'), as ``CUDA_VISIBLE_DEVICES`` entries;
    one line (:class:`ConfigError`) for GPUs this process does not see, or none."""
    gpus = _visible_gpus()
    if not gpus:
        raise ConfigError(f"--devices {devices}: this machine shows no CUDA GPU; leave --devices out to run one trial "
                          f"at a time")
    if devices == "all":
        return gpus
    numbers = [n.strip() for n in devices.split(",")]
    if not all(n.isdigit() and int(n) < len(gpus) for n in numbers) or len({int(n) for n in numbers}) < len(numbers):
        raise ConfigError(f"--devices {devices}: give GPUs this process sees (0-{len(gpus) - 1}), each once, or 'all'")
    return [gpus[int(n)] for n in numbers]


def _program() -> list[str]:
    """How a worker is started: ``vitlab`` in this interpreter."""
    return [sys.executable, "-m", "vitlab.cli"]


def run_workers(gpus: list[str], options: dict[str, Any], overrides: list[str]) -> None:
    """Run ``vitlab tune`` with ``options`` (``{"trials": 20, "base-first": True, "storage": None, ...}``: ``--trials 20
    --base-first``) and ``overrides`` once a GPU of ``gpus``, each process shown only its GPU, and wait for them all.
    A stop (SIGTERM, Ctrl-C) is passed to each; one line (``SystemExit``) if any of them stopped or failed."""
    arguments = [a for key, value in options.items() if value is not None and value is not False
                 for a in ((f"--{key}",) if value is True else (f"--{key}", str(value)))]
    workers = [subprocess.Popen([*_program(), "tune", *arguments, "--worker", *overrides],
                                env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu}) for gpu in gpus]
    stopped: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        stopped.append(signum)
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        codes = []
        for w in workers:
            while True:
                try:
                    codes.append(w.wait())
                    break
                except KeyboardInterrupt:  # Ctrl-C (the workers' group may have it too): stop them, wait for them
                    on_signal(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if stopped:
        raise SystemExit("the study stopped; the same command continues it")
    failed = [f"GPU {gpu}: exit code {code}" for gpu, code in zip(gpus, codes) if code]
    if failed:
        raise SystemExit(f"a study process ended with an error ({'; '.join(failed)}; its output above); the same "
                         f"command continues the study")
