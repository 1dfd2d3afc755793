"""The linear probe on cached features (CLIP's protocol, Radford et al. 2021, appendix A.3): a classifier's head
fitted on the features of a frozen backbone, computed once for every image, as a multinomial logistic regression
by L-BFGS. The objective is scikit-learn's ``LogisticRegression``'s: the mean cross-entropy plus
``l2 / 2 * |W|^2``, the bias not penalised (scikit-learn's ``C = 1 / (l2 N)``), and so is its solver (SciPy's
L-BFGS-B in float64, on all the features at once), so the head is the same whatever the batch size or the number of
processes. The L2 strength is chosen on a validation split from :data:`L2_GRID` (CLIP sweeps its C alike), or given.
Multi-hot labels ``(N, K)`` make it scikit-learn's one-vs-rest logistic regression instead: each class's binary
cross-entropy, summed over the classes."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from ..errors import ConfigError

__all__ = ["L2_GRID", "fit_linear_probe", "choose_l2", "probe_head"]

# 1e-6 to 10 in half decades: from next to no penalty to a head that barely moves from zero.
L2_GRID = tuple(float(f"{10 ** (e / 2):.3g}") for e in range(-12, 3))


def _objective(theta: np.ndarray, x: np.ndarray, y: np.ndarray, l2: float, multi: bool) -> tuple[float, np.ndarray]:
    """The objective at ``theta`` (the weight ``(K, E)`` then the bias ``(K,)``, flat) and its gradient: the mean
    cross-entropy of ``x @ weight.T + bias`` against one-hot ``y`` ``(N, K)`` (``multi``: the mean over the images of
    the summed binary cross-entropies of the classes) plus ``l2 / 2 * |weight|^2``; float64."""
    n, e = x.shape
    k = y.shape[1]
    weight, bias = theta[:k * e].reshape(k, e), theta[k * e:]
    logits = x @ weight.T + bias
    if multi:
        data = (np.logaddexp(0.0, logits) - y * logits).sum() / n
        p = np.exp(-np.logaddexp(0.0, -logits))  # the sigmoid, without overflow
    else:
        top = logits.max(axis=1, keepdims=True)
        log_z = top + np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
        data = float((log_z[:, 0] - (logits * y).sum(axis=1)).mean())
        p = np.exp(logits - log_z)
    g = (p - y) / n
    gradient = np.concatenate(((g.T @ x + l2 * weight).ravel(), g.sum(axis=0)))
    return data + 0.5 * l2 * float((weight * weight).sum()), gradient


def fit_linear_probe(features: Tensor, labels: Tensor, num_classes: int, l2: float,
                     init: tuple[Tensor, Tensor] | None = None, max_iter: int = 1000) -> tuple[Tensor, Tensor]:
    """The head ``weight (K, E)``, ``bias (K,)`` (float32) of the multinomial logistic regression of ``features``
    ``(N, E)`` on ``labels`` ``(N,)`` (multi-hot ``(N, K)``: one-vs-rest) with L2 strength ``l2`` (see the module),
    by full-batch L-BFGS in float64: SciPy's L-BFGS-B with the settings of scikit-learn's ``lbfgs`` solver (its line
    search of up to 50 steps, ``ftol`` 64 machine epsilons), to a gradient of 1e-9 or ``max_iter`` iterations;
    ``init`` (a previous solution) starts it nearer."""
    from scipy.optimize import minimize

    x = features.double().cpu().numpy()
    multi = labels.dim() == 2
    y = labels.double().cpu().numpy() if multi else np.eye(num_classes)[labels.long().cpu().numpy()]
    if init is None:
        theta = np.zeros(num_classes * (x.shape[1] + 1))
    else:
        theta = np.concatenate((init[0].double().cpu().numpy().ravel(), init[1].double().cpu().numpy()))
    found = minimize(_objective, theta, args=(x, y, l2, multi), jac=True, method="L-BFGS-B",
                     options={"maxiter": max_iter, "maxls": 50, "gtol": 1e-9, "ftol": 64 * np.finfo(float).eps})
    weight = torch.from_numpy(found.x[:num_classes * x.shape[1]].reshape(num_classes, -1).copy())
    return weight.float(), torch.from_numpy(found.x[num_classes * x.shape[1]:].copy()).float()


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
