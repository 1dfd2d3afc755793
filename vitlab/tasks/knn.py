"""k-nearest-neighbour classification by a backbone's features (DINO's protocol, Caron et al. 2021): what a
model's pooled pre-logits features are worth without its head. Each evaluated image votes among the ``k``
training images most like it (cosine similarity of L2-normalized features), each neighbour's vote weighted by
``exp(similarity / T)`` (``T = 0.07``), for its class; the class with the most weight wins."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import Tensor, nn

from ..inference.forward import gathered, pooled_features

__all__ = ["pooled_features", "collect_features", "knn_predict"]  # pooled_features: vitlab.inference's


def collect_features(model: nn.Module, loader: Any, accelerator: Accelerator,
                     model_input: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor]:
    """Every image's pooled features ``(N, E)`` (float32, on the CPU) and its label ``(N,)``, in the loader's order,
    gathered over the processes (``loader`` prepared by ``accelerator``, or one that shards itself exactly):
    :func:`~vitlab.inference.forward.gathered` of :func:`~vitlab.inference.forward.pooled_features`."""
    return gathered(model, loader, accelerator, lambda net, images: pooled_features(net, images).float(), model_input)


def knn_predict(train_features: Tensor, train_labels: Tensor, features: Tensor, num_classes: int, k: int = 20,
                temperature: float = 0.07, chunk: int = 1024) -> Tensor:
    """Each row of ``features`` ``(M, E)`` classified by its ``k`` nearest ``train_features`` ``(N, E)`` (cosine
    similarity), their votes for ``train_labels`` weighted by ``exp(similarity / temperature)``: class indices ``(M,)``."""
    train = F.normalize(train_features.float(), dim=1)
    votes = []
    for start in range(0, len(features), chunk):
        sims = F.normalize(features[start:start + chunk].float(), dim=1) @ train.T
        top, index = sims.topk(min(k, len(train)), dim=1)
        weights = (top / temperature).exp()
        scores = torch.zeros(len(top), num_classes).scatter_add_(1, train_labels[index], weights)
        votes.append(scores.argmax(1))
    return torch.cat(votes)
