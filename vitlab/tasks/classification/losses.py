"""The losses of single-label classification: cross-entropy (of soft targets under mixup/cutmix, with label
smoothing), binary cross-entropy of one-hot targets (timm's, DeiT III's), class weights (scikit-learn's balanced,
Cui et al.'s effective numbers), the logit-adjusted loss and post-hoc logit adjustment (Menon et al. 2021). The
multi-label loss is :class:`~vitlab.tasks.multilabel.MultiLabelLoss`."""
from __future__ import annotations

from typing import Callable

from timm.loss import BinaryCrossEntropy, SoftTargetCrossEntropy
from torch import Tensor, nn

__all__ = ["classification_criterion", "class_weights", "logit_adjustment"]


def classification_criterion(mixing: bool, label_smoothing: float, loss: str = "ce",
                             bce_target_thresh: float | None = None, class_counts: Tensor | None = None,
                             logit_adjust_tau: float = 1.0, weighting: str = "none",
                             weighting_beta: float = 0.9999) -> Callable[[Tensor, Tensor], Tensor]:
    """The training loss, chosen as timm's ``train.py`` chooses it: with mixup/cutmix (which smooth the
    targets themselves) soft-target cross-entropy, or binary cross-entropy on the soft targets
    (``loss='bce'``, DeiT III); without, cross-entropy with ``label_smoothing``, or binary cross-entropy on
    the smoothed one-hot targets. ``bce_target_thresh`` binarizes BCE's targets above it (timm's).
    ``loss='logit_adjusted'``: the cross-entropy (soft-target with mixing) of the logits plus
    ``logit_adjust_tau * log`` of the training frequencies of ``class_counts`` (Menon et al. 2021): the model
    learns logits whose plain argmax suits the balanced error. ``weighting`` (``balanced``, ``effective``:
    :func:`class_weights`) weighs the cross-entropy's classes, as torch's ``weight`` does (a weighted mean over
    the targets' weights; with mixing, of the soft targets')."""
    if loss == "bce":
        return BinaryCrossEntropy(smoothing=0.0 if mixing else label_smoothing, target_threshold=bce_target_thresh)
    if weighting != "none":
        if class_counts is None:
            raise ValueError(f"weighting={weighting!r} needs the training class counts")
        weight = class_weights(class_counts, weighting, weighting_beta)
        return _SoftWeighted(weight) if mixing else nn.CrossEntropyLoss(weight=weight, label_smoothing=label_smoothing)
    base = SoftTargetCrossEntropy() if mixing else nn.CrossEntropyLoss(label_smoothing=label_smoothing)
    if loss == "logit_adjusted":
        if class_counts is None:
            raise ValueError("loss='logit_adjusted' needs the training class counts")
        return _Shifted(base, logit_adjustment(class_counts, logit_adjust_tau))  # + tau * log(prior)
    return base


def class_weights(class_counts: Tensor, kind: str, beta: float = 0.9999) -> Tensor:
    """Weights ``(K,)`` of the classes from their training counts: ``balanced``, ``n / (K * n_c)``
    (scikit-learn's ``compute_class_weight('balanced')``); ``effective``, ``(1 - beta) / (1 - beta ** n_c)``
    scaled to sum to ``K`` (the effective number of samples, Cui et al. 2019). Every class must have
    images (:func:`require_trained_classes`)."""
    counts = _positive_counts(class_counts)
    if kind == "balanced":
        return (counts.sum() / (len(counts) * counts)).float()
    if kind != "effective":
        raise ValueError(f"class weights {kind!r}: expected 'balanced' or 'effective'")
    weights = (1 - beta) / (1 - beta ** counts)
    return (weights * len(counts) / weights.sum()).float()


class _SoftWeighted(nn.Module):
    """Cross-entropy of soft targets (mixup's) with class weights: ``sum_i sum_c -w_c t_ic log p_ic`` over
    ``sum_i sum_c w_c t_ic``, what torch's weighted cross-entropy is for one-hot targets."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        weighted = targets * self.weight.to(logits.device, logits.dtype)
        return -(weighted * logits.log_softmax(-1)).sum() / weighted.sum()


class _Shifted(nn.Module):
    """``base(logits + shift, targets)``: a loss of logits moved by a fixed ``shift`` ``(K,)``."""

    def __init__(self, base: nn.Module, shift: Tensor) -> None:
        super().__init__()
        self.base = base
        self.register_buffer("shift", shift, persistent=False)

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        return self.base(logits + self.shift.to(logits.device, logits.dtype), targets)


def logit_adjustment(class_counts: Tensor, tau: float) -> Tensor:
    """Post-hoc logit adjustment (Menon et al. 2021, "Long-tail learning via logit adjustment"): the offset
    ``tau * log(prior)`` to subtract from a model's logits, the prior being the training class frequencies
    ``(K,)``, every class with images (:func:`require_trained_classes`). Subtracted, it takes back the head
    classes' head start: ``tau = 1`` is the balanced error's Bayes rule for a model of the training distribution."""
    counts = _positive_counts(class_counts)
    return (tau * (counts / counts.sum()).log()).float()


def _positive_counts(class_counts: Tensor) -> Tensor:
    """The counts as float64, refusing a class without images: weighting or adjusting by its count would make it
    the favourite class (a count of 0, or one taken as 1, is the rarest of all)."""
    if (class_counts <= 0).any():
        missing = (class_counts <= 0).nonzero().flatten().tolist()
        raise ValueError(f"class(es) {missing[:10]} have no training images: their count cannot weigh or adjust "
                         f"them (see require_trained_classes)")
    return class_counts.double()
