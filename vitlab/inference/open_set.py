"""Scores of how much an image looks like the classes a classifier was taught: higher is more like them, lower
is "none of my classes". Each is a function of the model's logits or pooled features, no retraining:

- :func:`msp`: the maximum softmax probability (Hendrycks & Gimpel 2017);
- :func:`max_logit`: the maximum logit (Vaze et al. 2022, "a good closed-set classifier is all you need");
- :func:`energy`: the negative energy ``T logsumexp(logits / T)`` (Liu et al. 2020);
- :class:`KNNScore`: minus the distance of the unit-length feature to its ``k``-th nearest unit-length training
  feature (Sun et al. 2022; ``k`` 50 for CIFAR-10, the paper's);
- :class:`MahalanobisScore`: minus the smallest squared Mahalanobis distance to a class mean under the classes'
  shared covariance, fitted on training features (Lee et al. 2018, without input perturbation); ``relative=True``
  (the score ``relative_mahalanobis``) subtracts the distance under one Gaussian of all the training features (Ren
  et al. 2021, "a simple fix to Mahalanobis distance for improving near-OOD detection");
- :class:`ViMScore`: the negative energy less a "virtual logit", ``alpha`` times the norm of the feature's part outside
  the principal subspace of the training features (Wang et al. 2022, ViM), from the features and the linear head.

Each is tested equal to pytorch-ood's detector of the same name (which returns the outlier score, the negative of
these; its covariances are sums, not means, so its distances are these over N, its Mahalanobis' halved). vitlab's own
rather than pytorch-ood's at run time: pytorch-ood's k-NN goes through scikit-learn on the CPU and its fitted
detectors keep no state a checkpoint could store; these are a few tensor lines on the model's device.

:func:`auroc` and :func:`fpr_at_tpr` rate a score on known and unknown images (the known ones the positives);
:func:`threshold_keeping` is the score's value that keeps a share of known images. :class:`UnknownRule` is a score
with the threshold ``vitlab calibrate --unknown`` fitted (and the k-NN bank or the Mahalanobis statistics it fitted
them on, kept in a file beside the weights): what ``vitlab predict``, ``vitlab serve`` and
:func:`vitlab.unknown.unknown_scores` answer ``unknown`` by.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..files import replaced

__all__ = ["msp", "max_logit", "energy", "KNNScore", "MahalanobisScore", "ViMScore", "auroc", "fpr_at_tpr",
           "threshold_keeping", "LOGIT_SCORES", "FEATURE_SCORES", "SCORES", "feature_score", "UNKNOWN_MODES",
           "UnknownRule", "stored_rule"]


def msp(logits: Tensor) -> Tensor:
    """``(B, C)`` logits -> ``(B,)``: the largest softmax probability."""
    return logits.float().softmax(dim=1).amax(dim=1)


def max_logit(logits: Tensor) -> Tensor:
    """``(B, C)`` logits -> ``(B,)``: the largest logit."""
    return logits.float().amax(dim=1)


def energy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """``(B, C)`` logits -> ``(B,)``: the negative energy, ``T logsumexp(logits / T)``."""
    return temperature * torch.logsumexp(logits.float() / temperature, dim=1)


LOGIT_SCORES = {"msp": msp, "max_logit": max_logit, "energy": energy}


def _unit(features: Tensor) -> Tensor:
    features = features.float()
    return features / features.norm(dim=1, keepdim=True).clamp(min=1e-12)


class KNNScore:
    """Minus the Euclidean distance of each unit-length feature to its ``k``-th nearest unit-length feature of the
    bank :meth:`fit` was given (the training images'), computed ``chunk`` queries at a time."""

    def __init__(self, k: int = 50, chunk: int = 1024) -> None:
        if k < 1:
            raise ValueError(f"k={k}: give the neighbour whose distance is the score, 1 or more")
        self.k, self.chunk, self.bank = k, chunk, None

    def fit(self, features: Tensor, labels: Tensor | None = None) -> KNNScore:
        """``features`` ``(N, D)``, N >= k: the bank (their ``labels`` are not used)."""
        if len(features) < self.k:
            raise ValueError(f"k={self.k} is more than the {len(features)} features of the bank")
        self.bank = _unit(features)
        return self

    def __call__(self, features: Tensor) -> Tensor:
        if self.bank is None:
            raise RuntimeError("KNNScore has no bank: call fit(training features) first")
        queries = _unit(features).to(self.bank.device)
        out = [torch.cdist(q, self.bank).topk(self.k, dim=1, largest=False).values[:, -1]
               for q in queries.split(self.chunk)]
        return -torch.cat(out) if out else queries.new_zeros(0)

    def state(self) -> dict[str, Tensor]:
        return {"bank": self.bank}

    def load_state(self, state: dict[str, Tensor]) -> KNNScore:
        self.bank = state["bank"]
        return self


class MahalanobisScore:
    """Minus the smallest squared Mahalanobis distance of a feature to a class mean, under the covariance the
    classes share (the mean of the centered outer products over the N training features), fitted by :meth:`fit`.
    ``relative``: minus the smallest of those distances less the feature's squared distance to the mean of all the
    training features under their covariance (the relative Mahalanobis distance)."""

    def __init__(self, relative: bool = False) -> None:
        self.relative = relative
        self.means = self.precision = self.background_mean = self.background_precision = None

    def fit(self, features: Tensor, labels: Tensor) -> MahalanobisScore:
        """``features`` ``(N, D)`` of the training images, ``labels`` ``(N,)`` their classes (each present)."""
        features, labels = features.double(), labels.to(features.device)
        classes = int(labels.max()) + 1
        counts = torch.bincount(labels, minlength=classes)
        if (counts == 0).any():
            raise ValueError(f"classes {torch.nonzero(counts == 0).flatten().tolist()} have no training features")
        means = torch.zeros(classes, features.shape[1], dtype=torch.float64, device=features.device)
        means.index_add_(0, labels, features)
        means /= counts[:, None]
        self.means, self.precision = means, _precision(features - means[labels], features)
        if self.relative:
            self.background_mean = features.mean(dim=0)
            self.background_precision = _precision(features - self.background_mean, features)
        return self

    def __call__(self, features: Tensor) -> Tensor:
        if self.means is None:
            raise RuntimeError("MahalanobisScore is not fitted: call fit(training features, labels) first")
        features = features.double()
        centered = features[:, None, :] - self.means[None]                                  # (B, C, D)
        distances = torch.einsum("bcd,de,bce->bc", centered, self.precision, centered)
        if self.relative:
            background = features - self.background_mean                                     # (B, D)
            distances -= torch.einsum("bd,de,be->b", background, self.background_precision, background)[:, None]
        return -distances.amin(dim=1).float()

    def state(self) -> dict[str, Tensor]:
        background = {"background_mean": self.background_mean, "background_precision": self.background_precision}
        return {"means": self.means, "precision": self.precision, **(background if self.relative else {})}

    def load_state(self, state: dict[str, Tensor]) -> MahalanobisScore:
        self.means, self.precision = state["means"], state["precision"]
        if self.relative:
            self.background_mean, self.background_precision = state["background_mean"], state["background_precision"]
        return self


def _precision(centered: Tensor, features: Tensor) -> Tensor:
    """``(N, D)`` features less their means -> ``(D, D)``: the pseudo-inverse of their covariance (a mean), dropping
    the directions whose variance is no more than float32 rounding gives ``features`` (the same, not centered): (4
    float32 ulps)^2 of the largest mean square of a coordinate, or float64's default cut-off where larger. Features
    come from float32 (or narrower) passes; a direction they cannot vary in, as a LayerNorm's outputs cannot (they sum
    to a constant) or an affine map of fewer numbers (a patch embedding's mean) cannot, gets its variance from rounding
    alone, 1e-16 to 1e-14 here, which float64's cut-off (relative to the largest) may keep: inverted, it would make the
    score the rounding's. Variances the features do have start 6 orders above it (CIFAR-10's quick models)."""
    rounding = (4 * torch.finfo(torch.float32).eps) ** 2 * features.double().pow(2).mean(dim=0).max()
    return torch.linalg.pinv(centered.T @ centered / len(centered), atol=rounding,
                             rtol=centered.shape[1] * torch.finfo(centered.dtype).eps, hermitian=True)


class ViMScore:
    """The virtual-logit score (ViM): the negative energy of the logits ``features @ weight.T + bias`` less ``alpha``
    times the norm of the feature's residual, its part outside the ``dim`` most spread directions of the training
    features centred at the head's origin ``-pinv(weight) @ bias``. :meth:`fit` finds the residual directions (the
    covariance's eigenvectors of the ``D - dim`` smallest eigenvalues, the covariance a mean) and ``alpha`` (the
    training features' mean largest logit over their mean residual norm). ``dim``: half the width ``D`` when None
    (OpenOOD's choice for CIFAR-sized features; the paper's 1,000 of 2,048 and 512 of 768 are about as much).
    ``weight`` ``(C, D)`` and ``bias`` ``(C,)``: the classifier's linear head; none is needed to load a fitted state."""

    def __init__(self, weight: Tensor | None = None, bias: Tensor | None = None, dim: int | None = None) -> None:
        self.weight = None if weight is None else weight.detach().double()
        self.bias = None if bias is None else bias.detach().double()
        self.dim, self.origin, self.residual, self.alpha = dim, None, None, None

    def fit(self, features: Tensor, labels: Tensor | None = None) -> ViMScore:
        """``features`` ``(N, D)`` of the training images (their ``labels`` are not used)."""
        if self.weight is None or self.bias is None:
            raise ValueError("ViM needs the classifier's linear head: ViMScore(weight, bias), its logits being "
                             "features @ weight.T + bias")
        features = features.double().to(self.weight.device)
        width = features.shape[1]
        self.dim = width // 2 if self.dim is None else self.dim
        if not 0 < self.dim < width:
            raise ValueError(f"dim={self.dim}: give a principal subspace narrower than the {width} features (and > 0)")
        self.origin = -torch.linalg.pinv(self.weight) @ self.bias
        centered = features - self.origin
        _, vectors = torch.linalg.eigh(centered.T @ centered / len(centered))  # eigenvalues ascending
        self.residual = vectors[:, :width - self.dim].contiguous()
        largest = (features @ self.weight.T + self.bias).amax(dim=1)
        self.alpha = largest.mean() / (centered @ self.residual).norm(dim=1).mean()
        return self

    def __call__(self, features: Tensor) -> Tensor:
        if self.residual is None:
            raise RuntimeError("ViMScore is not fitted: call fit(training features) first")
        features = features.double().to(self.residual.device)
        virtual = self.alpha * ((features - self.origin) @ self.residual).norm(dim=1)
        return (torch.logsumexp(features @ self.weight.T + self.bias, dim=1) - virtual).float()

    def state(self) -> dict[str, Tensor]:
        return {"weight": self.weight, "bias": self.bias, "origin": self.origin, "residual": self.residual,
                "alpha": self.alpha.reshape(1)}

    def load_state(self, state: dict[str, Tensor]) -> ViMScore:
        self.weight, self.bias = state["weight"], state["bias"]
        self.origin, self.residual = state["origin"], state["residual"]
        self.alpha, self.dim = state["alpha"][0], self.weight.shape[1] - state["residual"].shape[1]
        return self


FEATURE_SCORES = ("knn", "mahalanobis", "relative_mahalanobis", "vim")


def feature_score(name: str, k: int | None = None,
                  head: tuple[Tensor, Tensor] | None = None) -> KNNScore | MahalanobisScore | ViMScore:
    """The unfitted feature score ``name`` (one of :data:`FEATURE_SCORES`); ``k``: the k-NN score's neighbour (its
    default when None; the other scores take none); ``head``: ViM's ``(weight, bias)``, the classifier's linear head
    (none to load a fitted state)."""
    if name not in FEATURE_SCORES:
        raise ValueError(f"{name!r} is not a feature score; give one of {', '.join(FEATURE_SCORES)}")
    if name == "knn":
        return KNNScore() if k is None else KNNScore(k)
    if name == "vim":
        return ViMScore(*(head or (None, None)))
    return MahalanobisScore(relative=name == "relative_mahalanobis")


SCORES = (*LOGIT_SCORES, *FEATURE_SCORES)


def auroc(known: Tensor, unknown: Tensor) -> float:
    """The area under the ROC curve of telling known images (positives) from unknown ones by the score: the chance
    that a known image scores above an unknown one, ties counted half (the Mann-Whitney statistic)."""
    scores = torch.cat([known, unknown]).double()
    order = scores.argsort()
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    values, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    summed = torch.zeros(len(values), dtype=torch.float64).index_add_(0, inverse, ranks)
    ranks = (summed / counts)[inverse]  # tied scores share their mean rank
    n, m = len(known), len(unknown)
    return float((ranks[:n].sum() - n * (n + 1) / 2) / (n * m))


def threshold_keeping(known: Tensor, keep: float = 0.95) -> float:
    """The largest score value at or above which at least ``keep`` of the known images lie."""
    if not 0 < keep < 1:
        raise ValueError(f"keep={keep}: give the share of known images to keep, in (0, 1)")
    ranked = known.double().sort(descending=True).values
    return float(ranked[math.ceil(keep * len(ranked) - 1e-9) - 1])


def fpr_at_tpr(known: Tensor, unknown: Tensor, tpr: float = 0.95) -> float:
    """The share of unknown images kept at the threshold that keeps ``tpr`` of the known ones (FPR at 95% TPR)."""
    return float((unknown.double() >= threshold_keeping(known, tpr)).double().mean())


@dataclass
class UnknownRule:
    """A score and the threshold below which an image is said to be of none of the classes: ``score`` (one of
    :data:`SCORES`), ``threshold`` (fitted to keep ``keep`` of the validation images), the name rows give such an
    image (``label``), and for a feature score its fitted :class:`KNNScore` (``k``) or :class:`MahalanobisScore`."""

    score: str
    threshold: float
    keep: float
    label: str = "unknown"
    k: int | None = None
    fitted: KNNScore | MahalanobisScore | ViMScore | None = None

    @property
    def needs_features(self) -> bool:
        return self.score in FEATURE_SCORES

    def scores(self, logits: Tensor, features: Tensor | None = None) -> Tensor:
        """``(B,)`` float32 on the CPU: the score of each image, from its logits ``(B, C)`` (the raw ones, not
        divided by a temperature) or pooled features ``(B, D)``."""
        if self.needs_features:
            return self.fitted(features).float().cpu()
        return LOGIT_SCORES[self.score](logits).cpu()

    def record(self, state_file: str | None) -> dict[str, Any]:
        """What ``config.json`` keeps of it, under the weights it was fitted on (``state_file``: its bank's)."""
        return {"score": self.score, "threshold": self.threshold, "keep": self.keep,
                **({"k": self.k} if self.k is not None else {}), **({"state": state_file} if state_file else {})}

    def save_state(self, path: Path) -> None:
        """The fitted bank or statistics to ``path`` (safetensors, written whole, then renamed into place)."""
        from safetensors.torch import save_file

        with replaced(path) as tmp:
            save_file({k: v.detach().cpu().contiguous() for k, v in self.fitted.state().items()}, str(tmp))


UNKNOWN_MODES = ("auto", "on", "off")


def stored_rule(cfg: dict[str, Any], label: str = "unknown", mode: str = "auto") -> UnknownRule | None:
    """The rule ``vitlab calibrate --unknown`` kept for a loaded model's weights (its ``pretrained_cfg``: the
    ``unknown`` record and the ``checkpoint`` directory its state file lies in), rows naming such images ``label``;
    None if none was fitted (``mode='auto'``) or ``mode='off'``. ``mode='on'``: one line if none was fitted."""
    from ..errors import ConfigError

    if mode not in UNKNOWN_MODES:
        raise ConfigError(f"--unknown {mode}: give auto (the stored threshold where there is one), on or off")
    if not label.strip():
        raise ConfigError("--unknown-label: give the name a row gives an image of none of the classes")
    record = cfg.get("unknown")
    if mode == "off" or not record:
        if mode == "on":
            raise ConfigError("--unknown on: this model was never calibrated for unknown images (no threshold kept "
                              "with its weights): run vitlab calibrate --checkpoint RUN --unknown SCORE first")
        return None
    rule = UnknownRule(record["score"], float(record["threshold"]), float(record["keep"]), label, record.get("k"))
    if rule.needs_features:
        from safetensors.torch import load_file

        from ..models.calibrated import open_set_file

        state = load_file(str(open_set_file(cfg["checkpoint"], record)))
        rule.fitted = feature_score(rule.score, rule.k).load_state(state)
    return rule
