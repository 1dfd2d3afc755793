"""Stand-in trials for the tests of ``vitlab tune`` that are about the study (its pruner, its database, its stop and
continuation, two processes sharing it) rather than the training its trials do (``test_tuning``'s first test trains
real ones): a trial's process is a few lines of Python that write a run's ``metrics.jsonl``, in place of train.py.

In the test's process: ``monkeypatch.setattr(vitlab.tuning.study, "_command", stand_in(...))``. In a study process of
its own (a test of signals or of two processes): ``python stand_in_trials.py SECONDS_PER_EPOCH EPOCHS tune ...``
runs ``vitlab tune ...`` with the stand-in; with ``STAND_IN_GPUS=3,5`` in its environment, ``--devices`` sees those
GPUs (none here) and starts its processes a GPU as this script, their trials stand-ins too."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable


def stand_in(seconds_per_epoch: float = 0.01, epochs: int = 10) -> Callable[..., list[str]]:
    """``vitlab.tuning.study._command``'s stand-in: a run of ``epochs`` evaluated epochs, ``seconds_per_epoch`` each,
    whose validation loss is 0.1 (top-1 0.9) at a learning rate that learns and 1.0 (top-1 0.0) at one that cannot
    (<= 1e-4); on SIGTERM it exits as a preempted run does (75)."""

    def command(base: str, overrides: list[str], values: dict[str, Any], run_dir: Path) -> list[str]:
        loss = 0.1 if values["optim.lr"] > 1e-4 else 1.0
        script = (
            "import json, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))\n"
            f"with open({str(run_dir / 'metrics.jsonl')!r}, 'a') as f:\n"
            f"    for epoch in range(1, {epochs + 1}):\n"
            f"        time.sleep({seconds_per_epoch})\n"
            f"        f.write(json.dumps({{'split': 'eval', 'epoch': epoch, 'val_loss': {loss}, "
            f"'val_top1': {1 - loss}}}) + '\\n'); f.flush()\n")
        return [sys.executable, "-c", script]

    return command


if __name__ == "__main__":
    import os

    import vitlab.tuning.devices
    import vitlab.tuning.study
    from vitlab.cli import main

    vitlab.tuning.study._command = stand_in(float(sys.argv[1]), int(sys.argv[2]))
    if os.environ.get("STAND_IN_GPUS"):
        vitlab.tuning.devices._visible_gpus = lambda: os.environ["STAND_IN_GPUS"].split(",")
        vitlab.tuning.devices._program = lambda: [sys.executable, __file__, *sys.argv[1:3]]
    main(sys.argv[3:])
