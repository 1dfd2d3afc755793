"""Language modelling as a training task: a decoder-only model, next-token cross-entropy on windows of a
text corpus, validation loss / perplexity (/ bits per character) choosing ``best/``."""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import Tensor, nn

from ..data.corpus import (CharTokenizer, WindowLoader, load_lm_tokenizer, read_corpus, split_tokens, tiny_shakespeare,
                           train_lm_bpe)
from ..models.hub import write_json
from ..runtime import create_accelerator
from .base import EvalRequest, Resumed, TaskSetup, build_model

if TYPE_CHECKING:
    from ..schema import Config, LMDataConfig

__all__ = ["lm_task", "evaluate_lm", "load_lm_data", "evaluate_run"]


def load_lm_data(d: "LMDataConfig", tokenizer: Any = None) -> tuple[Any, Tensor, Tensor]:
    """The corpus's tokenizer (given, or built: the alphabet for ``char``, a BPE trained on the training
    part for ``bpe``) and its training and validation token ids."""
    text = read_corpus(tiny_shakespeare(d.root, d.download) if d.dataset == "tinyshakespeare" else d.root)
    if tokenizer is None:
        if d.tokenizer == "char":
            tokenizer = CharTokenizer.from_text(text)  # the corpus's alphabet, as nanoGPT
        else:
            tokenizer = train_lm_bpe(text[:int(len(text) * (1 - d.val_fraction))], d.vocab_size)
    train, val = split_tokens(tokenizer.encode_text(text), d.val_fraction, d.block_size)
    return tokenizer, train, val


@torch.no_grad()
def evaluate_lm(model: nn.Module, loader: WindowLoader, accelerator: Accelerator, char_level: bool,
                max_batches: int = 0) -> dict[str, float]:
    """Mean next-token cross-entropy over the loader's windows (every process gets the same numbers),
    its perplexity, and bits per character for a character vocabulary."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, device=accelerator.device, dtype=torch.float64)  # summed loss, token count
    for i, (x, y) in enumerate(loader):
        if max_batches and i >= max_batches:
            break
        if len(x):
            with accelerator.autocast():
                logits = model(x)
            total[0] += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum").double()
            total[1] += y.numel()
    model.train(was_training)
    total = accelerator.reduce(total, reduction="sum")
    loss = (total[0] / total[1]).item()
    metrics = {"loss": loss, "perplexity": math.exp(loss)}
    if char_level:
        metrics["bpc"] = loss / math.log(2)
    return metrics


def lm_task(cfg: Config, accelerator: Accelerator, micro_batch: int, run_dir: Path,
            resumed: Resumed | None = None) -> TaskSetup:
    """Corpus, tokenizer (saved with the run), decoder-only model, windows, loss and validation metrics."""
    d, t = cfg.data, cfg.train
    build_model(cfg, vocab_size=8, block_size=d.block_size)  # bad model arguments fail before reading data
    saved = resumed.directory / "tokenizer.json" if resumed is not None else None
    tokenizer, train_tokens, val_tokens = load_lm_data(
        d, load_lm_tokenizer(saved) if saved is not None and saved.is_file() else None)
    torch.manual_seed(t.seed)
    model = build_model(cfg, vocab_size=tokenizer.vocab_size(), block_size=d.block_size)
    shard = dict(device=accelerator.device, seed=t.seed, num_processes=accelerator.num_processes,
                 process_index=accelerator.process_index)
    # One global batch per optimizer step: the loader's batch is the micro-batch of all processes.
    train_loader = WindowLoader(train_tokens, d.block_size, micro_batch,
                                steps=d.steps_per_epoch * t.grad_accum_steps, **shard)
    val_loader = WindowLoader(val_tokens, d.block_size, micro_batch, train=False, **shard)

    def loss(net: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return F.cross_entropy(net(x).flatten(0, 1).float(), y.flatten())

    def count(batch: tuple[Tensor, Tensor]) -> int:
        return batch[1].numel()

    def score(net: nn.Module, loader: Any, acc: Accelerator) -> dict[str, float]:
        return evaluate_lm(net, loader, acc, d.tokenizer == "char", d.eval_batches)

    return TaskSetup(model=model, train_loader=train_loader, prepare_train_loader=False,
                     eval_loaders={"val": val_loader}, prepare_eval_loaders=False, loss=loss, count=count,
                     evaluate=score, select="loss", select_lower=True,
                     meta={"task": "lm", "tokenizer_type": d.tokenizer},
                     save_files=lambda directory: tokenizer.save(str(directory / "tokenizer.json")),
                     train_size=len(train_loader) * micro_batch * d.block_size)  # tokens per epoch


def evaluate_run(request: EvalRequest, cfg: Config, model: nn.Module) -> dict[str, Any]:
    """``vitlab eval`` of a language model: its loss, perplexity (and bits a character) on the validation part of
    its text (``--split test`` too: the text has a training and a validation part), or its training part."""
    
    r, d = request, cfg.data
    split = "val" if r.split == "test" else r.split
    _, train_tokens, val_tokens = load_lm_data(d, load_lm_tokenizer(model.pretrained_cfg["tokenizer"]))
    accelerator = create_accelerator(cfg.train.mixed_precision)
    tokens = val_tokens if split == "val" else train_tokens
    loader = WindowLoader(tokens, d.block_size, r.batch_size, accelerator.device, train=False,
                          num_processes=accelerator.num_processes, process_index=accelerator.process_index)
    metrics = evaluate_lm(accelerator.prepare(model), loader, accelerator, d.tokenizer == "char")
    if accelerator.is_main_process:
        print(f"checkpoint {r.directory} | {split} split: {loader.num_targets} tokens")
        print("  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        if r.output:
            write_json(r.output, {**metrics, "num_tokens": loader.num_targets, "checkpoint": str(r.directory),
                                  "split": split})
    return metrics
