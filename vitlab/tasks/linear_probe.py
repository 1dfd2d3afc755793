"""The linear probe on cached features (CLIP's protocol, Radford et al. 2021, appendix A.3): a classifier's head
fitted on the features of a frozen backbone, computed once for every image, as a multinomial logistic regression
by L-BFGS. The objective is scikit-learn's ``LogisticRegression``'s: the mean cross-entropy plus
``l2 / 2 * |W|^2``, the bias not penalised (scikit-learn's ``C = 1 / (l2 N)``), solved in float64 to its optimum,
so the head is the same whatever the batch size or the number of processes. The L2 strength is chosen on a
validation split from :data:`L2_GRID` (CLIP sweeps its C alike), or given. Multi-hot labels ``(N, K)`` make it
scikit-learn's one-vs-rest logistic regression instead: each class's binary cross-entropy, summed over the classes."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError

__all__ = ["L2_GRID", "fit_linear_probe", "choose_l2", "probe_loss", "probe_head"]

# 1e-6 to 10 in half decades: from next to no penalty to a head that barely moves from zero.
L2_GRID = tuple(float(f"{10 ** (e / 2):.3g}") for e in range(-12, 3))


def probe_loss(features: Tensor, labels: Tensor, weight: Tensor, bias: Tensor, l2: float) -> Tensor:
    """The objective: mean cross-entropy of ``features @ weight.T + bias`` plus ``l2 / 2 * |weight|^2``; for
    multi-hot ``labels`` ``(N, K)``, the mean over the images of the summed binary cross-entropies of the classes."""
    logits = features @ weight.T + bias
    if labels.dim() == 2:
        data = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="sum") / len(labels)
    else:
        data = F.cross_entropy(logits, labels)
    return data + 0.5 * l2 * weight.square().sum()


def fit_linear_probe(features: Tensor, labels: Tensor, num_classes: int, l2: float,
                     init: tuple[Tensor, Tensor] | None = None, max_iter: int = 1000) -> tuple[Tensor, Tensor]:
    """The head ``weight (K, E)``, ``bias (K,)`` (float32) of the multinomial logistic regression of ``features``
    ``(N, E)`` on ``labels`` ``(N,)`` (multi-hot ``(N, K)``: one-vs-rest) with L2 strength ``l2`` (see the module),
    by full-batch L-BFGS with a strong-Wolfe line search in float64; ``init`` (a previous solution) starts it nearer."""
    x, y = features.double().cpu(), (labels.double() if labels.dim() == 2 else labels.long()).cpu()
    weight = torch.zeros(num_classes, x.shape[1], dtype=torch.float64)
    bias = torch.zeros(num_classes, dtype=torch.float64)
    if init is not None:
        weight, bias = init[0].double().clone(), init[1].double().clone()
    weight.requires_grad_(True)
    bias.requires_grad_(True)
    solver = torch.optim.LBFGS([weight, bias], lr=1, max_iter=max_iter, max_eval=2 * max_iter, history_size=20,
                               tolerance_grad=1e-9, tolerance_change=1e-15, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        solver.zero_grad()
        loss = probe_loss(x, y, weight, bias, l2)
        loss.backward()
        return loss

    with torch.enable_grad():
        solver.step(closure)
    return weight.detach().float(), bias.detach().float()


def choose_l2(features: Tensor, labels: Tensor, val_features: Tensor, val_labels: Tensor, num_classes: int,
              grid: tuple[float, ...] = L2_GRID) -> tuple[float, dict[float, float]]:
    """The L2 strength of ``grid`` whose head (fitted on ``features``) classifies ``val_features`` best (top-1),
    the strongest of a tie (the simpler head), and every strength's validation top-1. Fitted from the strongest
    down, each fit starting from the one before."""
    scores: dict[float, float] = {}
    solution = None
    for l2 in sorted(grid, reverse=True):
        solution = fit_linear_probe(features, labels, num_classes, l2, init=solution)
        predicted = (val_features.float() @ solution[0].T + solution[1]).argmax(1)
        scores[l2] = (predicted == val_labels).double().mean().item()
    best = max(scores.values())
    return max(l2 for l2, score in scores.items() if score == best), dict(sorted(scores.items()))


def probe_head(model: nn.Module) -> nn.Linear:
    """The one linear head a probe fits (``get_classifier()``, timm's API), or one line saying why not."""
    head = model.get_classifier() if hasattr(model, "get_classifier") else None
    if isinstance(head, nn.Linear):
        return head
    what = "two heads (a distillation token)" if isinstance(head, tuple) else f"a {type(head).__name__} head"
    raise ConfigError(f"train.cache_features fits one linear head on the pooled features; {type(model).__name__} has "
                      f"{what}: train its head with model.freeze=backbone alone")
