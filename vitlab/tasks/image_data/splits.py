"""The splits of an image classification run, from their listing alone (nothing decoded): the training and test
splits (a test split held out of the training split where ``data.test_size`` says), the images a run trains on and
its validation images (``data.train_subset``, ``data.val_size``), the count of each class, and their decoding."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ...data.images import ImageData, balanced_indices, stratified_indices
from ...data.sources import index_split
from ...data.split import SplitIndex, hold_out
from ...errors import ConfigError, DataError

if TYPE_CHECKING:
    from ...schema import DataConfig

__all__ = ["decode_size_of", "streamed_at_own_size", "index_splits", "training_class_counts", "class_counts", "require_trained_classes",
           "load_train_val_data", "load_test_data"]


def streamed_at_own_size(d: DataConfig) -> bool:
    """Whether streamed images are decoded each at its own size: for ImageNet-style transforms (``data.train_crop=rrc``
    or ``src``), which crop each image by its own size, without ``data.decode_size``, unless a self-supervised run's
    views are made on the device (``data.views=device``: a batch's images cropped at once, all of one size). Held in
    memory, the same images are stored at one size first: ``data.in_memory`` then changes the pixels."""
    return d.train_crop != "pad" and not d.decode_size and d.views != "device"


def decode_size_of(d: DataConfig, size: tuple[int, int], keep_in_memory: bool = True) -> tuple[int, int] | None:
    """The size image files are decoded at: ``data.decode_size``, else the model's input ``size``; None (each its own
    size) for streamed images where :func:`streamed_at_own_size`."""
    if not keep_in_memory and streamed_at_own_size(d):
        return None
    return (d.decode_size, d.decode_size) if d.decode_size else tuple(size)


def index_splits(d: DataConfig, classes: list[str] | None = None, seed: int = 0,
                 held_out: dict[str, Any] | None = None) -> tuple[SplitIndex, SplitIndex]:
    """List the training and test splits (nothing decoded), the test labels mapped through the training
    split's classes (or through ``classes``, a trained model's): bad labels fail here, before decoding.

    With ``data.test_size``, the test split is held out of the training split (:func:`hold_out`, chosen by
    ``seed``); a folder whose root holds the class folders itself is that split. ``held_out``: a run's
    record of the split it held out (``{}``: none), which this config and listing must give again (else
    one line); None: no run to agree with."""
    keys = dict(download=d.download, image_key=d.image_key, label_key=d.label_key, exif_transpose=d.exif_transpose)
    multi_label = None if d.multi_label == "auto" else d.multi_label
    split = d.train_split
    if d.test_size and d.dataset == "imagefolder" and not (Path(d.root).expanduser() / split).is_dir():
        split = "."  # the class folders are data.root's own
    train = index_split(d.dataset, d.root, split, **keys, classes=classes, multi_label=multi_label)
    train.max_pixels = d.max_image_pixels  # kept by the splits held out of it
    keys["multi_label"] = train.labels.ndim == 2  # every split as the training split holds its labels
    if held_out is not None and held_out.get("test_size", 0) != d.test_size:
        kept = held_out.get("test_size", 0)
        raise ConfigError(f"data.test_size: the run held out {held_out.get('images', 0)} images (data.test_size="
                          f"{kept:g}) and this asks for data.test_size={d.test_size:g}; a run keeps its test split: "
                          f"set data.test_size={kept:g}, or start a new run")
    if not d.test_size:
        test = index_split(d.dataset, d.root, d.test_split, **keys, classes=train.classes)
        test.max_pixels = d.max_image_pixels
        return train, test
    if held_out and held_out.get("seed", seed) != seed:
        raise ConfigError(f"train.seed={seed}: the run held out its test split with train.seed={held_out['seed']}, "
                          f"which chooses those images; a run keeps its test split: set train.seed={held_out['seed']}, "
                          f"or start a new run")
    # A run recorded before the rule was kept held out an equal count of every class.
    train, test = hold_out(train, d.test_size, seed, held_out.get("rule", "balanced") if held_out else "stratified")
    record = test.held_out
    if held_out is not None and held_out != record:
        raise DataError(f"the images held out as the test split changed on disk since the run started ({test.where}: "
                        f"{record['images']} images now, SHA-256 {record['sha256'][:12]}, against {held_out['images']}, "
                        f"{held_out['sha256'][:12]} recorded): its test metrics would be of other images; restore "
                        f"data.root as it was{'' if 'seed' in held_out else ' (and train.seed, if it changed)'}, or "
                        f"start a new run")
    return train, test


def _train_val_rows(d: DataConfig, seed: int, index: SplitIndex) -> tuple[Tensor, Tensor | None]:
    """From the labels alone: the rows of ``index`` a run uses (``data.train_subset`` of them plus its
    validation images, balanced, else all) and, among those, the positions of its validation images
    (``data.val_size``, stratified; None without)."""
    wanted = d.train_subset + d.val_size if d.train_subset else 0
    if d.val_size and d.val_size >= (wanted or len(index)):
        raise ConfigError(f"data.val_size={d.val_size} leaves no training images (the training set has "
                          f"{wanted or len(index)})")
    rows = balanced_indices(index.labels, wanted, seed)  # what index.load(subset=wanted) decodes
    if not d.val_size:
        return rows, None
    return rows, stratified_indices(index.labels[rows], d.val_size, seed + 1, index.classes,
                                    f"data.val_size={d.val_size} of {index.where}")


def training_class_counts(d: DataConfig, seed: int, index: SplitIndex) -> Tensor:
    """How many images of each class a run trained on (its validation images left out), from the labels
    alone: int64 ``(K,)`` (multi-label: the images that show it)."""
    rows, val = _train_val_rows(d, seed, index)
    keep = torch.ones(len(rows), dtype=torch.bool)
    if val is not None:
        keep[val] = False
    return class_counts(index.labels[rows][keep], len(index.classes))


def class_counts(labels: Tensor, num_classes: int) -> Tensor:
    """The images of each class, int64 ``(K,)``: of labels ``(N,)``, or multi-hot rows ``(N, K)`` (its positives)."""
    return labels.sum(0, dtype=torch.long) if labels.ndim == 2 else torch.bincount(labels, minlength=num_classes)


def require_trained_classes(classes: list[str], counts: Tensor, where: str) -> None:
    """Refuse, in one line, classes that no training image shows (``counts``: each class's training images,
    ``(K,)``): an empty class folder, a class whose images are all held out, one only the test split shows. A
    model cannot learn such a class, and class weights, a logit-adjusted loss or post-hoc logit adjustment, which
    favour the rarest classes, would predict it for every image (torchvision's ``ImageFolder`` refuses an empty
    class folder likewise).

    Raises:
        DataError: naming the classes and the way out.
    """
    absent = [c for c, n in zip(classes, counts.tolist()) if n == 0]
    if absent:
        raise DataError(f"class(es) {absent[:10]}{' ...' if len(absent) > 10 else ''} of {where} have no training "
                        f"images (an empty class folder, or all their images held out for validation or test): a "
                        f"model cannot learn them, and class weights or logit adjustment would predict them as the "
                        f"rarest; add training images of them, or remove them from the data")


def load_train_val_data(d: DataConfig, seed: int, size: tuple[int, int], index: SplitIndex,
                        keep_in_memory: bool = True) -> tuple[ImageData, ImageData | None]:
    """Decode the training images of ``index`` (at :func:`decode_size_of` for the model's input ``size``;
    into memory, or when read with ``keep_in_memory=False``) and hold out the validation set:
    ``data.val_size`` images, stratified (:func:`~vitlab.data.images.stratified_indices`: every class in
    proportion, at least one of each on each side), chosen by ``seed`` (None if 0), before any image is
    decoded. The same config and seed give the same images, so ``vitlab eval --split val`` scores exactly
    the validation images training used."""
    rows, val_index = _train_val_rows(d, seed, index)  # only these are decoded: the training subset and validation
    train = index.load(decode_size_of(d, size, keep_in_memory), len(rows) if d.train_subset else 0, seed,
                       keep_in_memory, d.scaled_decode, d.cache_dir or None)
    if val_index is None:
        return train, None
    keep = torch.ones(len(train.labels), dtype=torch.bool)
    keep[val_index] = False
    return train.subset(keep.nonzero().flatten()), train.subset(val_index)


def load_test_data(d: DataConfig, seed: int, size: tuple[int, int], index: SplitIndex,
                   keep_in_memory: bool = True) -> ImageData:
    """Decode the test images of ``index`` (``data.test_subset`` of them, balanced, if set), as
    :func:`load_train_val_data`."""
    return index.load(decode_size_of(d, size, keep_in_memory), d.test_subset, seed, keep_in_memory, d.scaled_decode,
                      d.cache_dir or None)
