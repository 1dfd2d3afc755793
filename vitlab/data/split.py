"""A split listed before it is decoded: its labels and class names first, its pixels on demand.

Every image source (:mod:`.folder`: ImageFolder and CIFAR-10; :mod:`.hf`: Hugging Face data) lists a
split as a :class:`SplitIndex`. Listing is cheap (file names, a label column), so what can be wrong with
the labels is found before any image is decoded, and every split is mapped through the *training*
split's classes (:func:`label_indices`): a test split that lacks a class keeps the training split's
numbering.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..errors import DataError
from ..files import replaced
from ..progress import Progress
from .decode import EncodedImage, check_pixels, dct_scale, decode_all, decode_image, decode_region, jpeg_size, \
    pil_to_tensor
from .images import ImageData, Picked, balanced_indices, stratified_indices

__all__ = ["SplitIndex", "StreamedImages", "label_indices", "label_sets", "hold_out", "held_out_count",
           "label_text", "multi_label_reason"]


@dataclass
class SplitIndex:
    """One split of an image-classification data set, listed but not decoded.

    Attributes:
        labels: int64 ``(N,)``, indices into ``classes``; for multi-label data (several classes an image),
            bool ``(N, K)``, ``labels[i, k]``: image ``i`` shows class ``k`` (:func:`label_sets`).
        classes: The class names, in label order (the training split's, for every split of a run).
        open: ``open(i)`` -> sample ``i`` as an 8-bit RGB PIL image at its own size
            (:func:`~vitlab.data.decode.to_rgb`).
        where: The split in words, for messages (``"split 'test' of data.root='/data'"``).
        pixels: A source already decoded (CIFAR-10): uint8 ``(N, 3, H, W)``, which :meth:`decode` indexes.
        encoded: ``encoded(i)`` -> sample ``i``'s image file as stored (its bytes), where the source keeps
            one (``vitlab shards`` copies it into a shard).
        read: ``read(i)`` -> sample ``i`` as uint8 RGB ``(3, H, W)`` at its own size, the pixels of ``open``,
            decoded fastest (:func:`~vitlab.data.decode.decode_image`), where the source has a faster way.
        key: ``key(i)`` -> what names sample ``i`` in its source (a file's path under the split's folder,
            a row's number), for recording which samples a run held out.
        held_out: For a test split held out of the training split (:func:`hold_out`), its record.
        upright: Whether its image files are read upright by their EXIF orientation (``data.exif_transpose``).
        stamp: ``stamp(i)`` -> what changes when sample ``i``'s file does (its size and modification time),
            where the source has files: what a decode cache (``data.cache_dir``) is checked against.
        path: ``path(i)`` -> sample ``i``'s file, where the source has files (what ``vitlab inspect
            --write-clean`` lists).
        max_pixels: An image file of more pixels than this (its header's width x height) is refused before it
            is decoded (:func:`~vitlab.data.decode.check_pixels`; ``data.max_image_pixels``, ``--max-image-pixels``);
            0: no limit but PIL's own.
    """

    labels: Tensor
    classes: list[str]
    open: Callable[[int], Image.Image]
    where: str
    pixels: Tensor | None = None
    encoded: Callable[[int], bytes] | None = None
    read: Callable[[int], Tensor] | None = None
    key: Callable[[int], str] = str
    held_out: dict[str, Any] | None = None
    upright: bool = True
    stamp: Callable[[int], str] | None = None
    path: Callable[[int], Path] | None = None
    max_pixels: int = 0

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, ids: Tensor, where: str) -> SplitIndex:
        """Samples ``ids`` of this split as a split of their own, described by ``where``."""
        ids = ids.clone()
        pick = [None if f is None else Picked(f, ids) for f in (self.encoded, self.read)]
        return SplitIndex(self.labels[ids], self.classes, Picked(self.open, ids), where,
                          None if self.pixels is None else self.pixels[ids], *pick, Picked(self.key, ids),
                          upright=self.upright, stamp=None if self.stamp is None else Picked(self.stamp, ids),
                          path=None if self.path is None else Picked(self.path, ids), max_pixels=self.max_pixels)

    def decode(self, i: int, size: tuple[int, int] | None, scaled: bool = False) -> Tensor:
        """Sample ``i`` as uint8 RGB ``(3, H, W)``, resized (PIL's bicubic) to ``size`` if given (a source
        already decoded keeps its size); with ``scaled`` (``data.scaled_decode``), a JPEG file decoded only
        as large as ``size`` needs (:func:`~vitlab.data.decode.decode_region`)."""
        if self.pixels is not None:
            return self.pixels[i]
        if self.max_pixels and self.encoded is not None and not scaled:  # its header first, then the bytes in hand
            return decode_image(self._checked(i), self._where(i), size, self.upright)  # (scaled: below)
        if size is None and self.read is not None:
            return self.read(i)
        if scaled and self.encoded is not None:
            data = self._checked(i)
            found = jpeg_size(data, self.upright)
            if found is not None and dct_scale(found[0], found[1], size) > 1:  # else as without scaling
                return decode_region(data, self._where(i), lambda h, w: (0, 0, h, w), size, self.upright, found)
            try:
                return decode_image(data, self._where(i), size, self.upright)  # the bytes in hand, not read again
            except DataError:
                pass  # said by the source itself, naming the file as it knows it
        return pil_to_tensor(self.open(i), size)

    def encoded_image(self, i: int) -> EncodedImage | None:
        """Sample ``i``'s file, undecoded, for transforms that decode only what they need; None where the
        source keeps no file (decoded pixels)."""
        if self.pixels is not None or self.encoded is None:
            return None
        return EncodedImage(self._checked(i), self._where(i), self.upright)

    def _where(self, i: int) -> str:
        return f"{self.key(i)!r} of {self.where}"

    def _checked(self, i: int) -> bytes:
        """Sample ``i``'s file as stored, refused (:class:`~vitlab.data.decode.TooManyPixels`) if its header says
        more than ``max_pixels``."""
        data = self.encoded(i)
        check_pixels(data, self._where(i), self.max_pixels)
        return data

    def load(self, size: tuple[int, int] | None, subset: int = 0, seed: int = 0, in_memory: bool = True,
             scaled: bool = False, cache_dir: str | Path | None = None) -> ImageData:
        """The split (or ``subset`` images of it, balanced across classes, chosen by ``seed``: only
        those are used) at ``size``: decoded into memory now, or with ``in_memory=False`` decoded
        each time an image is read (:class:`StreamedImages`, for data larger than memory).

        ``cache_dir`` (``data.cache_dir``): a split of files decoded into memory at ``size`` is kept there
        (safetensors, written whole and renamed into place) and read back by the next load of the same images
        at the same size and scaling whose files have kept their sizes and modification times; anything
        else decodes anew into an entry of its own."""
        index = balanced_indices(self.labels, subset, seed).tolist()
        if not index:
            raise DataError(f"{self.where} holds no images")
        key = Picked(self.key, torch.tensor(index))
        if not in_memory:
            return ImageData(StreamedImages(self, torch.tensor(index), size, scaled), self.labels[index], self.classes,
                             key)
        cached = None
        if cache_dir is not None and size is not None and self.pixels is None and self.stamp is not None:
            cached = self._cache_file(Path(cache_dir), index, size, scaled)
            if cached.is_file():
                images = load_file(str(cached))["images"]
                if len(images) == len(index):
                    print(f"read the {len(index):,} decoded images ({self.where}) from {cached} (data.cache_dir)")
                    return ImageData(images, self.labels[index], self.classes, key)
        with Progress(total=len(index), desc=f"decoding {len(index):,} images ({self.where})", unit="images",
                      interval=10.0) as progress:
            if not progress.terminal and progress.enabled:
                print(f"decoding {len(index):,} images ({self.where}) ...", flush=True)
            images = decode_all(lambda i: self.decode(i, size, scaled), index, progress.update)
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            with replaced(cached) as tmp:
                save_file({"images": images.contiguous()}, str(tmp))
            print(f"kept the {len(index):,} decoded images ({self.where}) in {cached} for the next run (data.cache_dir)")
        return ImageData(images, self.labels[index], self.classes, key)

    def _cache_file(self, cache_dir: Path, index: list[int], size: tuple[int, int], scaled: bool) -> Path:
        """The entry of these samples (their keys and file stamps) at ``size``, ``scaled``, upright or not."""
        digest = hashlib.sha256(json.dumps(["vitlab decoded split 1", list(size), scaled, self.upright]).encode())
        for i in index:
            digest.update(f"{self.key(i)}\0{self.stamp(i)}\n".encode())
        return cache_dir / f"{digest.hexdigest()[:40]}.safetensors"


def held_out_count(size: float, total: int) -> int:
    """The images ``data.test_size`` asks of ``total``: a share below 1 (rounded), else a count."""
    return round(size * total) if size < 1 else int(size)


def hold_out(index: SplitIndex, size: float, seed: int, rule: str = "stratified") -> tuple[SplitIndex, SplitIndex]:
    """Split ``index`` into training and test splits: ``size`` of its samples (a share below 1, else a
    count) are the test split (``data.test_size``), stratified (:func:`~vitlab.data.images.stratified_indices`:
    every class in proportion, at least one image of each on each side) and chosen by ``seed``. The test
    split's ``held_out`` is the record a run keeps of it: the size, the real count, the seed, the rule and a
    SHA-256 of the held-out samples' keys and labels, which changes if the samples, their files or the
    choice do. ``rule="balanced"`` chooses as runs recorded before the rule was kept did (an equal count of
    every class, :func:`~vitlab.data.images.balanced_indices`), so that those runs keep their test split.

    Raises:
        DataError: one line, if ``size`` leaves no images on a side, or a class has a single image.
    """
    n = held_out_count(size, len(index))
    if not 0 < n < len(index):
        raise DataError(f"data.test_size={size:g} holds out {n} of the {len(index)} images of {index.where}; "
                        f"choose a share in (0, 1) or a count below {len(index)}")
    if rule == "balanced":
        test = balanced_indices(index.labels, n, seed=seed + 2)
    else:  # seed + 1 picks the validation images
        test = stratified_indices(index.labels, n, seed + 2, index.classes, f"data.test_size={size:g} of {index.where}")
    rest = torch.ones(len(index), dtype=torch.bool)
    rest[test] = False
    keys = sorted(f"{index.key(int(i))}\t{label_text(index.labels[i])}" for i in test)
    record = {"test_size": size, "images": len(test), "sha256": hashlib.sha256("\n".join(keys).encode()).hexdigest()}
    if rule != "balanced":
        record.update(seed=seed, rule=rule)
    held = index.subset(test, f"the test images held out of {index.where}")
    held.held_out = record
    return index.subset(rest.nonzero().flatten(), index.where), held


def label_text(label: Tensor) -> str:
    """An image's label in a record: its class index, or the indices of a multi-label image's classes."""
    return str(int(label)) if label.ndim == 0 else ",".join(map(str, label.nonzero().flatten().tolist()))


def label_sets(values: Sequence[Sequence[Any]], classes: list[str] | None, where: str,
               names: Sequence[str] | None = None) -> tuple[Tensor, list[str]]:
    """A multi-label split's label sets as multi-hot rows, :func:`label_indices`' rules for each member.

    Args:
        values: One sequence of labels per sample (class names, or with ``names`` indices into them); an
            empty one is an image of none of the classes, which multi-label data may have.
        classes: The training split's class names; None for the training split itself, whose classes are
            ``names`` if given, else every name its samples carry, sorted as :func:`label_indices` sorts.
        where: The split in words, for messages.
        names: The class names integer ``values`` index (a ``Sequence(ClassLabel)``'s ``names``).

    Returns:
        bool ``(N, K)`` and the class names.

    Raises:
        DataError: one line, if a label is not one of ``classes``, or an image lists a class twice.
    """
    if names is not None:
        values = [[names[v] for v in row] for row in values]
    flat = [str(v) for row in values for v in row]
    if classes is None:
        classes = list(names) if names is not None else \
            [str(v) for v in sorted({v for row in values for v in row})]
    position = {name: i for i, name in enumerate(classes)}
    unknown = sorted(set(flat) - position.keys())
    if unknown:
        raise DataError(f"{where} has class(es) {unknown[:10]}{' ...' if len(unknown) > 10 else ''} that the "
                        f"training split does not have (its classes: {classes[:20]}{' ...' if len(classes) > 20 else ''}); "
                        f"a model can only be scored on classes it was trained on")
    twice = next((i for i, row in enumerate(values) if len(set(map(str, row))) != len(row)), None)
    if twice is not None:
        raise DataError(f"{where}: image {twice} lists a class twice ({list(values[twice])}); give each class once")
    hot = torch.zeros(len(values), len(classes), dtype=torch.bool)
    for i, row in enumerate(values):
        hot[i, [position[str(v)] for v in row]] = True
    return hot, classes


def label_indices(values: Sequence[Any], classes: list[str] | None, where: str,
                  names: Sequence[str] | None = None) -> tuple[Tensor, list[str]]:
    """A split's raw labels as indices into its classes.

    Args:
        values: One label per sample: a class name, or an integer (with ``names``: an index into
            ``names``, as a ``ClassLabel`` column; -1 or None is an unlabelled sample).
        classes: The training split's class names; None for the training split itself, whose classes
            are ``names`` if given, else its distinct values sorted (numbers in numeric order, names in
            alphabetical order) and written as strings.
        where: The split in words, for messages.
        names: The class names integer ``values`` index (a ``ClassLabel``'s ``names``).

    Raises:
        DataError: one line, if a sample has no label, or a label is not one of ``classes``.
    """
    unlabelled = sum(1 for v in values if v is None or (names is not None and v == -1))
    if unlabelled:
        raise DataError(f"{where}: {unlabelled} of its {len(values)} images have no label (-1 or null, as the test "
                        f"split of ImageNet-1k on the Hub); train and evaluate on labelled splits (data.train_split, "
                        f"data.test_split, e.g. data.test_split=validation)")
    if names is not None:
        values = [names[v] for v in values]
    if classes is None:
        classes = list(names) if names is not None else [str(v) for v in sorted(set(values))]
    position = {name: i for i, name in enumerate(classes)}
    unknown = sorted({str(v) for v in values} - position.keys())
    if unknown:
        raise DataError(f"{where} has class(es) {unknown[:10]}{' ...' if len(unknown) > 10 else ''} that the "
                        f"training split does not have (its classes: {classes[:20]}{' ...' if len(classes) > 20 else ''}); "
                        f"a model can only be scored on classes it was trained on")
    return torch.tensor([position[str(v)] for v in values], dtype=torch.long), classes


class StreamedImages:
    """A split's images decoded when they are read: what a uint8 ``(N, 3, H, W)`` tensor is to a split
    decoded into memory, for data that does not fit there. Indexing with an integer decodes that image
    (in a DataLoader worker): uint8 ``(3, H, W)`` at ``size``, or with ``size`` None at its own size (for
    transforms that crop each image by its own size, as ImageNet recipes do).
    Indexing with a tensor or a list of indices selects a subset, decoding nothing. Pickles cheaply
    (DataLoader workers get the listing, not pixels).
    """

    def __init__(self, index: SplitIndex, rows: Tensor, size: tuple[int, int] | None, scaled: bool = False) -> None:
        self.index, self.rows, self.scaled = index, rows, scaled
        self.size = (int(size[0]), int(size[1])) if size is not None else None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(N, 3, H, W)``; images streamed at their own sizes (``size`` None) have none."""
        if self.size is None:
            raise ValueError("images streamed at their own sizes have no common shape")
        return (len(self.rows), 3, *self.size)

    def __getitem__(self, i: Any) -> "Tensor | StreamedImages":
        if isinstance(i, Tensor) and i.ndim == 0:
            i = int(i)
        if isinstance(i, int):
            return self.index.decode(int(self.rows[i]), self.size, self.scaled)
        return StreamedImages(self.index, self.rows[torch.as_tensor(i)], self.size, self.scaled)

    def lazy(self, i: int) -> "Tensor | EncodedImage":
        """Image ``i`` for a transform that decodes what it needs: its file undecoded
        (:class:`~vitlab.data.decode.EncodedImage`) where the images are streamed at their own sizes and
        ``scaled`` decoding is on, else decoded (``self[i]``)."""
        if self.scaled and self.size is None:
            encoded = self.index.encoded_image(int(self.rows[i]))
            if encoded is not None:
                return encoded
        return self[i]


def multi_label_reason(index: SplitIndex) -> str:
    """Why ``data.multi_label=auto`` took ``index`` (multi-hot) as multi-label, in words: how many of its images
    show other than one class, the first of them with its classes."""
    counts = index.labels.sum(1)
    other = (counts != 1).nonzero().flatten()
    if not len(other):
        return f"every image of {index.where} has one class, and data.multi_label=true asks for label sets"
    i = int(other[0])
    shown = [index.classes[k] for k in index.labels[i].nonzero().flatten().tolist()]
    return (f"{len(other):,} of the {len(counts):,} images of {index.where} show other than one class (the first: "
            f"{index.key(i)!r} with {shown})")
