"""How far a classifier's confidence is from its accuracy, and temperature scaling to close the gap
(Guo et al. 2017, "On Calibration of Modern Neural Networks").

:func:`expected_calibration_error` bins the top-1 confidence of every image into 15 equal bins of (0, 1]
and averages ``|accuracy - confidence|`` over the bins, weighted by their images. :func:`fit_temperature`
finds the one number ``T`` that minimises the negative log-likelihood of ``softmax(logits / T)`` on
held-out images (Guo et al.), or their expected calibration error itself (Mukhoti et al. 2020, "Calibrating
Deep Neural Networks using Focal Loss", choose their temperature so): the predicted class never changes, the
probabilities soften (``T > 1``) or sharpen.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["calibration_bins", "expected_calibration_error", "fit_temperature"]

ECE_BINS = 15


def calibration_bins(probs: Tensor, labels: Tensor, bins: int = ECE_BINS) -> tuple[Tensor, Tensor, Tensor]:
    """Per bin of top-1 confidence (``bins`` equal bins of (0, 1], the upper edge inside): the mean confidence,
    the accuracy and the number of images; ``probs`` ``(N, K)``, ``labels`` ``(N,)``. Empty bins: 0, 0, 0."""
    confidence, predicted = probs.double().max(dim=1)
    return _bins(confidence, (predicted == labels).double(), bins)


def _bins(confidence: Tensor, correct: Tensor, bins: int) -> tuple[Tensor, Tensor, Tensor]:
    which = (torch.ceil(confidence * bins).long() - 1).clamp(0, bins - 1)
    counts = torch.bincount(which, minlength=bins).double()
    right = torch.bincount(which, weights=correct, minlength=bins)
    summed = torch.bincount(which, weights=confidence, minlength=bins)
    seen = counts.clamp(min=1)
    return summed / seen, right / seen, counts


def _ece(confidence: Tensor, accuracy: Tensor, counts: Tensor) -> float:
    return float((counts / counts.sum() * (accuracy - confidence).abs()).sum())


def expected_calibration_error(probs: Tensor, labels: Tensor, bins: int = ECE_BINS) -> float:
    """``sum_b n_b / N * |accuracy_b - confidence_b|`` over :func:`calibration_bins`."""
    return _ece(*calibration_bins(probs, labels, bins))


def fit_temperature(logits: Tensor, labels: Tensor, objective: Literal["nll", "ece"] = "nll") -> float:
    """The temperature ``T`` that minimises ``cross_entropy(logits / T, labels)`` (``objective='nll'``; ``logits``
    ``(N, K)``, in float64), found by L-BFGS on ``log T`` (so that ``T`` stays positive), from ``T = 1``; or
    (``'ece'``) the one of the least :func:`expected_calibration_error`, searched on a grid (the error is a step
    function of ``T``): 401 temperatures log-spaced over [0.05, 20], then 401 between the best one's neighbours."""
    logits, labels = logits.detach().double(), labels.detach()
    if objective == "ece":
        return _least_ece_temperature(logits, labels)
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([log_t], lr=0.5, max_iter=200, tolerance_grad=1e-12, tolerance_change=1e-14,
                                  line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(logits / log_t.exp(), labels)
        loss.backward()
        return loss

    optimizer.step(closure)
    return float(log_t.detach().exp())


def _least_ece_temperature(logits: Tensor, labels: Tensor, points: int = 401) -> float:
    # Only the top-1 confidence moves with T (the predicted class never does): exp(-logsumexp((z - z_max) / T)).
    top, predicted = logits.max(dim=1)
    below, correct = logits - top[:, None], (predicted == labels).double()

    def search(grid: Tensor) -> tuple[int, Tensor]:
        errors = torch.tensor([_ece(*_bins(torch.exp(-torch.logsumexp(below / t, dim=1)), correct, ECE_BINS))
                               for t in grid.tolist()])
        return int(errors.argmin()), grid

    best, grid = search(torch.logspace(math.log10(0.05), math.log10(20.0), points, dtype=torch.float64))
    best, grid = search(torch.linspace(float(grid[max(best - 1, 0)]), float(grid[min(best + 1, points - 1)]), points,
                                       dtype=torch.float64))
    return float(grid[best])
