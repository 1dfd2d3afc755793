"""``vitlab shards SRC OUT``: an ImageFolder or a Hugging Face data set written as WebDataset shards
(:func:`~vitlab.data.shards.write_shards`), so a user can stream what they have (``data.dataset=wds``).

Each image keeps its encoded bytes where it has them (a JPEG stays the same JPEG; formats other than
JPEG, PNG and WebP are written as PNG), each split in an order shuffled by ``seed`` (every shard then
holds every class), its integer class as ``cls``, the class names in ``OUT/classes.txt``.

``max_size`` (``--max-size N``) writes the data set once at a training resolution, as FFCV's
``max_resolution`` does: an image whose longer side is over N px is turned upright by its EXIF orientation,
resized (PIL's bicubic, antialiased) to a longer side of N and written as a JPEG of ``quality`` with
full-resolution chroma (4:4:4); one at most N px keeps its bytes. Every epoch then decodes what the model can use, not a 12-megapixel photo.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Iterator

from PIL import Image

from ..errors import DataError
from .shards import read_classes, shuffled, write_shards
from .sources import index_split
from .split import SplitIndex

__all__ = ["convert_to_shards"]

_SUFFIXES = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}


def _encoded(index: SplitIndex, i: int, max_size: int = 0, quality: int = 90) -> tuple[bytes, str]:
    """Sample ``i``'s image as it is stored (bytes, suffix), or as PNG when it has no such form here; larger
    than ``max_size`` (its longer side), upright, resized to it and as a JPEG of ``quality``."""
    if max_size:
        image = index.open(i)  # upright by its EXIF orientation, as the split reads it; RGB
        if max(image.size) > max_size:
            scale = max_size / max(image.size)
            size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
            buffer = io.BytesIO()
            # Full-resolution chroma (4:4:4): 4:2:0's halved colour cost 4.5 dB of the model's input on photos.
            image.resize(size, Image.BICUBIC).save(buffer, format="JPEG", quality=quality, subsampling=0)
            return buffer.getvalue(), "jpg"
    if index.encoded is not None:
        data = index.encoded(i)
        with Image.open(io.BytesIO(data)) as img:
            suffix = _SUFFIXES.get(img.format or "")
        if suffix is not None:
            return data, suffix
    buffer = io.BytesIO()
    index.open(i).save(buffer, format="PNG")
    return buffer.getvalue(), "png"


def _samples(index: SplitIndex, order: list[int], split: str, max_size: int = 0,
             quality: int = 90) -> Iterator[tuple[str, bytes, str, int]]:
    for i in order:
        data, suffix = _encoded(index, i, max_size, quality)
        label = index.labels[i]
        yield f"{split}_{i:08d}", data, suffix, label.nonzero().flatten().tolist() if label.ndim else int(label)


def convert_to_shards(src: str | Path, out: str | Path, splits: list[str], shard_size: int = 1000,
                      dataset: str = "", seed: int = 0, image_key: str = "", label_key: str = "",
                      max_size: int = 0, quality: int = 90) -> dict[str, list[Path]]:
    """Write each of ``splits`` of ``src`` as shards ``out/<split>-000000.tar``, ... of ``shard_size``
    samples, and ``out/classes.txt``; returns the shards written, by split. Every split is numbered by
    the first split's classes (the training split's, as training numbers them), or by the
    ``classes.txt`` already in ``out`` (a split written before), which is never overwritten.

    Args:
        src: An ImageFolder root (``src/<split>/<class>/<image>``), a ``DatasetDict.save_to_disk``
            directory, a folder of parquet files, or a Hub id.
        dataset: ``'imagefolder'``, ``'csv'`` or ``'hf'``; '' tells them apart (a folder with ``<split>.csv``
            is ``'csv'``, a saved dataset or parquet files ``'hf'``, a folder of class folders ``'imagefolder'``,
            anything else a Hub id). Label sets (multi-label) are written as ``labels``.
        max_size, quality: 0, or the longest side an image is written at (see the module), as a JPEG of
            ``quality`` (1-95, PIL's scale; 90 by default).

    Raises:
        DataError: one line, before anything is written, if a split is missing or ``out`` already
            holds shards of a split (nothing on disk is overwritten).
    """
    if shard_size < 1:
        raise DataError(f"--shard-size={shard_size}: give a number of samples >= 1")
    if max_size < 0 or not 1 <= quality <= 95:
        raise DataError(f"--max-size={max_size} --quality={quality}: give a size in px >= 1 (or 0: as stored) and a "
                        f"JPEG quality in 1..95")
    path = Path(src).expanduser()
    if not dataset and (path / f"{splits[0]}.csv").is_file():
        dataset = "csv"
    if not dataset:
        hf = not path.is_dir() or (path / "dataset_dict.json").is_file() or any(path.rglob("*.parquet"))
        dataset = "hf" if hf else "imagefolder"
    out = Path(out).expanduser()
    existing = [p.name for split in splits for p in sorted(out.glob(f"{split}-*.tar"))]
    if existing:
        raise DataError(f"{str(out)!r} already holds shards {existing[:3]}; write into an empty folder, or remove them")
    keys = dict(image_key=image_key, label_key=label_key)
    classes_file = out / "classes.txt"
    written = read_classes(classes_file) if classes_file.is_file() else None  # a split written before: its numbering
    indexes: dict[str, SplitIndex] = {}
    for split in splits:  # every split listed (labels checked) before anything is written
        first = next(iter(indexes.values()), None)
        indexes[split] = index_split(dataset, src, split, download=False,
                                     classes=first.classes if first else written, **keys)
    out.mkdir(parents=True, exist_ok=True)
    if written is None:
        classes_file.write_text("".join(f"{c}\n" for c in next(iter(indexes.values())).classes))
    return {split: write_shards(_samples(index, shuffled(len(index), seed), split, max_size, quality), out, split,
                                shard_size, len(index))
            for split, index in indexes.items()}
