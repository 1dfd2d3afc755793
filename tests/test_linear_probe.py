"""The linear probe on cached features (issue 52, 2: ``model.freeze=backbone train.cache_features=true``): the
backbone's features of every training image computed once, the head fitted on them by L-BFGS as scikit-learn's
multinomial logistic regression fits it (CLIP's protocol), its L2 strength chosen on the validation split."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import reset_accelerate, tiny_overrides
from vitlab.config import load_config
from vitlab.errors import ConfigError
from vitlab.tasks.linear_probe import L2_GRID, choose_l2, fit_linear_probe


def _features(seed: int, counts: list[int], dim: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Overlapping Gaussian classes of uneven sizes (a class of one image among them)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(len(counts), dim, generator=g)
    labels = torch.cat([torch.full((n,), c) for c, n in enumerate(counts)])
    return centers[labels] + 1.5 * torch.randn(len(labels), dim, generator=g), labels


@pytest.mark.parametrize("l2", [1e-4, 1e-2, 1.0])
def test_the_head_is_scikit_learns_multinomial_logistic_regression(l2):
    from sklearn.linear_model import LogisticRegression

    x, y = _features(0, [40, 25, 1, 9])
    weight, bias = fit_linear_probe(x, y, 4, l2)
    # scikit-learn minimises C * sum(loss) + |W|^2 / 2, the intercept unpenalised: C = 1 / (l2 N).
    ref = LogisticRegression(C=1 / (l2 * len(y)), tol=1e-12, max_iter=100_000).fit(x.double().numpy(), y.numpy())
    assert weight.shape == (4, 12) and bias.shape == (4,)
    assert np.abs(weight.double().numpy() - ref.coef_).max() < 1e-4
    ours = torch.softmax(x.double() @ weight.double().T + bias.double(), 1).numpy()
    assert np.abs(ours - ref.predict_proba(x.double().numpy())).max() < 1e-5


def test_the_l2_strength_is_the_grids_best_on_the_validation_split_the_strongest_of_a_tie():
    from sklearn.linear_model import LogisticRegression

    tx, ty = _features(1, [60, 60, 60], dim=20)
    x, y, vx, vy = tx[::2], ty[::2], tx[1::2], ty[1::2]
    chosen, scores = choose_l2(x, y, vx, vy, 3)
    reference = {}
    for l2 in L2_GRID:
        ref = LogisticRegression(C=1 / (l2 * len(y)), tol=1e-12, max_iter=100_000).fit(x.double().numpy(), y.numpy())
        reference[l2] = float((ref.predict(vx.double().numpy()) == vy.numpy()).mean())
    assert scores == pytest.approx(reference, abs=1 / len(vy) + 1e-9)  # a tie broken by rounding at most
    best = max(scores.values())
    assert chosen == max(l2 for l2, s in scores.items() if s == best)
    assert min(reference.values()) < max(reference.values())  # the grid matters on this split


def test_a_probe_run_keeps_the_backbone_fits_the_head_on_the_features_and_evaluates_as_vitlab_eval(
        tiny_imagefolder, tmp_path, capsys, on_cpu):
    from vitlab import load_model
    from vitlab.evaluation import evaluate_checkpoint
    from vitlab.prediction import embed_images
    from vitlab.training import train

    source = tmp_path / "source"
    train(load_config(None, tiny_overrides(tiny_imagefolder, source, "train.epochs=1")))
    reset_accelerate()
    run = tmp_path / "probe"
    result = train(load_config(None, tiny_overrides(
        tiny_imagefolder, run, f"model.pretrained={source}", "model.freeze=backbone", "train.cache_features=true",
        "data.mixup_alpha=0.8", "train.ema_decay=0.9")))
    reset_accelerate()
    out = capsys.readouterr().out
    assert "train.cache_features: the features of the 96 training images are computed once" in out
    assert "the optimizer, its schedule, augmentation, mixup, EMA and train.epochs do not apply" in out
    assert "no validation split: L2 strength 1/N = 0.0104 (scikit-learn's default C=1)" in out
    start = load_file(str(source / "checkpoints/last/model.safetensors"))
    end = load_file(str(run / "checkpoints/last/model.safetensors"))
    assert all(torch.equal(start[k], end[k]) for k in start if not k.startswith("head."))
    # The head: the logistic regression of the training images' pooled features, read by another path (embed).
    embed_images(load_model(source), [str(tiny_imagefolder / "train")], tmp_path / "f.npy", num_workers=0)
    features = torch.from_numpy(np.load(tmp_path / "f.npy"))
    labels = torch.arange(3).repeat_interleave(32)
    weight, bias = fit_linear_probe(features, labels, 3, 1 / 96)
    assert (end["head.weight"] - weight).abs().max() < 1e-4 and (end["head.bias"] - bias).abs().max() < 1e-4
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["epoch"] == 1 and record["probe_l2"] == pytest.approx(1 / 96)
    assert result["epochs_done"] == 1
    evaluated = evaluate_checkpoint(run)  # vitlab eval: the full model on the test images
    reset_accelerate()
    assert evaluated["top1"] == record["test_top1"] and evaluated["loss"] == pytest.approx(record["test_loss"], abs=1e-6)
    # The device-resident loader (it shards evaluation itself) gives the features, and so the head, alike.
    on_device = tmp_path / "on_device"
    train(load_config(None, tiny_overrides(tiny_imagefolder, on_device, f"model.pretrained={source}",
                                           "model.freeze=backbone", "train.cache_features=true", "data.loader=gpu")))
    reset_accelerate()
    head = load_file(str(on_device / "checkpoints/last/model.safetensors"))
    assert (head["head.weight"] - end["head.weight"]).abs().max() < 1e-5
    # A validation split chooses the strength; the run says which and what each scored.
    chosen = tmp_path / "chosen"
    train(load_config(None, tiny_overrides(tiny_imagefolder, chosen, f"model.pretrained={source}",
                                           "model.freeze=backbone", "train.cache_features=true", "data.val_size=12")))
    reset_accelerate()
    record = json.loads((chosen / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["probe_l2"] in L2_GRID and "val_top1" in record
    assert "L2 strength chosen on the 12 validation images" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["model.freeze=blocks:1"], r"^train.cache_features=True fits the head alone on the backbone's features: set "
                                r"model.freeze=backbone"),
    (["model.freeze=backbone", "data.multi_label=true"], r"^train.cache_features=True fits one class an image"),
    (["model.freeze=backbone", "distill.type=hard", "distill.teacher=timm:y"],
     r"^distill.type='hard': train.cache_features fits the head alone on the backbone's features, without a teacher"),
    (["model.freeze=backbone", "data.dataset=wds"], r"^data.dataset='wds': train.cache_features reads each "
                                                    r"training image once from a split, not from streamed shards"),
])
def test_bad_probes_are_one_line_before_any_image_is_decoded(tiny_imagefolder, tmp_path, extra, message):
    from vitlab.training import train

    with pytest.raises(ConfigError, match=message):
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "r", "model.pretrained=timm:x",
                                               "train.cache_features=true", *extra)))
    reset_accelerate()
    assert not (tmp_path / "r").exists()


def test_a_model_without_one_linear_head_is_one_line_before_any_image_is_decoded(tiny_imagefolder, tmp_path, capsys):
    from vitlab.training import train

    with pytest.raises(ConfigError, match=r"^train.cache_features fits one linear head on the pooled features; "
                                          r"VisionTransformer has two heads \(a distillation token\): train its head "
                                          r"with model.freeze=backbone alone$"):
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "r", "model.distilled=true",
                                               "model.freeze=backbone", "train.cache_features=true")))
    reset_accelerate()
    assert "decoding" not in capsys.readouterr().out
