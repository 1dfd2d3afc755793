"""Launched by the tests under ``torchrun``: train a config (``key=value`` overrides), optionally
stopping after an epoch as an interruption would, or recording each process's first random draws.

    torchrun --nproc_per_node 2 dist_train.py [--stop-after-epoch N] [--record PREFIX] [--record-batches PREFIX]
        [--sigterm-at-step RANK STEP] key=value ...

``--record PREFIX`` writes ``PREFIX.<rank>.json`` at the first forward pass of training: the batch the
model sees (augmented), then a draw from torch's, NumPy's and Python's global generators (the streams
dropout, drop path and mixup use). ``--record-batches PREFIX``: every training batch's image digests
(:mod:`batch_record`). ``--sigterm-at-step RANK STEP``: process RANK alone sends itself SIGTERM as
optimizer step STEP begins (:mod:`signals`), as a scheduler's signal to one process would, but at a
step the test chooses however fast the run goes.
"""
from __future__ import annotations

import argparse
import json
import os
import random

import numpy as np
import torch

from vitlab.config import load_config
from vitlab.training import train
from vitlab.models import VisionTransformer

parser = argparse.ArgumentParser()
parser.add_argument("--stop-after-epoch", type=int)
parser.add_argument("--record")
parser.add_argument("--record-batches")
parser.add_argument("--sigterm-at-step", nargs=2, type=int, metavar=("RANK", "STEP"))
parser.add_argument("overrides", nargs="*")
args = parser.parse_args()

if args.record_batches:
    from batch_record import recording

    from vitlab.data.transforms import ModelInput

    ModelInput.__call__ = recording(args.record_batches)

if args.sigterm_at_step and int(os.environ.get("RANK", 0)) == args.sigterm_at_step[0]:
    from signals import signalling_step

    from vitlab import training

    training._Loop.step = signalling_step(args.sigterm_at_step[1])

if args.record:
    forward = VisionTransformer.forward

    def recording_forward(self, x):
        if not getattr(recording_forward, "done", False) and self.training:
            recording_forward.done = True
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            draws = {"images": x.tolist(), "torch": torch.rand(4).tolist(), "numpy": np.random.rand(4).tolist(),
                     "python": [random.random() for _ in range(4)]}
            with open(f"{args.record}.{rank}.json", "w") as f:
                json.dump(draws, f)
        return forward(self, x)

    VisionTransformer.forward = recording_forward

train(load_config(None, args.overrides), stop_after_epoch=args.stop_after_epoch)
