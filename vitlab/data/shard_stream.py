"""Shards streamed to training and evaluation (WebDataset tar files, :mod:`.shards`; the data files of
a Hugging Face data set read with ``streaming=True``, :func:`~vitlab.data.hf.index_hf_stream`): every
sample once an epoch, the same global batches on any number of processes and DataLoader workers, and
an epoch that resumes at any step, to the sample, on another number of them.

Training follows the epoch's plan (:class:`~vitlab.data.plan.EpochPlan`: its order of shards, its
partitions, each read through a shuffle buffer, and which process and worker reads which partition).
Each worker yields, for every step, the chunks of its partitions' samples, decoded and augmented
(seeded by (seed, epoch, sample), as the map-style loaders do); :class:`ShardLoader` joins its
process's workers' chunks into the process's batch. Resuming at step S, each partition replays its
shuffle buffer's draws on sample ids (nothing read) up to its sample ``S * chunk``, then reads only
what the buffer still holds (passed over undecoded from the earliest of them) and what follows.

Evaluation reads every sample once, in listing order, cut into ``processes x workers`` equal parts
without dropping any.
"""
from __future__ import annotations

import itertools
import random
from typing import Any, Iterator

import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info
from torchvision.transforms import v2

from .images import seeded_sample
from .plan import EpochPlan, Segment, pieces, shuffle
from .shards import ShardIndex
from .workers import shutdown_workers

__all__ = ["Segment", "spread", "ShardStream", "ShardLoader"]


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
    (module docstring). Yields batches ``(images, labels)``: each image decoded (uint8, at ``size`` or
    with ``size`` None at its own), then ``transform``-ed; in training a worker's chunks of one step (the
    process's batch is its workers' chunks joined: :class:`ShardLoader`), in evaluation batches of
    ``batch_size`` (the last of each reader shorter).

    Args:
        index: The listed shards.
        segments: The sample ranges to read, ``(shard, start, stop)``.
        transform: Applied to each image (seeded per sample in training, :func:`~.images.seeded_sample`).
        batch_size: This process's batch (the global batch is ``batch_size * num_processes``).
        train: Follow the epoch's plan (shuffled, whole global batches); else every sample once, in order.
        num_processes, process_index: This process among the run's.
        num_workers: The DataLoader workers each process reads with (0: the process itself).
        shuffle_buffer: Samples each partition shuffles among (training).
        partitions: The plan's partition count, fixed when the run starts (0: ``num_processes`` x
            ``num_workers``, at least one a process).

    Raises:
        ConfigError, DataError: one line, when the plan cannot serve this layout or these shards
            (:meth:`~vitlab.data.plan.EpochPlan.check`).
    """

    def __init__(self, index: ShardIndex, segments: list[Segment], transform: v2.Transform | None, batch_size: int,
                 train: bool, size: tuple[int, int] | None = None, seed: int = 0, num_processes: int = 1,
                 process_index: int = 0, num_workers: int = 0, shuffle_buffer: int = 1000,
                 partitions: int = 0, lazy: bool = False) -> None:
        self.read, self.decode, self.labels, self.label = index.read, index.decode, index.labels, index.label
        self.multi_label, self.where = index.multi_label, index.where  # label sets: multi-hot rows for labels
        self.lazy = lazy and size is None  # the transform decodes each file itself (data.scaled_decode)
        self.segments, self.transform, self.size = [s for s in segments if s[2] > s[1]], transform, size
        self.batch_size, self.train, self.seed = batch_size, train, seed
        self.num_processes, self.process_index, self.num_workers = num_processes, process_index, num_workers
        offsets = tuple([0, *itertools.accumulate(index.counts)][:-1])  # each shard's first sample id
        self.plan = EpochPlan(tuple(self.segments), offsets, batch_size * num_processes,
                              partitions or num_processes * max(num_workers, 1), seed, shuffle_buffer)
        self.total = self.plan.total
        if train:
            self.plan.check(num_processes, index.where)
        # The epoch and the step to start at, in shared memory: workers that live across epochs read them.
        self._position = torch.zeros(2, dtype=torch.long).share_memory_()

    @property
    def epoch(self) -> int:
        return int(self._position[0])

    def set_epoch(self, epoch: int) -> None:
        self._position[0] = epoch

    def start_at(self, step: int) -> None:
        """Begin the next pass at step (batch) ``step`` of the epoch (training)."""
        self._position[1] = step

    @property
    def loader_workers(self) -> int:
        """The DataLoader workers this process reads with: in training at most one a partition it reads."""
        return self.plan.workers_for(self.num_processes, self.num_workers) if self.train else self.num_workers

    @property
    def samples_per_epoch(self) -> int:
        """Samples an epoch uses over all processes (training: whole global batches)."""
        return self.plan.steps * self.plan.batch_size if self.train else self.total

    def _eval_range(self, reader: int) -> tuple[int, int]:
        readers = self.num_processes * max(self.num_workers, 1)
        return reader * self.total // readers, (reader + 1) * self.total // readers

    def __len__(self) -> int:
        """This process's batches in an epoch."""
        if self.train:
            return self.plan.steps
        first = self.process_index * max(self.num_workers, 1)
        return sum(-(-(b - a) // self.batch_size) for a, b in map(self._eval_range,
                                                               range(first, first + max(self.num_workers, 1))))

    def _read(self, pieces: Iterator[Segment]) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(sample id, raw sample)`` for the shards' sample ranges ``pieces``, in order."""
        for shard, a, b in pieces:
            # The reader first: read to its shard's end, it checks there is no sample beyond the count listed.
            first = self.plan.offsets[shard]
            yield from ((sid, sample) for sample, sid in zip(self.read(shard, a, b), range(first + a, first + b)))

    def _shuffled_from(self, part: int, passed: int, epoch: int) -> Iterator[tuple[int, dict[str, Any]]]:
        """A partition's samples through its shuffle buffer (plan rule 4), from the ``passed``-th on. The
        buffer's draws depend on the samples' number only, so they are replayed on sample ids (nothing
        read) up to ``passed``; then only the samples still in the buffer are read again (from the
        earliest of them on, passed over undecoded) and the rest of the part after them."""
        plan = self.plan
        start, stop = plan.part_range(part)
        rng = random.Random(plan.shuffle_seed(epoch, part))
        if passed == 0:
            return shuffle(self._read(plan.pieces(epoch, start, stop)), plan.shuffle_buffer, rng, [])
        ids = plan.ids(epoch, start, stop)
        taken = iter(ids)
        held: list[int] = []
        for _ in itertools.islice(shuffle(taken, plan.shuffle_buffer, rng, held), passed):
            pass
        consumed = len(ids) - sum(1 for _ in taken)  # read from the part so far
        position = {sid: p for p, sid in enumerate(ids[:consumed])}
        earliest = min((position[sid] for sid in held), default=consumed)
        wanted = set(held)
        rest = self._read(plan.pieces(epoch, start + earliest, stop))  # what the buffer held, then what follows
        again = {sid: sample for sid, sample in itertools.islice(rest, consumed - earliest) if sid in wanted}
        return shuffle(rest, plan.shuffle_buffer, rng, [(sid, again[sid]) for sid in held])

    def _sample(self, sid: int, sample: dict[str, Any], epoch: int) -> tuple[Tensor, Tensor]:
        image = self.decode(sample, self.size, lazy=True) if self.lazy else self.decode(sample, self.size)
        if self.transform is not None:
            image = (seeded_sample(self.transform, image, self.seed, epoch, sid) if self.train
                     else self.transform(image))
        return image, (self.labels[sid] if self.labels is not None else torch.tensor(self.label(sample)))

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if workers != max(self.loader_workers, 1):
            raise RuntimeError(f"ShardStream built for {self.loader_workers} workers is read by {workers}")
        epoch, skip = (int(v) for v in self._position)  # read once: the pass's epoch and first step
        if not self.train:
            start, stop = self._eval_range(self.process_index * workers + worker)
            samples = self._read(pieces(self.segments, start, stop))  # the listing's order
            while batch := list(itertools.islice(samples, self.batch_size)):
                yield default_collate([self._sample(sid, sample, epoch) for sid, sample in batch])
            return
        plan = self.plan
        parts = plan.parts_of_worker(self.process_index, self.num_processes, worker, workers)
        readers = [(plan.chunk(r), self._shuffled_from(r, skip * plan.chunk(r), epoch)) for r in parts]
        for _ in range(skip, plan.steps):
            chunk = [self._sample(sid, sample, epoch) for size, reader in readers
                     for sid, sample in itertools.islice(reader, size)]
            yield default_collate(chunk)


class ShardLoader:
    """A :class:`ShardStream` read by a ``DataLoader`` of the stream's workers, which live for the whole run
    (forking new ones each epoch from a process with live threads can hang inside ``os.fork``), the
    batches moved to ``device``: what a prepared DataLoader is to map-style data. In training each of the
    process's batches is its workers' chunks of one step, joined in partition order; batches of
    evaluation are every sample once over the processes (``exact_shards``)."""

    exact_shards = True

    def __init__(self, stream: ShardStream, device: torch.device | str = "cpu", pin_memory: bool = False) -> None:
        self.stream, self.device, self.pin_memory = stream, device, pin_memory
        self.worker_init_fn: Any = None  # vitlab.preemption.ignore_in_workers sets it
        self._loader: DataLoader | None = None

    @property
    def num_workers(self) -> int:
        return self.stream.loader_workers

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.stream)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self.batches_from(0)

    def shutdown_workers(self) -> None:
        """End the workers now (:func:`~vitlab.data.workers.shutdown_workers`); the next epoch starts new ones."""
        if self._loader is not None:
            shutdown_workers(self._loader)

    def batches_from(self, start: int) -> Iterator[tuple[Tensor, Tensor]]:
        """The epoch's batches from batch ``start`` on, equal to those of a whole epoch."""
        self.stream.start_at(start)
        if self._loader is None:
            self._loader = DataLoader(self.stream, batch_size=None, num_workers=self.num_workers,
                                      worker_init_fn=self.worker_init_fn, pin_memory=self.pin_memory,
                                      persistent_workers=self.num_workers > 0)
        items = iter(self._loader)
        # A DataLoader takes its workers' items in turn: in training, a step's chunks from workers 0, 1, ...
        join = max(self.num_workers, 1) if self.stream.train else 1
        for first in items:
            chunks = [first, *itertools.islice(items, join - 1)]
            images, labels = chunks[0]
            if join > 1:
                images, labels = _join([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])
                if self.pin_memory:  # joined in pageable memory: pinned again, so the copy does not block
                    images, labels = _apply(images, Tensor.pin_memory), labels.pin_memory()
            yield _apply(images, lambda x: x.to(self.device, non_blocking=True)), labels.to(self.device,
                                                                                              non_blocking=True)


def _join(parts: list[Any]) -> Any:
    """Batches of images joined: tensors end to end, or views (a tuple or list of tensors: a self-supervised
    task's masks, crops) view by view."""
    if isinstance(parts[0], Tensor):
        return torch.cat(parts)
    return type(parts[0])(_join([p[i] for p in parts]) for i in range(len(parts[0])))


def _apply(images: Any, fn: Any) -> Any:
    """``fn`` of a tensor, or of each tensor of a tuple or list of views."""
    return fn(images) if isinstance(images, Tensor) else type(images)(_apply(x, fn) for x in images)
