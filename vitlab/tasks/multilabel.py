"""Multi-label classification: several classes an image, each a yes/no of its own.

The model's logits ``(N, K)`` are K independent scores (a sigmoid each, not a softmax); the targets are
multi-hot rows. What is here: the loss (binary cross-entropy with timm's smoothing of dense targets and
torch's ``pos_weight``), mixup/cutmix of multi-hot targets (timm's ``Mixup`` choosing the mix), and the
metrics a report asks for, each defined as scikit-learn defines it (tested against it): average
precision per class and its macro and micro means (mAP), F1 at a threshold (0.5, or one a class chosen
on the validation split by :func:`choose_thresholds`), label-based (macro, micro) and example-based. And what
multi-label training cannot take (:func:`multi_label_problem`), which the config checks where
``data.multi_label=true`` and the classification task where the training labels turn out to be sets.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from timm.data import Mixup
from torch import Tensor, nn

from ..errors import ConfigError

__all__ = ["MultiLabelLoss", "MultiHotMixup", "average_precision", "f1_scores", "choose_thresholds",
           "multilabel_metrics", "positive_weights", "SCORES", "multi_label_problem"]

# What each evaluation of a multi-label training run records (val_map, test_micro_f1, ...).
SCORES = ("map", "micro_map", "loss", "macro_f1", "micro_f1", "example_f1")


class MultiLabelLoss(nn.Module):
    """Binary cross-entropy of logits ``(N, K)`` and multi-hot or soft targets ``(N, K)`` (mixup's), the mean
    over images and classes. ``smoothing`` moves each target towards 0.5 (timm's ``BinaryCrossEntropy`` with
    ``smooth_dense``, and its multi-label ``mixup_target``); ``pos_weight`` ``(K,)`` weighs each class's
    positive term (torch's ``binary_cross_entropy_with_logits``)."""

    def __init__(self, smoothing: float = 0.0, pos_weight: Tensor | None = None) -> None:
        super().__init__()
        self.smoothing = smoothing
        self.register_buffer("pos_weight", pos_weight, persistent=False)

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        targets = targets.to(logits.dtype)
        if self.smoothing:
            targets = targets * (1.0 - self.smoothing) + 0.5 * self.smoothing
        weight = None if self.pos_weight is None else self.pos_weight.to(logits.device, logits.dtype)
        return F.binary_cross_entropy_with_logits(logits, targets, pos_weight=weight)


class MultiHotMixup(Mixup):
    """timm's ``Mixup`` (its mixup/cutmix choice, lambda and boxes) for multi-hot targets ``(N, K)``: each
    image's targets become ``lam * t + (1 - lam) * t_flipped`` after smoothing towards 0.5, as timm's
    ``mixup_target(multi_label=True)`` does (timm >= 1.0.25; here for every timm vitlab admits)."""

    def __call__(self, x: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        assert len(x) % 2 == 0, "mixup/cutmix need an even batch"
        if self.mode == "elem":
            lam = self._mix_elem(x)
        elif self.mode == "pair":
            lam = self._mix_pair(x)
        else:
            lam = self._mix_batch(x)
        y = target.float() * (1.0 - self.label_smoothing) + 0.5 * self.label_smoothing
        return x, y * lam + y.flip(0) * (1.0 - lam)


def positive_weights(positives: Tensor, total: int) -> Tensor:
    """``train.pos_weight=balanced``: each class's negatives over its positives among ``total`` training
    images, from its positive count ``(K,)`` (a class without positives counted as one), float32 ``(K,)``."""
    p = positives.double().clamp(min=1)
    return ((total - p).clamp(min=0) / p).float()


def _ranked(scores: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per column, scores sorted from the highest: the true positives and false positives counted down to
    each place, whether a place ends a run of equal scores (a threshold), and the sorted scores."""
    order = scores.argsort(dim=0, descending=True, stable=True)
    s = scores.gather(0, order)
    t = targets.gather(0, order).double()
    tp = t.cumsum(0)
    fp = (1 - t).cumsum(0)
    ends = torch.ones_like(s, dtype=torch.bool)
    ends[:-1] = s[:-1] != s[1:]
    return tp, fp, ends, s


def average_precision(scores: Tensor, targets: Tensor) -> Tensor:
    """Each column's average precision, ``sum_n (R_n - R_{n-1}) P_n`` over the thresholds at its distinct
    scores (scikit-learn's ``average_precision_score``, no interpolation): float64 ``(K,)``, NaN for a class
    without positives (it has no recall).

    Args:
        scores: ``(N, K)`` scores of each class (logits or probabilities: only their order counts).
        targets: ``(N, K)`` multi-hot (bool or 0/1).
    """
    tp, fp, ends, _ = _ranked(scores.double(), targets)
    positives = tp[-1]
    recall = tp / positives.clamp(min=1)
    precision = tp / (tp + fp)
    at_ends = torch.where(ends, recall, torch.zeros_like(recall))
    before = torch.cat([torch.zeros_like(recall[:1]), at_ends.cummax(0).values[:-1]])
    ap = (ends * (recall - before) * precision).sum(0)
    return torch.where(positives > 0, ap, torch.full_like(ap, float("nan")))


def f1_scores(predicted: Tensor, targets: Tensor) -> dict[str, Any]:
    """F1, precision and recall of yes/no predictions ``(N, K)`` against multi-hot ``targets`` ``(N, K)``,
    as scikit-learn's ``precision_recall_fscore_support`` / ``f1_score`` (``zero_division=0``) give them: per
    class, their ``macro`` means over every class, ``micro`` (the counts of all classes pooled) and
    ``example`` (each image's F1 of its label set, averaged; scikit-learn's ``average='samples'``)."""
    p, t = predicted.bool(), targets.bool()
    tp, fp, fn = (p & t).sum(0).double(), (p & ~t).sum(0).double(), (~p & t).sum(0).double()

    def ratio(a: Tensor, b: Tensor) -> Tensor:
        return torch.where(b > 0, a / b.clamp(min=1e-300), torch.zeros_like(a))

    f1 = ratio(2 * tp, 2 * tp + fp + fn)
    per_image = ratio(2 * (p & t).sum(1).double(), p.sum(1).double() + t.sum(1).double())
    return {"f1": f1.tolist(), "precision": ratio(tp, tp + fp).tolist(), "recall": ratio(tp, tp + fn).tolist(),
            "macro_f1": f1.mean().item(), "macro_precision": ratio(tp, tp + fp).mean().item(),
            "macro_recall": ratio(tp, tp + fn).mean().item(),
            "micro_f1": ratio(2 * tp.sum(), 2 * tp.sum() + fp.sum() + fn.sum()).item(),
            "example_f1": per_image.mean().item()}


def choose_thresholds(probs: Tensor, targets: Tensor, default: float = 0.5) -> Tensor:
    """The threshold of each class (predict it where its probability is at least that) that maximizes its
    F1 on these images: one of its distinct probabilities, the highest where several tie. ``default``
    for a class without positives here. float32 ``(K,)``. Fit on the validation split, never the test split."""
    tp, fp, ends, s = _ranked(probs.double(), targets)
    positives = tp[-1]
    f1 = 2 * tp / (tp + fp + positives)  # fn = positives - tp
    f1 = torch.where(ends, f1, torch.full_like(f1, -1.0))
    best = f1.argmax(0)  # the first (highest threshold) of equal maxima
    chosen = s.gather(0, best[None]).squeeze(0)
    return torch.where(positives > 0, chosen, torch.full_like(chosen, default)).float()


def multilabel_metrics(logits: Tensor, targets: Tensor, thresholds: Tensor | None = None) -> dict[str, Any]:
    """The metrics of a multi-label evaluation from logits ``(N, K)`` and multi-hot targets ``(N, K)``:
    ``map`` (the mean average precision of the classes that have positives here) and ``micro_map`` (every
    (image, class) pair pooled), ``ap`` per class (NaN without positives), the binary cross-entropy ``loss``,
    F1 / precision / recall at 0.5 (:func:`f1_scores`), and with ``thresholds`` ``(K,)`` the same F1s at
    them (``*_tuned``)."""
    logits, targets = logits.float(), targets.bool()
    probs = logits.sigmoid()
    ap = average_precision(logits, targets)
    present = ~ap.isnan()
    out: dict[str, Any] = {
        "map": ap[present].mean().item() if present.any() else float("nan"),
        "micro_map": average_precision(logits.reshape(-1, 1), targets.reshape(-1, 1)).item(),
        "ap": ap.tolist(),
        "loss": F.binary_cross_entropy_with_logits(logits, targets.float()).item(),
        "num_images": len(targets),
        "positives": targets.sum(0).tolist(),
        **f1_scores(probs >= 0.5, targets),
    }
    if thresholds is not None:
        tuned = f1_scores(probs >= thresholds.to(probs), targets)
        out.update({f"{k}_tuned": v for k, v in tuned.items()})
    return out


def multi_label_problem(cfg: Any, said: str) -> ConfigError | None:
    """The first key of ``cfg`` that multi-label training cannot take (a single-label loss, class weights, sampler,
    teacher, calibration objective, or the cached-feature probe), as the one-line error that names it and says
    why (``said``: why the run is multi-label); None when it can train."""
    d, t = cfg.data, cfg.train
    if d.sampler != "uniform":
        return ConfigError(f"data.sampler={d.sampler} balances one class an image, and {said}; weigh the "
                           f"classes with train.pos_weight=balanced")
    if t.loss != "ce" or t.class_weights != "none":
        key, value = ("train.loss", t.loss) if t.loss != "ce" else ("train.class_weights", t.class_weights)
        return ConfigError(f"{key}={value} is for one class an image, and {said}: multi-label trains the binary "
                           f"cross-entropy; weigh its classes with train.pos_weight=balanced")
    if cfg.distill.type != "none":
        return ConfigError(f"distill.type={cfg.distill.type} distills a teacher's softmax, one class an image, and "
                           f"{said}")
    if t.calibrate and t.calibrate_objective != "nll":
        return ConfigError(f"train.calibrate_objective={t.calibrate_objective} chooses a temperature, for one class "
                           f"an image, and {said}: a multi-label run's calibration is a threshold a class (each its "
                           f"best F1 on the validation images); leave it nll")
    if t.cache_features:
        return ConfigError(f"train.cache_features=True fits one class an image (a multinomial logistic regression), "
                           f"and {said}: train the head of this multi-label run with model.freeze=backbone alone")
    return None
