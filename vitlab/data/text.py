"""Sequence-to-sequence data: synthetic tasks, parallel text with a BPE tokenizer, batching.

Token ids 0, 1, 2 are ``<pad>``, ``<s>`` (BOS) and ``</s>`` (EOS) in every vocabulary here.
"""
from __future__ import annotations

import gzip
import random
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import Tensor
from torch.utils.data import Sampler

from ..errors import DataError

__all__ = ["PAD_ID", "BOS_ID", "EOS_ID", "SPECIAL_TOKENS", "synthetic_pairs", "read_lines", "train_bpe",
           "load_tokenizer", "collate_pairs", "TokenBatchSampler"]

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
SYNTHETIC_TASKS = ("copy", "reverse", "sort")


def synthetic_pairs(task: str, n: int, vocab_size: int, min_len: int, max_len: int,
                    seed: int) -> list[tuple[list[int], list[int]]]:
    """``n`` (source, target) id lists: random symbols ``3 .. vocab_size - 1`` of random length in
    ``[min_len, max_len]``; the target is the source copied, reversed or sorted."""
    if task not in SYNTHETIC_TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; expected one of {SYNTHETIC_TASKS}")
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        src = [rng.randrange(3, vocab_size) for _ in range(rng.randint(min_len, max_len))]
        tgt = src if task == "copy" else src[::-1] if task == "reverse" else sorted(src)
        pairs.append((src, list(tgt)))
    return pairs


def read_lines(root: str | Path, split: str, lang: str) -> list[str]:
    """Lines of ``root/split.lang`` or ``root/split.lang.gz`` (one sentence a line)."""
    root = Path(root)
    for path in (root / f"{split}.{lang}", root / f"{split}.{lang}.gz"):
        if path.is_file():
            try:
                opener = gzip.open if path.suffix == ".gz" else open
                with opener(path, "rt", encoding="utf-8") as f:
                    return [line.rstrip("\n") for line in f]
            except (OSError, UnicodeDecodeError) as e:
                raise DataError(f"cannot read {str(path)!r}: {e}") from None
    if not root.is_dir():
        raise DataError(f"data.root={str(root)!r} does not exist; point it at a folder with "
                        f"<split>.<lang>[.gz] text files")
    raise DataError(f"no {split}.{lang} or {split}.{lang}.gz in data.root={str(root)!r}")


def train_bpe(texts: Sequence[str], vocab_size: int, path: Path) -> "tokenizers.Tokenizer":  # noqa: F821
    """Train a joint byte-level-free BPE (SentencePiece-style ``▁`` word marks, so decoding restores
    the spacing) on ``texts`` and save it as ``path`` (``tokenizer.json``)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    return tokenizer


def load_tokenizer(path: str | Path) -> "tokenizers.Tokenizer":  # noqa: F821
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception types
        raise DataError(f"cannot load tokenizer {str(path)!r}: {e}") from None


def collate_pairs(pairs: Sequence[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    """Pad a list of (source ids, target ids) into a batch; masks come from the lengths.

    Returns ``src`` ``(B, S)``, ``src_mask`` ``(B, S)`` (True = real token), ``tgt_in`` ``(B, T)``
    (BOS + target), ``tgt_out`` ``(B, T)`` (target + EOS; the labels), ``tgt_mask`` ``(B, T)``.
    """
    src_len = torch.tensor([len(s) for s, _ in pairs])
    tgt_len = torch.tensor([len(t) + 1 for _, t in pairs])
    batch = len(pairs)
    src = torch.full((batch, int(src_len.max())), PAD_ID, dtype=torch.long)
    tgt_in = torch.full((batch, int(tgt_len.max())), PAD_ID, dtype=torch.long)
    tgt_out = tgt_in.clone()
    for i, (s, t) in enumerate(pairs):
        src[i, :len(s)] = s
        tgt_in[i, 0] = BOS_ID
        tgt_in[i, 1:len(t) + 1] = t
        tgt_out[i, :len(t)] = t
        tgt_out[i, len(t)] = EOS_ID
    return {"src": src, "src_mask": torch.arange(src.shape[1]) < src_len[:, None],
            "tgt_in": tgt_in, "tgt_out": tgt_out, "tgt_mask": torch.arange(tgt_in.shape[1]) < tgt_len[:, None]}


class TokenBatchSampler(Sampler[list[int]]):
    """Batches by token count, every sentence exactly once per epoch.

    A *global batch* (one optimizer step) holds sentences of similar length, at most ``max_tokens``
    padded tokens (source or target, whichever is longer) over all processes and accumulation steps.
    It is cut into ``num_processes * accum_steps`` contiguous parts whose sizes differ by at most one
    sentence; this process yields its ``accum_steps`` parts of each global batch in turn (micro-batch
    ``i`` of process ``p`` is part ``i * num_processes + p``). The last global batch of the epoch (the
    longest sentences) joins the one before it if it has fewer sentences than parts, so nothing is
    dropped; that one batch may exceed ``max_tokens`` by less than ``parts`` sentences.

    Shuffled per epoch (``set_epoch``) from ``seed``, identically on every process.
    """

    def __init__(self, lengths: Sequence[int], max_tokens: int, seed: int = 0, shuffle: bool = True,
                 num_processes: int = 1, process_index: int = 0, accum_steps: int = 1) -> None:
        self.lengths = list(lengths)
        self.max_tokens, self.seed, self.shuffle = max_tokens, seed, shuffle
        self.num_processes, self.process_index, self.accum_steps = num_processes, process_index, accum_steps
        self.parts = num_processes * accum_steps
        self.epoch = 0
        longest = max(self.lengths)
        if max_tokens < longest * self.parts:
            raise ValueError(f"data.batch_tokens={max_tokens} cannot hold {self.parts} sentence(s) (one per process "
                             f"and accumulation step) of the longest length {longest}; raise it to at least "
                             f"{longest * self.parts}")
        if len(self.lengths) < self.parts:
            raise ValueError(f"{len(self.lengths)} sentences cannot be cut into {self.parts} parts (one per process "
                             f"and accumulation step)")
        self._batches = self._make_batches(random.Random(seed))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _make_batches(self, rng: random.Random) -> list[list[int]]:
        order = list(range(len(self.lengths)))
        rng.shuffle(order)  # random among equal lengths, then sorted by length
        order.sort(key=lambda i: self.lengths[i])
        batches, current, longest = [], [], 0
        for i in order:
            longest_if_added = max(longest, self.lengths[i])
            if current and longest_if_added * (len(current) + 1) > self.max_tokens:
                batches.append(current)
                current, longest_if_added = [], self.lengths[i]
            current.append(i)
            longest = longest_if_added
        batches.append(current)
        # Every batch but the last holds >= parts sentences (max_tokens >= longest * parts).
        if len(batches) > 1 and len(batches[-1]) < self.parts:
            batches[-2].extend(batches.pop())
        return batches

    def __len__(self) -> int:
        """Micro-batches this process yields per epoch."""
        return len(self._batches) * self.accum_steps

    def __iter__(self) -> Iterator[list[int]]:
        rng = random.Random(self.seed + self.epoch)
        batches = self._make_batches(rng) if self.shuffle else self._batches
        if self.shuffle:
            rng.shuffle(batches)
        for batch in batches:
            size, extra = divmod(len(batch), self.parts)
            bounds = [j * size + min(j, extra) for j in range(self.parts + 1)]
            for i in range(self.accum_steps):
                j = i * self.num_processes + self.process_index
                yield batch[bounds[j]:bounds[j + 1]]
