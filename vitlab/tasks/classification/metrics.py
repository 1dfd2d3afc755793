"""What an evaluation of a classifier reports: top-1/top-5, the loss, per-class accuracy, precision, recall and F1
and their means, the balanced accuracy, the calibration error and the confusion matrix (multi-label data: mAP and
the F1s of :mod:`~vitlab.tasks.multilabel`), from the logits the one gathered forward pass gives
(:func:`~vitlab.inference.forward.gathered`)."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import Tensor, nn

from ...inference.forward import gathered
from ...inference.tta import tta_logits
from ..calibration import expected_calibration_error
from ..multilabel import multilabel_metrics

__all__ = ["SCORES", "evaluate_classifier", "metrics_from_predictions", "report_metrics"]


# What each evaluation of a training run records (val_top1, test_macro_f1, ...; :func:`report_metrics`).
SCORES = ("top1", "top5", "loss", "balanced_top1", "macro_f1")


def evaluate_classifier(model: nn.Module, loader: Any, accelerator: Accelerator, num_classes: int,
                        model_input: Callable[[Tensor], Tensor] | None = None, keep_probs: bool = False,
                        temperature: float = 1.0, logit_offset: Tensor | None = None,
                        thresholds: Tensor | None = None, tta: str = "none",
                        input_size: tuple[int, int] | None = None, multi_label: bool = False) -> dict[str, Any]:
    """Top-1/top-5 accuracy, mean cross-entropy, per-class accuracy and the confusion matrix; for a ``multi_label``
    model (labels multi-hot ``(N, K)``) the multi-label metrics instead (:func:`~vitlab.tasks.multilabel.multilabel_metrics`:
    mAP, F1s at 0.5 and, given per-class ``thresholds``, at them; ``probs`` are then sigmoids).

    ``loader`` must be prepared by ``accelerator`` (or shard itself); every process gets the same result
    (:func:`~vitlab.inference.forward.gathered`). ``model_input`` makes its batches the model's input
    (:class:`~vitlab.data.transforms.ModelInput`). Accuracies are fractions in [0, 1]; ``confusion[i][j]`` counts
    images of class i predicted as j. ``temperature`` divides the logits before the loss, the calibration error and
    the probabilities (a calibrated model's; top-1 unchanged); ``logit_offset`` ``(K,)`` is subtracted from them first
    (post-hoc logit adjustment, :func:`~vitlab.tasks.classification.losses.logit_adjustment`). With ``keep_probs``
    also ``probs``, the predicted probabilities ``(N, num_classes)`` in the loader's order, the raw ``logits`` and the
    ``labels``. ``tta``: each image's logits are those of the mean of its views' probabilities
    (:func:`~vitlab.inference.tta.tta_logits`; for ``'crops'`` the loader holds the larger views and the crops are of
    the model's ``input_size``).
    """
    compute = lambda net, images: tta_logits(net, images, tta, multi_label, input_size)
    logits, labels = gathered(model, loader, accelerator, compute, model_input)
    scaled = (logits if logit_offset is None else logits - logit_offset) / temperature
    if multi_label:
        metrics = multilabel_metrics(scaled, labels, thresholds)
        probs = scaled.sigmoid()
    else:
        metrics = metrics_from_predictions(scaled, labels, num_classes)
        probs = scaled.softmax(-1)
    if keep_probs:
        metrics.update(probs=probs, logits=logits, labels=labels)
    return metrics


def metrics_from_predictions(logits: Tensor, labels: Tensor, num_classes: int) -> dict[str, Any]:
    """Metrics from logits ``(N, num_classes)`` and integer labels ``(N,)``."""
    k = min(5, num_classes)
    topk = logits.topk(k, dim=-1).indices
    correct = topk == labels[:, None]
    pred = topk[:, 0]
    confusion = torch.bincount(labels * num_classes + pred, minlength=num_classes ** 2).view(num_classes, num_classes)
    per_class_total = confusion.sum(1).clamp(min=1)
    return {
        "top1": correct[:, 0].float().mean().item(),
        "top5": correct.any(-1).float().mean().item(),
        "loss": F.cross_entropy(logits, labels).item(),
        "per_class": (confusion.diag() / per_class_total).tolist(),
        "confusion": confusion.tolist(),
        "num_images": len(labels),
        "ece": expected_calibration_error(logits.softmax(-1), labels),
        **report_metrics(confusion),
    }


def report_metrics(confusion: Tensor) -> dict[str, Any]:
    """Precision, recall and F1 of every class, their macro and support-weighted means, and the balanced
    accuracy, from a confusion matrix ``(K, K)`` (rows: true class, columns: predicted), as scikit-learn's
    ``precision_recall_fscore_support(zero_division=0)`` and ``balanced_accuracy_score`` give them (tested
    against both): a class that is neither a label nor a prediction is left out of the means, a ratio over
    nothing is 0, and the balanced accuracy is the mean recall of the classes that have images."""
    c = confusion.double()
    tp, true, predicted = c.diag(), c.sum(1), c.sum(0)
    scores = {"precision": torch.where(predicted > 0, tp / predicted, 0.0),
              "recall": torch.where(true > 0, tp / true, 0.0),
              "f1": torch.where(true + predicted > 0, 2 * tp / (true + predicted), 0.0)}
    present = (true + predicted) > 0
    out: dict[str, Any] = {name: v.tolist() for name, v in scores.items()}
    for name, v in scores.items():
        out[f"macro_{name}"] = v[present].mean().item()
        out[f"weighted_{name}"] = ((v * true).sum() / true.sum()).item() if true.sum() > 0 else 0.0
    out["balanced_top1"] = scores["recall"][true > 0].mean().item()
    return out
