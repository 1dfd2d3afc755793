"""Classification metrics over a data loader, exact under several processes (``gather_for_metrics``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import Tensor, nn

__all__ = ["evaluate", "metrics_from_predictions", "plot_confusion_matrix"]


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, accelerator: Accelerator, num_classes: int) -> dict[str, Any]:
    """Top-1/top-5 accuracy, mean cross-entropy, per-class accuracy and the confusion matrix.

    ``loader`` must be prepared by ``accelerator``; every process gets the same result. Accuracies
    are fractions in [0, 1]; ``confusion[i][j]`` counts images of class i predicted as j.
    """
    was_training = model.training
    model.eval()
    logits_all, labels_all = [], []
    exact = getattr(loader, "exact_shards", False)  # a loader that shards itself, nothing repeated
    for images, labels in loader:
        with accelerator.autocast():
            logits = model(images).float()
        if not exact:  # an Accelerate-prepared loader: drop the samples it repeated to even out
            logits, labels = accelerator.gather_for_metrics((logits, labels))
        logits_all.append(logits)
        labels_all.append(labels)
    model.train(was_training)
    logits, labels = torch.cat(logits_all), torch.cat(labels_all)
    if exact:
        logits, labels = _gather_uneven(accelerator, logits), _gather_uneven(accelerator, labels)
    return metrics_from_predictions(logits.cpu(), labels.cpu(), num_classes)


def _gather_uneven(accelerator: Accelerator, x: Tensor) -> Tensor:
    """Concatenate every process's ``x`` (first dimensions may differ) in process order."""
    if accelerator.num_processes == 1:
        return x
    sizes = accelerator.gather(torch.tensor([len(x)], device=x.device)).tolist()
    padded = accelerator.gather(accelerator.pad_across_processes(x, dim=0))
    longest = max(sizes)
    return torch.cat([padded[i * longest:i * longest + n] for i, n in enumerate(sizes)])


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
    }


def plot_confusion_matrix(confusion: list[list[int]], classes: list[str], path: Path) -> None:
    """Row-normalized confusion matrix as a PNG (rows: true class, columns: predicted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cm = torch.tensor(confusion, dtype=torch.float64)
    frac = cm / cm.sum(1, keepdim=True).clamp(min=1)
    n = len(classes)
    fig, ax = plt.subplots(figsize=(1.0 + 0.6 * n, 0.8 + 0.6 * n))
    ax.imshow(frac.numpy(), cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(n), classes, rotation=45, ha="right")
    ax.set_yticks(range(n), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    for i in range(n):
        for j in range(n):
            ax.text(j, i, f"{frac[i, j]:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if frac[i, j] > 0.5 else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
