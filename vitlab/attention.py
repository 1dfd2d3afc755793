"""The one attention core of vitlab: scaled dot-product attention and multi-head attention.

Everything in vitlab that attends (the ViT blocks, the text encoder and decoder) imports this
module; there is no second implementation.

Mask convention, everywhere in vitlab: a boolean mask is **True where a query may attend to a
key** (the convention of ``torch.nn.functional.scaled_dot_product_attention``; note that
``torch.nn.MultiheadAttention``'s boolean masks mean the opposite). A query whose keys are all
masked gets a zero output and zero attention weights, never NaN.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["scaled_dot_product_attention", "causal_mask", "KVCache", "MultiHeadAttention"]


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None) -> Tensor:
    """Boolean causal mask ``(q_len, k_len)``, True = may attend, aligned to the end.

    Query ``i`` sits at absolute position ``k_len - q_len + i`` and sees every key up to and
    including that position. With ``q_len == k_len`` this is the usual lower triangle; with
    ``q_len < k_len`` (decoding with a key/value cache) the new queries see the whole past.
    """
    offset = k_len - q_len
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=offset)


def _check_mask(mask: Tensor, q: Tensor, k: Tensor) -> None:
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
    the explicit path below runs. Both give the same output.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be (batch, heads, length, head_dim); got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    q_len, k_len = q.shape[-2], k.shape[-2]
    if mask is not None:
        _check_mask(mask, q, k)
    if not need_weights and mask is None and (not is_causal or q_len == k_len):
        # The fast path: no mask tensor, so flash / memory-efficient kernels can run.
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    if is_causal:
        causal = causal_mask(q_len, k_len, device=q.device)
        mask = causal if mask is None else mask & causal

    # A query with no visible key would get softmax over all -inf = NaN. Let such rows attend
    # everywhere (finite forward and backward) and zero them afterwards; no host sync needed.
    has_key = None
    if mask is not None:
        has_key = mask.any(dim=-1, keepdim=True)  # (..., Lq, 1)
        mask = mask | ~has_key

    if not need_weights:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
        return out if has_key is None else out.masked_fill(~has_key, 0.0)

    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1)
    if has_key is not None:
        weights = weights.masked_fill(~has_key, 0.0)
    out = F.dropout(weights, p=dropout_p) @ v if dropout_p > 0.0 else weights @ v
    return out, weights


@dataclass
class KVCache:
    """Keys and values of one attention layer kept across decoding steps.

    ``key`` and ``value`` are ``(B, H, L, D)``. A self-attention cache grows by the new tokens
    at each step; a cross-attention cache (``static=True``) is filled once from the context and
    then reused, so the encoder output is projected once per source.
    """

    key: Tensor | None = None
    value: Tensor | None = None
    static: bool = False

    def __len__(self) -> int:
        return 0 if self.key is None else self.key.shape[-2]

    def reorder(self, index: Tensor) -> None:
        """Select batch rows in place (beam search): ``key = key[index]``."""
        if self.key is not None:
            self.key = self.key.index_select(0, index)
            self.value = self.value.index_select(0, index)


class MultiHeadAttention(nn.Module):
    """Multi-head attention for self-attention ``attn(x)`` and cross-attention ``attn(x, context)``.

    Parameters are named as in timm's ``Attention`` (``qkv``: the stacked query, key and value
    projections, ``proj``: the output projection), so ViT checkpoints map one to one.

    Args:
        embed_dim: Model width ``E``; must be divisible by ``num_heads``.
        num_heads: Number of heads ``H``; each has ``E / H`` channels.
        qkv_bias: Bias on the query/key/value projections.
        attn_drop: Dropout on the attention weights.
        proj_drop: Dropout after the output projection.
        proj_bias: Bias on the output projection.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        proj_bias: bool = True,
    ) -> None:
        super().__init__()
        if num_heads <= 0 or embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}; choose num_heads "
                f"among the divisors of embed_dim (e.g. {_divisors(embed_dim)})"
            )
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(embed_dim, embed_dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)

    def _split_heads(self, t: Tensor) -> Tensor:
        b, n, _ = t.shape  # (B, L, E) -> (B, H, L, D)
        return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def _project(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        if context is None:  # self-attention: one matmul for q, k, v
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        else:  # cross-attention: queries from x, keys and values from context
            q = F.linear(x, *self._qkv_params(0, 1))
            k, v = F.linear(context, *self._qkv_params(1, 3)).chunk(2, dim=-1)
        return self._split_heads(q), self._split_heads(k), self._split_heads(v)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        key_mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x`` to itself, or to ``context``.

        Args:
            x: Queries' input ``(B, Lq, E)``.
            context: Keys' and values' input ``(B, Lk, E)`` for cross-attention; None for
                self-attention. With a filled static ``kv_cache`` it may be None.
            mask: Boolean mask broadcastable to ``(B, H, Lq, Lk)``; **True = may attend**.
            is_causal: Causal self-attention (aligned to the end when a cache holds the past).
            need_weights: Also return the attention weights ``(B, H, Lq, Lk)``.
            key_mask: Boolean ``(B, Lk)``; **True = real token** (may be attended to).
            kv_cache: Incremental decoding state, updated in place: self-attention appends the
                new keys and values; a ``static`` cache (cross-attention) is filled once.

        Returns:
            ``(B, Lq, E)``, or ``(output, weights)`` when ``need_weights``.
        """
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"expected input (batch, length, embed_dim={self.embed_dim}), got {tuple(x.shape)}")
        if context is not None and (context.dim() != 3 or context.shape[-1] != self.embed_dim
                                    or context.shape[0] != x.shape[0]):
            raise ValueError(
                f"expected context (batch={x.shape[0]}, length, embed_dim={self.embed_dim}), "
                f"got {tuple(context.shape)}")

        if kv_cache is not None and kv_cache.static and kv_cache.key is not None:
            q = self._split_heads(F.linear(x, *self._qkv_params(0, 1)))
            k, v = kv_cache.key, kv_cache.value
        else:
            q, k, v = self._project(x, context)
            if kv_cache is not None:
                if not kv_cache.static and kv_cache.key is not None:
                    k = torch.cat([kv_cache.key, k], dim=2)
                    v = torch.cat([kv_cache.value, v], dim=2)
                kv_cache.key, kv_cache.value = k, v

        if key_mask is not None:
            if key_mask.dtype != torch.bool or key_mask.shape != (x.shape[0], k.shape[2]):
                raise ValueError(
                    f"key_mask must be boolean (batch, k_len) = {(x.shape[0], k.shape[2])} with "
                    f"True = real token; got {key_mask.dtype} {tuple(key_mask.shape)}")
            km = key_mask[:, None, None, :]
            mask = km if mask is None else mask & km

        result = scaled_dot_product_attention(
            q, k, v, mask=mask, is_causal=is_causal, need_weights=need_weights,
            dropout_p=self.attn_drop if self.training else 0.0,
        )
        out, weights = result if need_weights else (result, None)
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], self.embed_dim)  # (B, Lq, E)
        out = self.proj_drop(self.proj(out))
        return (out, weights) if need_weights else out

    def _qkv_params(self, start: int, stop: int) -> tuple[Tensor, Tensor | None]:
        """Rows of the stacked projection for q (0, 1), k (1, 2), v (2, 3) or k and v (1, 3)."""
        rows = slice(start * self.embed_dim, stop * self.embed_dim)
        bias = None if self.qkv.bias is None else self.qkv.bias[rows]
        return self.qkv.weight[rows], bias

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, attn_drop={self.attn_drop}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0][:8]
