"""One folder of class folders and no split (issue 37, 3): ``data.test_size`` holds out a balanced test
split chosen by the seed; the run says so, records it, and ``vitlab eval``, ``--split test`` and a resumed
run use exactly those images; a change of it, or of the images on disk, is one line."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import make_imagefolder, reset_accelerate
from vitlab.config import load_config
from vitlab.errors import ConfigError, DataError
from vitlab.evaluation import evaluate_checkpoint
from vitlab.tasks.classification import index_splits
from vitlab.training import train


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """``photos/<class>/*.png``: 3 classes of 20, no train/ or test/."""
    return make_imagefolder(tmp_path_factory.mktemp("flat"), {"photos": 20}) / "photos"


def _overrides(root, out, *extra):
    return ["model.name=vit_cifar_tiny_patch4_32", "model.depth=1", "model.embed_dim=32", "model.num_heads=2",
            "data.dataset=imagefolder", f"data.root={root}", "data.num_workers=0", "train.batch_size=8",
            "train.epochs=2", "optim.warmup_epochs=1", "train.log_every=2", f"train.output_dir={out}", *extra]


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
