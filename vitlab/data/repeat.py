"""Repeated augmentation (Hoffer et al. 2020; DeiT's ``RASampler``, timm's ``RepeatAugSampler``):
``data.aug_repeats`` copies of each chosen image in an epoch, each augmented independently.

:class:`RepeatAugSampler` orders a whole epoch for the *global* batch, which Accelerate cuts into the
processes' parts (``split_batches``), so the epoch does not depend on the number of processes (a run
resumes on another count with the same global batches):

1. the images are shuffled by ``(train.seed, epoch)`` and each is repeated ``repeats`` times in a row,
   as timm's ``[0, 0, 0, 1, 1, 1, ...]``;
2. the epoch keeps timm's length: ``N // 256 * 256`` samples (``N`` below 256: ``N``), in whole global
   batches; so an epoch sees about ``N / repeats`` distinct images;
3. global batch ``s`` holds positions ``[sB, (s + 1)B)`` of that sequence, as it does in DeiT across all
   ranks, dealt so that position ``q`` of the batch goes before ``q'`` when ``(q % repeats, q // repeats)``
   is smaller: on ``repeats`` processes, or a multiple of it, the copies of an image land on different
   processes; on exactly ``repeats`` processes each reads what timm's sampler gives its rank (tested
   against timm). On a multiple of it (6 processes, 3 repeats) the ranks' samples are not timm's: timm
   deals each rank every P-th sample of the repeated sequence, vitlab keeps the global batch whole.

The sampler yields ``image + copy * N``: :class:`~vitlab.data.images.TensorImageDataset` reads image
``j % N`` and seeds its augmentation by ``j``, so the copies draw independent augmentations and copy 0
draws what the image draws without repeats.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor
from torch.utils.data import Sampler

from ..seeding import process_seed

__all__ = ["RepeatAugSampler", "epoch_length"]

SELECTED_ROUND = 256  # timm's selected_round: the epoch is a multiple of it


def epoch_length(n: int) -> int:
    """Samples in an epoch of ``n`` images with repeated augmentation: timm's ``N // 256 * 256`` (``n``
    below 256), whatever the number of repeats."""
    return n // SELECTED_ROUND * SELECTED_ROUND if n >= SELECTED_ROUND else n


class RepeatAugSampler(Sampler[int]):
    """The global order of an epoch of ``n`` images with ``repeats`` copies each (module docstring).

    Args:
        n: Images in the data set.
        repeats: Copies of each chosen image (DeiT: 3).
        seed: ``train.seed``; the epoch (``set_epoch``) and the seed decide the shuffle.
        batch_size: The global batch the order is dealt within (1: no dealing).
    """

    def __init__(self, n: int, repeats: int, seed: int, batch_size: int = 1) -> None:
        self.n, self.repeats, self.seed, self.batch_size = n, repeats, seed, batch_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return epoch_length(self.n) // self.batch_size * self.batch_size

    def order(self, perm: Tensor, batch_size: int) -> Tensor:
        """The epoch's sample ids (``image + copy * n``) from the shuffled images ``perm``, dealt within
        global batches of ``batch_size``."""
        r = self.repeats
        length = epoch_length(self.n) // batch_size * batch_size
        t = torch.arange(length)
        ids = perm[t // r] + (t % r) * self.n  # [a, a + n, a + 2n, b, b + n, ...]
        within = torch.arange(batch_size)
        deal = within[torch.argsort(within % r * batch_size + within // r)]  # (q % r, q // r) order
        return ids.view(-1, batch_size)[:, deal].reshape(-1)

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(process_seed(self.seed, 0, self.epoch, "repeats"))
        return iter(self.order(torch.randperm(self.n, generator=g), self.batch_size).tolist())
