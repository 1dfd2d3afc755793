"""Autoregressive decoding for any sequence model: greedy search and beam search.

The model is seen through two callables, so every decoder (the Transformer with its KV cache, and
later ones) shares one implementation:

- ``step(tokens, t) -> log_probs``: ``tokens`` ``(N, t + 1)`` are the rows' ids so far (BOS first);
  return the next token's log-probabilities ``(N, V)``. A cached decoder reads only ``tokens[:, -1:]``.
- ``reorder(index)``: the rows were permuted (``index`` ``(N,)``: new row ``i`` continues old row
  ``index[i]``); a cached decoder permutes its state the same way.

Scores follow the Hugging Face / fairseq convention: a hypothesis scores
``sum(log p) / length ** length_penalty``, where ``length`` counts the generated tokens **including
EOS** (not BOS). PAD and BOS are never generated.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["greedy_search", "beam_search", "sample_next"]

StepFn = Callable[[Tensor, int], Tensor]


def _forbid(log_probs: Tensor, ids: tuple[int, ...]) -> Tensor:
    log_probs = log_probs.float()
    log_probs[:, list(ids)] = float("-inf")
    return log_probs


def _trim(out: Tensor, pad_id: int) -> Tensor:
    """Drop the trailing columns that are padding in every row."""
    real = (out != pad_id).any(0).nonzero()
    return out[:, :int(real.max()) + 1] if len(real) else out[:, :0]


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    """One token per row from next-token ``logits`` ``(N, V)`` -> ids ``(N, 1)``.

    ``temperature == 0`` or ``top_k == 1``: the argmax (greedy). Otherwise sample from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens and/or the
    nucleus: the smallest set of most likely tokens whose probability reaches ``top_p``.
    """
    if temperature < 0 or (top_k is not None and top_k < 1) or (top_p is not None and not 0 < top_p <= 1):
        raise ValueError(f"temperature={temperature} must be >= 0, top_k={top_k} >= 1, top_p={top_p} in (0, 1]")
    logits = logits.float()
    if temperature == 0 or top_k == 1:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # tokens after the set reached top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


@torch.no_grad()
def greedy_search(step: StepFn, batch: int, max_new_tokens: int, *, bos_id: int, eos_id: int, pad_id: int,
                  device: torch.device | str) -> Tensor:
    """The most likely token at every step, until EOS or ``max_new_tokens``.

    Returns:
        ``(batch, L)`` ids without BOS, ending with EOS (unless cut at ``max_new_tokens``), padded
        with ``pad_id`` after EOS.
    """
    tokens = torch.full((batch, 1), bos_id, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        next_token = _forbid(step(tokens, t), (pad_id, bos_id)).argmax(-1)
        next_token = next_token.masked_fill(done, pad_id)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        done |= next_token == eos_id
        if bool(done.all()):
            break
    return _trim(tokens[:, 1:], pad_id)


@torch.no_grad()
def beam_search(step: StepFn, reorder: Callable[[Tensor], None] | None, batch: int, beam_size: int,
                max_new_tokens: int, *, bos_id: int, eos_id: int, pad_id: int, device: torch.device | str,
                length_penalty: float = 1.0) -> Tensor:
    """Beam search with a separate n-best set of finished hypotheses.

    Rows ``b * beam_size + j`` hold live beam ``j`` of source ``b``. At every step each live beam
    ending with EOS becomes a finished hypothesis (kept in an n-best set of ``beam_size`` per source,
    ranked by the length-normalised score); the ``beam_size`` best continuations that do not end
    become the live beams, so the live beam never shrinks. Live beams all have the same length, so
    ranking them by ``sum(log p)`` is ranking them by the normalised score. At ``max_new_tokens`` the
    live beams join the n-best set as they are. Decoding stops early only when no live beam can beat
    the best finished hypothesis: a live sum of log-probabilities can only fall, so its best possible
    normalised score is reached at the longest length (``length_penalty > 0``) or the shortest
    (``< 0``). With a beam as large as the number of candidate sequences, the result is the exact
    best-scoring sequence.

    Returns:
        ``(batch, L)`` ids of the best hypothesis per source, without BOS, ending with EOS unless
        cut at ``max_new_tokens``, padded with ``pad_id``.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size={beam_size} must be >= 1")
    k = beam_size
    rows = batch * k
    tokens = torch.full((rows, 1), bos_id, dtype=torch.long, device=device)
    live = torch.zeros(batch, k, device=device)
    live[:, 1:] = float("-inf")  # all beams start equal: expand only the first
    best_scores = torch.full((batch, k), float("-inf"), device=device)  # the n-best set, normalised scores
    best_tokens = torch.full((batch, k, max_new_tokens), pad_id, dtype=torch.long, device=device)
    first_row = torch.arange(batch, device=device)[:, None] * k

    def add_finished(scores: Tensor, hyps: Tensor) -> None:
        """Merge ``(batch, k)`` normalised scores with hypotheses ``(batch, k, n)`` into the n-best set."""
        nonlocal best_scores, best_tokens
        hyps = torch.nn.functional.pad(hyps, (0, max_new_tokens - hyps.shape[-1]), value=pad_id)
        all_scores = torch.cat([best_scores, scores], dim=1)
        all_tokens = torch.cat([best_tokens, hyps], dim=1)
        best_scores, keep = all_scores.topk(k, dim=1)
        best_tokens = all_tokens.gather(1, keep[:, :, None].expand(-1, -1, max_new_tokens))

    for t in range(max_new_tokens):
        total = live.view(rows, 1) + _forbid(step(tokens, t), (pad_id, bos_id))  # (rows, V)
        length = t + 1  # generated tokens after this step, EOS included
        ended = torch.cat([tokens[:, 1:], torch.full((rows, 1), eos_id, device=device)], dim=1)
        add_finished(total[:, eos_id].view(batch, k) / length ** length_penalty, ended.view(batch, k, length))
        total[:, eos_id] = float("-inf")
        vocab = total.shape[-1]
        live, index = total.view(batch, k * vocab).topk(k, dim=1)
        beam = (index // vocab + first_row).flatten()
        tokens = torch.cat([tokens[beam], (index % vocab).flatten()[:, None]], dim=1)
        if reorder is not None:
            reorder(beam)
        if length == max_new_tokens:  # cut: the live beams are hypotheses as they are
            add_finished(live / length ** length_penalty, tokens[:, 1:].view(batch, k, length))
            break
        longest_gain = max_new_tokens if length_penalty > 0 else length + 1
        if bool((live[:, 0] / longest_gain ** length_penalty <= best_scores[:, 0]).all()):
            break
    return _trim(best_tokens[:, 0], pad_id)
