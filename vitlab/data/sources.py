"""Where a split's images come from, chosen by ``data.dataset``: ``cifar10`` (torchvision),
``imagefolder`` (:mod:`.folder`), ``csv`` (:mod:`.table`) or ``hf`` (:mod:`.hf`, Hugging Face ``datasets``,
imported only then). Each is listed as a :class:`~vitlab.data.split.SplitIndex`, then decoded into memory."""
from __future__ import annotations

from pathlib import Path

from .folder import index_cifar10, index_imagefolder
from .images import ImageData
from .split import SplitIndex
from .table import index_csv, one_hot_index

__all__ = ["index_split", "load_split"]


def index_split(dataset: str, root: str | Path, split: str, *, download: bool = False, image_key: str = "",
                label_key: str = "", classes: list[str] | None = None, exif_transpose: bool = True,
                multi_label: bool | None = None, labelled: bool = True) -> SplitIndex:
    """List one split without decoding it.

    Args:
        dataset: ``'cifar10'`` (``torchvision.datasets.CIFAR10`` under ``root``), ``'imagefolder'``
            (``root/<split>/<class>/*.png``; class folders sorted give the labels), ``'csv'``
            (``root/<split>.csv``: :func:`vitlab.data.table.index_csv`) or ``'hf'`` (a Hugging Face dataset:
            :func:`vitlab.data.hf.index_hf_split`).
        root: Data root (for ``'hf'``: a Hub id, a ``save_to_disk`` directory or a folder of parquet files).
        split: The split's name (CIFAR-10: ``'train'`` or ``'test'``).
        download: Download CIFAR-10 if absent.
        image_key, label_key: The columns of a Hugging Face dataset ('' = found by name).
        classes: The training split's class names, which every other split's labels index (None for
            the training split itself).
        exif_transpose: Read image files upright by their EXIF orientation (``data.exif_transpose``), as
            ``PIL.ImageOps.exif_transpose`` and Hugging Face ``datasets`` do; False: the stored pixels.
        multi_label: True: labels as multi-hot rows (bool ``(N, K)``), also where each image has one class;
            False: one class an image (label sets are one line); None: as the data holds them (``data.multi_label``).
        labelled: False (predictions, pretraining): a Hugging Face split without a label column, or a csv table
            without a ``labels`` column, is listed, its labels 0.
    """
    if dataset == "hf":
        from .hf import index_hf_split

        index = index_hf_split(str(root), split, image_key=image_key, label_key=label_key, classes=classes,
                               exif_transpose=exif_transpose, multi_label=multi_label, labelled=labelled)
    elif dataset == "csv":
        index = index_csv(Path(root).expanduser(), split, classes, exif_transpose, multi_label, labelled)
    elif dataset == "cifar10":
        index = index_cifar10(Path(root).expanduser(), split, download)
    else:
        index = index_imagefolder(Path(root).expanduser(), split, classes, exif_transpose)
    return one_hot_index(index) if multi_label else index


def load_split(dataset: str, root: str | Path, split: str, *, download: bool = False, subset: int = 0,
               seed: int = 0, size: tuple[int, int] = (32, 32), image_key: str = "", label_key: str = "",
               classes: list[str] | None = None) -> ImageData:
    """Decode one split (:func:`index_split`) into memory: ``subset`` images of it, balanced across
    classes and chosen by ``seed`` (0 = all; only those are decoded), ImageFolder and Hugging Face
    images resized (bicubic, once) to ``size`` ``(H, W)`` where they differ (CIFAR-10 stays 32 x 32)."""
    index = index_split(dataset, root, split, download=download, image_key=image_key, label_key=label_key,
                        classes=classes)
    return index.load(size, subset, seed)
