"""Calibration (issue 50, 3): the expected calibration error against its definition written out here (Guo
et al. 2017: 15 equal bins of the top-1 confidence), temperature scaling against SciPy's minimizer of the
same negative log-likelihood, and vitlab calibrate / eval on a run: the temperature is kept with the model,
top-1 unchanged, the probabilities of eval and predict calibrated."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.optimize import minimize_scalar

from conftest import reset_accelerate, tiny_overrides
from vitlab.config import load_config
from vitlab.tasks.calibration import calibration_bins, expected_calibration_error, fit_temperature
from vitlab.training import train


def _ece_by_hand(probs: np.ndarray, labels: np.ndarray, bins: int = 15) -> float:
    confidence, predicted = probs.max(1), probs.argmax(1)
    ece = 0.0
    for lo, hi in zip(np.linspace(0, 1, bins + 1)[:-1], np.linspace(0, 1, bins + 1)[1:]):
        inside = (confidence > lo) & (confidence <= hi)
        if inside.any():
            ece += inside.mean() * abs((predicted[inside] == labels[inside]).mean() - confidence[inside].mean())
    return float(ece)


@pytest.mark.parametrize("seed", range(3))
def test_the_expected_calibration_error_is_its_definition(seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 7, (500,), generator=g)
    logits = 3 * torch.randn(500, 7, generator=g) + 2 * F.one_hot(labels, 7)
    probs = logits.softmax(-1)
    assert expected_calibration_error(probs, labels) == pytest.approx(_ece_by_hand(probs.numpy(), labels.numpy()),
                                                                      abs=1e-6)
    confidence, accuracy, counts = calibration_bins(probs, labels)
    assert counts.sum() == 500 and len(confidence) == len(accuracy) == 15


def test_temperature_scaling_minimizes_the_validation_nll_as_scipy_finds_it():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (2000,), generator=g)
    logits = 4 * (torch.randn(2000, 10, generator=g) + 1.5 * F.one_hot(labels, 10))  # overconfident
    nll = lambda t: F.cross_entropy(logits / t, labels).item()
    reference = minimize_scalar(nll, bounds=(0.05, 20), method="bounded", options={"xatol": 1e-8}).x
    fitted = fit_temperature(logits, labels)
    assert fitted == pytest.approx(reference, abs=1e-3) and fitted > 1.5  # it softens an overconfident model
    assert nll(fitted) < nll(1.0)
    scaled = (logits / fitted).softmax(-1)
    assert expected_calibration_error(scaled, labels) < expected_calibration_error(logits.softmax(-1), labels)


@pytest.mark.slow
def test_the_ece_objective_finds_the_temperature_of_the_least_calibration_error_a_dense_search_finds():
    # Two kinds of images, their logits at scales 1 and 4: no one temperature fits both, and the one of the least
    # NLL is not the one of the least ECE (here it is worse than none at all).
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (3000,), generator=g)
    scale = torch.where(torch.rand(3000, generator=g) < 0.5, 1.0, 4.0)[:, None]
    logits = scale * (torch.randn(3000, 10, generator=g) + 1.5 * F.one_hot(labels, 10))
    ece = lambda t: _ece_by_hand((logits.double() / t).softmax(-1).numpy(), labels.numpy())
    grid = np.exp(np.linspace(np.log(0.05), np.log(20), 4000))
    least = min(ece(t) for t in grid)
    fitted = fit_temperature(logits, labels, objective="ece")
    assert ece(fitted) <= least + 1e-6 and ece(fitted) == pytest.approx(0.1360, abs=1e-4)
    assert ece(fit_temperature(logits, labels)) > least + 0.02 and ece(1.0) > least + 0.005


def test_calibrate_keeps_the_temperature_with_the_model_and_eval_and_predict_use_it(
        tiny_imagefolder, tmp_path, capsys, on_cpu):
    from vitlab import load_model
    from vitlab.cli import main

    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(tiny_imagefolder, run, "data.val_size=12", "train.epochs=1")))
    reset_accelerate()
    before = tmp_path / "before.json"
    main(["eval", "--checkpoint", str(run), "--output", str(before)])
    reset_accelerate()
    main(["calibrate", "--checkpoint", str(run)])
    reset_accelerate()
    out = capsys.readouterr().out
    model = load_model(run)
    temperature = model.pretrained_cfg["temperature"]
    assert temperature > 0 and f"temperature {temperature:.4f} fitted on the 12 validation images" in out
    after = tmp_path / "after.json"
    main(["eval", "--checkpoint", str(run), "--output", str(after)])
    reset_accelerate()
    b, a = json.loads(before.read_text()), json.loads(after.read_text())
    assert a["top1"] == b["top1"] and a["temperature"] == temperature and b["temperature"] == 1.0
    assert a["loss"] != pytest.approx(b["loss"], abs=1e-6) and 0 <= a["ece"] <= 1
    assert (after.parent / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = sorted((tiny_imagefolder / "test" / "class_0").iterdir())[0]
    main(["predict", "--checkpoint", str(run), "--topk", "1", str(image)])
    shown = float(capsys.readouterr().out.strip().rsplit(" ", 1)[1])
    from PIL import Image

    from vitlab import create_transform

    with torch.no_grad():
        logits = model(create_transform(model)(Image.open(image))[None])
    assert shown == pytest.approx((logits / temperature).softmax(-1).max().item(), abs=5e-4)
    with pytest.raises(SystemExit):
        main(["calibrate", "--checkpoint", str(tmp_path / "nowhere")])


@pytest.mark.parametrize("entry", ["train.py", "vitlab.training.train"])
def test_train_calibrate_fits_at_the_end_what_vitlab_calibrate_fits(tiny_imagefolder, tmp_path, capsys, on_cpu, entry):
    from vitlab import load_model
    from vitlab.cli import main, train_main
    from vitlab.errors import ConfigError
    from vitlab.training import train

    run, config = tmp_path / "run", tmp_path / "tiny.yaml"
    config.write_text("{}\n")  # every key from the defaults and the overrides
    overrides = tiny_overrides(tiny_imagefolder, run, "data.val_size=12", "train.epochs=1", "train.calibrate=true",
                               "train.calibrate_objective=ece", "train.log_with=none")
    if entry == "train.py":
        train_main(["--config", str(config), *overrides])
    else:  # the library entry honours the key as the command does
        train(load_config(str(config), overrides))
    reset_accelerate()
    at_end = load_model(run).pretrained_cfg["temperature"]
    assert "temperature of the least calibration error" in capsys.readouterr().out
    main(["calibrate", "--checkpoint", str(run), "--objective", "ece"])
    reset_accelerate()
    assert load_model(run).pretrained_cfg["temperature"] == pytest.approx(at_end, rel=1e-6)
    assert "fitted on the 12 validation images" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"train.calibrate=True reads the validation split, and this run holds out "
                                          r"none: set data.val_size=N"):
        load_config(None, tiny_overrides(tiny_imagefolder, run, "train.calibrate=true"))


def test_a_temperature_belongs_to_the_weights_it_was_fitted_on(tiny_imagefolder, tmp_path, on_cpu):
    # the EMA's temperature is not the raw weights': each set of weights gets the one fitted on its own logits
    from vitlab import load_model
    from vitlab.cli import main
    from vitlab.evaluation import evaluate_checkpoint

    import shutil

    data = shutil.copytree(tiny_imagefolder, tmp_path / "noisy")  # a quarter of each class labelled as the next:
    for c in range(3):  # no temperature separates them all
        for path in sorted((data / "train" / f"class_{c}").iterdir())[:8]:
            path.rename(data / "train" / f"class_{(c + 1) % 3}" / f"moved_{c}_{path.name}")
    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(data, run, "data.val_size=24", "train.epochs=1", "train.ema_decay=0.9")))
    reset_accelerate()

    def fitted_on(use_ema: bool) -> float:  # the reference: SciPy's minimizer of the NLL of those weights' logits
        from vitlab.checkpoint import resolve_checkpoint
        from vitlab.data.transforms import ModelInput
        from vitlab.tasks.classification.evaluation import classifier_split
        from vitlab.tasks.classification import evaluate_classifier

        directory = resolve_checkpoint(run)
        model = load_model(run, use_ema=use_ema)
        cfg = load_config(directory / "run_config.yaml", recorded=True)
        acc, loader, classes, _, _ = classifier_split(directory, cfg, model, "val", 64)
        info = model.pretrained_cfg
        m = evaluate_classifier(model, loader, acc, len(classes), ModelInput(info["mean"], info["std"]),
                                keep_probs=True)
        nll = lambda t: F.cross_entropy(m["logits"] / t, m["labels"]).item()
        return minimize_scalar(nll, bounds=(0.05, 20), method="bounded", options={"xatol": 1e-8}).x

    main(["calibrate", "--checkpoint", str(run)])  # the EMA's weights, as eval reads them by default
    reset_accelerate()
    ema_t = load_model(run, use_ema=True).pretrained_cfg["temperature"]
    assert ema_t == pytest.approx(fitted_on(True), abs=1e-3)
    assert "temperature" not in load_model(run, use_ema=False).pretrained_cfg  # none fitted on the raw weights yet
    reset_accelerate()
    assert evaluate_checkpoint(run, use_ema=False)["temperature"] == 1.0
    reset_accelerate()
    main(["calibrate", "--checkpoint", str(run), "--no-ema"])
    reset_accelerate()
    raw_t = load_model(run, use_ema=False).pretrained_cfg["temperature"]
    assert raw_t == pytest.approx(fitted_on(False), abs=1e-3) and raw_t != pytest.approx(ema_t, abs=1e-3)
    assert load_model(run, use_ema=True).pretrained_cfg["temperature"] == ema_t  # the EMA's kept
    assert evaluate_checkpoint(run, use_ema=False)["temperature"] == raw_t


def test_a_calibration_belongs_to_the_weights_it_was_fitted_on_not_to_their_file_name(tiny_imagefolder, tmp_path,
                                                                                      on_cpu, capsys):
    # Weights changed in Python and saved with save_pretrained, or other weights under the file name the calibration
    # was kept for, do not take the temperature and unknown threshold fitted on the old ones: they are dropped, in
    # one line. The same weights keep them (in a save_pretrained copy too).
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vitlab import load_model
    from vitlab.checkpoint import resolve_checkpoint
    from vitlab.cli import main
    from vitlab.models.calibrated import weights_name
    from vitlab.models.hub import read_json

    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(tiny_imagefolder, run, "data.val_size=24", "train.epochs=1")))
    reset_accelerate()
    for extra in ([], ["--unknown", "energy"]):
        main(["calibrate", "--checkpoint", str(run), *extra])
        reset_accelerate()
    import shutil

    import vitlab.models.calibrated

    digests = []
    digest = vitlab.models.calibrated.weights_digest
    vitlab.models.calibrated.weights_digest = lambda m: digests.append(1) or digest(m)
    try:
        model = load_model(run)  # the weights file as calibrate left it (its size and time): not read again
        assert digests == [] and {"temperature", "unknown"} <= set(model.pretrained_cfg)
        copied = shutil.copytree(run, tmp_path / "copied", copy_function=shutil.copyfile)  # new times: read, kept
        assert {"temperature", "unknown"} <= set(load_model(copied).pretrained_cfg) and digests == [1]
    finally:
        vitlab.models.calibrated.weights_digest = digest
    model.save_pretrained(tmp_path / "same")
    assert {"temperature", "unknown"} <= set(load_model(tmp_path / "same").pretrained_cfg)
    with torch.no_grad():
        model.head.bias.add_(0.5)  # fine-tuned in Python
    capsys.readouterr()
    model.save_pretrained(tmp_path / "changed")
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "calibrate" in said, said
    assert not {"temperature", "unknown"} & set(load_model(tmp_path / "changed").pretrained_cfg)
    directory = resolve_checkpoint(run)
    weights = directory / weights_name(read_json(directory / "config.json"), True)
    with safe_open(str(weights), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors["head.bias"] += 0.5
    save_file(tensors, str(weights), metadata=metadata)  # other weights under the name calibrate kept them for
    capsys.readouterr()
    assert not {"temperature", "unknown"} & set(load_model(run).pretrained_cfg)
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and weights.name in said and "vitlab calibrate" in said, said


def test_a_checkpoint_of_before_keeps_its_temperature_for_the_weights_calibrate_read(tmp_path):
    from vitlab.models.calibrated import calibration_of, set_calibration

    meta = {"has_ema": True, "temperature": 1.7}  # calibrate read the EMA's weights where a run kept them
    assert calibration_of(meta, "ema.safetensors") == {"temperature": 1.7}
    assert calibration_of(meta, "model.safetensors") == {}
    assert calibration_of({"temperature": 1.7}, "model.safetensors") == {"temperature": 1.7}
    (tmp_path / "config.json").write_text(json.dumps(meta))
    set_calibration(tmp_path, "model.safetensors", temperature=0.8)
    kept = json.loads((tmp_path / "config.json").read_text())
    assert kept == {"has_ema": True, "calibration": {"ema.safetensors": {"temperature": 1.7},
                                                     "model.safetensors": {"temperature": 0.8}}}


def test_calibrate_objective_ece_on_a_multi_label_run_is_one_line(tmp_path, capsys, on_cpu):
    from test_multilabel import _overrides, write_quadrants
    from vitlab.cli import main
    from vitlab.errors import ConfigError

    data = write_quadrants(tmp_path / "data", {"train": 40, "test": 8})
    with pytest.raises(ConfigError, match=r"^train.calibrate_objective=ece chooses a temperature, for one class an "
                                          r"image, and the data's labels are sets"):
        train(load_config(None, _overrides(data, tmp_path / "r0", "data.val_size=8", "train.calibrate=true",
                                           "train.calibrate_objective=ece")))
    reset_accelerate()
    run = tmp_path / "run"
    train(load_config(None, _overrides(data, run, "data.val_size=8", "train.epochs=1")))
    reset_accelerate()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["calibrate", "--checkpoint", str(run), "--objective", "ece"])
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --objective ece chooses a temperature, for one class an image; ") and \
        "holds a multi-label classifier" in err and len(err.splitlines()) == 1
