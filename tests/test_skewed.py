"""Skewed classes (issue 50, 2): post-hoc logit adjustment (Menon et al. 2021) in vitlab eval, from the
class counts of the images the run trained on, against the formula written out here."""
from __future__ import annotations

import csv
import json
import re

import pytest
import torch

from conftest import make_imagefolder, reset_accelerate, tiny_overrides
from vitlab.config import load_config
from vitlab.errors import DataError
from vitlab.tasks.classification import class_weights, logit_adjustment
from vitlab.tasks.image_data import index_splits, training_class_counts
from vitlab.training import train


@pytest.fixture(scope="module")
def skewed_folder(tmp_path_factory):
    """train: 32, 10 and 5 images of the three classes; test: 12 of each."""
    root = make_imagefolder(tmp_path_factory.mktemp("skewed"), {"train": 32, "test": 12})
    for name, keep in (("class_1", 10), ("class_2", 5)):
        for path in sorted((root / "train" / name).iterdir())[keep:]:
            path.unlink()
    return root


def test_the_adjustment_is_tau_log_of_the_training_frequencies():
    counts = torch.tensor([500, 50, 5, 1])
    prior = torch.tensor([500, 50, 5, 1], dtype=torch.float64) / 556
    torch.testing.assert_close(logit_adjustment(counts, 0.5), (0.5 * prior.log()).float())
    # a class without images would be the rarest of all, so the most favoured: neither function takes it
    for weigh in (lambda c: logit_adjustment(c, 1.0), lambda c: class_weights(c, "balanced")):
        with pytest.raises(ValueError, match=r"class\(es\) \[3\] have no training images"):
            weigh(torch.tensor([500, 50, 5, 0]))


@pytest.mark.parametrize("extra", [(), ("train.class_weights=balanced",), ("train.loss=logit_adjusted",)])
def test_an_empty_class_folder_is_refused_in_one_line_before_any_image_is_decoded(tmp_path, capsys, extra):
    # torchvision's ImageFolder refuses such a folder; the class would otherwise be listed, never learnt, and,
    # as the rarest class, predicted for every image under class weights or logit adjustment
    root = make_imagefolder(tmp_path / "data", {"train": 6, "test": 2})
    for path in (root / "train" / "class_1").iterdir():
        path.unlink()
    with pytest.raises(DataError, match=r"^class\(es\) \['class_1'\] of split 'train' of data.root=.* have no "
                                        r"training images \(an empty class folder"):
        train(load_config(None, tiny_overrides(root, tmp_path / "run", *extra)))
    assert "decoding" not in capsys.readouterr().out


def test_eval_refuses_to_adjust_by_a_class_whose_training_images_are_gone(skewed_folder, tmp_path, capsys, on_cpu):
    import shutil

    from vitlab.cli import main

    data = shutil.copytree(skewed_folder, tmp_path / "data")
    train(load_config(None, tiny_overrides(data, tmp_path / "run", "train.epochs=1")))
    reset_accelerate()
    for path in (data / "train" / "class_2").iterdir():  # the folder is kept, empty
        path.unlink()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["eval", "--checkpoint", str(tmp_path / "run"), "--adjust-logits", "1"])
    out, err = capsys.readouterr()
    assert re.match(r"error: class\(es\) \['class_2'\] of split 'train' .* have no training images", err)
    assert "decoding" not in out  # refused from the listing


def test_eval_adjusts_the_logits_by_the_class_counts_the_run_trained_on(skewed_folder, tmp_path, on_cpu):
    from PIL import Image

    from vitlab import create_transform, load_model
    from vitlab.cli import main

    run = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(skewed_folder, run, "data.val_size=6", "train.epochs=1"))
    train(cfg)
    reset_accelerate()
    counts = training_class_counts(cfg.data, 0, index_splits(cfg.data)[0])
    assert counts.tolist() == [28, 9, 4]  # 32, 10, 5 less the 6 validation images, in proportion (4, 1, 1)
    main(["eval", "--checkpoint", str(run), "--adjust-logits", "1", "--predictions", str(tmp_path / "p.csv"),
          "--output", str(tmp_path / "m.json")])
    reset_accelerate()
    assert json.loads((tmp_path / "m.json").read_text())["adjust_logits"] == 1.0
    rows = list(csv.DictReader((tmp_path / "p.csv").open()))
    model = load_model(run)
    transform = create_transform(model)
    images = torch.stack([transform(Image.open(skewed_folder / "test" / r["image"])) for r in rows])
    with torch.no_grad():
        expected = (model(images) - (counts.double() / counts.sum()).log().float()).softmax(-1)
    got = torch.tensor([[float(r[f"prob_class_{k}"]) for k in range(3)] for r in rows])
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("mixing", [False, True])
def test_the_logit_adjusted_loss_is_cross_entropy_of_the_logits_plus_tau_log_prior(mixing):
    # Menon et al. 2021, eq. 10: l(y, f(x)) = -log softmax(f(x) + tau * log(prior))_y; with mixup the soft targets.
    import torch.nn.functional as F

    from vitlab.tasks.classification import classification_criterion

    g = torch.Generator().manual_seed(0)
    counts, tau = torch.tensor([300, 60, 12, 3]), 1.5
    logits = torch.randn(16, 4, generator=g)
    targets = torch.randn(16, 4, generator=g).softmax(-1) if mixing else torch.randint(0, 4, (16,), generator=g)
    criterion = classification_criterion(mixing, 0.1, "logit_adjusted", class_counts=counts, logit_adjust_tau=tau)
    shifted = logits + tau * (counts.double() / counts.sum()).log().float()
    expected = (-(targets * shifted.log_softmax(-1)).sum(-1)).mean() if mixing else \
        F.cross_entropy(shifted, targets, label_smoothing=0.1)
    torch.testing.assert_close(criterion(logits, targets), expected)


def test_a_run_trains_with_the_logit_adjusted_loss_and_refuses_it_on_shards(skewed_folder, tmp_path, on_cpu):
    from vitlab.errors import ConfigError

    summary = train(load_config(None, tiny_overrides(skewed_folder, tmp_path / "run", "train.loss=logit_adjusted",
                                                     "train.logit_adjust_tau=1.0", "train.epochs=1")))
    reset_accelerate()
    assert summary["epochs_done"] == 1
    with pytest.raises(ConfigError, match=r"^train.loss='logit_adjusted' is invalid; expected 'ce' or 'bce' with "
                                          r"shards"):
        load_config(None, tiny_overrides(skewed_folder, tmp_path / "x", "train.loss=logit_adjusted",
                                         "data.dataset=wds"))


def test_balanced_class_weights_are_scikit_learns_and_effective_ones_cui_et_als():
    from sklearn.utils.class_weight import compute_class_weight

    from vitlab.tasks.classification import class_weights

    counts = torch.tensor([500, 120, 30, 7])
    labels = torch.arange(4).repeat_interleave(counts).numpy()
    reference = compute_class_weight("balanced", classes=torch.arange(4).numpy(), y=labels)
    torch.testing.assert_close(class_weights(counts, "balanced"), torch.tensor(reference, dtype=torch.float32))
    beta = 0.999  # Cui et al. 2019: (1 - beta) / (1 - beta ** n), scaled to sum to the number of classes
    effective = (1 - beta) / (1 - beta ** counts.double())
    torch.testing.assert_close(class_weights(counts, "effective", beta), (effective * 4 / effective.sum()).float())


@pytest.mark.parametrize("mixing", [False, True])
def test_the_weighted_loss_weighs_each_class_as_torch_does(mixing):
    import torch.nn.functional as F

    from vitlab.tasks.classification import classification_criterion

    g = torch.Generator().manual_seed(1)
    counts, logits = torch.tensor([300, 60, 12]), torch.randn(10, 3, generator=g)
    targets = torch.randn(10, 3, generator=g).softmax(-1) if mixing else torch.randint(0, 3, (10,), generator=g)
    criterion = classification_criterion(mixing, 0.0, "ce", class_counts=counts, weighting="balanced")
    w = counts.sum() / (3 * counts.double())
    hard = F.one_hot(targets, 3).double() if not mixing else targets.double()
    per_image = -(hard * w * logits.double().log_softmax(-1)).sum(-1)
    expected = per_image.sum() / (hard * w).sum()  # torch's weighted mean: over the targets' weights
    torch.testing.assert_close(criterion(logits, targets).double(), expected, rtol=1e-5, atol=1e-6)


def test_class_weights_are_refused_with_another_loss_and_with_shards(skewed_folder, tmp_path):
    from vitlab.errors import ConfigError

    for extra, message in ((("train.loss=bce",), r"'none' with train.loss=bce or logit_adjusted"),
                           (("data.dataset=wds",), r"'none' with shards")):
        with pytest.raises(ConfigError, match=r"^train.class_weights='balanced' is invalid; expected " + message):
            load_config(None, tiny_overrides(skewed_folder, tmp_path, "train.class_weights=balanced", *extra))


# data.sampler: class-balanced and square-root sampling


def test_the_draws_are_torchs_weighted_random_sampler_and_each_copy_is_its_own_sample():
    from torch.utils.data import WeightedRandomSampler

    from vitlab.data.balance import ClassSampler
    from vitlab.seeding import process_seed

    labels = torch.tensor([0] * 60 + [1] * 25 + [2] * 4 + [3] * 1)
    sampler = ClassSampler(labels, "class_balanced", seed=3)
    sampler.set_epoch(2)
    g = torch.Generator().manual_seed(process_seed(3, 0, 2, "sampler"))
    weights = torch.tensor([1 / 60] * 60 + [1 / 25] * 25 + [1 / 4] * 4 + [1.0], dtype=torch.float64)
    theirs = torch.tensor(list(WeightedRandomSampler(weights, 90, generator=g)))
    ids = torch.tensor(list(sampler))
    assert torch.equal(ids % 90, theirs) and torch.equal(sampler.draws(), theirs)
    assert ids.unique().numel() == 90  # an image drawn k times: ids i, i + 90, ..., each augmented apart
    for i in theirs.unique():
        assert sorted(ids[theirs == i].tolist()) == [int(i) + 90 * c for c in range((theirs == i).sum())]
    sampler.set_epoch(3)
    assert not torch.equal(sampler.draws(), theirs)


@pytest.mark.parametrize("kind, q", [("class_balanced", 0.0), ("sqrt", 0.5)])
def test_each_class_is_drawn_in_proportion_to_its_count_to_the_power_q(kind, q):
    from vitlab.data.balance import ClassSampler

    counts = torch.tensor([5000, 500, 50, 5])
    labels = torch.repeat_interleave(torch.arange(4), counts)
    sampler = ClassSampler(labels, kind, seed=0)
    drawn = torch.zeros(4)
    for epoch in range(20):
        sampler.set_epoch(epoch)
        drawn += torch.bincount(labels[sampler.draws()], minlength=4)
    want = counts.double() ** q / (counts.double() ** q).sum()
    torch.testing.assert_close(drawn.double() / drawn.sum(), want, atol=0.01, rtol=0.03)
    assert ClassSampler.share(counts, kind, 3) == pytest.approx(want[3].item())


@pytest.mark.parametrize("loader", ["torch", "gpu"])
def test_a_balanced_run_resumes_inside_an_epoch_on_other_workers_with_the_same_samples(skewed_folder, tmp_path, loader,
                                                                                        monkeypatch, capsys, on_cpu):
    from safetensors.torch import load_file

    from conftest import train_until_signal

    keys = ("data.sampler=class_balanced", "train.epochs=2", "data.augment=randaugment", f"data.loader={loader}")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(load_config(None, tiny_overrides(skewed_folder, whole, *keys)))
    reset_accelerate()
    out = capsys.readouterr().out
    # 32, 10, 5 images: uniform draws 68.1% and 10.6% of the class_0 and class_2 images; balanced, a third each
    assert "class_balanced sampling (data.sampler), 47 draws an epoch with replacement: the largest class 33.3% " \
           "of them, the smallest 33.3% (uniform: 68.1%, 10.6%)" in out
    train_until_signal(monkeypatch, load_config(None, tiny_overrides(skewed_folder, parts, *keys)), 3)
    train(load_config(None, tiny_overrides(skewed_folder, parts, *keys, "data.num_workers=2")))
    reset_accelerate()
    a, b = (load_file(str(r / "checkpoints/last/model.safetensors")) for r in (whole, parts))
    assert all(torch.equal(a[k], b[k]) for k in a)
    train(load_config(None, tiny_overrides(skewed_folder, tmp_path / "plain", *keys[1:])))
    reset_accelerate()
    plain = load_file(str(tmp_path / "plain/checkpoints/last/model.safetensors"))
    assert not torch.equal(a["head.weight"], plain["head.weight"])  # the draws changed what it trained on


def test_two_processes_read_the_parts_of_the_one_process_global_batches():
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from vitlab.data.balance import ClassSampler
    from vitlab.data.images import ImageData, TensorImageDataset
    from vitlab.training import set_epoch

    labels = torch.tensor([0] * 40 + [1] * 8 + [2] * 2)
    data = ImageData(torch.zeros(50, 3, 4, 4, dtype=torch.uint8), labels, ["a", "b", "c"])
    loader = DataLoader(TensorImageDataset(data, lambda x: x, seed=0), batch_size=10,
                        sampler=ClassSampler(labels, "sqrt", seed=0), drop_last=True)
    for epoch in (1, 2):
        parts = []
        for processes in (1, 2):
            shards = [prepare_data_loader(loader, num_processes=processes, process_index=r, split_batches=True,
                                          put_on_device=False) for r in range(processes)]
            for shard in shards:
                set_epoch(shard, epoch)
            parts.append([sum(batches, []) for batches in zip(*(list(s.batch_sampler) for s in shards))])
        assert parts[0] == parts[1]  # the same global batches, cut in two


def test_the_sampler_is_refused_where_it_cannot_draw(skewed_folder, tmp_path):
    from vitlab.errors import ConfigError

    for keys, message in ((("data.aug_repeats=3",), r"is invalid; expected uniform with data.aug_repeats > 1"),
                          (("data.dataset=wds",), r"is invalid; expected uniform with shards"),
                          (("data.multi_label=true",), r"balances one class an image, and data.multi_label=true asks "
                                                       r"for label sets")):
        with pytest.raises(ConfigError, match=r"^data.sampler='?sqrt'? " + message):
            load_config(None, tiny_overrides(skewed_folder, tmp_path / "x", "data.sampler=sqrt", *keys))
