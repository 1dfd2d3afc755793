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


def test_eval_rates_each_score_on_unknown_images_as_scikit_learn_does_on_predicts_probabilities(tiny_run, tmp_path):
    # The tiny run's test images (known) against flat colours and noise of none of its classes; the maximum softmax
    # probability's AUROC recomputed from vitlab predict's rows of the same images by scikit-learn
    import csv
    import json

    from PIL import Image

    from vitlab.cli import main

    unknown = tmp_path / "far away"  # a space in the name
    unknown.mkdir()
    g = np.random.default_rng(0)
    for i in range(30):
        pixels = np.full((32, 32, 3), g.integers(0, 256, 3), np.uint8) if i % 2 else \
            g.integers(0, 256, (32, 32, 3)).astype(np.uint8)
        Image.fromarray(pixels).save(unknown / f"{i}.png")
    main(["eval", "--checkpoint", str(tiny_run), "--unknown-images", str(unknown), "--unknown-k", "5",
          "--output", str(tmp_path / "unknown.json")])
    written = json.loads((tmp_path / "unknown.json").read_text())
    assert written["known"] == 36 and written["unknown"] == 30 and written["k"] == 5
    assert set(written["scores"]) == {"msp", "max_logit", "energy", "knn", "mahalanobis"}
    assert (tmp_path / "unknown_scores.png").stat().st_size > 10_000
    main(["eval", "--checkpoint", str(tiny_run), "--predictions", str(tmp_path / "known.csv")])
    main(["predict", "--checkpoint", str(tiny_run), "--output", str(tmp_path / "unknown.csv"), "--topk", "1",
          str(unknown)])
    with open(tmp_path / "known.csv") as f:
        known = [max(float(v) for k, v in row.items() if k.startswith("prob_")) for row in csv.DictReader(f)]
    with open(tmp_path / "unknown.csv") as f:
        other = [float(row["prob_1"]) for row in csv.DictReader(f)]
    expected = roc_auc_score(np.r_[np.ones(len(known)), np.zeros(len(other))], np.r_[known, other])
    assert written["scores"]["msp"]["auroc"] == pytest.approx(expected, abs=1e-6)


def test_unknown_images_named_like_a_class_or_a_multi_label_run_are_one_line(tiny_run, tmp_path):
    from vitlab.errors import DataError
    from vitlab.unknown import evaluate_unknown

    clash = tmp_path / "class_1"
    clash.mkdir()
    from PIL import Image

    Image.new("RGB", (32, 32)).save(clash / "a.png")
    with pytest.raises(DataError, match=r"^--unknown-images: the folder 'class_1' is named like one of the run's"):
        evaluate_unknown(tiny_run, [str(tmp_path)])
