"""Record what training feeds the model: for each training batch, one line of ``PREFIX.<rank>.jsonl``
holding a digest of each image (uint8, augmented, before normalization). An image's digest names the
sample and its augmentation, so two runs' lines say whether every step saw the same samples, augmented
alike, in the same order."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from vitlab.data.transforms import ModelInput


def recording(prefix: str | Path):
    """A :class:`ModelInput` ``__call__`` that also appends each training batch's digests to
    ``PREFIX.<rank>.jsonl``: patch it in (``ModelInput.__call__ = recording(prefix)``)."""
    original = ModelInput.__call__

    def call(self, images: torch.Tensor, train: bool = False) -> torch.Tensor:
        if train:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            digests = [hashlib.sha1(image.cpu().contiguous().numpy().tobytes()).hexdigest()[:12] for image in images]
            with open(f"{prefix}.{rank}.jsonl", "a") as f:
                f.write(json.dumps(digests) + "\n")
        return original(self, images, train)

    return call


def global_batches(prefix: str | Path) -> list[list[str]]:
    """The recorded global batches: line k of every rank's file, joined in rank order."""
    files = sorted(Path(prefix).parent.glob(f"{Path(prefix).name}.*.jsonl"), key=lambda f: int(f.suffixes[-2][1:]))
    ranks = [[json.loads(line) for line in f.read_text().splitlines()] for f in files]
    assert len({len(r) for r in ranks}) == 1, [len(r) for r in ranks]
    return [[d for r in ranks for d in r[k]] for k in range(len(ranks[0]))]
