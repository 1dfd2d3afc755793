"""The scores of "none of my classes" (vitlab.inference.open_set) against pytorch-ood's detectors, and their
ratings against scikit-learn's ROC."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.metrics import roc_auc_score, roc_curve

from vitlab.inference.open_set import (KNNScore, MahalanobisScore, ViMScore, auroc, energy, fpr_at_tpr, max_logit,
                                       msp, threshold_keeping)

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



def test_mahalanobis_of_layer_normed_features_drops_their_null_direction_not_its_rounding():
    # a LayerNorm's outputs x = gamma * n + beta, n summing to zero: their covariance has a null direction (1 / gamma),
    # which float32 rounding gives a variance of ~1e-14 of the largest. Inverting that would make the score the
    # rounding's (1e14 x it); the reference is the distance in the 15 dimensions left once that direction is
    # projected out, in float64
    g = torch.Generator().manual_seed(5)
    labels = torch.arange(400) % 4
    gamma = torch.rand(16, generator=g, dtype=torch.float64) + 0.5
    beta = torch.randn(16, generator=g, dtype=torch.float64) * 10

    def layer_norm(x: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.layer_norm(x, (16,)) * gamma + beta).float()

    raw = torch.randn(400, 16, generator=g, dtype=torch.float64) * torch.linspace(0.5, 2, 16, dtype=torch.float64)
    features = layer_norm(raw + labels[:, None] * torch.linspace(-1, 1, 16, dtype=torch.float64))
    queries = layer_norm(torch.randn(100, 16, generator=g, dtype=torch.float64) * 1.5)
    null = (1 / gamma)[:, None] / (1 / gamma).norm()
    basis = torch.linalg.qr(torch.cat([null, torch.randn(16, 15, generator=g, dtype=torch.float64)], 1)).Q[:, 1:]
    f, q = features.double() @ basis, queries.double() @ basis
    means = torch.stack([f[labels == c].mean(0) for c in range(4)])
    covariance = (f - means[labels]).T @ (f - means[labels]) / len(f)
    centered = q[:, None] - means[None]
    expected = -torch.einsum("bcd,de,bce->bc", centered, torch.linalg.inv(covariance), centered).amin(1)
    score = MahalanobisScore().fit(features, labels)
    torch.testing.assert_close(score(queries).double(), expected, rtol=1e-4, atol=1e-4)
    # a query moved by float32's last bit scores as it did
    nudged = queries * (1 + torch.finfo(torch.float32).eps * torch.randn(100, 16, generator=g).sign())
    torch.testing.assert_close(score(nudged), score(queries), rtol=1e-4, atol=1e-4)


def test_relative_mahalanobis_is_pytorch_oods_rmd_with_both_covariances_means():
    # Ren et al. 2021: the class distance minus the distance under one Gaussian of all the training features
    g = torch.Generator().manual_seed(4)
    labels = torch.arange(900) % 3
    features = torch.randn(900, 16, generator=g) * torch.linspace(0.2, 3, 16) + labels[:, None] * 1.5
    queries = torch.randn(300, 16, generator=g) * 3
    theirs = pood.RMD(None).fit_features(features, labels).predict_features(queries)
    score = MahalanobisScore(relative=True).fit(features, labels)
    # pytorch-ood's: both distances under summed covariances, i.e. ours / N, and the outlier score (negated); in
    # float32, its difference of two distances keeps float32's 7 digits of the larger one, not of the difference
    background = -MahalanobisScore().fit(features, torch.zeros(900, dtype=torch.long))(queries)
    torch.testing.assert_close(score(queries).double(), -900 * theirs.double(), rtol=0, atol=1e-5 * background.max())
    plain = MahalanobisScore().fit(features, labels)(queries)
    assert not torch.allclose(score(queries), plain, atol=1)
    stored = MahalanobisScore(relative=True).load_state(score.state())  # what vitlab calibrate keeps, read back
    torch.testing.assert_close(stored(queries), score(queries), rtol=0, atol=0)


def test_vim_is_pytorch_oods_virtual_logit_score_negated():
    # Wang et al. 2022: the energy of the logits less alpha x the norm of the feature outside the principal subspace,
    # centred at the head's origin -pinv(W) b; alpha from the training features. Features of uneven spread, so the
    # residual subspace (the 16 least-spread directions of 32) is a real choice; queries wider than the data
    g = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(6, 32, generator=g), torch.randn(6, generator=g)
    labels = torch.arange(1200) % 6
    features = torch.randn(1200, 32, generator=g) * torch.linspace(0.2, 3, 32) + weight[labels] * 0.5
    queries = torch.randn(300, 32, generator=g) * 2
    theirs = pood.ViM(None, d=16, w=weight, b=bias).fit_features(features, labels)
    score = ViMScore(weight, bias).fit(features, labels)  # dim: half the features' width, 16
    assert score.dim == 16 and score.alpha == pytest.approx(theirs.alpha, rel=1e-5)
    torch.testing.assert_close(score(queries).double(), -theirs.predict_features(queries).double(), rtol=1e-5,
                               atol=1e-4)
    assert (score(features[:100]) > score(features[:100] + 5 * score.residual[:, 0])).all()  # off the subspace: lower
    stored = ViMScore().load_state(score.state())  # what vitlab calibrate keeps, read back: no head needed
    torch.testing.assert_close(stored(queries), score(queries), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"dim=32: give a principal subspace narrower than the 32 features"):
        ViMScore(weight, bias, dim=32).fit(features, labels)
    with pytest.raises(ValueError, match=r"ViM needs the classifier's linear head"):
        ViMScore().fit(features, labels)


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
    from vitlab.inference.open_set import feature_score

    with pytest.raises(ValueError, match=r"^'msp' is not a feature score; give one of knn, mahalanobis, "
                                         r"relative_mahalanobis, vim$"):
        feature_score("msp")
    assert feature_score("knn").k == 50 and feature_score("relative_mahalanobis").relative


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
    assert set(written["scores"]) == {"msp", "max_logit", "energy", "knn", "mahalanobis", "relative_mahalanobis",
                                      "vim"}
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


# --- a threshold kept with the weights: vitlab calibrate --unknown, then predict, serve and the Python API -------------

@pytest.fixture(scope="module")
def val_run(tiny_imagefolder, tmp_path_factory):
    """The tiny run holding out 24 validation images (8 a class), one epoch."""
    from conftest import train_tiny

    return train_tiny(tiny_imagefolder, tmp_path_factory.mktemp("val_run") / "run", "train.epochs=1",
                      "data.val_size=24", "data.loader=torch")


def _csv(path):
    import csv

    with open(path) as f:
        return list(csv.DictReader(f))


def test_the_msp_threshold_keeps_the_share_asked_of_the_validation_images_and_predict_answers_unknown_below_it(
        val_run, tmp_path, tiny_imagefolder):
    # The reference: vitlab eval's probabilities of the 24 validation images (the run is not temperature-calibrated,
    # so they are softmax(logits)); the threshold keeping 95% is the 23rd largest maximum probability
    import json

    from vitlab.cli import main

    main(["eval", "--checkpoint", str(val_run), "--split", "val", "--predictions", str(tmp_path / "val.csv")])
    val = _csv(tmp_path / "val.csv")
    top = {str(tiny_imagefolder / "train" / row["image"]): max(float(v) for k, v in row.items() if k.startswith("prob_"))
           for row in val}
    assert len(top) == 24
    main(["calibrate", "--checkpoint", str(val_run), "--unknown", "msp", "--keep", "0.95"])
    config = json.loads((val_run / "checkpoints/best/config.json").read_text())
    stored = config["calibration"]["model.safetensors"]["unknown"]
    assert stored["score"] == "msp" and stored["keep"] == 0.95 and "state" not in stored
    assert stored["threshold"] == pytest.approx(sorted(top.values(), reverse=True)[22], abs=1e-6)
    main(["predict", "--checkpoint", str(val_run), "--topk", "2", "--output", str(tmp_path / "rows.csv"), *top])
    rows = _csv(tmp_path / "rows.csv")
    assert [r["image"] for r in rows] == list(top)
    for r in rows:
        assert float(r["unknown_score"]) == pytest.approx(top[r["image"]], abs=1e-5)
        below = top[r["image"]] < stored["threshold"] - 1e-6  # the 23rd image is the threshold: kept (CSV's digits)
        assert r["label"] == ("unknown" if below else r["class_1"]), r
    assert sum(r["label"] == "unknown" for r in rows) == 1
    main(["predict", "--checkpoint", str(val_run), "--unknown", "off", "--output", str(tmp_path / "off.csv"),
          *list(top)[:3]])
    assert "label" not in _csv(tmp_path / "off.csv")[0]


def test_a_knn_threshold_keeps_its_bank_beside_the_weights_and_the_python_api_scores_as_predict(val_run, tmp_path,
                                                                                                  tiny_imagefolder):
    # The bank: the unit-length features of the 72 training images, as vitlab embed gives them (the 24 validation
    # images' left out); the Python API's scores: predict's
    import json

    from PIL import Image

    import vitlab
    from vitlab import load_model
    from vitlab.cli import main
    from vitlab.inference.open_set import stored_rule
    from vitlab.prediction import embed_images, predict_images

    main(["calibrate", "--checkpoint", str(val_run), "--unknown", "knn", "--unknown-k", "5", "--keep", "0.75"])
    last = val_run / "checkpoints/best"
    stored = json.loads((last / "config.json").read_text())["calibration"]["model.safetensors"]["unknown"]
    assert stored["score"] == "knn" and stored["k"] == 5 and (last / stored["state"]).is_file()
    model = load_model(val_run)
    bank = stored_rule(model.pretrained_cfg).fitted.bank
    main(["eval", "--checkpoint", str(val_run), "--split", "val", "--predictions", str(tmp_path / "val.csv")])
    held_out = {str(tiny_imagefolder / "train" / r["image"]) for r in _csv(tmp_path / "val.csv")}
    embed_images(model, [str(tiny_imagefolder / "train")], tmp_path / "train.jsonl")
    embedded = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    features = torch.tensor([r["embedding"] for r in embedded if r["image"] not in held_out])
    assert len(held_out) == 24 and bank.shape == features.shape == (72, 32)
    unit = features / features.norm(dim=1, keepdim=True)
    apart = torch.cdist(bank.double(), unit.double(), compute_mode="donot_use_mm_for_euclid_dist")
    assert apart.amin(dim=1).max() < 1e-5 and apart.amin(dim=0).max() < 1e-5  # the same 72 points
    folder = tmp_path / "noise"
    folder.mkdir()
    g = np.random.default_rng(1)
    for i in range(6):
        Image.fromarray(g.integers(0, 256, (32, 32, 3)).astype(np.uint8)).save(folder / f"{i}.png")
    predict_images(model, [str(folder)], tmp_path / "rows.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    pixels = torch.stack([torch.from_numpy(np.array(Image.open(folder / f"{i}.png"))).permute(2, 0, 1)
                          for i in range(6)])
    got = vitlab.unknown_scores(model, pixels)
    assert got["scores"].tolist() == pytest.approx([r["unknown_score"] for r in rows], abs=1e-5)
    assert got["unknown"].tolist() == [r["label"] == "unknown" for r in rows]


def test_a_relative_mahalanobis_threshold_keeps_its_background_fitted_on_the_training_features(
        val_run, tiny_imagefolder, tmp_path):
    import json

    from vitlab import load_model
    from vitlab.cli import main
    from vitlab.inference.open_set import stored_rule
    from vitlab.prediction import embed_images, predict_images

    main(["calibrate", "--checkpoint", str(val_run), "--unknown", "relative_mahalanobis"])
    model = load_model(val_run)
    rule = stored_rule(model.pretrained_cfg)
    assert rule.score == "relative_mahalanobis" and rule.k is None
    main(["eval", "--checkpoint", str(val_run), "--split", "val", "--predictions", str(tmp_path / "val.csv")])
    held_out = {str(tiny_imagefolder / "train" / r["image"]) for r in _csv(tmp_path / "val.csv")}
    embed_images(model, [str(tiny_imagefolder / "train")], tmp_path / "train.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    features = torch.tensor([r["embedding"] for r in rows if r["image"] not in held_out], dtype=torch.float64)
    torch.testing.assert_close(rule.fitted.background_mean, features.mean(dim=0), rtol=0, atol=1e-5)
    # predict answers by the stored rule: its scores are the stored statistics' on the images' features
    predict_images(model, [str(tiny_imagefolder / "test")], tmp_path / "rows.jsonl")
    embed_images(model, [str(tiny_imagefolder / "test")], tmp_path / "test.jsonl")
    predicted = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    embedded = {r["image"]: r["embedding"] for r in (json.loads(line) for line in
                                                      (tmp_path / "test.jsonl").read_text().splitlines())}
    expected = rule.fitted(torch.tensor([embedded[r["image"]] for r in predicted]))
    assert [r["unknown_score"] for r in predicted] == pytest.approx(expected.tolist(), rel=1e-4, abs=1e-3)
    assert [r["label"] == "unknown" for r in predicted] == (expected < rule.threshold).tolist()


def test_the_default_vim_threshold_keeps_the_head_and_predict_scores_by_it(val_run, tiny_imagefolder, tmp_path):
    # ViM's state holds the classifier's head as fitted (no model needed to score features); predict's scores are the
    # stored rule's on the features vitlab embed gives
    import json

    from vitlab import load_model
    from vitlab.cli import main
    from vitlab.inference.open_set import stored_rule
    from vitlab.prediction import embed_images, predict_images

    main(["calibrate", "--checkpoint", str(val_run), "--unknown"])  # the default score: vim
    model = load_model(val_run)
    rule = stored_rule(model.pretrained_cfg)
    assert rule.score == "vim" and rule.fitted.dim == model.head.weight.shape[1] // 2
    torch.testing.assert_close(rule.fitted.weight, model.head.weight.double(), rtol=0, atol=0)
    predict_images(model, [str(tiny_imagefolder / "test")], tmp_path / "rows.jsonl")
    embed_images(model, [str(tiny_imagefolder / "test")], tmp_path / "test.jsonl")
    predicted = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    embedded = {r["image"]: r["embedding"] for r in (json.loads(line) for line in
                                                      (tmp_path / "test.jsonl").read_text().splitlines())}
    features = torch.tensor([embedded[r["image"]] for r in predicted])
    expected = rule.fitted(features)
    assert [r["unknown_score"] for r in predicted] == pytest.approx(expected.tolist(), rel=1e-4, abs=1e-3)
    assert [r["label"] == "unknown" for r in predicted] == (expected < rule.threshold).tolist()


def test_vim_on_a_distilled_model_is_refused_in_one_line_and_eval_rates_the_other_scores(tiny_imagefolder, tmp_path,
                                                                                        capsys):
    # A distillation token's head beside the class token's: the logits average two heads of two tokens, not one
    # linear map of the pooled features, which ViM's origin and energy need
    from conftest import train_tiny
    from vitlab.cli import main
    from vitlab.errors import ConfigError
    from vitlab.unknown import calibrate_unknown

    run = train_tiny(tiny_imagefolder, tmp_path / "run", "train.epochs=1", "data.val_size=24", "model.distilled=true",
                     "model.global_pool=token")
    with pytest.raises(ConfigError, match=r"^--unknown vim needs logits that are one linear map of the pooled "
                                          r"features, and this model's are not \(a distilled model's two heads\)"):
        calibrate_unknown(run)  # the default score
    assert "unknown" not in json.loads((run / "checkpoints/best/config.json").read_text())
    unknown = tmp_path / "noise"
    unknown.mkdir()
    for i in range(8):
        pixels = np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(unknown / f"{i}.png")
    main(["eval", "--checkpoint", str(run), "--unknown-images", str(unknown), "--unknown-k", "5", "--output",
          str(tmp_path / "u.json")])
    assert set(json.loads((tmp_path / "u.json").read_text())["scores"]) == {
        "msp", "max_logit", "energy", "knn", "mahalanobis", "relative_mahalanobis"}
    assert "vim          not rated: this model's logits are not one linear map" in capsys.readouterr().out


def test_what_an_unknown_threshold_cannot_take_is_one_line(val_run, tiny_run, tmp_path):
    from vitlab import load_model
    from vitlab.errors import ConfigError, DataError
    from vitlab.prediction import predict_images
    from vitlab.unknown import calibrate_unknown, unknown_scores

    with pytest.raises(ConfigError, match=r"^--keep 1\.5: give the share of known images to keep, in \(0, 1\)"):
        calibrate_unknown(val_run, "msp", keep=1.5)
    with pytest.raises(ConfigError, match=r"^--unknown odin: give one of msp, max_logit, energy, knn, mahalanobis, "
                                          r"relative_mahalanobis, vim$"):
        calibrate_unknown(val_run, "odin")
    with pytest.raises(ConfigError, match=r"held out no validation images \(data\.val_size=0\)"):
        calibrate_unknown(tiny_run, "msp")
    with pytest.raises(DataError, match=r"^data\.root='.*gone' does not exist; point it at a folder"):
        calibrate_unknown(val_run, "knn", overrides=(f"data.root={tmp_path / 'gone'}",))
    never = load_model(tiny_run)
    with pytest.raises(ConfigError, match=r"^--unknown on: this model was never calibrated for unknown images"):
        predict_images(never, [str(tmp_path)], unknown="on")
    with pytest.raises(ConfigError, match=r"^this model was never calibrated for unknown images"):
        unknown_scores(never, torch.zeros(1, 3, 32, 32, dtype=torch.uint8))
    calibrate_unknown(val_run, "energy")
    with pytest.raises(ConfigError, match=r"^--tta flip: the unknown threshold was fitted on the scores"):
        predict_images(load_model(val_run), [str(tmp_path)], tta="flip")


def test_a_stopped_predict_job_is_not_continued_with_another_unknown_setting(val_run, tmp_path):
    from PIL import Image

    from vitlab import load_model
    from vitlab.errors import DataError
    from vitlab.prediction import predict_images
    from vitlab.unknown import calibrate_unknown

    calibrate_unknown(val_run, "max_logit")
    for i in range(4):
        Image.new("RGB", (32, 32), (60 * i, 20, 90)).save(tmp_path / f"{i}.png")
    out = tmp_path / "rows.csv"
    predict_images(load_model(val_run), [str(tmp_path)], out, batch_size=2, stop_after_batches=1)
    with pytest.raises(DataError, match=r"holds rows of another job \(.*unknown"):
        predict_images(load_model(val_run), [str(tmp_path)], out, batch_size=2, unknown="off")
    predict_images(load_model(val_run), [str(tmp_path)], out, batch_size=2)
    assert [r["image"] for r in _csv(out)] == [str(tmp_path / f"{i}.png") for i in range(4)]


def test_serve_answers_unknown_first_below_the_threshold_and_its_classes_after(val_run):
    pytest.importorskip("fastapi")
    import io

    from fastapi.testclient import TestClient
    from PIL import Image

    from vitlab import load_model
    from vitlab.serving.app import create_app

    blob = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(blob, format="PNG")
    for threshold, said in ((2.0, True), (-1.0, False)):  # above every msp / below every msp
        model = load_model(val_run)
        model.pretrained_cfg["unknown"] = {"score": "msp", "threshold": threshold, "keep": 0.95}
        with TestClient(create_app(model, device="cpu", unknown_label="none of these")) as client:
            answer = client.post("/v1/predict?top_k=2", content=blob.getvalue(),
                                 headers={"Content-Type": "image/png"}).json()
            info = client.get("/v1/model").json()
        classes = answer[1:] if said else answer
        assert len(classes) == 2 and all(not a.get("unknown") for a in classes)
        assert info["unknown"] == {"score": "msp", "threshold": threshold, "label": "none of these"}
        if said:
            assert answer[0]["label"] == "none of these" and answer[0]["unknown"] is True
            assert answer[0]["score"] == pytest.approx(classes[0]["score"], abs=1e-6)  # msp: the top probability
        with TestClient(create_app(model, device="cpu", unknown="off")) as client:
            assert len(client.post("/v1/predict?top_k=2", content=blob.getvalue(),
                                   headers={"Content-Type": "image/png"}).json()) == 2


def test_an_exported_file_with_its_preprocessing_carries_a_logit_scores_threshold_and_says_when_it_cannot(val_run,
                                                                                                           tmp_path):
    # onnxruntime runs the file on uint8 images (B, H, W, 3): its unknown_score is vitlab.unknown_scores' of the same
    # images, its metadata the threshold; a k-NN threshold stays out of the file, in one line
    import json

    ort = pytest.importorskip("onnxruntime")
    import onnx

    import vitlab
    from vitlab import load_model
    from vitlab.export import export_model
    from vitlab.unknown import calibrate_unknown

    threshold = calibrate_unknown(val_run, "energy")
    model = load_model(val_run)
    result = export_model(model, tmp_path / "m.onnx", with_preprocess=True)
    assert result["outputs"] == ["probabilities", "unknown_score"] and result["max_abs_diff"] < 1e-4
    assert "unknown" not in result
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "m.onnx")).metadata_props}
    assert json.loads(meta["vitlab.unknown"]) == {"score": "energy", "threshold": threshold, "below": "unknown"}
    images = torch.from_numpy(np.random.default_rng(2).integers(0, 256, (5, 32, 32, 3), dtype=np.uint8))
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    probs, scores = session.run(None, {"images": images.numpy()})
    expected = vitlab.unknown_scores(model, images.permute(0, 3, 1, 2))["scores"]
    assert scores.shape == (5,) and np.allclose(scores, expected.numpy(), atol=1e-4)
    assert np.allclose(probs.sum(1), 1, atol=1e-5)
    calibrate_unknown(val_run, "knn", k=5)
    result = export_model(load_model(val_run), tmp_path / "k.onnx", with_preprocess=True, check=False)
    assert result["outputs"] == ["probabilities"]
    assert result["unknown"].startswith("the knn score is not in the file: its bank is every training image's "
                                        "features")



@pytest.mark.parametrize("score", ["vim", "knn", "energy"])
def test_save_pretrained_carries_the_unknown_threshold_and_its_statistics_as_it_carries_the_temperature(
        val_run, tmp_path, score):
    # a calibrated model saved (save_pretrained, push_to_hub's files) and loaded again answers unknown as before:
    # the same threshold, the fitted statistics copied beside the weights, the same scores; the run is not touched
    import vitlab
    from vitlab import load_model
    from vitlab.unknown import calibrate_unknown

    threshold = calibrate_unknown(val_run, score)
    model = load_model(val_run)
    before = sorted(p.name for p in (val_run / "checkpoints" / "best").iterdir())
    model.save_pretrained(tmp_path / "saved")
    assert sorted(p.name for p in (val_run / "checkpoints" / "best").iterdir()) == before
    saved = load_model(tmp_path / "saved")
    assert saved.pretrained_cfg["unknown"]["threshold"] == threshold
    assert (tmp_path / "saved" / "open_set.model.safetensors").is_file() == (score != "energy")
    images = torch.from_numpy(np.random.default_rng(4).integers(0, 256, (5, 3, 32, 32), dtype=np.uint8))
    ours, theirs = vitlab.unknown_scores(model, images), vitlab.unknown_scores(saved, images)
    assert torch.equal(ours["scores"], theirs["scores"]) and torch.equal(ours["unknown"], theirs["unknown"])
    hub = type(model).from_pretrained(tmp_path / "saved")  # huggingface_hub's way in
    assert torch.equal(vitlab.unknown_scores(hub, images)["scores"], ours["scores"])
    saved.save_pretrained(tmp_path / "again")  # saved from a saved directory: the statistics follow again
    assert torch.equal(vitlab.unknown_scores(load_model(tmp_path / "again"), images)["scores"], ours["scores"])


def test_from_pretrained_downloads_the_fitted_statistics_beside_the_weights_when_the_hub_has_them(val_run, tmp_path,
                                                                                                  monkeypatch):
    # a stand-in for the Hub: a folder a repository, hf_hub_download copying its files into a cache folder and
    # saying "not there" (huggingface_hub's EntryNotFoundError) for a file the repository lacks
    import shutil

    import huggingface_hub.hub_mixin
    from huggingface_hub.errors import LocalEntryNotFoundError

    import vitlab
    import vitlab.models.hub
    from vitlab import load_model
    from vitlab.unknown import calibrate_unknown

    def download(repo_id: str, filename: str, **_: object) -> str:
        source, target = tmp_path / "hub" / repo_id / filename, tmp_path / "cache" / repo_id / filename
        if not source.is_file():
            raise LocalEntryNotFoundError(f"{filename} is not in {repo_id}")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        return str(target)

    monkeypatch.setattr(huggingface_hub.hub_mixin, "hf_hub_download", download)
    monkeypatch.setattr(vitlab.models.hub, "hf_hub_download", download)
    calibrate_unknown(val_run, "vim")
    model = load_model(val_run)
    model.save_pretrained(tmp_path / "hub" / "someone" / "calibrated")
    downloaded = type(model).from_pretrained("someone/calibrated")
    assert (tmp_path / "cache" / "someone" / "calibrated" / "open_set.model.safetensors").is_file()
    images = torch.from_numpy(np.random.default_rng(6).integers(0, 256, (4, 3, 32, 32), dtype=np.uint8))
    assert torch.equal(vitlab.unknown_scores(downloaded, images)["scores"],
                       vitlab.unknown_scores(model, images)["scores"])
    plain = load_model(val_run)
    del plain.pretrained_cfg["unknown"]  # a model never calibrated for unknown images: the Hub holds no such file
    plain.save_pretrained(tmp_path / "hub" / "someone" / "plain")
    assert "unknown" not in type(model).from_pretrained("someone/plain").pretrained_cfg


def test_a_threshold_whose_fitted_statistics_are_gone_is_one_line_wherever_it_is_read(val_run, tiny_imagefolder,
                                                                                       tmp_path, capsys):
    # open_set.<weights> deleted beside a calibrated checkpoint: predict, export and save_pretrained say so in one
    # line and write nothing; --unknown off predicts as before
    import shutil

    from vitlab import load_model
    from vitlab.cli import main
    from vitlab.errors import CheckpointError
    from vitlab.export import export_model
    from vitlab.unknown import calibrate_unknown

    calibrate_unknown(val_run, "vim")
    copy = tmp_path / "copy"
    shutil.copytree(val_run / "checkpoints" / "best", copy)
    (copy / "open_set.model.safetensors").unlink()
    image = str(next((tiny_imagefolder / "test").rglob("*.png")))
    said = "needs open_set.model.safetensors beside its weights, and it is missing"
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(["predict", "--checkpoint", str(copy), "--output", str(tmp_path / "rows.csv"), image])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 1 and said in err and len(err.splitlines()) == 1
    with pytest.raises(CheckpointError, match=said):
        export_model(load_model(copy), tmp_path / "m.onnx", with_preprocess=True, check=False)
    with pytest.raises(CheckpointError, match=said):
        load_model(copy).save_pretrained(tmp_path / "saved")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]
    main(["predict", "--checkpoint", str(copy), "--output", str(tmp_path / "rows.csv"), "--unknown", "off", image])
    assert len(_csv(tmp_path / "rows.csv")) == 1


@pytest.mark.parametrize("score", ["vim", "relative_mahalanobis"])
def test_a_classifier_behind_its_preprocessing_and_score_runs_where_its_model_is(val_run, score):
    # A model on a GPU exported from Python: the normalization and the fitted statistics were on the CPU, so an export
    # of a model on a GPU with its preprocessing failed at its first operation. The meta device stands in for the GPU
    # here (an operation mixing it with the CPU raises, as one mixing CUDA and the CPU does); test_gpu exports there.
    from vitlab import load_model
    from vitlab.export import PreprocessedClassifier
    from vitlab.unknown import calibrate_unknown

    calibrate_unknown(val_run, score)
    model = load_model(val_run)
    size, classes = model.pretrained_cfg["input_size"][1:], len(model.pretrained_cfg["label_names"])
    wrapped = PreprocessedClassifier(model.to("meta")).eval()
    probs, scores = wrapped(torch.zeros(2, *size, 3, dtype=torch.uint8, device="meta"))
    assert probs.device.type == scores.device.type == "meta" and probs.shape == (2, classes) and scores.shape == (2,)


@pytest.mark.parametrize("score, format", [("vim", "onnx"), ("mahalanobis", "onnx"), ("relative_mahalanobis", "onnx"),
                                           ("vim", "torch-export")])
def test_an_exported_file_carries_a_feature_score_of_fixed_size_as_vitlab_computes_it(val_run, tiny_imagefolder,
                                                                                       tmp_path, score, format):
    # ViM (the default) and the Mahalanobis scores are a few fixed matrices of the pooled features: the file holds
    # them; onnxruntime's or torch.export's scores of uint8 images (6 test images of the run's classes, 2 of noise, a
    # flat grey frame) are vitlab.unknown_scores' of the same images, and the same images fall below the stored
    # threshold (to 1e-4 of a score, 1e-2 at most: the tiny run's 96 training images leave directions of 1e-5 of the
    # largest variance, whose precision multiplies the last bits by which onnxruntime's float32 pass differs)
    from vitlab.data import read_image
    import json

    import vitlab
    from vitlab import load_model
    from vitlab.export import export_model
    from vitlab.unknown import calibrate_unknown

    if format == "onnx":
        ort = pytest.importorskip("onnxruntime")
        import onnx
    threshold = calibrate_unknown(val_run, score)
    model = load_model(val_run)
    path = tmp_path / ("m.onnx" if format == "onnx" else "m.pt2")
    result = export_model(model, path, format=format, with_preprocess=True)
    assert result["outputs"] == ["probabilities", "unknown_score"] and "unknown" not in result
    files = sorted((tiny_imagefolder / "test").rglob("*.png"))[::6]
    images = torch.cat([torch.stack([read_image(f).permute(1, 2, 0) for f in files]),
                        torch.from_numpy(np.random.default_rng(3).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)),
                        torch.full((1, 32, 32, 3), 128, dtype=torch.uint8)])
    assert len(images) == 9
    if format == "onnx":
        meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        probs, scores = session.run(None, {"images": images.numpy()})
    else:
        import zipfile

        with zipfile.ZipFile(path) as z:
            meta = json.loads(next(z.read(n) for n in z.namelist() if n.endswith("vitlab.json")))
        with torch.no_grad():
            probs, scores = (t.numpy() for t in torch.export.load(str(path)).module()(images))
    assert json.loads(meta["vitlab.unknown"]) == {"score": score, "threshold": threshold, "below": "unknown"}
    expected = vitlab.unknown_scores(model, images.permute(0, 3, 1, 2))
    assert scores.shape == (9,) and np.allclose(scores, expected["scores"].numpy(), rtol=1e-4, atol=1e-2)
    assert ((scores < threshold) == expected["unknown"].numpy()).all()
    assert 0 < expected["unknown"].sum() < 9  # images on both sides of the threshold
    assert np.allclose(probs.sum(1), 1, atol=1e-5)
    if format == "onnx" and score == "vim":  # and int8: onnxruntime's quantization reads ViM's norm too (how far
        # int8 weights move a score is the export benchmark's to say)
        quantized = export_model(model, tmp_path / "q.onnx", with_preprocess=True, quantize="int8")
        assert quantized["outputs"] == ["probabilities", "unknown_score"] and np.isfinite(quantized["max_abs_diff"])


@pytest.mark.parametrize("build", ["vit", "vit distilled", "vit avg pool", "timm"])
def test_logits_and_features_of_one_pass_are_the_forward_and_the_pooled_features(build):
    from vitlab.inference.forward import logits_and_features, pooled_features
    from vitlab.models import VisionTransformer
    from vitlab.models.timm_classifier import TimmClassifier

    torch.manual_seed(0)
    small = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    model = {"vit": lambda: VisionTransformer(**small),
             "vit distilled": lambda: VisionTransformer(**small, distilled=True),
             "vit avg pool": lambda: VisionTransformer(**small, global_pool="avg", class_token=False),
             "timm": lambda: TimmClassifier("test_vit", num_classes=5)}[build]().eval()
    x = torch.randn(3, 3, *(32, 32) if build != "timm" else model.pretrained_cfg["input_size"][1:])
    with torch.no_grad():
        logits, features = logits_and_features(model, x)
        assert torch.equal(logits, model(x)) and torch.equal(features, pooled_features(model, x))


def test_unknown_images_as_a_csv_table_score_as_the_same_files_and_a_table_of_the_runs_classes_is_refused(tiny_run,
                                                                                                         tmp_path):
    import json

    from PIL import Image

    from vitlab.errors import DataError
    from vitlab.unknown import evaluate_unknown

    g = np.random.default_rng(3)
    (tmp_path / "imgs").mkdir()
    for i in range(12):
        Image.fromarray(g.integers(0, 256, (32, 32, 3)).astype(np.uint8)).save(tmp_path / "imgs" / f"{i}.png")
    (tmp_path / "test.csv").write_text("image,labels\n" + "".join(f"imgs/{i}.png,{'noise' if i % 2 else 'blank'}\n"
                                                                   for i in range(12)))
    by_table = evaluate_unknown(tiny_run, ["data.dataset=csv", f"data.root={tmp_path}"], k=5,
                                output=tmp_path / "table.json")
    by_files = evaluate_unknown(tiny_run, [str(tmp_path / "imgs")], k=5, output=tmp_path / "files.json")
    assert json.loads((tmp_path / "table.json").read_text())["unknown"] == 12
    assert by_table == by_files
    (tmp_path / "test.csv").write_text("image,labels\nimgs/0.png,class_2\nimgs/1.png,noise\n")
    with pytest.raises(DataError, match=r"^--unknown-images: the data set's class 'class_2' is one of the run's"):
        evaluate_unknown(tiny_run, ["data.dataset=csv", f"data.root={tmp_path}"], k=5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_calibrate_and_eval_unknown_on_two_processes_give_one_process_numbers(val_run, tmp_path):
    # Each process scores its share of the validation, training, test and unknown images (13: uneven shares);
    # gathered, the threshold and every rating are one process's
    import json
    import shutil

    from PIL import Image

    from conftest import launch_env, run_two
    from vitlab.cli import main

    run = Path(shutil.copytree(val_run, tmp_path / "run"))
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    g = np.random.default_rng(4)
    for i in range(13):
        Image.fromarray(g.integers(0, 256, (32, 32, 3)).astype(np.uint8)).save(unknown / f"{i}.png")
    calibrate = ["calibrate", "--checkpoint", str(run), "--unknown"]  # the default score (vim)
    calibrate_knn = [*calibrate, "knn", "--unknown-k", "5"]  # the score whose bank is gathered
    evaluate = ["eval", "--checkpoint", str(run), "--unknown-images", str(unknown), "--unknown-k", "5",
                "--batch-size", "8", "--output"]
    stored = lambda: json.loads((run / "checkpoints/best/config.json").read_text())["calibration"][
        "model.safetensors"]["unknown"]
    main(calibrate_knn)
    one_knn = stored()
    main(calibrate)
    assert stored()["score"] == "vim"
    main([*evaluate, str(tmp_path / "one.json")])
    helper = Path(__file__).parent / "helpers" / "dist_train.py"  # the commands in one launch
    done = run_two([str(helper), "vitlab", *calibrate, "--then", "vitlab", *evaluate, str(tmp_path / "two.json"),
                    "--then", "vitlab", *calibrate_knn], launch_env(2, exact=True))
    assert done.returncode == 0, done.stderr[-3000:]
    two_knn = stored()
    assert two_knn["score"] == "knn" and two_knn["threshold"] == pytest.approx(one_knn["threshold"], abs=1e-6)
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert a["known"] == b["known"] == 36 and a["unknown"] == b["unknown"] == 13
    for name in a["scores"]:
        assert b["scores"][name] == pytest.approx(a["scores"][name], abs=1e-6), name
    assert a["stored_threshold"]["score"] == b["stored_threshold"]["score"] == "vim"
    numbers = ("threshold", "known_kept", "top1_of_kept", "unknown_rejected")
    assert [b["stored_threshold"][n] for n in numbers] == pytest.approx([a["stored_threshold"][n] for n in numbers],
                                                                         abs=1e-6)
