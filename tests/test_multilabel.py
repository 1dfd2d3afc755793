"""Multi-label classification: the metrics against scikit-learn's, the loss and mixup against timm's and
torch's definitions, the csv and Hugging Face label sets, and a run end to end."""
from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from conftest import reset_accelerate
from vitlab.config import load_config
from vitlab.errors import ConfigError, DataError
from vitlab.tasks.multilabel import MultiHotMixup, MultiLabelLoss, average_precision, choose_thresholds, \
    f1_scores, multilabel_metrics, positive_weights

sklearn_metrics = pytest.importorskip("sklearn.metrics")


def _case(seed: int, n: int = 40, k: int = 5, ties: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    targets = torch.rand(n, k, generator=g) < torch.linspace(0.05, 0.6, k)  # a rare class to a common one
    scores = torch.randn(n, k, generator=g) + 1.5 * targets
    if ties:
        scores = (scores * 2).round() / 2  # many equal scores
    return scores, targets


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ties", [False, True])
def test_average_precision_is_scikit_learns_per_class_and_micro(seed, ties):
    scores, targets = _case(seed, ties=ties)
    theirs = sklearn_metrics.average_precision_score(targets.numpy(), scores.numpy(), average=None)
    np.testing.assert_allclose(average_precision(scores, targets).numpy(), theirs, atol=1e-12)
    m = multilabel_metrics(scores, targets)
    assert m["map"] == pytest.approx(sklearn_metrics.average_precision_score(targets.numpy(), scores.numpy(),
                                                                             average="macro"), abs=1e-6)
    assert m["micro_map"] == pytest.approx(sklearn_metrics.average_precision_score(
        targets.numpy(), scores.sigmoid().numpy(), average="micro"), abs=1e-6)


def test_a_class_without_positives_has_no_average_precision_and_is_left_out_of_the_mean():
    scores, targets = _case(0)
    targets[:, 2] = False
    ap = average_precision(scores, targets)
    assert ap[2].isnan() and not ap[[0, 1, 3, 4]].isnan().any()
    kept = [0, 1, 3, 4]
    assert multilabel_metrics(scores, targets)["map"] == pytest.approx(sklearn_metrics.average_precision_score(
        targets[:, kept].numpy(), scores[:, kept].numpy(), average="macro"), abs=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_f1_precision_and_recall_are_scikit_learns_label_and_example_based(seed):
    scores, targets = _case(seed, n=30, k=6)
    targets[3] = False  # an image of none of the classes
    targets[:, 5] = False  # a class never true ...
    predicted = scores.sigmoid() >= 0.5
    predicted[:, 5] = False  # ... and never predicted
    predicted[7] = False
    mine = f1_scores(predicted, targets)
    t, p = targets.numpy(), predicted.numpy()
    for average in ("macro", "micro", "samples"):
        key = "example_f1" if average == "samples" else f"{average}_f1"
        assert mine[key] == pytest.approx(sklearn_metrics.f1_score(t, p, average=average, zero_division=0), abs=1e-12)
    precision, recall, f1, _ = sklearn_metrics.precision_recall_fscore_support(t, p, average=None, zero_division=0)
    np.testing.assert_allclose(mine["f1"], f1, atol=1e-12)
    np.testing.assert_allclose(mine["precision"], precision, atol=1e-12)
    np.testing.assert_allclose(mine["recall"], recall, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_each_classs_threshold_is_the_one_of_its_highest_f1_found_by_trying_every_score(seed):
    scores, targets = _case(seed, n=50, k=4, ties=seed % 2 == 1)
    probs = scores.sigmoid()
    chosen = choose_thresholds(probs, targets)
    for k in range(4):
        candidates = sorted(set(probs[:, k].tolist()), reverse=True)
        f1 = [sklearn_metrics.f1_score(targets[:, k].numpy(), (probs[:, k] >= c).numpy(), zero_division=0)
              for c in candidates]
        best = max(f1)
        assert chosen[k].item() == pytest.approx(candidates[f1.index(best)], abs=1e-6)  # the highest of the ties
    tuned = multilabel_metrics(scores, targets, chosen)
    assert tuned["macro_f1_tuned"] >= tuned["macro_f1"]


def test_the_loss_is_torchs_binary_cross_entropy_with_timms_smoothing_and_pos_weight():
    scores, targets = _case(1)
    weight = positive_weights(targets.sum(0), len(targets))
    np.testing.assert_allclose(weight.numpy(), ((len(targets) - targets.sum(0)) / targets.sum(0)).numpy(), rtol=1e-6)
    smoothed = targets.float() * 0.9 + 0.05  # towards 0.5 by 0.1
    want = F.binary_cross_entropy_with_logits(scores, smoothed, pos_weight=weight)
    assert MultiLabelLoss(0.1, weight)(scores, targets).item() == pytest.approx(want.item(), rel=1e-6)
    timm_loss = pytest.importorskip("timm.loss").BinaryCrossEntropy
    try:
        theirs = timm_loss(smoothing=0.1, pos_weight=weight, smooth_dense=True)
    except TypeError:
        pytest.skip("this timm has no smooth_dense (timm >= 1.0.25)")
    assert MultiLabelLoss(0.1, weight)(scores, targets).item() == pytest.approx(theirs(scores, targets.float()).item(),
                                                                                rel=1e-6)


@pytest.mark.parametrize("cutmix", [False, True])
def test_mixup_mixes_the_multi_hot_targets_as_timms_multi_label_mixup(cutmix):
    from timm.data import mixup as timm_mixup

    x = torch.rand(8, 3, 16, 16)
    _, targets = _case(2, n=8, k=5)
    args = dict(mixup_alpha=0.0 if cutmix else 0.8, cutmix_alpha=1.0 if cutmix else 0.0, label_smoothing=0.1,
                num_classes=5)
    torch.manual_seed(0)
    np.random.seed(0)
    mixed, y = MultiHotMixup(**args)(x.clone(), targets)
    # lambda from the images: mixup blends every pixel, cutmix pastes a box of the flipped batch
    lam = 1.0 - (mixed != x).flatten(1).float().mean(1)[0].item() if cutmix else None
    smoothed = targets.float() * 0.9 + 0.05
    if lam is None:  # mixup: x' = lam x + (1 - lam) x.flip(0), solved for lam on one pixel
        a, b, c = x[0, 0, 0, 0], x.flip(0)[0, 0, 0, 0], mixed[0, 0, 0, 0]
        lam = ((c - b) / (a - b)).item()
    torch.testing.assert_close(y, smoothed * lam + smoothed.flip(0) * (1 - lam), atol=2e-3, rtol=0)
    if "multi_label" in timm_mixup.mixup_target.__code__.co_varnames:
        theirs = timm_mixup.mixup_target(targets, 5, lam, 0.1, multi_label=True)
        torch.testing.assert_close(y, theirs, atol=2e-3, rtol=0)


COLORS = {"red": (230, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 230), "yellow": (230, 230, 30)}


def write_quadrants(root: Path, counts: dict[str, int], seed: int = 0) -> Path:
    """A multi-label data set in the csv layout: 32 x 32 images of 4 quadrants, each black or one of the
    :data:`COLORS` (its labels: the colours it shows, none to four), ``<split>.csv`` for each split."""
    rng = np.random.default_rng(seed)
    names = list(COLORS)
    (root / "images").mkdir(parents=True)
    for split, n in counts.items():
        rows = []
        for i in range(n):
            quadrants = rng.choice(len(names) + 1, size=4, p=[0.15] * len(names) + [0.4])  # len(names): black
            pixels = np.zeros((32, 32, 3), np.uint8)
            for q, c in enumerate(quadrants):
                if c < len(names):
                    pixels[16 * (q // 2):16 * (q // 2) + 16, 16 * (q % 2):16 * (q % 2) + 16] = COLORS[names[c]]
            pixels = np.clip(pixels + rng.integers(0, 25, pixels.shape), 0, 255).astype(np.uint8)
            path = f"images/{split}_{i}.png"
            Image.fromarray(pixels).save(root / path)
            rows.append((path, " ".join(sorted({names[c] for c in quadrants if c < len(names)}))))
        with (root / f"{split}.csv").open("w", newline="") as f:
            csv.writer(f).writerows([("image", "labels"), *rows])
    return root


@pytest.fixture(scope="module")
def quadrants(tmp_path_factory) -> Path:
    return write_quadrants(tmp_path_factory.mktemp("quadrants"), {"train": 160, "test": 48})


def _overrides(root: Path, out: Path, *extra: str) -> list[str]:
    return ["model.name=vit_cifar_tiny_patch4_32", "model.depth=1", "model.embed_dim=32", "model.num_heads=2",
            "model.patch_size=8", "data.dataset=csv", f"data.root={root}", "data.num_workers=0", "train.batch_size=16",
            "train.epochs=12", "optim.warmup_epochs=1", "optim.lr=3e-3", "train.log_every=100",
            "data.crop_padding=0", "data.hflip=false", "train.curves=false", f"train.output_dir={out}", *extra]


def test_the_csv_layout_lists_label_sets_as_multi_hot_rows_with_the_train_files_classes(quadrants):
    from vitlab.data.sources import index_split

    train = index_split("csv", quadrants, "train")
    rows = list(csv.reader((quadrants / "train.csv").open()))[1:]
    assert train.classes == sorted(COLORS) and train.labels.shape == (160, 4) and train.labels.dtype == torch.bool
    for i in (0, 5, 77):
        assert [train.classes[k] for k in train.labels[i].nonzero().flatten()] == rows[i][1].split()
    assert train.key(3) == rows[3][0]
    assert (train.labels.sum(1) == 0).any()  # an image of none of the classes is a row of zeros
    test = index_split("csv", quadrants, "test", classes=train.classes, multi_label=True)
    assert test.labels.shape == (48, 4)


@pytest.mark.multiprocess
def test_a_run_learns_the_label_sets_and_eval_reports_map_as_scikit_learn_computes_it(quadrants, tmp_path, capsys,
                                                                                       on_cpu):
    from vitlab.evaluation import calibrate_checkpoint, evaluate_checkpoint
    from vitlab.training import train

    run = tmp_path / "run"
    summary = train(load_config(None, _overrides(quadrants, run, "data.val_size=32", "train.pos_weight=balanced")))
    out = capsys.readouterr().out
    assert "best/ chosen on val_map" in out and "test mAP" in out
    assert summary["test_map"] > 0.9  # chance: the share of positives, about 0.2 a class
    meta = json.loads((run / "checkpoints/best/config.json").read_text())
    assert meta["multi_label"] is True
    thresholds = calibrate_checkpoint(run)
    assert len(thresholds) == 4 and all(0 < t < 1 for t in thresholds)
    predictions = tmp_path / "p.csv"
    m = evaluate_checkpoint(run, output=tmp_path / "m.json", predictions=predictions)
    with predictions.open() as f:
        rows = list(csv.DictReader(f))
    names = sorted(COLORS)
    truth = np.array([[c in json.loads(r["labels"]) for c in names] for r in rows])
    scores = np.array([[float(r[f"prob_{c}"]) for c in names] for r in rows])
    assert len(rows) == 48
    assert m["map"] == pytest.approx(sklearn_metrics.average_precision_score(truth, scores, average="macro"), abs=1e-6)
    assert m["micro_map"] == pytest.approx(sklearn_metrics.average_precision_score(truth, scores, average="micro"),
                                           abs=1e-6)
    predicted = scores >= np.array(thresholds)
    assert m["macro_f1_tuned"] == pytest.approx(sklearn_metrics.f1_score(truth, predicted, average="macro",
                                                                         zero_division=0), abs=1e-6)
    assert [json.loads(r["predicted"]) for r in rows] == [[c for c, p in zip(names, row) if p] for row in predicted]
    written = json.loads((tmp_path / "m.json").read_text())
    assert written["map"] == m["map"] and set(written["per_class_ap"]) == set(names)
    # two processes: the evaluation sharded and gathered, every mosaic once, the same rows and numbers
    from conftest import eval_on_two_processes

    two = tmp_path / "two.csv"
    eval_on_two_processes(run, two, tmp_path / "two.json")
    on_two = json.loads((tmp_path / "two.json").read_text())
    assert on_two["num_images"] == 48
    assert [on_two[k] for k in ("map", "micro_map", "macro_f1_tuned", "example_f1")] == pytest.approx(
        [written[k] for k in ("map", "micro_map", "macro_f1_tuned", "example_f1")], abs=1e-6)
    rows_two = list(csv.DictReader(two.open()))
    assert [(r["image"], r["labels"], r["predicted"]) for r in rows_two] == \
        [(r["image"], r["labels"], r["predicted"]) for r in rows]


def _copy(root: Path, tmp_path: Path, edit=None) -> Path:
    """``root``'s csv files beside links to its images, ``edit(split, rows)`` changing the rows."""
    out = tmp_path / "copy"
    out.mkdir()
    (out / "images").symlink_to(root / "images")
    for f in root.glob("*.csv"):
        rows = list(csv.reader(f.open()))
        if edit is not None:
            rows = [rows[0], *edit(f.stem, rows[1:])]
        with (out / f.name).open("w", newline="") as g:
            csv.writer(g).writerows(rows)
    return out


@pytest.mark.parametrize("edit, message", [
    (lambda split, rows: rows + [[rows[0][0], "red"]] if split == "train" else rows,
     r"train.csv of data.root=.* lists the image 'images/train_0.png' twice; list each image once"),
    (lambda split, rows: rows + [["images/train_1.png", "purple red"]] if split == "test" else rows,
     r"test.csv of data.root=.* has class\(es\) \['purple'\] that the training split does not have"),
    (lambda split, rows: rows + [["images/nowhere.png", "red"]] if split == "train" else rows,
     r"train.csv of data.root=.*: 1 of its 161 images are not there \('images/nowhere.png' under data.root\)"),
    (lambda split, rows: rows + [["images/train_1.png", "red red"]] if split == "test" else rows,
     r"test.csv of data.root=.*: image 48 lists a class twice"),
])
def test_bad_csv_rows_are_one_line_before_any_image_is_decoded(quadrants, tmp_path, edit, message, monkeypatch):
    from vitlab.data import split as split_module
    from vitlab.training import train

    root = _copy(quadrants, tmp_path, edit)
    monkeypatch.setattr(split_module, "decode_all", lambda *a: pytest.fail("decoded an image"))
    with pytest.raises(DataError, match=message) as e:
        train(load_config(None, _overrides(root, tmp_path / "run")))
    assert "\n" not in str(e.value)


def test_label_sets_with_multi_label_false_and_a_class_no_training_image_shows_are_one_line(quadrants, tmp_path,
                                                                                             monkeypatch):
    from vitlab.data import split as split_module
    from vitlab.training import train

    monkeypatch.setattr(split_module, "decode_all", lambda *a: pytest.fail("decoded an image"))

    with pytest.raises(DataError, match=r"train.csv of data.root=.*: image 'images/train_0.png' has \d labels .* and "
                                        r"data.multi_label=false asks for one class an image"):
        train(load_config(None, _overrides(quadrants, tmp_path / "a", "data.multi_label=false")))
    # an empty label set is a label set too: single-label data has one class an image
    single = _copy(quadrants, tmp_path, lambda split, rows: [[r[0], (r[1].split() or ["red"])[0]] for r in rows]
                   + ([["images/test_0.png", ""]] if split == "train" else []))
    with pytest.raises(DataError, match=r"image 'images/test_0.png' has 0 labels \(''\) and data.multi_label=false"):
        train(load_config(None, _overrides(single, tmp_path / "b", "data.multi_label=false")))
    # yellow on one training image, which a subset of 20 leaves out: no positive to learn it from
    (tmp_path / "r").mkdir()
    def one_yellow(split: str, rows: list[list[str]]) -> list[list[str]]:
        first = next(i for i, r in enumerate(rows) if "yellow" in r[1].split())
        return [[r[0], " ".join(c for c in r[1].split() if c != "yellow" or split != "train" or i == first)]
                for i, r in enumerate(rows)]

    rare = _copy(quadrants, tmp_path / "r", one_yellow)
    with pytest.raises(DataError, match=r"^class\(es\) \['yellow'\] of .* have no training images"):
        train(load_config(None, _overrides(rare, tmp_path / "c", "data.train_subset=20")))


def test_a_held_out_split_keeps_an_image_of_every_class_in_training(quadrants):
    from vitlab.data.images import stratified_indices

    labels = torch.zeros(200, 4, dtype=torch.bool)
    labels[:, 0] = True  # every image
    labels[:3, 1] = True  # three images
    labels[100, 2] = True  # one image: it can never be held out
    for seed in range(20):
        held = stratified_indices(labels, 150, seed, ["a", "b", "c", "d"], "test")
        rest = torch.ones(200, dtype=torch.bool)
        rest[held] = False
        assert len(held) == 150 and held.unique().numel() == 150
        assert labels[rest, 0].any() and labels[rest, 1].any() and labels[rest, 2].sum() == 1
    # where the classes leave fewer to take, fewer are taken: images 100 and one of 0-2 stay, at least
    held = stratified_indices(labels, 199, 0, ["a", "b", "c", "d"], "test")
    assert len(held) <= 198 and 100 not in held.tolist() and not {0, 1, 2} <= set(held.tolist())


@pytest.mark.parametrize("loader", ["torch", "gpu"])
def test_mixup_cutmix_and_both_loaders_train_on_multi_hot_targets(quadrants, tmp_path, loader, on_cpu):
    from vitlab.training import train

    summary = train(load_config(None, _overrides(quadrants, tmp_path / "run", f"data.loader={loader}",
                                                 "data.mixup_alpha=0.8", "data.cutmix_alpha=1.0", "train.epochs=3",
                                                 "data.test_size=0.25")))
    assert 0 < summary["test_map"] <= 1 and summary["epochs_done"] == 3


def test_predict_names_the_classes_at_or_above_their_thresholds(quadrants, tmp_path, capsys, on_cpu):
    from vitlab.checkpoint import load_model
    from vitlab.cli import main
    from vitlab.data.transforms import create_transform
    from vitlab.training import train

    run = tmp_path / "run"
    train(load_config(None, _overrides(quadrants, run, "train.epochs=4")))
    model = load_model(run)
    files = [quadrants / "images/test_0.png", quadrants / "images/test_1.png"]
    probs = model(torch.stack([create_transform(model)(Image.open(f).convert("RGB")) for f in files])).sigmoid()
    capsys.readouterr()
    main(["predict", "--checkpoint", str(run), *map(str, files)])
    out = capsys.readouterr().out.splitlines()
    names = sorted(COLORS)
    for line, f, p in zip(out, files, probs):
        shown = [f"{names[k]} {p[k]:.3f}" for k in range(4) if p[k] >= 0.5]
        assert line == f"{f}: " + (", ".join(shown) if shown else "no class")


@pytest.mark.parametrize("keys, message", [
    (("train.loss=logit_adjusted",), r"^train.loss=logit_adjusted is for one class an image, and the data's labels "
                                     r"are sets .* train.pos_weight=balanced"),
    (("train.class_weights=balanced",), r"^train.class_weights=balanced is for one class an image"),
    (("data.sampler=sqrt",), r"^data.sampler=sqrt balances one class an image, and the data's labels are sets"),
    (("train.pos_weight=[1, 2]",), r"^train.pos_weight has 2 numbers for the 4 classes \['blue', 'green', 'red', "
                                   r"'yellow'\]; give one a class, or balanced"),
])
def test_what_label_sets_cannot_take_is_one_line_before_any_image_is_decoded(quadrants, tmp_path, keys, message,
                                                                            monkeypatch):
    from vitlab.data import split as split_module
    from vitlab.training import train

    monkeypatch.setattr(split_module, "decode_all", lambda *a: pytest.fail("decoded an image"))
    with pytest.raises(ConfigError, match=message):
        train(load_config(None, _overrides(quadrants, tmp_path / "run", *keys)))


@pytest.mark.parametrize("listed_by", ["index", "reading"])
def test_vitlab_shards_of_label_sets_keep_every_images_set_and_train_as_multi_label(quadrants, tmp_path, listed_by,
                                                                                  on_cpu):
    pytest.importorskip("webdataset")
    from vitlab.cli import main
    from vitlab.data.shards import index_shards
    from vitlab.data.sources import index_split
    from vitlab.training import train

    shards = tmp_path / "shards"
    main(["shards", str(quadrants), str(shards), "--split", "train,test", "--shard-size", "50"])
    if listed_by == "reading":
        for f in shards.glob("*.json"):
            f.unlink()
    listed = index_shards(shards, "train")
    assert listed.multi_label and listed.classes == sorted(COLORS)
    source = index_split("csv", quadrants, "train")
    by_key = {f"train_{i:08d}": source.labels[i] for i in range(len(source))}  # the keys vitlab shards writes
    from vitlab.data.shards import read_samples

    rows = [(sample["__key__"], listed.label(sample) if listed.labels is None else None)
            for url in listed.urls for sample in read_samples(url)]
    if listed.labels is not None:
        rows = [(key, row.tolist()) for (key, _), row in zip(rows, listed.labels)]
    assert len(rows) == 160 and all(by_key[key].tolist() == row for key, row in rows)
    summary = train(load_config(None, _overrides(shards, tmp_path / "run", "data.dataset=wds", "train.epochs=2")))
    assert 0 < summary["test_map"] <= 1 and "test_micro_f1" in summary
    with pytest.raises(ConfigError, match=r"^data.multi_label=false, and shards 'train' .* carry label sets "
                                          r"\('labels'\); shards are read as written: leave data.multi_label=auto"):
        train(load_config(None, _overrides(shards, tmp_path / "x", "data.dataset=wds", "data.multi_label=false")))


def test_a_streamed_hugging_face_column_of_lists_trains_as_multi_label(tmp_path, on_cpu):
    datasets = pytest.importorskip("datasets")
    from vitlab.data.hf import index_hf_stream
    from vitlab.training import train

    rng = np.random.default_rng(0)
    root = tmp_path / "pq"
    root.mkdir()
    for split, n in (("train", 48), ("test", 16)):
        images = [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(n)]
        labels = [sorted(rng.choice(["cat", "dog", "owl"], size=rng.integers(0, 3), replace=False).tolist())
                  for _ in range(n)]
        labels[0] = ["cat", "dog", "owl"]
        features = datasets.Features({"image": datasets.Image(), "labels": datasets.Sequence(datasets.Value("string"))})
        datasets.Dataset.from_dict({"image": images, "labels": labels}, features=features).to_parquet(
            str(root / f"{split}-00000-of-00001.parquet"))
    listed = index_hf_stream(str(root), "train")
    assert listed.multi_label and listed.classes == ["cat", "dog", "owl"] and listed.labels.shape == (48, 3)
    assert listed.labels[0].all()
    summary = train(load_config(None, _overrides(root, tmp_path / "run", "data.dataset=hf", "data.streaming=true",
                                                 "train.epochs=1")))
    assert 0 < summary["test_map"] <= 1


def test_a_streamed_multi_label_run_resumes_inside_an_epoch_on_other_workers_bit_identical(quadrants, tmp_path,
                                                                                         monkeypatch, on_cpu):
    from safetensors.torch import load_file

    from conftest import train_until_signal
    from vitlab.training import train

    keys = ("data.in_memory=false", "data.loader=torch", "train.epochs=2", "data.mixup_alpha=0.8")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(load_config(None, _overrides(quadrants, whole, *keys)))
    reset_accelerate()
    train_until_signal(monkeypatch, load_config(None, _overrides(quadrants, parts, *keys)), 13)
    train(load_config(None, _overrides(quadrants, parts, *keys, "data.num_workers=2")))
    reset_accelerate()
    a, b = (load_file(str(r / "checkpoints/last/model.safetensors")) for r in (whole, parts))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_class_names_with_spaces_round_trip_through_the_csv_files(quadrants, tmp_path, capsys, on_cpu):
    # "stop sign" written as a JSON list stays one class; the prediction files' cells read back as they were
    from vitlab.evaluation import evaluate_checkpoint
    from vitlab.prediction import predict_images
    from vitlab.training import train

    spaced = lambda names: json.dumps([n.replace("yellow", "stop sign") for n in names])
    data = _copy(quadrants, tmp_path, lambda split, rows: [[r[0], spaced(r[1].split())] for r in rows])
    run = tmp_path / "run"
    train(load_config(None, _overrides(data, run, "train.epochs=1")))
    out = capsys.readouterr().out
    assert re.search(r"data: multi-label \(data.multi_label=auto, .*\): \d+ of the 160 images of train.csv .* show "
                     r"other than one class \(the first: 'images/train_\d+.png' with \[.*\]\)", out)
    reset_accelerate()
    from vitlab import load_model

    model = load_model(run)
    assert model.pretrained_cfg["label_names"] == ["blue", "green", "red", "stop sign"]
    evaluate_checkpoint(run, predictions=tmp_path / "e.csv")
    predict_images(model, [str(data / "images")], tmp_path / "p.csv", num_workers=0)
    given = {r[0]: json.loads(r[1]) for r in list(csv.reader((data / "test.csv").open()))[1:]}
    for r in csv.DictReader((tmp_path / "e.csv").open()):
        assert json.loads(r["labels"]) == given[r["image"]]
        assert set(json.loads(r["predicted"])) <= {"blue", "green", "red", "stop sign"}
    assert all(isinstance(json.loads(r["labels"]), list) for r in csv.DictReader((tmp_path / "p.csv").open()))
    # the evaluation's own file reads back as a data set's csv: the same label sets
    from vitlab.data.table import index_csv

    shutil.copy(tmp_path / "e.csv", data / "again.csv")
    again, test = (index_csv(data, s, classes=model.pretrained_cfg["label_names"]) for s in ("again", "test"))
    assert torch.equal(again.labels, test.labels)


def test_a_single_label_csv_with_a_spaced_name_says_why_it_became_multi_label(quadrants, tmp_path, capsys, on_cpu):
    from vitlab.training import train

    one = lambda split, rows: [[r[0], (r[1].split() or ["none"])[0].replace("yellow", "sea vessel")] for r in rows]
    data = _copy(quadrants, tmp_path, one)
    train(load_config(None, _overrides(data, tmp_path / "run", "train.epochs=1")))
    assert re.search(r"show other than one class \(the first: '.*' with \['sea', 'vessel'\]\); in data.dataset=csv a "
                     r"class name with a space is a JSON list, \[\"stop sign\"\]", capsys.readouterr().out)


def test_a_csv_of_absolute_image_paths_trains_and_names_each_image_by_its_path(quadrants, tmp_path, on_cpu):
    from vitlab.data.table import index_csv
    from vitlab.evaluation import evaluate_checkpoint
    from vitlab.training import train

    absolute = lambda split, rows: [[str(quadrants / r[0]), r[1]] for r in rows]  # the images outside data.root
    data = _copy(quadrants, tmp_path, absolute)
    listed = index_csv(data, "test")
    assert listed.key(0) == str(quadrants / "images" / "test_0.png") and listed.path(0) == quadrants / "images" / \
        "test_0.png"
    run = tmp_path / "run"
    train(load_config(None, _overrides(data, run, "train.epochs=1")))
    reset_accelerate()
    evaluate_checkpoint(run, predictions=tmp_path / "p.csv")
    named = [r["image"] for r in csv.DictReader(open(tmp_path / "p.csv"))]
    assert named == [str(quadrants / r[0]) for r in list(csv.reader(open(quadrants / "test.csv")))[1:]]


def test_an_image_listed_under_two_spellings_of_its_path_is_listed_twice(quadrants, tmp_path):
    from vitlab.data.table import index_csv

    twice = lambda split, rows: rows + [["./" + rows[0][0], "red"]] if split == "train" else rows
    data = _copy(quadrants, tmp_path, twice)
    with pytest.raises(DataError, match=r"^train.csv of data.root=.* lists the image './images/train_0.png' twice "
                                        r"\(as 'images/train_0.png' too\); list each image once, with all its labels"):
        index_csv(data, "train")


def test_the_output_json_is_strict_json_a_class_without_positives_null(quadrants, tmp_path, on_cpu):
    from vitlab.evaluation import evaluate_checkpoint
    from vitlab.training import train

    no_blue = lambda split, rows: [[r[0], " ".join(c for c in r[1].split() if c != "blue")] if split == "test" else r
                                   for r in rows]
    data = _copy(quadrants, tmp_path, no_blue)
    run = tmp_path / "run"
    train(load_config(None, _overrides(data, run, "train.epochs=1")))
    reset_accelerate()
    evaluate_checkpoint(run, output=tmp_path / "m.json")
    text = (tmp_path / "m.json").read_text()
    strict = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert strict["per_class_ap"]["blue"] is None and isinstance(strict["per_class_ap"]["red"], float)
    assert "NaN" not in text
