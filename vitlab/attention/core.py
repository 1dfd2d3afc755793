"""Scaled dot-product attention and the masked weights every softmax-like kernel shares.

Mask convention, everywhere in vitlab: a boolean mask is **True where a query may attend to a
key** (the convention of ``torch.nn.functional.scaled_dot_product_attention``; note that
``torch.nn.MultiheadAttention``'s boolean masks mean the opposite). A query whose keys are all
masked gets a zero output and zero attention weights, never NaN.

Shapes: queries ``(B, H, Lq, D)``, keys ``(B, H, Lk, D)``, values ``(B, H, Lk, Dv)``, scores and
weights ``(B, H, Lq, Lk)``, outputs ``(B, H, Lq, Dv)``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["scaled_dot_product_attention", "attend_scores", "causal_mask", "full_mask", "check_qkv", "check_mask", "check_key_mask"]


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None) -> Tensor:
    """Boolean causal mask ``(q_len, k_len)``, True = may attend, aligned to the end.

    Query ``i`` sits at absolute position ``k_len - q_len + i`` and sees every key up to and
    including that position. With ``q_len == k_len`` this is the usual lower triangle; with
    ``q_len < k_len`` (decoding with a key/value cache) the new queries see the whole past.
    """
    offset = k_len - q_len
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=offset)


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise a ``ValueError`` unless q, k, v are ``(B, H, L, D)`` tensors that fit together."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be (batch, heads, length, head_dim); got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3] or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit: q and k need the same "
            f"batch, heads and head_dim; k and v the same batch, heads and length"
        )


def check_mask(mask: Tensor, q: Tensor, k: Tensor) -> None:
    expected = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if mask.dtype != torch.bool:
        raise ValueError(
            f"attention mask must be boolean (True = may attend), got dtype {mask.dtype}; "
            "convert it with `mask.bool()` or build it from a comparison"
        )
    try:
        ok = mask.dim() <= 4 and torch.broadcast_shapes(mask.shape, expected) == expected
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"attention mask of shape {tuple(mask.shape)} does not broadcast to "
            f"(batch, heads, q_len, k_len) = {expected}; use e.g. (batch, 1, 1, k_len) for a "
            f"key mask or (q_len, k_len) for one mask shared by all sequences"
        )


def check_key_mask(key_mask: Tensor, batch: int, k_len: int) -> None:
    """Raise a ``ValueError`` unless ``key_mask`` is boolean ``(batch, k_len)`` (True = real token)."""
    if key_mask.dtype != torch.bool or tuple(key_mask.shape) != (batch, k_len):
        raise ValueError(f"key_mask must be boolean (batch, k_len) = {(batch, k_len)} with True = real token; got "
                         f"{key_mask.dtype} {tuple(key_mask.shape)}")


def full_mask(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor | None:
    """``mask`` (checked) and the causal mask combined by logical and; None when neither is given."""
    if mask is not None:
        check_mask(mask, q, k)
    if is_causal:
        causal = causal_mask(q.shape[-2], k.shape[-2], device=q.device)
        mask = causal if mask is None else mask & causal
    return mask


def attend_scores(
    scores: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    hard: bool = False,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Turn scores into weights and average the values: the explicit path of every softmax kernel.

    Args:
        scores: Logits ``(B, H, Lq, Lk)`` from any score function (dot, general, additive).
        v: Values ``(B, H, Lk, Dv)``.
        mask: Boolean, broadcastable to the scores; **True = may attend**.
        hard: Argmax attention: each query takes the value of its highest-scoring allowed key
            (first on ties). The forward weights are one-hot; gradients flow through the softmax
            of the same scores (straight-through estimator).
        dropout_p: Dropout on the weights (0.0 in eval mode).
        need_weights: Also return the weights (before dropout; rows sum to 1, or are all zero for
            a query without an allowed key).

    Returns:
        ``(B, H, Lq, Dv)``, or ``(output, weights)``.
    """
    has_key = None
    if mask is not None:
        # A query with no allowed key would get softmax over all -inf = NaN: let such rows attend
        # everywhere (finite forward and backward) and zero them afterwards.
        has_key = mask.any(dim=-1, keepdim=True)
        scores = scores.masked_fill(~(mask | ~has_key), float("-inf"))
    weights = scores.softmax(dim=-1)
    if hard:
        one_hot = F.one_hot(scores.argmax(dim=-1), scores.shape[-1]).to(weights.dtype)
        weights = one_hot + weights - weights.detach()  # forward: one-hot; backward: softmax
    if has_key is not None:
        weights = weights.masked_fill(~has_key, 0.0)
    out = (F.dropout(weights, p=dropout_p) if dropout_p > 0.0 else weights) @ v
    return (out, weights) if need_weights else out


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    scale: float | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``softmax(q @ k^T * scale + mask) @ v`` over heads.

    Args:
        q: Queries ``(B, H, Lq, D)``.
        k: Keys ``(B, H, Lk, D)``.
        v: Values ``(B, H, Lk, Dv)``.
        mask: Optional boolean mask broadcastable to ``(B, H, Lq, Lk)``; **True = may attend**.
        is_causal: Apply a causal mask aligned to the end (see :func:`causal_mask`); combined
            with ``mask`` by logical and.
        dropout_p: Dropout on the attention weights (pass 0.0 in eval mode).
        need_weights: Also return the attention weights.
        scale: Logit scale; default ``1 / sqrt(D)``.

    Returns:
        The output ``(B, H, Lq, Dv)``, or ``(output, weights)`` with weights ``(B, H, Lq, Lk)``
        when ``need_weights``. The weights are taken before dropout, so each row sums to 1 (or is
        all zero for a query with no key to attend to).

    Without weights PyTorch's fused kernel (flash / memory-efficient / math) runs; with weights
    the explicit path (:func:`attend_scores`) runs. Both give the same output.
    """
    check_qkv(q, k, v)
    if not need_weights and mask is None and (not is_causal or q.shape[-2] == k.shape[-2]):
        # The fast path: no mask tensor, so flash / memory-efficient kernels can run.
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    mask = full_mask(q, k, mask, is_causal)
    if not need_weights:
        has_key = mask.any(dim=-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_key, dropout_p=dropout_p, scale=scale)
        return out.masked_fill(~has_key, 0.0)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return attend_scores((q @ k.transpose(-2, -1)) * scale, v, mask, dropout_p=dropout_p, need_weights=True)
