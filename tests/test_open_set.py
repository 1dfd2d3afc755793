"""The scores of "none of my classes" (vitlab.inference.open_set) against pytorch-ood's detectors, and their
ratings against scikit-learn's ROC."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score, roc_curve

from vitlab.inference.open_set import (KNNScore, MahalanobisScore, auroc, energy, fpr_at_tpr, max_logit, msp,
                                       threshold_keeping)

pood = pytest.importorskip("pytorch_ood.detector", reason="the test extra's pytorch-ood is not installed")


def test_logit_scores_are_pytorch_oods_negated():
    logits = torch.randn(500, 10, generator=torch.Generator().manual_seed(0)) * 3
    torch.testing.assert_close(msp(logits), -pood.MaxSoftmax.score(logits))
    torch.testing.assert_close(max_logit(logits), -pood.MaxLogit.score(logits))
    for t in (1.0, 2.5):
        torch.testing.assert_close(energy(logits, t), -pood.EnergyBased.score(logits, t))


def test_knn_is_pytorch_oods_distance_to_the_kth_neighbour_negated():
    g = torch.Generator().manual_seed(1)
    bank, queries = torch.randn(2000, 32, generator=g), torch.randn(300, 32, generator=g) * 2
    for k in (1, 50):
        theirs = pood.KNN(None, k=k).fit_features(bank, torch.zeros(2000, dtype=torch.long)).predict_features(queries)
        ours = KNNScore(k, chunk=128).fit(bank)(queries)  # in chunks: the same
        torch.testing.assert_close(ours.double(), -theirs.double(), atol=1e-5, rtol=0)


def test_mahalanobis_is_pytorch_oods_with_the_covariance_a_mean():
    g = torch.Generator().manual_seed(2)
    labels = torch.arange(600) % 3
    features = torch.randn(600, 16, generator=g) + labels[:, None] * 2.0
    queries = torch.randn(200, 16, generator=g) * 3
    theirs = pood.Mahalanobis(None).fit_features(features, labels).predict_features(queries)
    ours = MahalanobisScore().fit(features, labels)(queries)
    # pytorch-ood's: 0.5 x the distance under the summed (not averaged) covariance, i.e. ours / N / 2
    torch.testing.assert_close(ours.double(), -2 * 600 * theirs.double(), rtol=1e-4, atol=1e-4)
    assert (ours[:50] > MahalanobisScore().fit(features, labels)(queries[:50] * 10)).all()  # farther: lower


def test_auroc_and_fpr_at_95_tpr_are_scikit_learns():
    g = np.random.default_rng(3)
    for known, unknown in [(g.normal(1, 1, 700), g.normal(0, 1, 300)),
                           (g.integers(0, 5, 400).astype(float), g.integers(0, 4, 250).astype(float))]:  # ties
        truth = np.r_[np.ones(len(known)), np.zeros(len(unknown))]
        scores = np.r_[known, unknown]
        a, b = torch.tensor(known), torch.tensor(unknown)
        assert auroc(a, b) == pytest.approx(roc_auc_score(truth, scores), abs=1e-12)
        fpr, tpr, _ = roc_curve(truth, scores)
        assert fpr_at_tpr(a, b) == pytest.approx(fpr[np.searchsorted(tpr, 0.95)], abs=1e-12)
        kept = (a >= threshold_keeping(a, 0.95)).double().mean()
        assert kept >= 0.95


def test_bad_arguments_say_what_to_give():
    with pytest.raises(ValueError, match=r"keep=1\.0: give the share of known images to keep, in \(0, 1\)"):
        threshold_keeping(torch.ones(3), 1.0)
    with pytest.raises(ValueError, match=r"k=5 is more than the 3 features of the bank"):
        KNNScore(5).fit(torch.ones(3, 2))
    with pytest.raises(RuntimeError, match=r"call fit"):
        KNNScore(1)(torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"classes \[1\] have no training features"):
        MahalanobisScore().fit(torch.ones(4, 2), torch.tensor([0, 0, 2, 2]))
