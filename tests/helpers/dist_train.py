"""Launched by the tests under ``torchrun``: train a config (``key=value`` overrides), optionally
stopping after an epoch as an interruption would, or recording each process's first random draws;
several runs, one after the other in the same processes, separated by ``--then`` (a test's variants
then start their processes once; a run stopped by a signal, ``Preempted``, is followed by the next, and the
processes exit with its status 75 at the end). A part that starts with ``vitlab`` is that command instead
(``vitlab calibrate ... --then vitlab eval ...``: a test's commands in one launch).

    torchrun --nproc_per_node 2 dist_train.py [--config FILE] [--stop-after-epoch N] [--record PREFIX]
        [--record-batches PREFIX] [--sigterm-at-step RANK STEP] key=value ... [--then ...]

``--config FILE``: the YAML config the overrides apply to (default: none, the overrides alone).
``--record PREFIX`` writes ``PREFIX.<rank>.json`` at the first forward pass of training: the batch the
model sees (augmented), then a draw from torch's, NumPy's and Python's global generators (the streams
dropout, drop path and mixup use). ``--record-batches PREFIX``: every training batch's image digests
(:mod:`batch_record`). ``--sigterm-at-step RANK STEP``: process RANK alone sends itself SIGTERM as
optimizer step STEP begins (:mod:`signals`), as a scheduler's signal to one process would, but at a
step the test chooses however fast the run goes.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
from typing import Iterator

import numpy as np
import torch
from accelerate.state import AcceleratorState, GradientState, PartialState

from vitlab import training
from vitlab.config import load_config
from vitlab.errors import Preempted
from vitlab.data.transforms import ModelInput
from vitlab.models import VisionTransformer

parser = argparse.ArgumentParser()
parser.add_argument("--config")
parser.add_argument("--stop-after-epoch", type=int)
parser.add_argument("--record")
parser.add_argument("--record-batches")
parser.add_argument("--sigterm-at-step", nargs=2, type=int, metavar=("RANK", "STEP"))
parser.add_argument("overrides", nargs="*")


@contextlib.contextmanager
def patched(owner: object, name: str, value: object) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def recording_forward(prefix: str):
    """``VisionTransformer.forward`` that records the first training batch and draws to ``PREFIX.<rank>.json``."""
    forward, done = VisionTransformer.forward, []

    def record(self, x):
        if not done and self.training:
            done.append(True)
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            draws = {"images": x.tolist(), "torch": torch.rand(4).tolist(), "numpy": np.random.rand(4).tolist(),
                     "python": [random.random() for _ in range(4)]}
            with open(f"{prefix}.{rank}.json", "w") as f:
                json.dump(draws, f)
        return forward(self, x)

    return record


def run(args: argparse.Namespace) -> None:
    with contextlib.ExitStack() as patches:
        if args.record_batches:
            from batch_record import recording

            patches.enter_context(patched(ModelInput, "__call__", recording(args.record_batches)))
        if args.sigterm_at_step and int(os.environ.get("RANK", 0)) == args.sigterm_at_step[0]:
            from signals import signalling_step

            patches.enter_context(patched(training.Loop, "step", signalling_step(args.sigterm_at_step[1])))
        if args.record:
            patches.enter_context(patched(VisionTransformer, "forward", recording_forward(args.record)))
        training.train(load_config(args.config, args.overrides), stop_after_epoch=args.stop_after_epoch)


def runs(argv: list[str]) -> Iterator[list[str]]:
    """``argv`` cut at each ``--then``."""
    current: list[str] = []
    for arg in argv:
        if arg == "--then":
            yield current
            current = []
        else:
            current.append(arg)
    yield current


every = list(runs(sys.argv[1:]))
preempted = None
for i, argv in enumerate(every):
    if i:  # Accelerate's process-wide state, for the next run
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    with contextlib.ExitStack() as keep:
        if i < len(every) - 1:  # the process group stays for the next run (end_training, a command's end destroy it)
            keep.enter_context(patched(PartialState, "destroy_process_group", lambda self, group=None: None))
            keep.enter_context(patched(torch.distributed, "destroy_process_group", lambda group=None: None))
        try:
            if argv[:1] == ["vitlab"]:
                from vitlab.cli import main

                main(argv[1:])
            else:
                run(parser.parse_args(argv))
        except Preempted as e:
            preempted = e
if preempted is not None:
    raise preempted
