"""Image classification data from Hugging Face ``datasets``: a Hub id, a ``save_to_disk`` directory or
a folder of parquet files, decoded into memory as :class:`~vitlab.data.images.ImageData`.

``datasets`` is an optional dependency (``pip install 'vitlab[hf]'``), imported only here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import DataError
from .images import ImageData, balanced_indices, pil_to_tensor

__all__ = ["IMAGE_KEYS", "LABEL_KEYS", "load_hf_split"]

# The names the usual image-classification data sets give their columns, in order of preference.
IMAGE_KEYS = ("image", "img")
LABEL_KEYS = ("label", "labels", "fine_label")


def _open(root: str) -> Any:
    """The ``DatasetDict`` of a ``save_to_disk`` directory, a folder of parquet files or a Hub id."""
    try:
        import datasets
    except ImportError:
        raise DataError("data.dataset=hf needs the Hugging Face datasets package: pip install 'vitlab[hf]'") from None
    path = Path(root).expanduser()
    try:
        if path.is_dir():
            if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
                loaded = datasets.load_from_disk(str(path))
                return loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict(train=loaded)
            if any(path.rglob("*.parquet")):
                return datasets.load_dataset("parquet", data_dir=str(path))
            raise DataError(f"data.root={root!r} is a directory with neither a saved dataset (dataset_dict.json, "
                            f"from DatasetDict.save_to_disk) nor parquet files")
        return datasets.load_dataset(root)
    except DataError:
        raise
    except Exception as e:  # no network, an unknown id, a gated repository: the library's own reason, one line
        reason = " ".join(str(e).split()) or type(e).__name__
        raise DataError(f"data.dataset=hf could not load data.root={root!r} ({reason[:300]}); give a Hub id (with "
                        f"network), a directory written by DatasetDict.save_to_disk, or a folder of parquet "
                        f"files") from None


def _column(names: list[str], wanted: str, usual: tuple[str, ...], what: str) -> str:
    if wanted:
        if wanted not in names:
            raise DataError(f"data.{what}_key={wanted!r} is not a column of the data set; its columns: {names}")
        return wanted
    for name in usual:
        if name in names:
            return name
    raise DataError(f"no {what} column found among {names} (looked for {', '.join(usual)}); name it with "
                    f"data.{what}_key=<column>")


def load_hf_split(root: str, split: str, *, image_key: str = "", label_key: str = "", subset: int = 0,
                  seed: int = 0, size: tuple[int, int] | None = None) -> ImageData:
    """Decode one split of a Hugging Face image-classification data set into memory.

    Args:
        root: A Hub id (``uoft-cs/cifar10``), a ``DatasetDict.save_to_disk`` directory or a folder of
            parquet files (splits named by their file names, ``train-*.parquet``, as ``datasets`` reads them).
        split: The split's name.
        image_key, label_key: Its columns; '' finds them among :data:`IMAGE_KEYS` / :data:`LABEL_KEYS`.
        subset: Keep only this many images, balanced across classes (0 = all); only those are decoded.
        seed: Seed of the subset choice.
        size: ``(H, W)`` every image is resized to (bicubic, once) if it differs; any mode (greyscale,
            RGBA, palette) becomes RGB.

    Class names come from the label column's ``ClassLabel`` feature, else from the sorted label values.
    """
    dataset_dict = _open(root)
    if split not in dataset_dict:
        raise DataError(f"data.root={root!r} has no split {split!r}; its splits: {list(dataset_dict)} (set "
                        f"data.train_split / data.test_split)")
    ds = dataset_dict[split]
    image_key = _column(ds.column_names, image_key, IMAGE_KEYS, "image")
    label_key = _column(ds.column_names, label_key, LABEL_KEYS, "label")
    feature = ds.features[label_key]
    values = ds[label_key]  # without decoding any image
    if hasattr(feature, "names"):  # a ClassLabel
        classes, labels = list(feature.names), torch.tensor(values)
    else:
        distinct = sorted(set(values))  # numbers in numeric order, names in alphabetical order
        position = {v: i for i, v in enumerate(distinct)}
        classes, labels = [str(v) for v in distinct], torch.tensor([position[v] for v in values])
    index = balanced_indices(labels, subset, seed)
    images = [pil_to_tensor(example[image_key], size) for example in ds.select(index.tolist())]
    if not images:
        raise DataError(f"split {split!r} of data.root={root!r} holds no images")
    return ImageData(torch.stack(images), labels[index], classes)
