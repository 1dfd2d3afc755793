"""Score functions beyond the scaled dot product (Luong et al. 2015; Bahdanau et al. 2015).

- ``general`` (Luong): ``score(q, k) = q^T W k * scale`` with a learned ``W`` per head. It is a dot
  product of ``q W`` with ``k``, so every dot-product kernel (fused softmax, streaming, argmax)
  runs on it unchanged.
- ``additive`` / concat (Bahdanau): ``score(q, k) = w^T tanh(W_q q + W_k k)`` per head: an MLP
  over every (query, key) pair, ``(B, H, Lq, Lk, A)`` in memory.

The modules hold the per-head parameters; the functions take them explicitly.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .core import attend_scores, check_qkv, full_mask, scaled_dot_product_attention

__all__ = ["general_attention", "general_query", "additive_scores", "additive_attention", "GeneralScore", "AdditiveScore"]


def general_attention(q: Tensor, k: Tensor, v: Tensor, weight: Tensor, mask: Tensor | None = None,
                      is_causal: bool = False, need_weights: bool = False, dropout_p: float = 0.0,
                      scale: float | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Softmax attention with Luong's general score ``q^T W_h k * scale``.

    Args:
        q, k, v: ``(B, H, Lq, D)``, ``(B, H, Lk, D)``, ``(B, H, Lk, Dv)``.
        weight: ``(H, D, D)``, one bilinear form per head.
        mask, is_causal, need_weights, dropout_p, scale: As in
            :func:`~vitlab.attention.scaled_dot_product_attention` (True = may attend).
    """
    return scaled_dot_product_attention(general_query(q, weight), k, v, mask=mask,
                                        is_causal=is_causal, need_weights=need_weights, dropout_p=dropout_p,
                                        scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))


def general_query(q: Tensor, weight: Tensor) -> Tensor:
    """``q W_h``, ``(B, H, L, D)``: Luong's general score is the (scaled) dot product of this with ``k``."""
    return torch.einsum("bhqd,hde->bhqe", q, weight)


def additive_scores(q: Tensor, k: Tensor, w_q: Tensor, w_k: Tensor, w_v: Tensor,
                    projected_keys: Tensor | None = None) -> Tensor:
    """Bahdanau's scores ``w_v^T tanh(q W_q + k W_k)``: q ``(B, H, Lq, D)``, k ``(B, H, Lk, D)``,
    ``w_q``, ``w_k`` ``(H, D, A)``, ``w_v`` ``(H, A)`` -> ``(B, H, Lq, Lk)``.

    ``projected_keys``: ``k W_k`` ``(B, H, Lk, A)`` computed once by the caller (a recurrent decoder
    attends to the same keys at every step, as Bahdanau et al. precompute ``U_a h_j``); ``k`` is then unused.
    """
    qa = torch.einsum("bhqd,hda->bhqa", q, w_q)
    ka = torch.einsum("bhkd,hda->bhka", k, w_k) if projected_keys is None else projected_keys
    return torch.einsum("bhqka,ha->bhqk", torch.tanh(qa.unsqueeze(3) + ka.unsqueeze(2)), w_v)


def additive_attention(q: Tensor, k: Tensor, v: Tensor, w_q: Tensor, w_k: Tensor, w_v: Tensor,
                       mask: Tensor | None = None, is_causal: bool = False, need_weights: bool = False,
                       dropout_p: float = 0.0, hard: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Softmax (or, with ``hard``, argmax) attention over :func:`additive_scores`; masks as everywhere
    (True = may attend). Returns ``(B, H, Lq, Dv)`` or ``(output, weights)``."""
    check_qkv(q, k, v)
    mask = full_mask(q, k, mask, is_causal)
    return attend_scores(additive_scores(q, k, w_q, w_k, w_v), v, mask, hard=hard, dropout_p=dropout_p,
                         need_weights=need_weights)


class GeneralScore(nn.Module):
    """Luong's ``W`` per head, ``weight`` ``(H, D, D)``, initialised to the identity (= the dot score)."""

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(head_dim).repeat(num_heads, 1, 1))

    def transform_query(self, q: Tensor) -> Tensor:
        """``q W_h`` ``(B, H, L, D)``: the general score is the dot product of this with ``k``."""
        return general_query(q, self.weight)


class AdditiveScore(nn.Module):
    """Bahdanau's per-head parameters: ``w_q``, ``w_k`` ``(H, D, A)`` and ``w_v`` ``(H, A)``."""

    def __init__(self, num_heads: int, head_dim: int, attn_dim: int | None = None) -> None:
        super().__init__()
        attn_dim = attn_dim or head_dim
        self.w_q = nn.Parameter(torch.randn(num_heads, head_dim, attn_dim) / math.sqrt(head_dim))
        self.w_k = nn.Parameter(torch.randn(num_heads, head_dim, attn_dim) / math.sqrt(head_dim))
        self.w_v = nn.Parameter(torch.randn(num_heads, attn_dim) / math.sqrt(attn_dim))

    def project_keys(self, k: Tensor) -> Tensor:
        """``k W_k``: ``(B, H, Lk, D)`` -> ``(B, H, Lk, A)``, to pass as ``projected_keys`` when the same
        keys are scored again and again."""
        return torch.einsum("bhkd,hda->bhka", k, self.w_k)

    def forward(self, q: Tensor, k: Tensor, projected_keys: Tensor | None = None) -> Tensor:
        """Scores ``(B, H, Lq, Lk)``."""
        return additive_scores(q, k, self.w_q, self.w_k, self.w_v, projected_keys)
