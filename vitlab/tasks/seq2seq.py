"""Sequence-to-sequence as a training task: synthetic tasks or parallel text, for the shared loop.

Evaluation decodes (greedy or beam, with the KV cache) and scores exact match (synthetic tasks) or
sacreBLEU on detokenized output against the raw references (parallel text).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from ..data.text import BOS_ID, EOS_ID, PAD_ID, TokenBatchSampler, collate_pairs, load_tokenizer, read_lines, \
    synthetic_pairs, train_bpe
from ..errors import ConfigError, DataError
from ..models.hub import write_json
from ..runtime import bare_model, create_accelerator
from .base import EvalRequest, Resumed, TaskSetup, build_model

if TYPE_CHECKING:
    from ..schema import Config, TextDataConfig

__all__ = ["seq2seq_task", "evaluate_run", "load_text_split", "evaluate_seq2seq", "translate", "alignment", "strip_eos",
           "collate_indexed", "PairDataset"]


class PairDataset(Dataset):
    """(source ids, target ids) pairs plus the raw reference text, if any; items carry their index."""

    def __init__(self, pairs: Sequence[tuple[list[int], list[int]]], references: Sequence[str] | None = None) -> None:
        self.pairs = [(torch.tensor(s, dtype=torch.long), torch.tensor(t, dtype=torch.long)) for s, t in pairs]
        self.references = references

    def __len__(self) -> int:
        return len(self.pairs)

    def head(self, n: int) -> "PairDataset":
        """The first ``n`` pairs (and references)."""
        out = PairDataset([])
        out.pairs, out.references = self.pairs[:n], self.references[:n] if self.references else None
        return out

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, int]:
        return (*self.pairs[i], i)


def collate_indexed(items: Sequence[tuple[Tensor, Tensor, int]]) -> dict[str, Tensor]:
    batch = collate_pairs([(s, t) for s, t, _ in items])
    batch["index"] = torch.tensor([i for _, _, i in items])
    return batch


def _encode(tokenizer: Any, lines: Sequence[str], max_tokens: int) -> list[list[int]]:
    return [e.ids[:max_tokens] for e in tokenizer.encode_batch(list(lines))]


def _parallel(d: TextDataConfig, split: str, tokenizer: Any) -> PairDataset:
    src, tgt = read_lines(d.root, split, d.src_lang), read_lines(d.root, split, d.tgt_lang)
    if len(src) != len(tgt):
        raise DataError(f"{split}.{d.src_lang} has {len(src)} lines but {split}.{d.tgt_lang} has {len(tgt)} in "
                        f"data.root={d.root!r}; the files must be aligned line by line")
    pairs = list(zip(_encode(tokenizer, src, d.max_tokens), _encode(tokenizer, tgt, d.max_tokens - 1)))
    return PairDataset(pairs, references=tgt)


def load_text_split(d: TextDataConfig, split: str, seed: int, tokenizer: Any = None) -> PairDataset:
    """``'train'``, ``'val'`` or ``'test'`` pairs. The synthetic tasks generate their validation and
    test sets (``data.num_test`` pairs each) from other seeds than the training set."""
    if d.dataset != "parallel":
        n = d.num_train if split == "train" else d.num_test
        offset = {"train": 0, "val": 1, "test": 2}[split]
        return PairDataset(synthetic_pairs(d.dataset, n, d.vocab_size, d.min_len, d.max_len, seed + offset))
    names = {"train": d.train_split, "val": d.valid_split, "test": d.test_split}
    return _parallel(d, names[split], tokenizer)


def strip_eos(ids: Sequence[int]) -> list[int]:
    """Ids up to (not including) the first EOS, without padding."""
    out = []
    for i in ids:
        if i == EOS_ID:
            break
        if i != PAD_ID:
            out.append(i)
    return out


def _max_new_tokens(cfg_value: int, src: Tensor) -> int:
    return cfg_value or src.shape[1] + 50


@torch.no_grad()
def evaluate_seq2seq(model: nn.Module, loader: Any, accelerator: Accelerator, dataset: PairDataset,
                     tokenizer: Any = None, beam_size: int = 1, length_penalty: float = 1.0,
                     max_new_tokens: int = 0, label_smoothing: float = 0.0) -> dict[str, float]:
    """Loss and token accuracy under teacher forcing, then decoding: ``exact_match`` (no tokenizer)
    or ``bleu`` (sacreBLEU, detokenized hypotheses against ``dataset.references``)."""
    net = bare_model(model, accelerator)
    was_training = net.training
    net.eval()
    indices, hyps, losses, tokens, correct = [], [], [], [], []
    for batch in loader:
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        with accelerator.autocast():
            logits = net(batch["src"], batch["tgt_in"], batch["src_mask"], batch["tgt_mask"]).float()
            out = net.generate(batch["src"], batch["src_mask"], _max_new_tokens(max_new_tokens, batch["src"]),
                               beam_size=beam_size, length_penalty=length_penalty)
        labels = batch["tgt_out"]
        real = labels != PAD_ID
        token_loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=PAD_ID, reduction="none")
        out = accelerator.pad_across_processes(out, dim=1, pad_index=PAD_ID)
        gathered = accelerator.gather_for_metrics((batch["index"], out, token_loss.sum(1), real.sum(1),
                                                   ((logits.argmax(-1) == labels) & real).sum(1)))
        for store, value in zip((indices, hyps, losses, tokens, correct), gathered):
            store.append(value.cpu())
    net.train(was_training)
    n_tokens = torch.cat(tokens).sum().clamp(min=1)
    metrics = {"loss": (torch.cat(losses).sum() / n_tokens).item(),
               "token_acc": (torch.cat(correct).sum() / n_tokens).item()}
    width = max(h.shape[1] for h in hyps)
    hyp_ids = torch.cat([F.pad(h, (0, width - h.shape[1]), value=PAD_ID) for h in hyps])
    order = torch.cat(indices).tolist()
    outputs = [strip_eos(row) for row in hyp_ids.tolist()]
    if tokenizer is None:
        refs = [dataset.pairs[i][1].tolist() for i in order]
        metrics["exact_match"] = sum(o == r for o, r in zip(outputs, refs)) / max(1, len(refs))
    else:
        import sacrebleu

        texts = [tokenizer.decode(o).strip() for o in outputs]
        refs = [dataset.references[i] for i in order]
        metrics["bleu"] = sacrebleu.corpus_bleu(texts, [refs]).score
    return metrics


@torch.no_grad()
def translate(model: nn.Module, tokenizer: Any, sentences: Sequence[str], beam_size: int = 4,
              length_penalty: float = 1.0, max_new_tokens: int = 0, max_tokens: int = 128) -> list[str]:
    """Translate raw sentences with a trained model and its tokenizer (detokenized output)."""
    ids = _encode(tokenizer, sentences, max_tokens)
    src = torch.full((len(ids), max(1, max(map(len, ids)))), PAD_ID, dtype=torch.long)
    for i, row in enumerate(ids):
        src[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    device = next(model.parameters()).device
    src = src.to(device)
    out = model.generate(src, src != PAD_ID, _max_new_tokens(max_new_tokens, src), beam_size=beam_size,
                         length_penalty=length_penalty)
    return [tokenizer.decode(strip_eos(row)).strip() for row in out.tolist()]


@torch.no_grad()
def alignment(model: nn.Module, tokenizer: Any, sentence: str, beam_size: int = 4, layer: int = -1,
              max_tokens: int = 128) -> tuple[Tensor, list[str], list[str]]:
    """Translate one sentence and return where each generated subword looked: the cross-attention weights
    ``(T, S)`` (generated subwords, EOS included, x source subwords; for a Transformer, decoder ``layer``
    averaged over its heads), the source subwords and the generated ones."""
    src_ids = _encode(tokenizer, [sentence], max_tokens)[0]
    if not src_ids:
        raise DataError(f"the sentence {sentence!r} has no tokens to translate")
    src = torch.tensor([src_ids], device=next(model.parameters()).device)
    out = [i for i in model.generate(src, max_new_tokens=_max_new_tokens(0, src), beam_size=beam_size)[0].tolist()
           if i != PAD_ID]
    tgt_in = torch.tensor([[BOS_ID] + out[:-1]], device=src.device)
    weights = model.attention_weights(src, tgt_in, layer=layer)[0].float().cpu()
    return weights, [tokenizer.id_to_token(i) for i in src_ids], [tokenizer.id_to_token(i) for i in out]


def _tokenizer(cfg: Config, accelerator: Accelerator, run_dir: Path, resumed: Resumed | None) -> Any:
    """The run's BPE: reloaded on resume, else trained on the training text (main process) and saved."""
    d = cfg.data
    path = run_dir / "tokenizer.json"
    if resumed is not None and (resumed.directory / "tokenizer.json").is_file():
        return load_tokenizer(resumed.directory / "tokenizer.json")
    if accelerator.is_main_process:
        texts = read_lines(d.root, d.train_split, d.src_lang) + read_lines(d.root, d.train_split, d.tgt_lang)
        run_dir.mkdir(parents=True, exist_ok=True)
        train_bpe(texts, d.vocab_size, path)
    accelerator.wait_for_everyone()
    return load_tokenizer(path)


def _build(cfg: Config, vocab: int) -> nn.Module:
    return build_model(cfg, src_vocab_size=vocab, tgt_vocab_size=vocab, pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID)


def seq2seq_task(cfg: Config, accelerator: Accelerator, micro_batch: int, run_dir: Path,
                 resumed: Resumed | None = None) -> TaskSetup:
    """Data, tokenizer, Transformer, label-smoothed loss (padding ignored) and decoding metrics."""
    d, t, g = cfg.data, cfg.train, cfg.generate
    _build(cfg, 8)  # bad model arguments fail here, before any data is read
    tokenizer = _tokenizer(cfg, accelerator, run_dir, resumed) if d.dataset == "parallel" else None
    vocab = tokenizer.get_vocab_size() if tokenizer is not None else d.vocab_size
    torch.manual_seed(t.seed)  # the initial weights do not depend on how long tokenizing took
    model = _build(cfg, vocab)
    train_set = load_text_split(d, "train", t.seed, tokenizer)
    eval_sets = {split: load_text_split(d, split, t.seed, tokenizer) for split in ("val", "test")}
    final_sets = {}
    if g.eval_subset:  # decoding is the slow part of evaluation: optionally only the first N sentences
        # each epoch; the last evaluation decodes the whole test split, whose metric the run reports
        final_sets = {"test": eval_sets["test"]} if len(eval_sets["test"]) > g.eval_subset else {}
        eval_sets = {k: v.head(g.eval_subset) for k, v in eval_sets.items()}

    if d.batch_tokens > 0:
        lengths = [max(len(s), len(t_) + 1) for s, t_ in train_set.pairs]
        try:
            sampler = TokenBatchSampler(lengths, d.batch_tokens, seed=t.seed, num_processes=accelerator.num_processes,
                                        process_index=accelerator.process_index, accum_steps=t.grad_accum_steps)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        train_loader = DataLoader(train_set, batch_sampler=sampler, collate_fn=collate_indexed, num_workers=d.num_workers)
    else:
        train_loader = DataLoader(train_set, batch_size=micro_batch, shuffle=True, drop_last=True,
                                  collate_fn=collate_indexed, num_workers=d.num_workers)
        if len(train_loader) == 0:
            raise ConfigError(f"train.batch_size={t.batch_size} is larger than the {len(train_set)} training pairs")
    eval_loaders, final_eval_loaders = (
        {k: DataLoader(v, batch_size=micro_batch, shuffle=False, collate_fn=collate_indexed) for k, v in sets.items()}
        for sets in (eval_sets, final_sets))

    def loss(net: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
        logits = net(batch["src"], batch["tgt_in"], batch["src_mask"], batch["tgt_mask"])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["tgt_out"].flatten(), ignore_index=PAD_ID,
                               label_smoothing=t.label_smoothing)

    def count(batch: dict[str, Tensor]) -> int:
        return int((batch["tgt_out"] != PAD_ID).sum())  # target tokens (EOS included)

    def score(net: nn.Module, loader: Any, acc: Accelerator) -> dict[str, float]:
        dataset = loader.dataset if hasattr(loader, "dataset") else loader.base_dataloader.dataset
        return evaluate_seq2seq(net, loader, acc, dataset, tokenizer, g.beam_size, g.length_penalty, g.max_new_tokens)

    def save_files(directory: Path) -> None:
        if tokenizer is not None:
            tokenizer.save(str(directory / "tokenizer.json"))

    return TaskSetup(model=model, train_loader=train_loader, prepare_train_loader=d.batch_tokens == 0,
                     eval_loaders=eval_loaders, prepare_eval_loaders=True, final_eval_loaders=final_eval_loaders,
                     loss=loss, count=count, evaluate=score,
                     select="bleu" if tokenizer is not None else "exact_match",
                     meta={"task": "seq2seq", "dataset": d.dataset, "src_lang": d.src_lang, "tgt_lang": d.tgt_lang},
                     save_files=save_files,
                     train_size=len(train_set))


def evaluate_run(request: EvalRequest, cfg: Config, model: nn.Module) -> dict[str, Any]:
    """``vitlab eval`` of a sequence-to-sequence run: its loss, token accuracy, exact matches (and BLEU of real text)
    on ``request.split``, decoded as ``generate.*`` says."""
    
    r, g = request, cfg.generate
    tokenizer = load_tokenizer(model.pretrained_cfg["tokenizer"]) if model.pretrained_cfg["tokenizer"] else None
    dataset = load_text_split(cfg.data, r.split, cfg.train.seed, tokenizer)
    accelerator = create_accelerator(cfg.train.mixed_precision)
    loader = DataLoader(dataset, batch_size=r.batch_size, collate_fn=collate_indexed)
    metrics = evaluate_seq2seq(accelerator.prepare(model), accelerator.prepare(loader), accelerator, dataset,
                               tokenizer, g.beam_size, g.length_penalty, g.max_new_tokens)
    if accelerator.is_main_process:
        print(f"checkpoint {r.directory} | {r.split} split: {len(dataset)} pairs | beam {g.beam_size}")
        print("  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        if r.output:
            write_json(r.output, {**metrics, "num_pairs": len(dataset), "checkpoint": str(r.directory),
                                  "split": r.split, "beam_size": g.beam_size})
    return metrics
