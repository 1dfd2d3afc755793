"""Where randomness comes from during training.

Every random draw of a training epoch on one process — augmentation (both loaders), dropout, drop
path, mixup/cutmix, RandAugment, DataLoader workers — comes from generators seeded by
:func:`process_seed` ``(train.seed, process index, epoch, stream)``; within the epoch the draws follow
in step order. So the processes of a multi-process run draw *different* streams, a run is reproducible
from its config, and a run resumed at an epoch boundary draws exactly what the uninterrupted run drew,
with no RNG state to checkpoint. What must be *equal* on every process — the initial weights and the
order of the data — is seeded from ``train.seed`` (and the epoch) alone.

Each consumer has a stream of its own, so no two draw the same numbers:

- ``'global'``: Python's, NumPy's and torch's global generators (:func:`seed_process`): dropout, drop
  path, mixup/cutmix, the DataLoader's workers and its per-image transforms;
- ``'augment'``: the device-resident image loader's crops, flips and RandAugment;
- ``'windows'``: the language model's training windows (the same on every process, so process 0's).
"""
from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["STREAMS", "process_seed", "seed_process"]

STREAMS = ("global", "augment", "windows")


def process_seed(seed: int, process_index: int, epoch: int, stream: str = "global") -> int:
    """A 32-bit seed, a pure function of its arguments, well mixed (NumPy's ``SeedSequence``) so that
    neighbouring seeds, processes and epochs give unrelated streams; each of :data:`STREAMS` is its own
    ``SeedSequence`` child (``spawn_key``), independent of the others."""
    if stream not in STREAMS:
        raise ValueError(f"stream={stream!r}; expected one of {STREAMS}")
    spawn_key = () if stream == "global" else (STREAMS.index(stream),)
    return int(np.random.SeedSequence([seed, process_index, epoch], spawn_key=spawn_key).generate_state(1)[0])


def seed_process(seed: int, process_index: int, epoch: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (CPU and every CUDA device) for one
    process's epoch."""
    s = process_seed(seed, process_index, epoch)
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)  # also seeds every CUDA device
