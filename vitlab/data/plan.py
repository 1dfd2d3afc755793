"""The epoch's plan for streamed training data: which samples an epoch trains on, in which global
batches, and which reader reads each of them (:class:`EpochPlan`).

The plan is what makes a streamed run *elastic*: the sample ids of every global step, and so each
sample's augmentation (seeded by (seed, epoch, sample)), are a function of the seed, the epoch, the
global batch, the data and one partition count fixed when the run starts and kept in its checkpoint;
not of the number of processes or DataLoader workers that read them. A run stopped on 2 processes x
2 workers continues on 1 x 1 with the same global batches.

Data read in any order (in memory, a folder streamed by a map-style DataLoader) needs no plan of its
own: Accelerate's seedable sampler permutes the whole split by (seed, epoch) and cuts it into global
batches, then into each process's contiguous part, which follows the same rules.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from ..errors import ConfigError, DataError
from ..seeding import process_seed

__all__ = ["Segment", "EpochPlan", "pieces", "shuffle"]

Segment = tuple[int, int, int]  # (shard, first sample, end): a contiguous run of one shard's samples


@dataclass(frozen=True)
class EpochPlan:
    """How an epoch of ``segments`` is trained on, in global batches of ``batch_size``, by any number of
    processes and workers. Its rules (each proved by a test named in ``docs/development.md``):

    1. **Order.** The segments are put in an order fixed by (seed, epoch), the same everywhere, and laid
       end to end: the epoch's *sequence*.
    2. **Steps.** An epoch has ``len(sequence) // batch_size`` global steps; the rest, fewer than one
       batch, is not used that epoch (as ``drop_last``; other samples each epoch, as the order changes).
    3. **Partitions.** The used part of the sequence is cut into ``partitions`` contiguous parts; part
       ``r`` gives ``chunk(r) = batch_size * (r + 1) // partitions - batch_size * r // partitions``
       samples to every global step, so it holds ``steps * chunk(r)`` of them.
    4. **Shuffle.** Each part is read in order through a shuffle buffer of ``shuffle_buffer`` samples
       seeded by (seed, epoch, part); its draws depend on the samples' number only.
    5. **Batches.** Global batch ``j`` is part 0's ``j``-th chunk, then part 1's, ... part R-1's.
    6. **Readers.** Process ``p`` of ``P`` reads the parts ``[p R / P, (p + 1) R / P)`` (``P`` must
       divide ``R``): its batch ``j`` is their chunks ``j``, which is its contiguous share of global batch
       ``j``. Its ``W`` DataLoader workers (at most one a part) share those parts, contiguously.
    7. **Resume.** Step ``S`` starts every part at its sample ``S * chunk(r)``.

    Nothing here depends on the processes or the workers, so the global batches are the same on every
    layout; the partition count is fixed when the run starts (``data.partitions``, else its processes x
    workers then) and kept in its checkpoint.

    Args:
        segments: The sample ranges to train on, ``(shard, start, stop)``.
        offsets: Each shard's first sample id (a sample's id is its shard's offset plus its position).
        batch_size: The global batch.
        partitions: R, the number of parts.
        seed: The run's seed.
        shuffle_buffer: Samples each part shuffles among.
    """

    segments: tuple[Segment, ...]
    offsets: tuple[int, ...]
    batch_size: int
    partitions: int
    seed: int = 0
    shuffle_buffer: int = 1000

    @property
    def total(self) -> int:
        return sum(stop - start for _, start, stop in self.segments)

    @property
    def steps(self) -> int:
        """Global steps an epoch (rule 2)."""
        return self.total // self.batch_size

    def chunk(self, part: int) -> int:
        """Samples part ``part`` gives to every global step (rule 3)."""
        return self.batch_size * (part + 1) // self.partitions - self.batch_size * part // self.partitions

    def part_range(self, part: int) -> tuple[int, int]:
        """Part ``part``'s positions in the epoch's sequence (rule 3)."""
        return (self.steps * (self.batch_size * part // self.partitions),
                self.steps * (self.batch_size * (part + 1) // self.partitions))

    def order(self, epoch: int) -> list[Segment]:
        """The epoch's order of segments (rule 1)."""
        g = torch.Generator().manual_seed(process_seed(self.seed, 0, epoch, "shards"))
        return [self.segments[i] for i in torch.randperm(len(self.segments), generator=g).tolist()]

    def pieces(self, epoch: int, start: int, stop: int) -> Iterator[Segment]:
        """``(shard, a, b)``: the shards' samples ``a`` to ``b`` at positions ``start`` to ``stop`` of the
        epoch's sequence, in order."""
        return pieces(self.order(epoch), start, stop)

    def ids(self, epoch: int, start: int, stop: int) -> list[int]:
        """The sample ids at positions ``start`` to ``stop`` of the epoch's sequence, nothing read."""
        return [self.offsets[shard] + i for shard, a, b in self.pieces(epoch, start, stop) for i in range(a, b)]

    def shuffle_seed(self, epoch: int, part: int) -> int:
        """The seed of part ``part``'s shuffle buffer in ``epoch`` (rule 4)."""
        return process_seed(self.seed, 0, epoch, "shards", part + 1)

    def batch_ids(self, epoch: int, step: int) -> list[int]:
        """The sample ids of global batch ``step`` of ``epoch`` (rule 5), nothing read: the reference the
        readers' batches are tested against."""
        out = []
        for part in range(self.partitions):
            size = self.chunk(part)
            shuffled = shuffle(iter(self.ids(epoch, *self.part_range(part))), self.shuffle_buffer,
                               random.Random(self.shuffle_seed(epoch, part)), [])
            out += list(itertools.islice(shuffled, step * size, (step + 1) * size))
        return out

    def parts_of(self, process: int, processes: int) -> range:
        """The parts process ``process`` of ``processes`` reads (rule 6)."""
        per = self.partitions // processes
        return range(process * per, (process + 1) * per)

    def workers_for(self, processes: int, workers: int) -> int:
        """The DataLoader workers a process uses: ``workers``, at most one a part it reads (0: none)."""
        return min(workers, self.partitions // processes)

    def parts_of_worker(self, process: int, processes: int, worker: int, workers: int) -> range:
        """The parts worker ``worker`` of a process's ``workers`` (>= 1) reads, contiguously (rule 6)."""
        parts = self.parts_of(process, processes)
        return parts[len(parts) * worker // workers:len(parts) * (worker + 1) // workers]

    def check(self, processes: int, where: str) -> None:
        """Refuse, in one line, a layout or data the plan cannot serve: processes that do not divide the
        partitions, more partitions than samples in a global batch or than segments, no whole batch."""
        if self.partitions % processes:
            fits = [k for k in range(1, self.partitions + 1) if self.partitions % k == 0]
            raise ConfigError(f"this run reads its training shards as {self.partitions} partitions, fixed when it "
                              f"started (data.partitions, else its processes x DataLoader workers then); {processes} "
                              f"processes cannot share them equally: launch {', '.join(map(str, fits))} process(es)")
        if self.partitions > self.batch_size:
            raise ConfigError(f"{self.partitions} partitions (data.partitions, else processes x DataLoader workers) "
                              f"are more than the global batch of {self.batch_size}: each gives samples to every "
                              f"batch; lower data.num_workers or data.partitions")
        if len(self.segments) < self.partitions:
            raise DataError(f"{where}: {len(self.segments)} shard(s) for {self.partitions} partitions (data.partitions, "
                              f"else processes x DataLoader workers); give each partition a shard of its own: lower "
                              f"data.num_workers or data.partitions, or write smaller shards (vitlab shards --shard-size)")
        if self.steps == 0:
            raise DataError(f"{where}: {self.total} training samples are fewer than one global batch of "
                              f"{self.batch_size}; lower train.batch_size")


def pieces(segments: Sequence[Segment], start: int, stop: int) -> Iterator[Segment]:
    """``(shard, a, b)``: the shards' samples ``a`` to ``b`` at positions ``start`` to ``stop`` of
    ``segments`` laid end to end, in order."""
    position = 0
    for shard, first, end in segments:
        lo, hi = max(start, position), min(stop, position + end - first)
        if lo < hi:
            yield shard, first + lo - position, first + hi - position
        position += end - first
        if position >= stop:
            break


def shuffle(items: Iterator[Any], size: int, rng: random.Random, buffer: list[Any]) -> Iterator[Any]:
    """A shuffle buffer (webdataset's): ``buffer`` filled to ``size`` items, then each item read goes in
    and one drawn by ``rng`` comes out; the rest drawn at the end. ``buffer`` is the
    caller's list, so a shuffle can be stopped and continued from its state."""
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
