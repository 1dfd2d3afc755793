"""How far a classifier's confidence is from its accuracy, and temperature scaling to close the gap
(Guo et al. 2017, "On Calibration of Modern Neural Networks").

:func:`expected_calibration_error` bins the top-1 confidence of every image into 15 equal bins of (0, 1]
and averages ``|accuracy - confidence|`` over the bins, weighted by their images. :func:`fit_temperature`
finds the one number ``T`` that minimises the negative log-likelihood of ``softmax(logits / T)`` on
held-out images: the predicted class never changes, the probabilities soften (``T > 1``) or sharpen.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["calibration_bins", "expected_calibration_error", "fit_temperature"]

ECE_BINS = 15


def calibration_bins(probs: Tensor, labels: Tensor, bins: int = ECE_BINS) -> tuple[Tensor, Tensor, Tensor]:
    """Per bin of top-1 confidence (``bins`` equal bins of (0, 1], the upper edge inside): the mean confidence,
    the accuracy and the number of images; ``probs`` ``(N, K)``, ``labels`` ``(N,)``. Empty bins: 0, 0, 0."""
    confidence, predicted = probs.double().max(dim=1)
    which = (torch.ceil(confidence * bins).long() - 1).clamp(0, bins - 1)
    counts = torch.bincount(which, minlength=bins).double()
    correct = torch.bincount(which, weights=(predicted == labels).double(), minlength=bins)
    summed = torch.bincount(which, weights=confidence, minlength=bins)
    seen = counts.clamp(min=1)
    return summed / seen, correct / seen, counts


def expected_calibration_error(probs: Tensor, labels: Tensor, bins: int = ECE_BINS) -> float:
    """``sum_b n_b / N * |accuracy_b - confidence_b|`` over :func:`calibration_bins`."""
    confidence, accuracy, counts = calibration_bins(probs, labels, bins)
    return float((counts / counts.sum() * (accuracy - confidence).abs()).sum())


def fit_temperature(logits: Tensor, labels: Tensor) -> float:
    """The temperature ``T`` that minimises ``cross_entropy(logits / T, labels)`` (``logits`` ``(N, K)``, in
    float64), found by L-BFGS on ``log T`` (so that ``T`` stays positive), from ``T = 1``."""
    logits, labels = logits.detach().double(), labels.detach()
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([log_t], lr=0.5, max_iter=200, tolerance_grad=1e-12, tolerance_change=1e-14,
                                  line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(logits / log_t.exp(), labels)
        loss.backward()
        return loss

    optimizer.step(closure)
    return float(log_t.exp())
