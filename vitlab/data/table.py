"""Images listed in a CSV file (``data.dataset=csv``): ``<root>/<split>.csv`` with a column ``image`` (a path
relative to ``root``) and a column ``labels``, listed as a :class:`~vitlab.data.split.SplitIndex`. A ``labels``
cell is class names separated by spaces, as Kaggle's Planet data set writes them (``person car``), or a JSON
list, which a name with a space needs (``["person", "stop sign"]``; what vitlab's own prediction files write,
:func:`label_set_cell`). A file whose every image has exactly one label is single-label data; any other is
multi-label (several classes an image, or none)."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import torch

from ..errors import DataError
from .folder import FolderFiles
from .split import SplitIndex, label_indices, label_sets

__all__ = ["index_csv", "one_hot_index", "label_set_cell", "label_cell", "parse_label_cell"]


def label_set_cell(names: list[str]) -> str:
    """A set of class names as one CSV cell that reads back as it was (:func:`parse_label_cell`): a JSON list."""
    return json.dumps(names, ensure_ascii=False)


def label_cell(label: torch.Tensor, classes: list[str]) -> str:
    """An image's label as a ``labels`` cell that reads back as it was: its class's name (a class index), or the
    :func:`label_set_cell` of its classes' names (a multi-hot row)."""
    if label.dim() == 1:
        return label_set_cell([classes[k] for k in label.nonzero().flatten().tolist()])
    return classes[int(label)]


def parse_label_cell(cell: str, where: str) -> list[str]:
    """The class names of a ``labels`` cell: a JSON list (``["stop sign"]``), or names separated by spaces.

    Raises:
        DataError: one line, for a cell that opens a JSON list and is not one of names.
    """
    cell = (cell or "").strip()
    if not cell.startswith("["):
        return cell.split()
    try:
        names = json.loads(cell)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: the labels cell {cell[:60]!r} opens a JSON list and is not one ({e.msg}); write "
                        f'["name", "other name"], or names separated by spaces') from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise DataError(f"{where}: the labels cell {cell[:60]!r} is a JSON list of other than class names; write "
                        f'["name", "other name"]')
    return names


def index_csv(root: Path, split: str, classes: list[str] | None = None, exif_transpose: bool = True,
              multi_label: bool | None = None, labelled: bool = True) -> SplitIndex:
    """List ``root/<split>.csv``: its images (read upright by their EXIF orientation unless
    ``exif_transpose=False``) and their labels, without decoding an image.

    Args:
        root: The folder holding the CSV files and the images they name.
        split: The file's name without ``.csv`` (``train``, ``val``, ``test``).
        classes: The training split's class names (None for the training split itself, whose classes are
            the names it uses, sorted).
        exif_transpose: Read image files upright by their EXIF orientation.
        multi_label: True: multi-hot labels (bool ``(N, K)``) whatever the rows hold; False: one class an
            image (int64 ``(N,)``); None: multi-hot unless every image has exactly one label.
        labelled: False (pretraining, predictions): a table without a ``labels`` column is listed too, its
            labels 0.

    Raises:
        DataError: one line, for a missing file, column or image, an image listed twice, a class the
            training split does not have, or label sets where ``multi_label`` is False.
    """
    path = root / f"{split}.csv"
    if not path.is_file():
        found = sorted(p.name for p in root.glob("*.csv")) if root.is_dir() else []
        raise DataError(f"data.dataset=csv: no {path.name} in data.root={str(root)!r} (its CSV files: "
                        f"{', '.join(found) or 'none'}); each split is <split>.csv with columns image and labels")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        needed = {"image", "labels"} if labelled or "labels" in (reader.fieldnames or ()) else {"image"}
        if not needed <= set(reader.fieldnames or ()):
            raise DataError(f"{path} has columns {reader.fieldnames}; it needs 'image' (a path relative to "
                            f"data.root, or absolute) and 'labels' (class names separated by spaces, or a JSON list)")
        where = f"{path.name} of data.root={str(root)!r}"
        rows = [(row["image"], parse_label_cell(row["labels"], where) if "labels" in needed else ["?"])
                for row in reader]
    if not rows:
        raise DataError(f"{where} lists no images")
    names = [image for image, _ in rows]
    files = [root / n for n in names]
    seen: dict[str, str] = {}  # the same file under two spellings (./a.png, a.png, a//b.png) is one image
    for name, file in zip(names, files):
        same = os.path.normpath(file)
        if same in seen:
            also = f" (as {seen[same]!r} too)" if seen[same] != name else ""
            raise DataError(f"{where} lists the image {name!r} twice{also}; list each image once, with all its labels")
        seen[same] = name
    missing = [n for n, f in zip(names, files) if not f.is_file()]
    if missing:
        raise DataError(f"{where}: {len(missing)} of its {len(files)} images are not there ({missing[0]!r} "
                        f"{'and others ' if len(missing) > 1 else ''}under data.root); image paths are relative to "
                        f"data.root, or absolute")
    labels, classes = _labels(rows, names, classes, where, multi_label) if "labels" in needed else \
        (torch.zeros(len(files), dtype=torch.long), list(classes or ["?"]))  # listed without labels: each class 0
    reader_ = FolderFiles(files, exif_transpose, root)
    return SplitIndex(labels, classes, reader_.open, where, encoded=reader_.encoded, read=reader_.read,
                      key=reader_.key, upright=exif_transpose, stamp=reader_.stamp, path=reader_.path)


def _labels(rows: list[tuple[str, list[str]]], names: list[str], classes: list[str] | None, where: str,
            multi_label: bool | None) -> tuple[torch.Tensor, list[str]]:
    """The rows' labels as class indices or multi-hot rows (see :func:`index_csv`), and the classes."""
    label_lists = [labels for _, labels in rows]
    single = all(len(labels) == 1 for labels in label_lists)
    if multi_label is False and not single:
        i = next(i for i, labels in enumerate(label_lists) if len(labels) != 1)
        raise DataError(f"{where}: image {names[i]!r} has {len(label_lists[i])} labels ({' '.join(label_lists[i])!r}) "
                        f"and data.multi_label=false asks for one class an image; set data.multi_label=true (or auto) "
                        f"to train on label sets")
    if multi_label or (multi_label is None and not single):
        return label_sets(label_lists, classes, where)
    return label_indices([labels[0] for labels in label_lists], classes, where)


def one_hot_index(index: SplitIndex) -> SplitIndex:
    """``index`` with its class indices as multi-hot rows (``data.multi_label=true`` on single-label data)."""
    if index.labels.ndim == 2:
        return index
    index.labels = torch.nn.functional.one_hot(index.labels, len(index.classes)).bool()
    return index
