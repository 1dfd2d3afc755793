"""Out-of-sample class probabilities of every image of a split, from its features alone: what confident learning
(cleanlab) needs to tell a wrong label from a hard image. An image's own label must not shape its probabilities,
or a wrong label would look right. Two ways:

- :func:`knn_out_of_sample`: each image voted on by its ``k`` nearest other images of the split (vitlab's k-NN,
  :func:`~vitlab.tasks.knn.knn_probabilities` with ``leave_one_out``): no training at all.
- :func:`cross_fitted`: the split cut into ``folds`` folds (stratified by class), a linear head fitted on the
  features of all folds but one (:func:`~vitlab.tasks.linear_probe.fit_linear_probe`, scikit-learn's logistic
  regression at ``C = 1``) and its probabilities taken on the fold left out, for each fold in turn: cleanlab's
  recipe of cross-validated predictions on embeddings, its models ``folds`` heads on frozen features rather than
  ``folds`` networks trained anew (each of those a whole training run)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..tasks.knn import knn_probabilities
from ..tasks.linear_probe import fit_linear_probe

__all__ = ["knn_out_of_sample", "cross_fitted", "fold_of", "agreement", "TRUSTED_AGREEMENT"]

# Below this agreement of the out-of-sample probabilities with the given labels, cleanlab reads many of the model's
# own mistakes as wrong labels (the figures behind it: docs/inspect.md, "How it decides"). A rule of thumb, not a
# measured boundary.
TRUSTED_AGREEMENT = 0.7


def knn_out_of_sample(features: Tensor, labels: Tensor, num_classes: int, k: int = 20) -> Tensor:
    """float32 ``(N, num_classes)``: each image's share of its ``k`` nearest other images' votes for each class
    (cosine similarity, votes weighted by ``exp(similarity / 0.07)``); ``labels`` class indices ``(N,)`` or
    multi-hot ``(N, num_classes)``."""
    return knn_probabilities(features, labels, features, num_classes, k, leave_one_out=True)


def fold_of(labels: Tensor, folds: int, seed: int = 0) -> Tensor:
    """Each image's fold ``(N,)`` in ``0..folds-1``: the images of each class (of each label set, multi-label)
    shuffled by ``seed`` and dealt to the folds in turn, so every fold holds each class in proportion."""
    keys = labels.long() if labels.dim() == 1 else torch.unique(labels.long(), dim=0, return_inverse=True)[1]
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(keys), generator=generator)
    order = order[torch.sort(keys[order], stable=True).indices]  # grouped by class, shuffled within each
    fold = torch.empty(len(keys), dtype=torch.long)
    fold[order] = torch.arange(len(keys)) % folds
    return fold


def cross_fitted(features: Tensor, labels: Tensor, num_classes: int, fold: Tensor, l2: float | None = None) -> Tensor:
    """float32 ``(N, num_classes)``: each image's probabilities (softmax; multi-hot ``labels``: sigmoids) from the
    linear head fitted on the images of the other folds (``fold``: each image's, as :func:`fold_of` deals them), at L2
    strength ``l2`` (default ``1 / N`` of the fitted images, scikit-learn's ``C = 1``)."""
    x = features.float()
    probs = torch.empty(len(x), num_classes)
    for f in torch.unique(fold).tolist():
        held = fold == f
        fitted = ~held
        weight, bias = fit_linear_probe(x[fitted], labels[fitted], num_classes,
                                        l2 if l2 is not None else 1 / int(fitted.sum()))
        logits = x[held] @ weight.T + bias
        probs[held] = logits.sigmoid() if labels.dim() == 2 else logits.softmax(-1)
    return probs


def agreement(probs: Tensor, labels: Tensor) -> float:
    """How often the out-of-sample probabilities ``probs`` ``(N, K)`` agree with the given ``labels``: the share of
    images whose most likely class is their label (class indices ``(N,)``), or for label sets (multi-hot ``(N, K)``)
    the micro-averaged F1 of the classes at or above 0.5 against the given ones."""
    if labels.dim() == 1:
        return float((probs.argmax(1) == labels).double().mean())
    predicted, given = probs >= 0.5, labels.bool()
    both = int((predicted & given).sum())
    return 2 * both / max(int(predicted.sum()) + int(given.sum()), 1)
