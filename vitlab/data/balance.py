"""Class-balanced sampling (``data.sampler``) for skewed classes: an epoch of ``N`` draws with replacement,
each image drawn with a probability set by its class's size ``n_c``, so that rare classes are seen more often.

- ``class_balanced``: every class equally often (an image's weight ``1 / n_c``; Kang et al. 2020's
  class-balanced sampling, ``q = 0``);
- ``sqrt``: a class in proportion to ``sqrt(n_c)`` (weight ``1 / sqrt(n_c)``; their square-root sampling,
  ``q = 1/2``), between the data's own frequencies and equal ones.

:class:`ClassSampler` draws as torch's ``WeightedRandomSampler`` draws (``torch.multinomial`` of the weights,
tested equal), from a generator seeded by ``(train.seed, epoch)``: the epoch's order is the *global* one,
which Accelerate cuts into the processes' parts (``split_batches``), as :mod:`.repeat` does. So it does not
depend on the number of processes or DataLoader workers, and a run resumes inside an epoch on the same
samples. An image drawn k times in an epoch is yielded as ``image + copy * N`` for its copies 0..k-1:
:class:`~vitlab.data.images.TensorImageDataset` reads image ``j % N`` and seeds its augmentation by ``j``,
so the copies are augmented independently.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor
from torch.utils.data import Sampler

from ..seeding import process_seed

__all__ = ["ClassSampler", "sample_weights"]

EXPONENTS = {"class_balanced": 0.0, "sqrt": 0.5}  # a class drawn in proportion to n_c ** q


def sample_weights(labels: Tensor, kind: str) -> Tensor:
    """Each image's weight, float64 ``(N,)``: ``n_c ** (q - 1)`` of its class's count ``n_c``, ``q`` of
    :data:`EXPONENTS` (a class is then drawn in proportion to ``n_c ** q``)."""
    if kind not in EXPONENTS:
        raise ValueError(f"sampler {kind!r}: expected one of {', '.join(EXPONENTS)}")
    counts = torch.bincount(labels).double()
    return counts.clamp(min=1).pow(EXPONENTS[kind] - 1)[labels]


class ClassSampler(Sampler[int]):
    """The global order of an epoch of ``len(labels)`` draws with replacement (module docstring).

    Args:
        labels: int64 ``(N,)``, the training images' classes.
        kind: ``'class_balanced'`` or ``'sqrt'``.
        seed: ``train.seed``; it and the epoch (``set_epoch``) decide the draws.
    """

    def __init__(self, labels: Tensor, kind: str, seed: int) -> None:
        self.weights, self.n, self.seed = sample_weights(labels, kind), len(labels), seed
        self.epoch = 0

    @staticmethod
    def share(counts: Tensor, kind: str, k: int) -> float:
        """The expected share of class ``k``'s images in an epoch, from the class ``counts`` ``(K,)``."""
        q = counts.double().pow(EXPONENTS[kind]) * (counts > 0)
        return (q[k] / q.sum()).item()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def draws(self) -> Tensor:
        """The epoch's images, drawn as ``WeightedRandomSampler(weights, N)`` draws them from its generator."""
        g = torch.Generator().manual_seed(process_seed(self.seed, 0, self.epoch, "sampler"))
        return torch.multinomial(self.weights, self.n, True, generator=g)

    def __iter__(self) -> Iterator[int]:
        ids = self.draws()
        order = torch.argsort(ids, stable=True)  # the copies of an image, in the order they were drawn
        ranked = ids[order]
        place = torch.arange(self.n)
        first = torch.ones(self.n, dtype=torch.bool)
        first[1:] = ranked[1:] != ranked[:-1]
        copy = torch.empty_like(ids)
        copy[order] = place - torch.cummax(torch.where(first, place, 0), 0).values
        return iter((ids + copy * self.n).tolist())
