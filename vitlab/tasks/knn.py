"""k-nearest-neighbour classification by a backbone's features (DINO's protocol, Caron et al. 2021): what a
model's pooled pre-logits features are worth without its head. Each evaluated image votes among the ``k``
training images most like it (cosine similarity of L2-normalized features), each neighbour's vote weighted by
``exp(similarity / T)`` (``T = 0.07``), for its class; the class with the most weight wins. The share of the
weight each class gets is the vote's class probabilities (:func:`knn_probabilities`; of a multi-label bank, the
share of the weight of the neighbours showing each class), out of sample when each image leaves itself out of the
vote (``leave_one_out``): what ``vitlab inspect --knn`` gives cleanlab."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import Tensor, nn

from ..inference.forward import gathered, pooled_features

# pooled_features: vitlab.inference's
__all__ = ["pooled_features", "collect_features", "knn_predict", "knn_probabilities", "nearest"]


def collect_features(model: nn.Module, loader: Any, accelerator: Accelerator,
                     model_input: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor]:
    """Every image's pooled features ``(N, E)`` (float32, on the CPU) and its label ``(N,)``, in the loader's order,
    gathered over the processes (``loader`` prepared by ``accelerator``, or one that shards itself exactly):
    :func:`~vitlab.inference.forward.gathered` of :func:`~vitlab.inference.forward.pooled_features`."""
    return gathered(model, loader, accelerator, lambda net, images: pooled_features(net, images).float(), model_input)


def nearest(queries: Tensor, bank: Tensor, k: int, offset: int | None = None,
            chunk: int = 1024) -> Iterator[tuple[Tensor, Tensor]]:
    """Each ``chunk`` of ``queries`` ``(M, E)`` against ``bank`` ``(N, E)`` (rows unit length: cosine similarity): the
    similarities and positions in ``bank`` of each row's ``k`` nearest, highest first, ``(m, k)`` each (``k`` cut to
    what the bank holds). ``offset``: the queries are ``bank[offset:offset + M]`` themselves, each leaving itself
    out. Chunks keep the similarity matrix at ``chunk x N``."""
    k = min(k, len(bank) - (offset is not None))
    for start in range(0, len(queries), chunk):
        sims = queries[start:start + chunk] @ bank.T
        if offset is not None:
            rows = torch.arange(len(sims))
            sims[rows, rows + offset + start] = -float("inf")
        yield sims.topk(k, dim=1)


def knn_probabilities(train_features: Tensor, train_labels: Tensor, features: Tensor, num_classes: int, k: int = 20,
                      temperature: float = 0.07, chunk: int = 1024, leave_one_out: bool = False) -> Tensor:
    """Each row of ``features`` ``(M, E)`` voted on by its ``k`` nearest ``train_features`` ``(N, E)`` (cosine
    similarity), each vote weighted by ``exp(similarity / temperature)``: the share of the weight for each class,
    float32 ``(M, num_classes)``, rows summing to 1. ``train_labels``: class indices ``(N,)``, or multi-hot
    ``(N, num_classes)`` (then a class's share is that of the neighbours showing it, and rows need not sum to 1).
    ``leave_one_out``: ``features`` are ``train_features`` themselves, and row ``i`` is voted on without image
    ``i`` (an out-of-sample probability for every image of the bank)."""
    train = F.normalize(train_features.float(), dim=1)
    onehot = train_labels.float() if train_labels.dim() == 2 else F.one_hot(train_labels.long(), num_classes).float()
    shares = []
    queries = F.normalize(features.float(), dim=1)
    for top, index in nearest(queries, train, k, 0 if leave_one_out else None, chunk):
        weights = ((top - top[:, :1]) / temperature).exp()  # shifted by the nearest: the shares alike, no overflow
        shares.append(torch.einsum("mk,mkc->mc", weights, onehot[index]) / weights.sum(1, keepdim=True))
    return torch.cat(shares)


def knn_predict(train_features: Tensor, train_labels: Tensor, features: Tensor, num_classes: int, k: int = 20,
                temperature: float = 0.07, chunk: int = 1024) -> Tensor:
    """Each row of ``features`` ``(M, E)`` classified by its ``k`` nearest ``train_features`` ``(N, E)`` (cosine
    similarity), their votes for ``train_labels`` weighted by ``exp(similarity / temperature)``: class indices
    ``(M,)``, the argmax of :func:`knn_probabilities`."""
    return knn_probabilities(train_features, train_labels, features, num_classes, k, temperature, chunk).argmax(1)
