"""Shards streamed to training and evaluation (WebDataset tar files, :mod:`.shards`; the data files of
a Hugging Face data set read with ``streaming=True``, :func:`~vitlab.data.hf.index_hf_stream`): every sample once an epoch across processes x
DataLoader workers, the same number of batches on every process, and an epoch that resumes at any
batch, to the sample.

How an epoch is cut (:class:`ShardStream`): the shards' sample ranges are put in an order fixed by
(seed, epoch), the same on every process, and laid end to end; this sequence is cut into
``processes x workers`` contiguous, equal parts (*readers*), each a whole number of batches, so a
reader's part may begin or end inside a shard (7 shards on 2 processes x 2 workers is fine). What is
left over, fewer than ``readers x batch`` samples, is not used that epoch (as ``drop_last`` drops a
partial batch; other samples each epoch, as the order changes). Each reader reads its part in order,
shuffles it through a buffer seeded by (seed, epoch, reader), and decodes and augments each sample
seeded by (seed, epoch, sample), as the map-style loaders do.

Resuming at batch S of an epoch: a DataLoader takes its workers' batches in turn (batch j from worker
``j mod W``), so the worker that would have given batch S is made to start: worker w plays reader
``(w + S) mod W`` of its process, replays its shuffle buffer's draws on sample ids up to the samples of
the batches it had given, and reads only what the buffer still holds (passed over undecoded from the
earliest of them) and what follows. Evaluation reads every sample once, in listing order, cut into equal
parts without dropping any.
"""
from __future__ import annotations

import itertools
import random
from typing import Any, Iterator

import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchvision.transforms import v2

from ..errors import DataError
from ..seeding import process_seed
from .images import seeded_transform
from .shards import ShardIndex

__all__ = ["Segment", "spread", "ShardStream", "ShardLoader"]

Segment = tuple[int, int, int]  # (shard, first sample, end): a contiguous run of one shard's samples


def spread(total: int, counts: list[int]) -> list[int]:
    """``total`` samples taken from the heads of shards holding ``counts``, in proportion to their sizes
    (the first shards take the remainder): how validation images are held out of a sharded training
    split, and how ``data.train_subset`` / ``test_subset`` pick theirs, without reading the rest."""
    n = sum(counts)
    total = min(total, n)
    take = [total * c // n for c in counts]
    for i in range(len(counts)):
        if sum(take) == total:
            break
        if take[i] < counts[i]:
            take[i] += 1
    return take


class ShardStream(IterableDataset):
    """The samples of ``segments`` of the shards of ``index``, read by this process's DataLoader workers
    (module docstring). Yields ``(image, label)``: the image decoded (uint8, at ``size`` or with ``size``
    None at its own), then ``transform``-ed.

    Args:
        index: The listed shards.
        segments: The sample ranges to read, ``(shard, start, stop)``.
        transform: Applied to each image (seeded per sample in training).
        batch_size: This process's batch.
        train: Shuffle, cut equal parts of whole batches, drop the rest; else every sample once, in order.
        num_processes, process_index: This process among the run's.
        num_workers: The DataLoader workers each process reads with (0: the process itself).
        shuffle_buffer: Samples each reader shuffles among (training).

    Raises:
        DataError: one line, when training has fewer shards than readers or too few samples for one
            batch on each.
    """

    def __init__(self, index: ShardIndex, segments: list[Segment], transform: v2.Transform | None, batch_size: int,
                 train: bool, size: tuple[int, int] | None = None, seed: int = 0, num_processes: int = 1,
                 process_index: int = 0, num_workers: int = 0, shuffle_buffer: int = 1000) -> None:
        self.read, self.decode, self.labels, self.label = index.read, index.decode, index.labels, index.label
        self.offsets = [0, *itertools.accumulate(index.counts)][:-1]  # each shard's first sample id
        self.segments, self.transform, self.size = [s for s in segments if s[2] > s[1]], transform, size
        self.batch_size, self.train, self.seed = batch_size, train, seed
        self.num_processes, self.process_index = num_processes, process_index
        self.workers, self.shuffle_buffer = max(num_workers, 1), shuffle_buffer
        self.epoch, self.skip_batches = 0, 0
        self.total = sum(stop - start for _, start, stop in self.segments)
        readers = num_processes * self.workers
        if train and len(self.segments) < readers:
            raise DataError(f"{index.where}: {len(self.segments)} shard(s) for {num_processes} process(es) x "
                            f"{self.workers} DataLoader worker(s) = {readers} readers; give each reader a shard of its "
                            f"own: lower data.num_workers, or write smaller shards (vitlab shards --shard-size)")
        self.per_reader = self.total // (readers * batch_size) * batch_size if train else 0
        if train and self.per_reader == 0:
            raise DataError(f"{index.where}: {self.total} training samples are fewer than one batch of {batch_size} "
                            f"for each of the {readers} readers (processes x DataLoader workers); lower "
                            f"train.batch_size or data.num_workers")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def samples_per_epoch(self) -> int:
        """Samples an epoch uses over all processes (training: a whole number of batches per reader)."""
        return self.per_reader * self.num_processes * self.workers if self.train else self.total

    def _range(self, reader: int) -> tuple[int, int]:
        if self.train:
            return reader * self.per_reader, (reader + 1) * self.per_reader
        readers = self.num_processes * self.workers
        return reader * self.total // readers, (reader + 1) * self.total // readers

    def __len__(self) -> int:
        """This process's batches in an epoch."""
        if self.train:
            return self.workers * self.per_reader // self.batch_size
        first = self.process_index * self.workers
        return sum(-(-(b - a) // self.batch_size) for a, b in map(self._range, range(first, first + self.workers)))

    def _plan(self) -> list[Segment]:
        """The epoch's order of segments: fixed by (seed, epoch) in training, the listing's otherwise."""
        if not self.train:
            return self.segments
        g = torch.Generator().manual_seed(process_seed(self.seed, 0, self.epoch, "shards"))
        return [self.segments[i] for i in torch.randperm(len(self.segments), generator=g).tolist()]

    def _pieces(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """``(shard, a, b)``: the shards' samples ``a`` to ``b`` at positions ``start`` to ``stop`` of the
        epoch's sequence, in order."""
        position = 0
        for shard, first, end in self._plan():
            lo, hi = max(start, position), min(stop, position + end - first)
            if lo < hi:
                yield shard, first + lo - position, first + hi - position
            position += end - first
            if position >= stop:
                break

    def _ids(self, start: int, stop: int) -> list[int]:
        """The sample ids at positions ``start`` to ``stop``, nothing read."""
        return [i for shard, a, b in self._pieces(start, stop) for i in range(self.offsets[shard] + a,
                                                                             self.offsets[shard] + b)]

    def _read(self, start: int, stop: int) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(sample id, raw sample)`` for positions ``start`` to ``stop`` of the epoch's sequence."""
        for shard, a, b in self._pieces(start, stop):
            # The reader first: read to its shard's end, it checks there is no sample beyond the count listed.
            yield from ((sid, sample) for sample, sid in zip(self.read(shard, a, b),
                                                             range(self.offsets[shard] + a, self.offsets[shard] + b)))

    def _shuffled_from(self, reader: int, passed: int) -> Iterator[tuple[int, dict[str, Any]]]:
        """A training reader's samples through its shuffle buffer (seeded by (seed, epoch, reader)), from
        the ``passed``-th on. The buffer's draws depend on the samples' number only, so they are replayed
        on sample ids (nothing read) up to ``passed``; then only the samples still in the buffer are read
        again (from the earliest of them on, passed over undecoded) and the rest of the part after them."""
        start, stop = self._range(reader)
        rng = random.Random(process_seed(self.seed, 0, self.epoch, "shards", reader + 1))
        if passed == 0:
            return _shuffle(self._read(start, stop), self.shuffle_buffer, rng, [])
        ids = self._ids(start, stop)
        taken = iter(ids)
        held: list[int] = []
        for _ in itertools.islice(_shuffle(taken, self.shuffle_buffer, rng, held), passed):
            pass
        consumed = len(ids) - sum(1 for _ in taken)  # read from the part so far
        position = {sid: p for p, sid in enumerate(ids[:consumed])}
        earliest = min((position[sid] for sid in held), default=consumed)
        wanted = set(held)
        rest = self._read(start + earliest, stop)  # one pass: what the buffer held, then what follows
        again = {sid: sample for sid, sample in itertools.islice(rest, consumed - earliest) if sid in wanted}
        buffer = [(sid, again[sid]) for sid in held]
        return _shuffle(rest, self.shuffle_buffer, rng, buffer)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if workers != self.workers:
            raise RuntimeError(f"ShardStream built for {self.workers} workers is read by {workers}")
        skip = self.skip_batches if self.train else 0
        role = (worker + skip) % workers  # the worker that gives the next batch plays the reader that would have
        passed = (skip - role + workers - 1) // workers * self.batch_size  # samples of its batches already given
        reader = self.process_index * workers + role
        samples = self._shuffled_from(reader, passed) if self.train else self._read(*self._range(reader))
        for sid, sample in samples:
            image = self.decode(sample, self.size)
            if self.transform is not None:
                image = (seeded_transform(self.transform, image, self.seed, self.epoch, sid) if self.train
                         else self.transform(image))
            yield image, (self.labels[sid] if self.labels is not None else torch.tensor(self.label(sample)))


def _shuffle(items: Iterator[Any], size: int, rng: random.Random, buffer: list[Any]) -> Iterator[Any]:
    """A shuffle buffer (webdataset's): ``buffer`` filled to ``size`` items, then each item read goes in
    and one drawn by ``rng`` comes out; the rest drawn at the end. ``buffer`` is the caller's list, so
    a shuffle can be stopped and continued from its state (:meth:`ShardStream._shuffled_from`)."""
    for item in items:
        buffer.append(item)
        if len(buffer) >= size:
            yield _pick(buffer, rng)
    while buffer:
        yield _pick(buffer, rng)


def _pick(buffer: list[Any], rng: random.Random) -> Any:
    k = rng.randrange(len(buffer))
    buffer[k], buffer[-1] = buffer[-1], buffer[k]
    return buffer.pop()


class ShardLoader:
    """A :class:`ShardStream` batched by a ``DataLoader`` of this process's ``num_workers`` workers (new
    ones each epoch), the batches moved to ``device``: what a prepared DataLoader is to map-style data.
    Batches of evaluation are every sample once over the processes (``exact_shards``)."""

    exact_shards = True

    def __init__(self, stream: ShardStream, num_workers: int, device: torch.device | str = "cpu",
                 pin_memory: bool = False) -> None:
        self.stream, self.num_workers, self.device, self.pin_memory = stream, num_workers, device, pin_memory
        self.worker_init_fn: Any = None  # vitlab.preemption.ignore_in_workers sets it

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.stream)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self.batches_from(0)

    def batches_from(self, start: int) -> Iterator[tuple[Tensor, Tensor]]:
        """The epoch's batches from batch ``start`` on, equal to those of a whole epoch."""
        self.stream.skip_batches = start
        loader = DataLoader(self.stream, batch_size=self.stream.batch_size, num_workers=self.num_workers,
                            worker_init_fn=self.worker_init_fn, pin_memory=self.pin_memory)
        for images, labels in loader:
            yield images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
