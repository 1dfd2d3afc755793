"""Image classification data from Hugging Face ``datasets``: a Hub id, a ``save_to_disk`` directory or
a folder of parquet files, listed as a :class:`~vitlab.data.split.SplitIndex`.

``datasets`` is an optional dependency (``pip install 'vitlab[hf]'``), imported only here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import DataError
from .decode import decode_image, to_rgb
from .images import ImageData
from .split import SplitIndex, label_indices

__all__ = ["IMAGE_KEYS", "LABEL_KEYS", "index_hf_split", "load_hf_split"]

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


def index_hf_split(root: str, split: str, *, image_key: str = "", label_key: str = "",
                   classes: list[str] | None = None) -> SplitIndex:
    """List one split of a Hugging Face image-classification data set: its labels, without decoding
    an image.

    Args:
        root: A Hub id (``uoft-cs/cifar10``), a ``DatasetDict.save_to_disk`` directory or a folder of
            parquet files (splits named by their file names, ``train-*.parquet``, as ``datasets`` reads them).
        split: The split's name.
        image_key, label_key: Its columns; '' finds them among :data:`IMAGE_KEYS` / :data:`LABEL_KEYS`.
        classes: The training split's class names (None for the training split itself).

    Class names come from the label column's ``ClassLabel`` feature, else from the sorted label values.
    An image column of ``{bytes, path}`` structs (parquet written by pandas or pyarrow, without the
    Hugging Face metadata) is decoded as images. Any image mode becomes RGB
    (:func:`~vitlab.data.decode.pil_to_tensor`).

    Raises:
        DataError: one line, for a missing split or column, a multi-label (list) label column, an
            unlabelled sample (``ClassLabel`` -1), a label the training split does not have.
    """
    dataset_dict = _open(root)
    import datasets  # _open has said it in one line if it is not installed

    if split not in dataset_dict:
        raise DataError(f"data.root={root!r} has no split {split!r}; its splits: {list(dataset_dict)} (set "
                        f"data.train_split / data.test_split)")
    ds = dataset_dict[split]
    image_key = _column(ds.column_names, image_key, IMAGE_KEYS, "image")
    label_key = _column(ds.column_names, label_key, LABEL_KEYS, "label")
    where = f"split {split!r} of data.root={root!r}"
    feature = ds.features[label_key]
    if isinstance(feature, (list, datasets.Sequence, getattr(datasets, "List", datasets.Sequence))):
        raise DataError(f"{where}: the label column {label_key!r} holds lists (multi-label); vitlab trains "
                        f"single-label classification, one class an image (name another column with data.label_key)")
    image_feature = ds.features[image_key]
    if isinstance(image_feature, dict) and {"bytes", "path"} <= set(image_feature):
        ds = ds.cast_column(image_key, datasets.Image())  # encoded images without the metadata that says so
    names = list(feature.names) if hasattr(feature, "names") else None  # a ClassLabel
    labels, classes = label_indices(ds[label_key], classes, where, names)  # without decoding any image
    images = ds.select_columns([image_key])
    raw = images.cast_column(image_key, datasets.Image(decode=False))

    def encoded(i: int) -> bytes:
        value = raw[i][image_key]
        return value["bytes"] if value.get("bytes") is not None else Path(value["path"]).read_bytes()

    return SplitIndex(labels, classes, lambda i: to_rgb(images[i][image_key]), where, encoded=encoded,
                      read=lambda i: decode_image(encoded(i), f"{i} of {where}"))


def load_hf_split(root: str, split: str, *, image_key: str = "", label_key: str = "", subset: int = 0,
                  seed: int = 0, size: tuple[int, int] | None = None) -> ImageData:
    """Decode one split (:func:`index_hf_split`) into memory: ``subset`` images of it, balanced
    across classes and chosen by ``seed`` (0 = all; only those are decoded), resized to ``size``."""
    return index_hf_split(root, split, image_key=image_key, label_key=label_key).load(size, subset, seed)
