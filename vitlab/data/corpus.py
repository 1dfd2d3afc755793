"""Language-model data: a text corpus, its tokenizer (characters or BPE), and windows of tokens.

The corpus is one UTF-8 file, or every ``.txt`` file of a folder in name order, joined. It is split
by position, as nanoGPT does: the first ``1 - val_fraction`` of the tokens train, the rest validate.
Training draws random windows of ``block_size + 1`` tokens (inputs and their next tokens);
evaluation walks the validation tokens in consecutive windows, so every validation token (after the
first) is predicted exactly once.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Protocol

import torch
from torch import Tensor

from ..errors import DataError
from ..seeding import process_seed

__all__ = ["read_corpus", "tiny_shakespeare", "TINY_SHAKESPEARE_URL", "CharTokenizer", "train_lm_bpe", "load_lm_tokenizer", "split_tokens", "WindowLoader",
           "LMTokenizer"]


# char-rnn's tiny Shakespeare (1,115,394 characters), the file nanoGPT's shakespeare_char downloads.
TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
_TINY_SHAKESPEARE_MD5 = "6fb458f1232090904fb40fe944165e91"


def tiny_shakespeare(root: str | Path, download: bool = False) -> Path:
    """The path of ``<root>/tinyshakespeare/input.txt``; with ``download``, fetched from char-rnn's
    repository first if absent (MD5-checked, written under a temporary name and renamed when whole)."""
    path = Path(root) / "tinyshakespeare" / "input.txt"
    if path.is_file():
        return path
    if not download:
        raise DataError(f"tiny Shakespeare not found at {path}; set data.download=true to download it, or "
                        f"data.dataset=text data.root=<path of input.txt>")
    from torchvision.datasets.utils import download_url  # only here: importing torchvision costs a second

    part = path.with_name(path.name + ".part")
    try:
        download_url(TINY_SHAKESPEARE_URL, str(path.parent), part.name, _TINY_SHAKESPEARE_MD5)
    except (OSError, RuntimeError) as e:  # URLError is an OSError; a wrong checksum a RuntimeError
        part.unlink(missing_ok=True)
        raise DataError(f"could not download tiny Shakespeare into {path.parent} ({e}); without network, set "
                        f"data.dataset=text data.root=<path of a copy of input.txt>") from None
    part.replace(path)
    return path


class LMTokenizer(Protocol):
    def encode_text(self, text: str) -> list[int]: ...
    def decode_ids(self, ids: list[int]) -> str: ...
    def vocab_size(self) -> int: ...
    def save(self, path: str) -> None: ...


def read_corpus(root: str | Path) -> str:
    """The text at ``root``: a UTF-8 file, or the ``.txt`` files of a folder joined in name order."""
    path = Path(root)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise DataError(f"data.root={str(root)!r} is a folder without .txt files; point it at a UTF-8 text file "
                            f"or a folder of .txt files")
    elif path.is_file():
        files = [path]
    else:
        raise DataError(f"data.root={str(root)!r} does not exist; point it at a UTF-8 text file (e.g. "
                        f"../shared/data/tinyshakespeare/input.txt)")
    try:
        text = "".join(f.read_text(encoding="utf-8") for f in files)
    except UnicodeDecodeError as e:
        raise DataError(f"data.root={str(root)!r} is not UTF-8 text: {e}") from None
    if not text:
        raise DataError(f"data.root={str(root)!r} is empty; a language model needs text to train on")
    return text


class CharTokenizer:
    """One id per character of the corpus's alphabet (sorted), as nanoGPT's shakespeare_char."""

    kind = "char"

    def __init__(self, chars: str) -> None:
        self.chars = chars
        self.index = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    def encode_text(self, text: str) -> list[int]:
        unknown = sorted(set(text) - self.index.keys())
        if unknown:
            raise DataError(f"the text has characters outside the model's {len(self.chars)}-character vocabulary: "
                            f"{''.join(unknown)!r}; use only characters of the training text")
        return [self.index[c] for c in text]

    def decode_ids(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def vocab_size(self) -> int:
        return len(self.chars)

    def save(self, path: str) -> None:
        Path(path).write_text(json.dumps({"type": "char", "chars": self.chars}, ensure_ascii=False))


class _BpeTokenizer:
    """A Hugging Face byte-level BPE ``tokenizers.Tokenizer`` behind the :class:`LMTokenizer` methods."""

    kind = "bpe"

    def __init__(self, tokenizer) -> None:  # noqa: ANN001 - tokenizers.Tokenizer
        self.tokenizer = tokenizer

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode_ids(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def save(self, path: str) -> None:
        self.tokenizer.save(path)


def train_lm_bpe(text: str, vocab_size: int) -> _BpeTokenizer:
    """A byte-level BPE (GPT-2 style: any text encodes, decoding is exact) trained on ``text``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer)
    return _BpeTokenizer(tokenizer)


def load_lm_tokenizer(path: str | Path) -> CharTokenizer | _BpeTokenizer:
    """The tokenizer a language-model run saved (``tokenizer.json``), character or BPE."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot load tokenizer {str(path)!r}: {e}") from None
    if raw.get("type") == "char":
        return CharTokenizer(raw["chars"])
    from .text import load_tokenizer

    return _BpeTokenizer(load_tokenizer(path))


def split_tokens(ids: list[int], val_fraction: float, block_size: int) -> tuple[Tensor, Tensor]:
    """The first ``1 - val_fraction`` of the tokens for training, the rest for validation (int64).

    Raises:
        DataError: if either part is shorter than one window of ``block_size + 1`` tokens.
    """
    tokens = torch.tensor(ids, dtype=torch.long)
    n_train = int(len(tokens) * (1 - val_fraction))
    train, val = tokens[:n_train], tokens[n_train:]
    for name, part in (("training", train), ("validation", val)):
        if len(part) < block_size + 1:
            raise DataError(f"the {name} text has {len(part)} tokens, fewer than data.block_size + 1 = "
                            f"{block_size + 1}; lower data.block_size or use more text (data.val_fraction="
                            f"{val_fraction})")
    return train, val


class WindowLoader:
    """Batches of token windows ``(x, y)``, ``y`` the next tokens of ``x``, both ``(b, block_size)`` int64.

    Training (``train=True``): ``steps`` batches per epoch of ``batch_size`` (global) windows at
    random offsets, drawn from a generator seeded by ``(seed, epoch)`` and so the same on every
    process; each process takes its contiguous part. Evaluation: consecutive windows
    ``tokens[i * block_size : (i + 1) * block_size + 1]`` covering the text once, shared out so that
    every window goes to exactly one process (``exact_shards``).
    """

    exact_shards = True

    def __init__(self, tokens: Tensor, block_size: int, batch_size: int, device: torch.device | str,
                 train: bool = True, steps: int = 0, seed: int = 0, num_processes: int = 1,
                 process_index: int = 0) -> None:
        if train and batch_size % num_processes:
            raise ValueError(f"batch size {batch_size} is not divisible by {num_processes} processes")
        self.tokens = tokens.to(device)
        self.block_size, self.batch_size, self.train = block_size, batch_size, train
        self.steps = steps or max(1, (len(tokens) - 1) // (block_size * batch_size))
        self.seed, self.num_processes, self.process_index = seed, num_processes, process_index
        self.epoch = 0
        self.num_windows = (len(tokens) - 1) // block_size  # evaluation windows

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps if self.train else -(-self.num_windows // self.batch_size) + bool(self._tail())

    @property
    def num_targets(self) -> int:
        """Evaluation: the tokens predicted, every token but the first."""
        return len(self.tokens) - 1

    def _tail(self) -> int:
        """Evaluation: tokens left after the whole windows, scored as one shorter window at the end."""
        return len(self.tokens) - 1 - self.num_windows * self.block_size

    def _windows(self, starts: Tensor) -> tuple[Tensor, Tensor]:
        idx = starts[:, None] + torch.arange(self.block_size + 1, device=starts.device)
        chunk = self.tokens[idx]
        return chunk[:, :-1], chunk[:, 1:]

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self.batches_from(0)

    def batches_from(self, start: int) -> Iterator[tuple[Tensor, Tensor]]:
        """Training: the epoch's batches from batch ``start`` on, equal to those of a whole epoch (the
        offsets of the batches before it are drawn and dropped: a few integers each)."""
        device = self.tokens.device
        if self.train:
            g = torch.Generator(device="cpu").manual_seed(process_seed(self.seed, 0, self.epoch, "windows"))
            high = len(self.tokens) - self.block_size  # last start whose window (block + 1) fits
            for step in range(self.steps):
                starts = torch.randint(0, high, (self.batch_size,), generator=g)
                if step >= start:
                    part = torch.tensor_split(starts, self.num_processes)[self.process_index]
                    yield self._windows(part.to(device))
            return
        if start:
            raise ValueError("evaluation batches always start at the first")
        starts = torch.arange(self.num_windows, device=device) * self.block_size
        for i in range(-(-self.num_windows // self.batch_size)):
            batch = starts[i * self.batch_size:(i + 1) * self.batch_size]
            yield self._windows(torch.tensor_split(batch, self.num_processes)[self.process_index])
        if tail := self._tail():
            start = self.num_windows * self.block_size
            chunk = self.tokens[start:start + tail + 1][None]
            yield (chunk[:, :-1], chunk[:, 1:]) if self.process_index == 0 else (chunk[:0, :-1], chunk[:0, 1:])
