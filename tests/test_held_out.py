"""One folder of class folders and no split (issue 37, 3): ``data.test_size`` holds out a test split
chosen by the seed, stratified as scikit-learn's ``train_test_split(stratify=)`` (issue 49, 1); the run
says so, records it, and ``vitlab eval``, ``--split test`` and a resumed run use exactly those images; a
change of it, of the seed, or of the images on disk, is one line. ``data.val_size`` follows the same rule."""
from __future__ import annotations

import json

import pytest
import torch
from sklearn.model_selection import train_test_split

from conftest import make_imagefolder, reset_accelerate
from vitlab.config import load_config
from vitlab.errors import ConfigError, DataError
from vitlab.data.images import balanced_indices, stratified_indices
from vitlab.evaluation import evaluate_checkpoint
from vitlab.tasks.image_data import index_splits
from vitlab.training import train


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """``photos/<class>/*.png``: 3 classes of 20, no train/ or test/."""
    return make_imagefolder(tmp_path_factory.mktemp("flat"), {"photos": 20}) / "photos"


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    """``skewed/<class>/*.png``: class_0 with 60 images, class_1 with 5."""
    root = make_imagefolder(tmp_path_factory.mktemp("skewed"), {"skewed": 60}) / "skewed"
    for path in sorted((root / "class_1").glob("*.png"))[5:]:
        path.unlink()
    for path in (root / "class_2").glob("*.png"):
        path.unlink()
    (root / "class_2").rmdir()
    return root


def _overrides(root, out, *extra):
    return ["model.name=vit_cifar_tiny_patch4_32", "model.depth=1", "model.embed_dim=32", "model.num_heads=2",
            "data.dataset=imagefolder", f"data.root={root}", "data.num_workers=0", "train.batch_size=8",
            "train.epochs=2", "optim.warmup_epochs=1", "train.log_every=2", "train.curves=false",
            f"train.output_dir={out}", *extra]


def test_the_held_out_split_is_balanced_seeded_and_disjoint(photos):
    cfg = load_config(None, _overrides(photos, "unused", "data.test_size=0.25"))
    train_index, test_index = index_splits(cfg.data, seed=0)
    assert (len(train_index), len(test_index)) == (45, 15)
    assert torch.bincount(test_index.labels).tolist() == [5, 5, 5]  # balanced
    keys = [train_index.key(i) for i in range(45)] + [test_index.key(i) for i in range(15)]
    assert len(set(keys)) == 60 and all(k.startswith("class_") for k in keys)  # every image once
    again = index_splits(cfg.data, seed=0)[1]
    other = index_splits(cfg.data, seed=1)[1]
    assert [again.key(i) for i in range(15)] == [test_index.key(i) for i in range(15)]
    assert [other.key(i) for i in range(15)] != [test_index.key(i) for i in range(15)]
    assert len(index_splits(load_config(None, _overrides(photos, "u", "data.test_size=7")).data, seed=0)[1]) == 7
    # the pixels are those files'
    from PIL import Image

    first = test_index.open(0)
    assert first.tobytes() == Image.open(photos / test_index.key(0)).convert("RGB").tobytes()


@pytest.mark.parametrize("in_memory", ["true", "false"])
def test_a_folder_without_splits_trains_in_one_command_and_evaluates_on_its_held_out_images(
        photos, tmp_path, capsys, on_cpu, in_memory):
    run = tmp_path / "run"
    summary = train(load_config(None, _overrides(photos, run, "data.test_size=0.25", f"data.in_memory={in_memory}")))
    reset_accelerate()
    out = capsys.readouterr().out
    assert "held out 15 of the 60 images under data.root" in out and "data.test_size=0.25" in out
    state = json.loads((run / "checkpoints/last/trainer_state.json").read_text())
    held = state["data"]["held_out"]
    assert held["test_size"] == 0.25 and held["images"] == 15 and len(held["sha256"]) == 64
    metrics = evaluate_checkpoint(run, split="test")
    reset_accelerate()
    assert metrics["num_images"] == 15 and metrics["top1"] == summary["test_top1"]


def test_a_change_of_the_held_out_split_is_refused_in_one_line(photos, tmp_path, on_cpu):
    copy = make_imagefolder(tmp_path / "copy", {"photos": 20}) / "photos"
    run = tmp_path / "run"
    train(load_config(None, _overrides(copy, run, "data.test_size=0.25", "train.epochs=1")))
    reset_accelerate()
    with pytest.raises(ConfigError, match=r"^data.test_size: the run held out 15 images \(data.test_size=0.25\)"
                                          r".*data.test_size=0.5"):
        train(load_config(None, _overrides(copy, run, "data.test_size=0.5", "train.epochs=2")), resume=run)
    reset_accelerate()
    held = index_splits(load_config(None, _overrides(copy, run, "data.test_size=0.25")).data, seed=0)[1]
    (copy / held.key(0)).unlink()  # a held-out image is gone from disk
    with pytest.raises(DataError, match=r"^the images held out as the test split changed on disk since the run "
                                        r"started"):
        evaluate_checkpoint(run, split="test")
    reset_accelerate()


def test_a_flat_folder_without_test_size_names_the_key(photos, tmp_path):
    with pytest.raises(DataError, match=r"holds class folders of images itself.*data.test_size=0.2"):
        train(load_config(None, _overrides(photos, tmp_path / "r")))
    reset_accelerate()
    with pytest.raises(ConfigError, match=r"^data.test_size=-1"):
        load_config(None, _overrides(photos, tmp_path / "r", "data.test_size=-1"))


def test_a_hugging_face_data_set_with_only_a_train_split_holds_out_its_test_split(photos, tmp_path):
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    folder = index_splits(load_config(None, _overrides(photos, "u", "data.test_size=0.25")).data, seed=0)[1]
    files = sorted(photos.glob("*/*.png"))
    ds = datasets.Dataset.from_dict({"image": [Image.open(f) for f in files],
                                     "label": [f.parent.name for f in files]})
    datasets.DatasetDict(train=ds).save_to_disk(str(tmp_path / "hf"))
    cfg = load_config(None, _overrides(tmp_path / "hf", "u", "data.dataset=hf", "data.test_size=0.25"))
    train_index, test_index = index_splits(cfg.data, seed=0)
    assert (len(train_index), len(test_index)) == (45, 15)
    # the same rows as the folder's files, in the same order: the same images held out
    assert [int(test_index.key(i)) for i in range(15)] == [files.index(photos / folder.key(i)) for i in range(15)]
    assert test_index.open(3).tobytes() == folder.open(3).tobytes()


def test_a_run_without_a_held_out_split_refuses_one_on_resume_and_eval(tiny_imagefolder, tmp_path, on_cpu):
    run = tmp_path / "run"
    train(load_config(None, _overrides(tiny_imagefolder, run, "train.epochs=1")))
    reset_accelerate()
    with pytest.raises(ConfigError, match=r"^data.test_size: the run held out 0 images \(data.test_size=0\) and "
                                          r"this asks for data.test_size=0.25"):
        train(load_config(None, _overrides(tiny_imagefolder, run, "train.epochs=2", "data.test_size=0.25")), resume=run)
    reset_accelerate()
    with pytest.raises(ConfigError, match=r"^data.test_size: the run held out 0 images"):
        evaluate_checkpoint(run, split="test", overrides=("data.test_size=0.25",))
    reset_accelerate()


def _sklearn_test_counts(counts, n, seed=0):
    labels = [k for k, c in enumerate(counts) for _ in range(c)]
    _, test = train_test_split(labels, test_size=n, stratify=labels, random_state=seed)
    return torch.bincount(torch.tensor(test), minlength=len(counts)).tolist()


def _ours(counts, n, seed=0):
    labels = torch.tensor([k for k, c in enumerate(counts) for _ in range(c)])
    picked = stratified_indices(labels, n, seed, [f"c{k}" for k in range(len(counts))], "test")
    return torch.bincount(labels[picked], minlength=len(counts)).tolist()


@pytest.mark.parametrize("counts, n", [([60, 5], 13), ([500] * 9 + [60], 912), ([40, 30, 20, 10], 25),
                                       ([1000, 100, 10], 222)])
def test_each_class_is_held_out_in_proportion_as_scikit_learn_stratifies(counts, n):
    assert _ours(counts, n) == _sklearn_test_counts(counts, n)


def test_on_random_class_sizes_the_counts_are_scikit_learns_up_to_its_random_tie_breaks():
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        counts = torch.randint(10, 400, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
        n = round(0.2 * sum(counts))
        ours, theirs = _ours(counts, n, trial), _sklearn_test_counts(counts, n, trial)
        assert sum(ours) == sum(theirs) == n
        assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1  # a remainder tied with another's rounds either way


def test_a_rare_class_keeps_images_on_both_sides_where_scikit_learn_would_hold_none_out():
    # 100, 2, 2, 3 at 5% (5 images): in proportion the small classes get no test image (scikit-learn's [6, 0, 0, 0]);
    # here each keeps one on each side, and the count grows to say so.
    assert _ours([100, 2, 2, 3], 5) == [5, 1, 1, 1]
    assert _ours([3] * 10, 4) == [1] * 10  # fewer images asked than classes: one of each
    assert _ours([3] * 10, 25) == [2] * 10  # nearly all asked: one of each stays to train on


def test_equal_classes_give_the_images_the_balanced_rule_gave():
    # CIFAR-10's data.val_size=5000 holds out the same images as before the split was stratified.
    labels = torch.arange(10).repeat_interleave(50)[torch.randperm(500, generator=torch.Generator().manual_seed(1))]
    for seed in range(3):
        assert torch.equal(stratified_indices(labels, 50, seed, [str(k) for k in range(10)], "val"),
                           balanced_indices(labels, 50, seed))


def test_a_skewed_folder_keeps_its_rare_class_in_training_and_says_how_many_it_held_out(skewed, tmp_path, capsys,
                                                                                        on_cpu):
    # The balanced rule took 7 of 60 and all 5 of the rare class (12 of the 13 it said): the model never saw it.
    cfg = load_config(None, _overrides(skewed, tmp_path / "run", "data.test_size=0.2", "train.epochs=1"))
    train_index, test_index = index_splits(cfg.data, seed=0)
    assert torch.bincount(train_index.labels).tolist() == [48, 4]
    assert torch.bincount(test_index.labels).tolist() == [12, 1]
    assert test_index.held_out["images"] == 13 and test_index.held_out["seed"] == 0
    train(cfg)
    reset_accelerate()
    assert "held out 13 of the 65 images" in capsys.readouterr().out
    held = json.loads((tmp_path / "run/checkpoints/last/trainer_state.json").read_text())["data"]["held_out"]
    assert held["images"] == 13 and held["rule"] == "stratified"
    # the same rule for the validation images, chosen before any image is decoded
    from vitlab.tasks.image_data import load_train_val_data

    val_cfg = load_config(None, _overrides(skewed, "u", "data.test_size=0.2", "data.val_size=10")).data
    train_data, val_data = load_train_val_data(val_cfg, 0, (32, 32), train_index)
    assert torch.bincount(val_data.labels).tolist() == [9, 1] and torch.bincount(train_data.labels).tolist() == [39, 3]


def test_a_class_with_one_image_is_refused_in_one_line_before_decoding(skewed, tmp_path):
    one = tmp_path / "one"
    (one / "class_1").mkdir(parents=True)
    (one / "class_0").symlink_to(skewed / "class_0")
    (one / "class_1" / "0000.png").symlink_to(skewed / "class_1" / "0000.png")
    cfg = load_config(None, _overrides(one, tmp_path / "r", "data.test_size=0.2"))
    with pytest.raises(DataError, match=r"^data.test_size=0.2 of .*: class\(es\) \['class_1'\] have a single image"):
        index_splits(cfg.data, seed=0)
    from vitlab.tasks.image_data import load_train_val_data

    train_index, _ = index_splits(load_config(None, _overrides(skewed, "u", "data.test_size=0.2")).data, seed=0)
    lone = train_index.subset(torch.tensor([0, 1, 2, 48]), train_index.where)  # 3 of class_0, 1 of class_1
    d = load_config(None, _overrides(skewed, "u", "data.val_size=2")).data
    with pytest.raises(DataError, match=r"^data.val_size=2 of .*\['class_1'\] have a single image"):
        load_train_val_data(d, 0, (32, 32), lone)


def test_another_seed_on_resume_of_a_held_out_run_names_the_seed(skewed, tmp_path, on_cpu):
    run = tmp_path / "run"
    train(load_config(None, _overrides(skewed, run, "data.test_size=0.2", "train.epochs=1")))
    reset_accelerate()
    with pytest.raises(ConfigError, match=r"^train.seed=3: the run held out its test split with train.seed=0.*"
                                          r"set train.seed=0"):
        train(load_config(None, _overrides(skewed, run, "data.test_size=0.2", "train.epochs=2", "train.seed=3")),
              resume=run)
    reset_accelerate()


def test_a_run_recorded_under_the_balanced_rule_keeps_its_test_split(skewed, tmp_path, on_cpu):
    # A run started before the split was stratified recorded no rule (nor seed): its eval and resume hold out
    # what it held out then (12 images: 7 of class_0 and all 5 of class_1), not the stratified 13.
    from vitlab.data.sources import index_split
    from vitlab.data.split import hold_out

    run = tmp_path / "run"
    train(load_config(None, _overrides(skewed, run, "data.test_size=0.2", "train.epochs=1")))
    reset_accelerate()
    whole = index_split("imagefolder", str(skewed), ".", download=False, image_key="", label_key="")
    legacy = hold_out(whole, 0.2, 0, rule="balanced")[1].held_out
    assert legacy["images"] == 12 and "rule" not in legacy
    state_file = run / "checkpoints/last/trainer_state.json"
    state = json.loads(state_file.read_text())
    state["data"]["held_out"] = legacy
    state_file.write_text(json.dumps(state))
    metrics = evaluate_checkpoint(run, split="test")
    reset_accelerate()
    assert metrics["num_images"] == 12
    train(load_config(None, _overrides(skewed, run, "data.test_size=0.2", "train.epochs=2")), resume=run)  # unrefused
    reset_accelerate()
    assert json.loads(state_file.read_text())["data"]["held_out"] == legacy
