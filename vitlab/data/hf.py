"""Image classification data from Hugging Face ``datasets``: a Hub id, a ``save_to_disk`` directory or
a folder of parquet files, listed as a :class:`~vitlab.data.split.SplitIndex`.

``datasets`` is an optional dependency (``pip install 'vitlab[hf]'``), imported only here.
"""
from __future__ import annotations

import functools
import io
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor

from ..errors import DataError
from .decode import EncodedImage, decode_image, open_image
from .shards import ShardIndex
from .split import SplitIndex, label_indices, label_sets

__all__ = ["IMAGE_KEYS", "LABEL_KEYS", "index_hf_split", "index_hf_stream"]

# The names the usual image-classification data sets give their columns, in order of preference.
IMAGE_KEYS = ("image", "img")
LABEL_KEYS = ("label", "labels", "fine_label")


def _open_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError("data.dataset=hf needs the Hugging Face datasets package: pip install 'vitlab[hf]'") from None
    return datasets


def _open(root: str) -> Any:
    """The ``DatasetDict`` of a ``save_to_disk`` directory, a folder of parquet files or a Hub id."""
    datasets = _open_datasets()
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
                   classes: list[str] | None = None, exif_transpose: bool = True,
                   multi_label: bool | None = None, labelled: bool = True) -> SplitIndex:
    """List one split of a Hugging Face image-classification data set: its labels, without decoding
    an image. ``labelled=False`` (predictions): a split without a label column is listed too, its labels 0.

    Args:
        root: A Hub id (``uoft-cs/cifar10``), a ``DatasetDict.save_to_disk`` directory or a folder of
            parquet files (splits named by their file names, ``train-*.parquet``, as ``datasets`` reads them).
        split: The split's name.
        image_key, label_key: Its columns; '' finds them among :data:`IMAGE_KEYS` / :data:`LABEL_KEYS`.
        classes: The training split's class names (None for the training split itself).
        exif_transpose: Read images upright by their EXIF orientation, as ``datasets`` decodes them.
        multi_label: False refuses a column of label lists; otherwise such a column (``Sequence(ClassLabel)``,
            or lists of names or integers) gives multi-hot labels (:func:`~vitlab.data.split.label_sets`).

    Class names come from the label column's ``ClassLabel`` feature, else from the sorted label values.
    An image column of ``{bytes, path}`` structs (parquet written by pandas or pyarrow, without the
    Hugging Face metadata) is decoded as images. Any image mode becomes RGB
    (:func:`~vitlab.data.decode.pil_to_tensor`).

    Raises:
        DataError: one line, for a missing split or column, a list label column with ``multi_label=False``,
            an unlabelled sample (``ClassLabel`` -1), a label the training split does not have.
    """
    dataset_dict = _open(root)
    import datasets  # _open has said it in one line if it is not installed

    if split not in dataset_dict:
        raise DataError(f"data.root={root!r} has no split {split!r}; its splits: {list(dataset_dict)} (set "
                        f"data.train_split / data.test_split)")
    ds = dataset_dict[split]
    image_key = _column(ds.column_names, image_key, IMAGE_KEYS, "image")
    where = f"split {split!r} of data.root={root!r}"
    if not labelled and not label_key and not set(LABEL_KEYS) & set(ds.column_names):
        reader = DatasetImages(ds.select_columns([image_key]), image_key, where, exif_transpose)
        return SplitIndex(torch.zeros(len(ds), dtype=torch.long), list(classes or ["?"]), reader.open, where,
                          encoded=reader.encoded, read=reader.read, upright=exif_transpose)
    label_key = _column(ds.column_names, label_key, LABEL_KEYS, "label")
    feature = ds.features[label_key]
    lists = _is_list(feature)
    if lists and multi_label is False:
        raise DataError(f"{where}: the label column {label_key!r} holds lists (several classes an image) and "
                        f"data.multi_label=false asks for one; set data.multi_label=true (or auto) to train on them, "
                        f"or name another column with data.label_key")
    image_feature = ds.features[image_key]
    if isinstance(image_feature, dict) and {"bytes", "path"} <= set(image_feature):
        ds = ds.cast_column(image_key, datasets.Image())  # encoded images without the metadata that says so
    labels, classes = _labels(ds[label_key], feature, lists, classes, where)  # without decoding any image
    images = ds.select_columns([image_key])
    reader = DatasetImages(images, image_key, where, exif_transpose)
    return SplitIndex(labels, classes, reader.open, where, encoded=reader.encoded, read=reader.read,
                      upright=exif_transpose)


def _is_list(feature: Any) -> bool:
    """Whether a column's feature holds a list for each row (``Sequence``, ``List`` or ``[feature]``)."""
    import datasets

    return isinstance(feature, (list, datasets.Sequence, getattr(datasets, "List", datasets.Sequence)))


def _labels(values: Any, feature: Any, lists: bool, classes: list[str] | None, where: str) -> tuple[Tensor, list[str]]:
    """A label column's values as class indices (:func:`~vitlab.data.split.label_indices`) or, for ``lists``,
    multi-hot rows (:func:`~vitlab.data.split.label_sets`), named by its ``ClassLabel`` (of the list's items)."""
    inner = (getattr(feature, "feature", None) or (feature[0] if isinstance(feature, list) and feature else None)
             if lists else feature)
    names = list(inner.names) if hasattr(inner, "names") else None
    return (label_sets if lists else label_indices)(values, classes, where, names)


class DatasetImages:
    """The image column of a Hugging Face split, read by position: its stored bytes (``encoded``) decoded
    by PIL (``open``) or fastest (``read``, :func:`~vitlab.data.decode.decode_image`), upright by their EXIF
    orientation as ``datasets`` decodes them, unless ``exif_transpose=False``: the pixels of the same files
    in a folder. A plain object holding the (memory-mapped) data set, so it pickles for DataLoader workers
    of any start method."""

    def __init__(self, images: Any, image_key: str, where: str, exif_transpose: bool = True) -> None:
        import datasets

        self.image_key, self.where, self.exif_transpose = image_key, where, exif_transpose
        self.raw = images.cast_column(image_key, datasets.Image(decode=False))  # the stored bytes, undecoded

    def open(self, i: int) -> Any:
        return open_image(io.BytesIO(self.encoded(i)), exif_transpose=self.exif_transpose)

    def encoded(self, i: int) -> bytes:
        value = self.raw[i][self.image_key]
        return value["bytes"] if value.get("bytes") is not None else Path(value["path"]).read_bytes()

    def read(self, i: int) -> Tensor:
        return decode_image(self.encoded(i), f"{i} of {self.where}", exif_transpose=self.exif_transpose)


def _streamed(root: str, split: str, **kwargs: Any) -> Any:
    """``split`` of a Hub id or a folder of parquet files as an ``IterableDataset`` (``streaming=True``)."""
    import datasets

    path = Path(root).expanduser()
    where = dict(path="parquet", data_dir=str(path)) if path.is_dir() else dict(path=root)
    try:
        return datasets.load_dataset(**where, split=split, streaming=True, **kwargs)
    except Exception as e:  # no network, an unknown id or split: the library's own reason, one line
        reason = " ".join(str(e).split()) or type(e).__name__
        raise DataError(f"data.streaming=true could not open split {split!r} of data.root={root!r} ({reason[:300]}); "
                        f"give a Hub id (with network) or a folder of parquet files (<split>-*.parquet)") from None


class _HubShards:
    """``read(shard, start, stop)`` of a streamed split's data files (one shard a file): the rows with their
    images undecoded (``{bytes, path}``), those before ``start`` read past. Picklable: each DataLoader
    worker opens the split itself, once."""

    def __init__(self, root: str, split: str, image_key: str, num_shards: int) -> None:
        self.root, self.split, self.image_key, self.num_shards = root, split, image_key, num_shards
        self._dataset: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_dataset": None}

    def __call__(self, shard: int, start: int, stop: int) -> Iterator[dict[str, Any]]:
        import datasets

        if self._dataset is None:
            self._dataset = _streamed(self.root, self.split).cast_column(self.image_key, datasets.Image(decode=False))
        rows = self._dataset.shard(self.num_shards, shard).skip(start).take(stop - start)
        # .iter(), not iter(): in a DataLoader worker, iter() would share the shard with the other workers
        for batch in rows.iter(batch_size=64):
            yield from ({k: v[i] for k, v in batch.items()} for i in range(len(batch[self.image_key])))


def _decode_row(image_key: str, exif_transpose: bool, row: dict[str, Any], size: tuple[int, int] | None,
                lazy: bool = False) -> Tensor | EncodedImage:
    value = row[image_key]
    data = value["bytes"] if value.get("bytes") is not None else Path(value["path"]).read_bytes()
    where = repr(value.get("path") or "an image of the stream")
    return EncodedImage(data, where, exif_transpose) if lazy else decode_image(data, where, size, exif_transpose)


def index_hf_stream(root: str, split: str, *, image_key: str = "", label_key: str = "",
                    classes: list[str] | None = None, exif_transpose: bool = True) -> ShardIndex:
    """List a split of a Hub id or a folder of parquet files to stream it (``data.streaming=true``): its
    data files are its shards, each sample's label is read (only the label column, where the files are
    parquet), no image. Streamed by :class:`~vitlab.data.shard_stream.ShardStream` as WebDataset shards are.

    Raises:
        DataError: one line, as :func:`index_hf_split`.
    """
    datasets = _open_datasets()
    if not hasattr(datasets.IterableDataset, "shard"):  # new in 3.1: a split's data files are the shards
        raise DataError(f"data.streaming=true needs datasets >= 3.1 (this is {datasets.__version__}): "
                        f"pip install -U 'vitlab[hf]'")
    ds = _streamed(root, split)
    names = list(ds.features) if ds.features is not None else list(next(iter(ds)))
    image_key = _column(names, image_key, IMAGE_KEYS, "image")
    label_key = _column(names, label_key, LABEL_KEYS, "label")
    feature = ds.features[label_key] if ds.features is not None else None
    where = f"split {split!r} of data.root={root!r} (streamed)"
    try:
        labels_only = _streamed(root, split, columns=[label_key])
    except DataError:  # a builder without column selection: whole rows, images not decoded
        labels_only = ds.select_columns([label_key])
    shards = ds.n_shards
    per_shard = [[row[label_key] for row in labels_only.shard(shards, s)] for s in range(shards)]
    values = [v for shard in per_shard for v in shard]
    multi = feature is not None and _is_list(feature) or any(isinstance(v, list) for v in values[:1])
    labels, classes = _labels(values, feature, multi, classes, where)
    return ShardIndex([f"{root} {split} file {s}" for s in range(shards)], [len(s) for s in per_shard], labels,
                      classes, where, read=_HubShards(root, split, image_key, shards),
                      decode=functools.partial(_decode_row, image_key, exif_transpose), multi_label=multi)
