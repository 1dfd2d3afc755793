"""Hugging Face datasets as training data (``data.dataset=hf``): the same images give the same numbers
as through ImageFolder; parquet; greyscale; bad input is one line."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import reset_accelerate, same_run_records
from vitlab.config import load_config
from vitlab.data.hf import index_hf_split
from vitlab.errors import DataError
from vitlab.training import train

datasets = pytest.importorskip("datasets", reason="the hf extra is not installed: pip install 'vitlab[hf]'")


def load_hf_split(root, split, *, size=None, **keys):
    """A split decoded into memory: the listing's load, as training's."""
    return index_hf_split(root, split, **keys).load(size)


PER_CLASS = {"train": 24, "test": 8}  # of each of CIFAR-10's 10 classes: 240 + 80 real images


@pytest.fixture(scope="module")
def cifar_copies(cifar10_dir, tmp_path_factory) -> dict[str, Path]:
    """The same real CIFAR-10 PNGs three ways: ImageFolder (links), a saved DatasetDict, parquet files."""
    root = tmp_path_factory.mktemp("hf")
    classes = sorted(p.name for p in (cifar10_dir / "train").iterdir())
    columns: dict[str, dict[str, list]] = {}
    for split, n in PER_CLASS.items():
        columns[split] = {"img": [], "label": []}
        for label, name in enumerate(classes):
            (root / "folder" / split / name).mkdir(parents=True)
            for f in sorted((cifar10_dir / split / name).iterdir())[:n]:
                (root / "folder" / split / name / f.name).symlink_to(f)
                columns[split]["img"].append(str(f))
                columns[split]["label"].append(label)
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
    dd = datasets.DatasetDict({s: datasets.Dataset.from_dict(c, features=features) for s, c in columns.items()})
    dd.save_to_disk(str(root / "saved"))
    (root / "parquet").mkdir()
    for split, ds in dd.items():
        ds.to_parquet(str(root / "parquet" / f"{split}-00000-of-00001.parquet"))
    (root / "files").mkdir()  # as Hub repositories keep a split: several parquet files (shards when streamed)
    for split, ds in dd.items():
        n = 4 if split == "train" else 2
        for i in range(n):
            ds.shard(n, i, contiguous=True).to_parquet(str(root / "files" / f"{split}-{i:05d}-of-{n:05d}.parquet"))
    return {"imagefolder": root / "folder", "saved": root / "saved", "parquet": root / "parquet", "files": root / "files"}


def _run(data: list[str], run_dir: Path) -> dict:
    overrides = ["model.name=vit_cifar_tiny_patch4_32", "model.depth=1", "model.embed_dim=32", "model.num_heads=2",
                 "data.num_workers=0", "train.batch_size=32", "train.epochs=2", "optim.warmup_epochs=1",
                 "train.log_every=2", "data.val_size=40", f"train.output_dir={run_dir}", *data]
    summary = train(load_config(None, overrides))
    reset_accelerate()
    return summary


def test_a_saved_datasetdict_trains_to_the_numbers_of_the_same_images_as_an_imagefolder(cifar_copies, tmp_path,
                                                                                           on_cpu):
    # Same images, same order, same seed: the same validation split, batches, augmentation and weights.
    folder = _run(["data.dataset=imagefolder", f"data.root={cifar_copies['imagefolder']}"], tmp_path / "folder")
    saved = _run(["data.dataset=hf", f"data.root={cifar_copies['saved']}"], tmp_path / "saved")
    assert saved["test_top1"] == folder["test_top1"] and saved["val_top1"] == folder["val_top1"]
    assert same_run_records(tmp_path / "folder", tmp_path / "saved")
    a = load_file(str(tmp_path / "folder/checkpoints/last/model.safetensors"))
    b = load_file(str(tmp_path / "saved/checkpoints/last/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The class names are the ClassLabel's, kept with the model.
    meta = json.loads((tmp_path / "saved/checkpoints/last/config.json").read_text())
    assert meta["classes"][:3] == ["airplane", "automobile", "bird"]


@pytest.mark.slow
def test_a_saved_datasetdict_streamed_from_its_arrow_files_trains_to_the_numbers_held_in_memory(cifar_copies,
                                                                                                  tmp_path, on_cpu):
    # Streamed: each image decoded from the memory-mapped Arrow table by a DataLoader worker when read.
    data = ["data.dataset=hf", f"data.root={cifar_copies['saved']}", "data.loader=torch"]
    memory = _run([*data, "data.in_memory=true"], tmp_path / "memory")
    streamed = _run([*data, "data.in_memory=false", "data.num_workers=2"], tmp_path / "streamed")
    assert streamed["test_top1"] == memory["test_top1"]
    assert same_run_records(tmp_path / "memory", tmp_path / "streamed")
    a = load_file(str(tmp_path / "memory/checkpoints/last/model.safetensors"))
    b = load_file(str(tmp_path / "streamed/checkpoints/last/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_split_read_with_streaming_true_resumes_to_the_sample_bit_identical_and_evaluates_as_its_folder(
        cifar_copies, tmp_path, monkeypatch, on_cpu):
    # data.streaming=true: the split's 4 parquet files are its shards (an IterableDataset, nothing whole
    # on disk), read by 2 workers; a SIGTERM after step 3 of 6 and the same command end bit-identical.
    from conftest import signal_at_step
    from vitlab.cli import main
    from vitlab.errors import Preempted

    data = ["data.dataset=hf", f"data.root={cifar_copies['files']}", "data.streaming=true", "data.num_workers=2",
            "data.loader=torch", "data.augment=randaugment", "model.drop_path_rate=0.1"]
    whole = _run(data, tmp_path / "whole")  # 200 training images: 2 readers x 3 batches of 32 an epoch
    records = [json.loads(x) for x in (tmp_path / "whole/metrics.jsonl").read_text().splitlines()]
    assert [r["train_samples"] for r in records if r["split"] == "eval"] == [192, 192]
    with monkeypatch.context() as m:
        signal_at_step(m, 3)
        with pytest.raises(Preempted):
            _run(data, tmp_path / "parts")
    reset_accelerate()
    resumed = _run(data, tmp_path / "parts")
    assert resumed["test_top1"] == whole["test_top1"] and same_run_records(tmp_path / "whole", tmp_path / "parts")
    a, b = (load_file(str(tmp_path / run / "checkpoints/last/model.safetensors")) for run in ("whole", "parts"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The model's test numbers from the same images read as an ImageFolder: the same pixels either way.
    main(["eval", "--checkpoint", str(tmp_path / "whole/checkpoints/last"), "--output", str(tmp_path / "m.json"),
          "data.dataset=imagefolder", "data.streaming=false", f"data.root={cifar_copies['imagefolder']}"])
    folder = json.loads((tmp_path / "m.json").read_text())
    assert folder["num_images"] == 80 and folder["top1"] == records[-1]["test_top1"]
    assert folder["loss"] == pytest.approx(records[-1]["test_loss"], abs=1e-5)


def test_parquet_files_read_like_the_saved_dataset(cifar_copies):
    saved = load_hf_split(str(cifar_copies["saved"]), "test", size=(32, 32))
    parquet = load_hf_split(str(cifar_copies["parquet"]), "test", size=(32, 32))
    assert torch.equal(saved.images, parquet.images) and torch.equal(saved.labels, parquet.labels)
    assert saved.images.shape == (80, 3, 32, 32) and saved.classes == parquet.classes


def test_greyscale_images_without_classlabel_train_with_the_data_s_number_of_classes(tmp_path):
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    rows = {"image": [], "labels": []}
    for i in range(48):
        label = i % 2
        pixels = (torch.rand(20, 24, generator=g) * 60 + 150 * label).to(torch.uint8).numpy()
        rows["image"].append(Image.fromarray(pixels, mode="L"))  # greyscale, 20 x 24: converted, resized
        rows["labels"].append(label + 3)  # plain integers: classes "3" and "4"
    ds = datasets.Dataset.from_dict(rows, features=datasets.Features({"image": datasets.Image(),
                                                                     "labels": datasets.Value("int64")}))
    datasets.DatasetDict(train=ds, test=ds.select(range(16))).save_to_disk(str(tmp_path / "grey"))
    data = load_hf_split(str(tmp_path / "grey"), "train", size=(32, 32))
    assert data.images.shape == (48, 3, 32, 32) and data.classes == ["3", "4"]
    assert torch.equal(data.images[:, 0], data.images[:, 1])  # grey: R = G = B
    summary = _run(["data.dataset=hf", f"data.root={tmp_path / 'grey'}", "data.val_size=0"], tmp_path / "run")
    weights = load_file(str(tmp_path / "run/checkpoints/last/model.safetensors"))
    assert weights["head.weight"].shape[0] == 2  # no model.num_classes in the config: the data's 2
    assert summary["test_top1"] >= 0.9  # dark against bright


def test_bad_hugging_face_input_is_one_line(cifar_copies, tmp_path, monkeypatch):
    saved = str(cifar_copies["saved"])
    cases = [
        (dict(root=saved, split="validation"), r"has no split 'validation'; its splits: \['train', 'test'\]"),
        (dict(root=saved, split="test", image_key="pixels"), r"data.image_key='pixels' is not a column of the "
                                                             r"data set; its columns: \['img', 'label'\]"),
        (dict(root=str(tmp_path), split="train"), "a directory with neither a saved dataset"),
    ]
    for kwargs, message in cases:
        with pytest.raises(DataError, match=message) as e:
            load_hf_split(**kwargs)
        assert "\n" not in str(e.value)
    ds = datasets.Dataset.from_dict({"picture": ["not an image"], "y": [1]})
    datasets.DatasetDict(train=ds).save_to_disk(str(tmp_path / "odd"))
    with pytest.raises(DataError, match=r"no image column found among \['picture', 'y'\] \(looked for image, img\); "
                                        r"name it with data.image_key=<column>"):
        load_hf_split(str(tmp_path / "odd"), "train")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(DataError, match=r"could not load data.root='someone/no-such-dataset' \(") as e:
        load_hf_split("someone/no-such-dataset", "train")
    assert "\n" not in str(e.value)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"needs the Hugging Face datasets package: pip install 'vitlab\[hf\]'"):
        load_hf_split(saved, "train")


def _tiny_hf(root: Path, splits: dict[str, list], features: dict | None = None) -> Path:
    """A saved DatasetDict of 8 x 8 images whose brightness says their label (an int or a name)."""
    from PIL import Image

    dd = {}
    for split, labels in splits.items():
        images = [Image.new("RGB", (8, 8), (40 * (i % 5), 0, 0)) for i in range(len(labels))]
        ds = datasets.Dataset.from_dict({"image": images, "label": labels})
        if features is not None:
            ds = ds.cast(datasets.Features({"image": datasets.Image(), **features}))
        dd[split] = ds
    datasets.DatasetDict(dd).save_to_disk(str(root))
    return root


def test_an_unlabelled_test_split_is_one_line_before_any_image_is_decoded(tmp_path, monkeypatch):
    # As ImageNet-1k's test split on the Hub: ClassLabel -1 for every image.
    root = _tiny_hf(tmp_path / "data", {"train": [0, 1] * 4, "test": [-1] * 4},
                    {"label": datasets.ClassLabel(names=["cat", "dog"])})
    from vitlab.data import hf

    def decoded(*args, **kwargs):
        raise AssertionError("an image was decoded before the labels were checked")

    monkeypatch.setattr(hf, "open_image", decoded)
    monkeypatch.setattr(hf, "decode_image", decoded)
    with pytest.raises(DataError) as e:
        _run(["data.dataset=hf", f"data.root={root}", "data.val_size=0"], tmp_path / "run")
    assert "\n" not in str(e.value)
    assert f"split 'test' of data.root='{root}': 4 of its 4 images have no label (-1 or null" in str(e.value)
    assert "data.test_split=validation" in str(e.value)


def test_integer_labels_of_every_split_are_numbered_by_the_training_split(tmp_path):
    root = _tiny_hf(tmp_path / "data", {"train": [3, 7, 9, 3], "test": [7, 9, 9], "odd": [7, 5]})
    train = load_hf_split(str(root), "train")
    from vitlab.data import index_split

    test = index_split("hf", root, "test", classes=train.classes)
    assert train.classes == test.classes == ["3", "7", "9"] and test.labels.tolist() == [1, 2, 2]
    with pytest.raises(DataError, match=r"split 'odd' of data.root=.* has class\(es\) \['5'\] that the training"):
        index_split("hf", root, "odd", classes=train.classes)


def test_parquet_with_encoded_image_structs_and_no_hugging_face_metadata_decodes(tmp_path):
    # What pandas or pyarrow write: an image column of {bytes, path} structs, no "huggingface" schema key.
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (6, 5, 3), dtype=np.uint8) for _ in range(4)]
    encoded = []
    for a in arrays:
        buffer = io.BytesIO()
        Image.fromarray(a).save(buffer, format="PNG")
        encoded.append({"bytes": buffer.getvalue(), "path": None})
    table = pa.table({"image": encoded, "label": [0, 1, 0, 1]})
    (tmp_path / "pq").mkdir()
    for split in ("train", "test"):
        pq.write_table(table, tmp_path / "pq" / f"{split}-00000-of-00001.parquet")
    assert b"huggingface" not in (pq.read_schema(tmp_path / "pq" / "train-00000-of-00001.parquet").metadata or {})
    data = load_hf_split(str(tmp_path / "pq"), "train")
    assert torch.equal(data.images, torch.stack([torch.from_numpy(a).permute(2, 0, 1) for a in arrays]))
    assert data.labels.tolist() == [0, 1, 0, 1]


def test_a_list_valued_label_column_gives_multi_hot_rows_and_false_refuses_it_in_one_line(tmp_path):
    from vitlab.data.sources import index_split

    root = _tiny_hf(tmp_path / "data", {"train": [[0, 1], [1], [0], []], "test": [[1], [0, 1]]})
    train = index_split("hf", str(root), "train")
    assert train.classes == ["0", "1"]
    assert train.labels.tolist() == [[True, True], [False, True], [True, False], [False, False]]
    test = index_split("hf", str(root), "test", classes=train.classes, multi_label=True)
    assert test.labels.tolist() == [[False, True], [True, True]]
    with pytest.raises(DataError, match=r"the label column 'label' holds lists \(several classes an image\) and "
                                        r"data.multi_label=false asks for one") as e:
        index_split("hf", str(root), "train", multi_label=False)
    assert "\n" not in str(e.value)


def test_a_sequence_of_class_labels_takes_its_names(tmp_path):
    from vitlab.data.sources import index_split

    names = datasets.ClassLabel(names=["cat", "dog", "owl"])
    root = _tiny_hf(tmp_path / "data", {"train": [[2, 0], [1], []]}, {"label": datasets.Sequence(names)})
    train = index_split("hf", str(root), "train")
    assert train.classes == ["cat", "dog", "owl"]
    assert train.labels.tolist() == [[True, False, True], [False, True, False], [False, False, False]]


def test_hugging_face_runs_keep_their_decode_size_for_predict(tmp_path):
    # predict / attention read files at the size training decoded them at: the checkpoint must say it.
    root = _tiny_hf(tmp_path / "data", {"train": [0, 1] * 8, "test": [0, 1] * 2})
    _run(["data.dataset=hf", f"data.root={root}", "data.val_size=0", "data.decode_size=24", "train.epochs=1",
          "train.batch_size=8"], tmp_path / "run")
    import vitlab
    from vitlab.data.transforms import decode_size

    assert decode_size(vitlab.load_model(tmp_path / "run")) == (24, 24)


def test_streaming_with_a_datasets_too_old_for_it_is_one_line(tmp_path, monkeypatch):
    # datasets 3.0.0 has no IterableDataset.shard: data.streaming=true died in an AttributeError.
    from vitlab.data.hf import index_hf_stream

    monkeypatch.delattr(datasets.IterableDataset, "shard")
    monkeypatch.setattr(datasets, "__version__", "3.0.0")
    with pytest.raises(DataError, match=r"^data.streaming=true needs datasets >= 3.1 \(this is 3.0.0\): "
                                        r"pip install -U 'vitlab\[hf\]'$"):
        index_hf_stream(str(tmp_path), "train")

