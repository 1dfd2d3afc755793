"""The splits ``vitlab inspect`` reads, listed with the data's own classes, and their features.

A split is listed as training lists it (the same ``data.*`` keys; a streamed one as its shards), its labels
numbered by the first split's classes; nothing is decoded. Its features are :func:`~vitlab.prediction.embed_images`'
(eval's preprocessing, a batch at a time, a stopped job continued) in ``<output>/features/<split>.npy``, reused
by a later inspection of the same images (where they are, their sizes and times) with the same weights (a record
beside them says which)."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..data.shards import ShardIndex, is_local
from ..data.split import SplitIndex
from ..errors import ConfigError, DataError
from ..inference.files import job_record
from ..runtime import autocast_dtype, default_device

__all__ = ["Split", "list_splits", "split_features", "describe"]


@dataclass
class Split:
    """One listed split: its name, its images' names (a file's path under the split, ``<shard>:<position>``), its
    labels (class indices ``(N,)`` or multi-hot ``(N, K)``), its listing (for reading images back), and where each
    image's file is, where it has one (else None)."""

    name: str
    names: list[str]
    labels: Tensor
    index: SplitIndex | ShardIndex
    files: list[Path] | None

    def __len__(self) -> int:
        return len(self.names)


def _shard_labels(index: ShardIndex) -> Tensor:
    """A shard listing's labels: from its index, or read with the samples (one pass, nothing decoded)."""
    if index.labels is not None:
        return index.labels
    labels = [index.label(sample) for shard, count in enumerate(index.counts) for sample in index.read(shard, 0, count)]
    return torch.stack([torch.as_tensor(v) for v in labels]) if index.multi_label else torch.tensor(labels)


def list_splits(keys: list[str], splits: list[str], upright: bool) -> tuple[list[Split], list[str], bool]:
    """Every split of ``splits`` of the data set the ``data.*`` ``keys`` name, listed (nothing decoded), the first
    split's classes numbering them all: the splits, the classes, whether the labels are label sets."""
    from ..config import load_config
    from ..data.sources import index_split
    from ..tasks.image_data import index_stream, streamed_in_shards

    bad = [k for k in keys if not k.startswith("data.")]
    if bad:
        raise ConfigError(f"{bad[0]!r}: vitlab inspect takes data.* keys (the data set to read), as training does")
    given = any(k.startswith("data.download=") for k in keys)
    d = load_config(None, keys if given else [*keys, "data.download=false"]).data
    d.exif_transpose = upright
    listed: list[Split] = []
    classes: list[str] | None = None
    multi_label = None if d.multi_label == "auto" else d.multi_label  # then every split as the first holds its labels
    for name in splits:
        if streamed_in_shards(d):
            index = index_stream(d, name, classes)
            labels = _shard_labels(index)
            names = [f"{Path(url).name}:{i}" for url, count in zip(index.urls, index.counts) for i in range(count)]
            files = None
        else:
            index = index_split(d.dataset, d.root, name, download=d.download, image_key=d.image_key,
                                label_key=d.label_key, classes=classes, exif_transpose=upright,
                                multi_label=multi_label)
            labels, names = index.labels, [index.key(i) for i in range(len(index))]
            files = [index.path(i) for i in range(len(index))] if index.path is not None else None
        classes = classes or list(index.classes)
        multi_label = labels.dim() == 2
        listed.append(Split(name, names, labels, index, files))
    return listed, list(classes or []), bool(listed and listed[0].labels.dim() == 2)


def _listing_digest(split: Split) -> str:
    """What the split's images are: their names, and where each file is and what it holds (its resolved path, size
    and time of change; a shard's, for shards), or where the data set is (a Hugging Face split). The same names under
    another ``data.root``, or a file changed since, give another digest."""
    h = hashlib.sha256("\n".join(split.names).encode())
    files = split.files if split.files is not None else [Path(u) for u in getattr(split.index, "urls", [])
                                                         if is_local(u)]
    for f in files:
        stat = Path(f).stat()
        h.update(f"\n{Path(f).resolve()}\t{stat.st_size}\t{stat.st_mtime_ns}".encode())
    h.update(f"\n{getattr(split.index, 'where', '')}".encode())
    return h.hexdigest()


def split_features(model: nn.Module, split: Split, folder: Path, batch_size: int, num_workers: int,
                   precision: str) -> tuple[np.ndarray, np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """``split``'s features, float32 ``(N, E)`` (a row of NaN for an image that cannot be read), its images'
    32 x 32 thumbnails, uint8 ``(N, 3, 32, 32)`` (:func:`~vitlab.inspection.duplicates.thumbnails` of each image as
    eval shows it), and what its pixels alone say (:func:`~vitlab.inspection.pixels.pixel_issues`), computed into
    ``folder/<split>.npy``, ``<split>.thumbnails.npy`` and ``<split>.pixels.npz``, or read from there when an earlier
    inspection computed them from the same images with the same weights and precision."""
    from ..prediction import embed_images
    from .pixels import pixel_issues

    out, thumbs = folder / f"{split.name}.npy", folder / f"{split.name}.thumbnails.npy"
    pixels, record = folder / f"{split.name}.pixels.npz", folder / f"{split.name}.job.json"
    dtype = autocast_dtype(model, precision, default_device())
    job = {**job_record(model, 1, "none", dtype, embed=True), "listing": _listing_digest(split)}
    if all(f.is_file() for f in (out, thumbs, pixels, record)) and json.loads(record.read_text()) == job:
        return np.load(out, mmap_mode="r"), np.load(thumbs, mmap_mode="r"), _read_pixels(pixels)
    folder.mkdir(parents=True, exist_ok=True)
    for done in (record, out, thumbs, pixels):
        done.unlink(missing_ok=True)
    embed_images(model, [], out, batch_size, num_workers, data=split.index, precision=precision)
    _write_thumbnails(model, split, thumbs, batch_size, num_workers)
    found = pixel_issues(split)
    np.savez(pixels, **{f"{kind}.{part}": a for kind, arrays in found.items() for part, a in zip(("flag", "score"),
                                                                                                  arrays)})
    record.write_text(json.dumps(job, indent=1))
    features = np.load(out, mmap_mode="r")
    if len(features) != len(split):
        raise DataError(f"{out}: {len(features)} rows for the {len(split)} images of split {split.name!r}")
    return features, np.load(thumbs, mmap_mode="r"), found


def _read_pixels(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    with np.load(path) as stored:
        kinds = dict.fromkeys(name.rsplit(".", 1)[0] for name in stored.files)
        return {kind: (stored[f"{kind}.flag"], stored[f"{kind}.score"]) for kind in kinds}


def _write_thumbnails(model: nn.Module, split: Split, out: Path, batch_size: int, num_workers: int) -> None:
    """Every image's thumbnail into ``out`` (a memory-mapped array, a batch at a time; zeros where unreadable)."""
    from torch.utils.data import DataLoader

    from ..prediction import image_dataset
    from ..progress import Progress
    from .duplicates import THUMBNAIL, thumbnails

    tmp = out.with_name(out.name + ".tmp")
    array = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=(len(split), 3, THUMBNAIL, THUMBNAIL))
    images = image_dataset(model, split.index, split.names, list(range(len(split))), batch_size, "none")
    done = 0
    with Progress(total=len(split), desc=f"thumbnails of {len(split):,} images", unit="images", interval=10.0) as bar:
        for batch, _ in DataLoader(images, batch_size=batch_size, num_workers=num_workers):
            array[done:done + len(batch)] = thumbnails(batch).numpy()
            done += len(batch)
            bar.update(len(batch))
    array.flush()
    del array
    os.replace(tmp, out)


def describe(split: Split, classes: list[str]) -> dict[str, Any]:
    """The split's class balance: images, and each class's count (images showing it, multi-label)."""
    counts = split.labels.sum(0) if split.labels.dim() == 2 else torch.bincount(split.labels, minlength=len(classes))
    return {"images": len(split), "classes": {c: int(n) for c, n in zip(classes, counts.tolist())}}
