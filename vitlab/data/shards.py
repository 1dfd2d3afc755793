"""WebDataset shards (``data.dataset=wds``): tar files of samples, each an image (``jpg``, ``jpeg``,
``png`` or ``webp``) and an integer class ``cls`` under one key (multi-label data: ``labels``, the indices of
its classes separated by spaces, none for an image of no class), the format large image sets are kept in
(timm's ``wds/``, OpenCLIP, DataComp). Listed here (:func:`index_shards`: the shards, the samples each
holds, their labels), read a sample at a time (:func:`read_samples`), and written from an ImageFolder
or a Hugging Face data set (:func:`write_shards`, ``vitlab shards``).

Shards are read with the ``webdataset`` package (``pip install 'vitlab[wds]'``), imported only here:
local files, ``http(s)://`` URLs and ``pipe:`` commands (object stores: ``pipe:aws s3 cp s3://b/x.tar -``).
"""
from __future__ import annotations

import functools
import glob
import json
import random
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor

from ..errors import DataError
from ..files import replaced
from ..progress import Progress
from .decode import EncodedImage, decode_image

__all__ = ["IMAGE_SUFFIXES", "ShardIndex", "expand_shards", "index_shards", "read_samples", "decode_sample",
           "write_shards", "read_classes", "is_local"]

IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp")
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta: members it never yields
_REMOTE = ("pipe:", "http://", "https://")  # shards webdataset opens as streams, not local files


def is_local(url: str) -> bool:
    """Whether a shard's URL is a file on this machine (else a stream webdataset opens)."""
    return not url.startswith(_REMOTE)


def _webdataset() -> Any:
    try:
        import webdataset
    except ImportError:
        raise DataError("data.dataset=wds reads shards with the webdataset package: pip install 'vitlab[wds]'") from None
    return webdataset


def _is_pattern(split: str) -> bool:
    return any(c in split for c in "{*/?") or split.endswith(".tar") or split.startswith(_REMOTE)


def expand_shards(root: str | Path, split: str) -> list[str]:
    """The shards of ``split``: ``root/<split>-*.tar`` sorted, or ``split`` itself as a pattern (braces
    ``train-{000000..001023}.tar``, a glob, a ``pipe:`` command or a URL; relative paths under ``root``).

    Raises:
        DataError: one line, if the pattern matches no file.
    """
    from braceexpand import braceexpand  # a dependency of webdataset

    _webdataset()
    pattern = split if _is_pattern(split) else f"{split}-*.tar"
    urls: list[str] = []
    for one in braceexpand(pattern):
        if one.startswith(_REMOTE):
            urls.append(one)
            continue
        path = Path(one).expanduser()
        path = path if path.is_absolute() else Path(root).expanduser() / path
        found = sorted(glob.glob(str(path))) if any(c in one for c in "*?[") else ([str(path)] if path.is_file() else [])
        urls.extend(found)
    if not urls:
        remote = pattern.startswith(_REMOTE) or Path(pattern).expanduser().is_absolute()
        shown = pattern if remote else str(Path(root).expanduser() / pattern)
        raise DataError(f"no WebDataset shards match {shown!r}; data.dataset=wds takes data.root=<dir of "
                        f"<split>-*.tar> or data.train_split/test_split as shard patterns (dir/train-{{0000..0099}}.tar)")
    return urls


@dataclass
class ShardIndex:
    """One split's shards, listed: each shard's URL and sample count, every sample's label.

    Attributes:
        urls: The shards, in listing order.
        counts: Samples in each shard.
        labels: int64 ``(N,)``, every sample's class in listing order (shard by shard), or multi-hot bool
            ``(N, K)`` for multi-label shards; None when the labels are read with the samples (``label``).
        classes: The class names ``cls`` indexes.
        where: The split in words, for messages.
        read: ``read(shard, start, stop)`` -> the raw samples ``start`` to ``stop`` of a shard, in order (those
            before ``start`` read past, not decoded); picklable, for DataLoader workers.
        decode: ``decode(sample, size)`` -> a raw sample's image as uint8 RGB ``(3, H, W)`` (at ``size``, if given).
        label: ``label(sample)`` -> a raw sample's class (multi-label: its multi-hot row), where ``labels`` is None.
        multi_label: Whether the samples carry label sets (``labels``) rather than a class (``cls``).
    """

    urls: list[str]
    counts: list[int]
    labels: Tensor | None
    classes: list[str]
    where: str
    read: Callable[[int, int, int], Iterator[dict[str, Any]]]
    decode: Callable[[dict[str, Any], "tuple[int, int] | None"], Tensor]
    label: Callable[[dict[str, Any]], Any] | None = None
    multi_label: bool = False

    def __len__(self) -> int:
        return sum(self.counts)


def _members(url: str) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """``(name, read)`` for each regular file of a tar shard: a local file by seeking over the data
    (only what is read is read), anything else as webdataset opens it (a stream)."""
    _webdataset()
    from webdataset.gopen import gopen

    local = not url.startswith(_REMOTE)
    stream = None if local else gopen(url)
    with (tarfile.open(url) if local else tarfile.open(fileobj=stream, mode="r|*")) as tar:
        for member in tar:
            if member.isreg():
                yield member.name, lambda m=member: tar.extractfile(m).read()
            tar.members = []  # a stream keeps no index


def _scan(url: str) -> list[int | list[int]]:
    """The labels of a shard's samples, grouped as webdataset groups its members (consecutive files of
    one key), checked: every sample has an image and an integer ``cls`` (or a label set ``labels``)."""
    wds = _webdataset()
    labels: list[int | list[int]] = []
    key: str | None = None
    suffixes: dict[str, bytes] = {}

    def close() -> None:
        if key is None:
            return
        if not any(s in suffixes for s in IMAGE_SUFFIXES):
            raise DataError(f"sample {key!r} of shard {url!r} has no image ({', '.join(IMAGE_SUFFIXES)}); its "
                            f"files: {sorted(suffixes)}")
        if "labels" in suffixes:
            labels.append(_label_set_of(suffixes["labels"], key, url))
            return
        if "cls" not in suffixes:
            raise DataError(f"sample {key!r} of shard {url!r} has no 'cls' (an integer class); its files: "
                            f"{sorted(suffixes)}. Write shards with 'vitlab shards SRC OUT', which adds it")
        labels.append(_class_of(suffixes["cls"], key, url))

    try:
        for name, read in _members(url):
            if ("/" not in name and name.startswith("__") and name.endswith("__")) or _META.match(name):
                continue
            prefix, suffix = wds.tariterators.base_plus_ext(name)
            if prefix is None:
                continue
            if prefix != key:
                close()
                key, suffixes = prefix, {}
            suffix = suffix.lower()
            suffixes[suffix] = read() if suffix in ("cls", "labels") else b""  # only the class is read
        close()
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"cannot read shard {url!r}: {e}") from None
    return labels


def _class_of(data: bytes, key: str, url: str) -> int:
    try:
        value = int(data.decode().strip())
    except ValueError:
        raise DataError(f"sample {key!r} of shard {url!r}: 'cls' is {data[:20]!r}, not an integer class") from None
    if value < 0:
        raise DataError(f"sample {key!r} of shard {url!r}: 'cls' is {value}, not a class index (0, 1, ...)")
    return value


def _label_set_of(data: bytes, key: str, url: str) -> list[int]:
    """A multi-label sample's ``labels``: class indices separated by spaces (none: an image of no class)."""
    try:
        values = [int(v) for v in data.decode().split()]
    except ValueError:
        raise DataError(f"sample {key!r} of shard {url!r}: 'labels' is {data[:40]!r}, not class indices separated "
                        f"by spaces") from None
    if any(v < 0 for v in values) or len(set(values)) != len(values):
        raise DataError(f"sample {key!r} of shard {url!r}: 'labels' is {values}; give each class index (0, 1, ...) once")
    return values


def _multi_hot(values: list[int], num_classes: int, key: Any = None, url: Any = None) -> list[bool]:
    if values and max(values) >= num_classes:
        raise DataError(f"sample {key!r} of shard {url!r} has 'labels' {values}, but there are {num_classes} classes")
    row = [False] * num_classes
    for v in values:
        row[v] = True
    return row


def read_classes(path: Path) -> list[str]:
    """A ``classes.txt``: one name a line, line i naming class i, each name as written (a class folder
    ``'bird '`` keeps its space, so a model trained on shards evaluates on the folder); blank lines skipped."""
    return [line for line in path.read_text().splitlines() if line.strip()]


def _classes_file(root: str | Path, urls: list[str]) -> list[str] | None:
    """``classes.txt`` (:func:`read_classes`) beside the shards or in ``root``."""
    places = [Path(root).expanduser()] + [Path(u).parent for u in urls[:1] if not u.startswith(_REMOTE)]
    for place in places:
        f = place / "classes.txt"
        if f.is_file():
            return read_classes(f)
    return None


INDEX_KIND = "wids-shard-index-v1"  # webdataset's wids index: {"shardlist": [{"url", "nsamples", "filesize"}]}


def _index_file(urls: list[str]) -> Path | None:
    """The index ``<prefix>.json`` beside local shards ``<prefix>-NNNNNN.tar`` (``vitlab shards`` writes it)."""
    if not urls or urls[0].startswith(_REMOTE):
        return None
    first = Path(urls[0])
    return first.with_name(first.name.rsplit("-", 1)[0] + ".json") if "-" in first.name else None


def _indexed_counts(urls: list[str], path: Path | None) -> list[int] | None:
    """Each shard's sample count from its wids index at ``path``, if it lists every shard at its present
    size and no shard was written after it (a shard rewritten since, even at its old size, as tar's 10 KiB
    records allow, is listed again by reading it)."""
    if path is None or not path.is_file():
        return None
    try:
        index = json.loads(path.read_text())
        entries = {e["url"]: e for e in index["shardlist"]} if index.get("__kind__") == INDEX_KIND else {}
    except (ValueError, KeyError, TypeError):
        return None
    counts, written = [], path.stat().st_mtime_ns
    for url in urls:
        entry, stat = entries.get(Path(url).name), Path(url).stat()
        if entry is None or entry.get("filesize") != stat.st_size or stat.st_mtime_ns > written:
            return None
        counts.append(int(entry["nsamples"]))
    return counts


def write_index(paths: list[Path], counts: list[int], out: Path) -> None:
    """Write ``out``, the wids index of local shards ``paths`` holding ``counts`` samples."""
    shardlist = [{"url": p.name, "nsamples": n, "filesize": p.stat().st_size} for p, n in zip(paths, counts)]
    with replaced(out) as tmp:
        tmp.write_text(json.dumps({"__kind__": INDEX_KIND, "wids_version": 1, "shardlist": shardlist}, indent=1))


def index_shards(root: str | Path, split: str, classes: list[str] | None = None,
                 exif_transpose: bool = True) -> ShardIndex:
    """List the shards of ``split`` (:func:`expand_shards`). With a wids index beside local shards
    (``<split>.json``, as ``vitlab shards`` writes) and class names, the counts are read from it and
    each label from its sample's ``cls`` when it is read. Otherwise every sample's label is read now,
    without decoding an image (local shards by seeking over the images; a ``pipe:`` or URL shard is
    read through once), by process 0 of a run alone (the training task shares its listing). Class names come from ``classes`` (the
    training split's), else ``classes.txt``, else ``'0'`` .. ``'K-1'`` for the largest ``cls`` K-1.
    Images are decoded upright by their EXIF orientation unless ``exif_transpose=False``.

    Raises:
        DataError: one line, for no shards, a sample without an image or ``cls``, a ``cls`` outside the
            classes, an unreadable shard (listed from an index: when the sample is read).
    """
    urls = expand_shards(root, split)
    where = f"shards {split!r}" + (f" of data.root={str(root)!r}" if not _is_pattern(split) else "")
    index_file = _index_file(urls)
    counts = _indexed_counts(urls, index_file)
    names = classes if classes is not None else _classes_file(root, urls)
    if counts is not None and names is not None:
        if sum(counts) == 0:
            raise DataError(f"{where} hold no samples")
        first = next(read_samples(urls[0], 0, 1), {})  # label sets or classes: the first sample says
        return ShardIndex(urls, counts, None, list(names), f"{where} (listed by {index_file.name})",
                          read=functools.partial(_read_shard, tuple(urls), tuple(counts), index_file.name),
                          decode=functools.partial(decode_sample, exif_transpose=exif_transpose),
                          label=functools.partial(_sample_class, len(names)), multi_label="labels" in first)
    per_shard: list[list[int]] = []
    with Progress(urls, total=len(urls), desc=f"listing {len(urls)} shards ({where})", unit="shards",
                  interval=10.0) as shards:
        for url in shards:
            per_shard.append(_scan(url))
    values = [c for shard in per_shard for c in shard]
    if not values:
        raise DataError(f"{where} hold no samples")
    multi = isinstance(values[0], list)
    if any(isinstance(v, list) != multi for v in values):
        raise DataError(f"{where} mix samples with a class ('cls') and samples with label sets ('labels'); write "
                        f"each split one way")
    largest = max((max(v, default=-1) for v in values), default=-1) if multi else max(values)
    if names is None:
        names = [str(i) for i in range(largest + 1)]
    if largest >= len(names):
        raise DataError(f"{where} have {'labels' if multi else 'cls'} {largest}, but there are {len(names)} classes "
                        f"({'the training split' if classes is not None else 'classes.txt'}: {names[:10]}...)")
    if multi:
        labels = torch.zeros(len(values), len(names), dtype=torch.bool)
        for i, v in enumerate(values):
            labels[i, v] = True
    else:
        labels = torch.tensor(values)
    counts = tuple(len(s) for s in per_shard)
    return ShardIndex(urls, list(counts), labels, list(names), where,
                      read=functools.partial(_read_shard, tuple(urls), counts, ""),
                      decode=functools.partial(decode_sample, exif_transpose=exif_transpose), multi_label=multi)


def _read_shard(urls: tuple[str, ...], counts: tuple[int, ...], index_name: str, shard: int, start: int,
                stop: int) -> Iterator[dict[str, Any]]:
    """Samples ``start`` to ``stop`` of ``shard``, checked against the count it was listed with: a shard
    that holds fewer samples, or more when read to its end, stops the run in one line (never a short batch)."""
    url, listed = urls[shard], counts[shard]
    position = start
    for sample in read_samples(url, start, stop + 1 if stop >= listed else stop):
        if position >= listed:
            raise _changed(url, f"more than {listed}", listed, index_name)
        yield sample
        position += 1
    if position < stop:
        raise _changed(url, str(position), listed, index_name)


def _changed(url: str, holds: str, listed: int, index_name: str) -> DataError:
    again = (f"remove its index {index_name} so that the shards are listed by reading them" if index_name else
             "start the run again so that it is listed again")
    return DataError(f"shard {url!r} holds {holds} samples, but it was listed with {listed}: it changed after it "
                     f"was listed; restore it, or {again}")


def _sample_class(num_classes: int, sample: dict[str, Any]) -> int | list[bool]:
    """A sample's ``cls`` (or the multi-hot row of its ``labels``), checked against the ``num_classes`` classes
    (shards listed by an index)."""
    key, url = sample.get("__key__"), sample.get("__url__")
    if "labels" in sample:
        return _multi_hot(_label_set_of(sample["labels"], key, url), num_classes, key, url)
    if "cls" not in sample:
        raise DataError(f"sample {key!r} of shard {url!r} has no 'cls' (an integer class); its files: "
                        f"{sorted(k for k in sample if not k.startswith('__'))}")
    value = _class_of(sample["cls"], key, url)
    if value >= num_classes:
        raise DataError(f"sample {key!r} of shard {url!r} has 'cls' {value}, but there are {num_classes} classes")
    return value


def read_samples(url: str, start: int = 0, stop: int | None = None) -> Iterator[dict[str, Any]]:
    """Samples ``start`` to ``stop`` of one shard, as webdataset yields them (a dict of raw bytes by
    suffix, with ``__key__``), in order; the ones before ``start`` are read past, not decoded."""
    wds = _webdataset()
    samples = wds.tariterators.tarfile_samples([{"url": url}])
    for position, sample in enumerate(samples):
        if stop is not None and position >= stop:
            break
        if position >= start:
            yield sample


def decode_sample(sample: dict[str, Any], size: tuple[int, int] | None = None, exif_transpose: bool = True,
                  lazy: bool = False) -> Tensor | EncodedImage:
    """A sample's image as uint8 RGB ``(3, H, W)``: at its own size (:func:`~vitlab.data.decode.decode_image`),
    or resized (PIL's bicubic) to ``size``, upright by its EXIF orientation unless ``exif_transpose=False``,
    as an ImageFolder's file would be; with ``lazy``, undecoded (an :class:`~vitlab.data.decode.EncodedImage`
    for a transform that decodes what it needs).

    Raises:
        DataError: naming the sample and its shard, if the image cannot be decoded.
    """
    data = next((sample[s] for s in IMAGE_SUFFIXES if s in sample), None)
    if data is None:  # listed by an index, a shard's samples are first seen here
        raise DataError(f"sample {sample.get('__key__')!r} of shard {sample.get('__url__')!r} has no image "
                        f"({', '.join(IMAGE_SUFFIXES)}); its files: {sorted(k for k in sample if not k.startswith('__'))}")
    where = f"{sample['__key__']!r} of shard {sample.get('__url__')!r}"
    return EncodedImage(data, where, exif_transpose) if lazy else decode_image(data, where, size, exif_transpose)


def write_shards(samples: Iterable[tuple[str, bytes, str, int | list[int]]], out: str | Path, split: str,
                 shard_size: int, total: int) -> list[Path]:
    """Write ``(key, encoded image, suffix, label)`` samples (``label`` a class, or a list of classes: written as
    ``labels``) as shards ``out/<split>-000000.tar``, ...,
    ``shard_size`` samples each, and their wids index ``out/<split>.json``; returns the shards' paths.
    Written as ``.tmp`` files and renamed when whole, so a shard that exists is complete."""
    wds = _webdataset()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    writer, written = None, 0
    with Progress(samples, total=total, desc=f"writing {split} shards", unit="images", interval=10.0) as bar:
        for n, (key, data, suffix, label) in enumerate(bar):
            written = n + 1
            if n % shard_size == 0:
                if writer is not None:
                    writer.close()
                    paths[-1].with_suffix(".tar.tmp").rename(paths[-1])
                paths.append(out / f"{split}-{len(paths):06d}.tar")
                writer = wds.TarWriter(str(paths[-1].with_suffix(".tar.tmp")))
            tag = {"labels": " ".join(map(str, label)).encode()} if isinstance(label, list) else \
                {"cls": str(label).encode()}
            writer.write({"__key__": key, suffix: data, **tag})
    if writer is not None:
        writer.close()
        paths[-1].with_suffix(".tar.tmp").rename(paths[-1])
        write_index(paths, [min(shard_size, written - i * shard_size) for i in range(len(paths))], out / f"{split}.json")
    return paths


def shuffled(n: int, seed: int) -> list[int]:
    """``range(n)`` in an order fixed by ``seed`` (the order :func:`write_shards` writes a split in, so
    each shard holds every class)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order
