"""Multi-head attention, with the score function and the kernel as options, and its decoding cache.

Every block in vitlab (the ViT's, the text encoder's and decoder's) attends through
:class:`MultiHeadAttention`; a variant is a constructor option, never a second module:

==========  ==================================================================================
score       ``dot`` (scaled; default), ``general`` (Luong, ``q^T W k``), ``additive`` (Bahdanau)
kernel      ``softmax`` (default; PyTorch's fused kernel where it can run), ``streaming`` (exact
            softmax over key blocks, O(L x block) memory), ``argmax`` (hard attention,
            straight-through gradients), ``linear`` (elu + 1 feature map, O(L))
==========  ==================================================================================

Combinations: ``linear`` needs the ``dot`` score; ``streaming`` a dot-product score (``dot`` or
``general``); attention-weight dropout needs a kernel that forms the weights (``softmax``, ``argmax``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from .core import attend_scores, check_key_mask, full_mask, scaled_dot_product_attention
from .kernels import LinearAttentionState, linear_attention, streaming_attention
from .scores import AdditiveScore, GeneralScore

__all__ = ["KVCache", "MultiHeadAttention", "attend", "attention_dropout", "ScoreName", "KernelName", "SCORES", "KERNELS", "KERNELS_WITH_DROPOUT",
           "check_attention_options"]

ScoreName = Literal["dot", "general", "additive"]
KernelName = Literal["softmax", "streaming", "argmax", "linear"]
SCORES: tuple[str, ...] = ("dot", "general", "additive")
KERNELS: tuple[str, ...] = ("softmax", "streaming", "argmax", "linear")
#: Kernels that form the attention weights, and so can drop them out.
KERNELS_WITH_DROPOUT: tuple[str, ...] = ("softmax", "argmax")


@dataclass
class KVCache:
    """One attention layer's decoding state, kept across steps.

    Softmax-like kernels keep ``key`` and ``value`` ``(B, H, L, D)``; the linear kernel keeps only its
    recurrent :class:`~vitlab.attention.LinearAttentionState` (constant size). A self-attention cache
    grows by the new tokens at each step; a cross-attention cache (``static=True``) is filled once
    from the context and then reused, so the encoder output is projected once per source.
    """

    key: Tensor | None = None
    value: Tensor | None = None
    static: bool = False
    state: LinearAttentionState | None = None
    length: int = 0

    def __len__(self) -> int:
        return self.length

    @property
    def filled(self) -> bool:
        return self.key is not None or self.state is not None

    def reorder(self, index: Tensor) -> None:
        """Select batch rows in place (beam search): ``key = key[index]``."""
        if self.key is not None:
            self.key = self.key.index_select(0, index)
            self.value = self.value.index_select(0, index)
        if self.state is not None:
            self.state.reorder(index)


class MultiHeadAttention(nn.Module):
    """Multi-head attention for self-attention ``attn(x)`` and cross-attention ``attn(x, context)``.

    Parameters are named as in timm's ``Attention`` (``qkv``: the stacked query, key and value
    projections, ``proj``: the output projection), so ViT checkpoints map one to one; a
    ``general`` or ``additive`` score adds its per-head parameters under ``score``.

    Args:
        embed_dim: Model width ``E``; must be divisible by ``num_heads``.
        num_heads: Number of heads ``H``; each has ``E / H`` channels.
        qkv_bias: Bias on the query/key/value projections.
        attn_drop: Dropout on the attention weights (softmax and argmax kernels).
        proj_drop: Dropout after the output projection.
        proj_bias: Bias on the output projection.
        score: ``'dot'``, ``'general'`` or ``'additive'`` (see the module docstring).
        kernel: ``'softmax'``, ``'streaming'``, ``'argmax'`` or ``'linear'``.
        block_size: Key block of the streaming kernel.
        qk_norm: Normalize each head's queries and keys before the scores (``q_norm``, ``k_norm``: timm's
            ``qk_norm``, as ViT-22B and recent ViTs): ``'layernorm'`` or ``'rmsnorm'`` (eps 1e-6), or None.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        proj_bias: bool = True,
        score: ScoreName = "dot",
        kernel: KernelName = "softmax",
        block_size: int = 128,
        qk_norm: Literal["layernorm", "rmsnorm"] | None = None,
    ) -> None:
        super().__init__()
        if num_heads <= 0 or embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}; choose num_heads "
                f"among the divisors of embed_dim (e.g. {_divisors(embed_dim)})"
            )
        check_attention_options(score, kernel, attn_drop)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.score_type, self.kernel, self.block_size = score, kernel, block_size
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=qkv_bias)
        norm = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}.get(qk_norm) if qk_norm else None
        if qk_norm and norm is None:
            raise ValueError(f"qk_norm={qk_norm!r}: expected 'layernorm', 'rmsnorm' or None")
        self.q_norm = norm(self.head_dim, eps=1e-6) if norm else nn.Identity()
        self.k_norm = norm(self.head_dim, eps=1e-6) if norm else nn.Identity()
        self.score: nn.Module | None = (GeneralScore(num_heads, self.head_dim) if score == "general" else
                                        AdditiveScore(num_heads, self.head_dim) if score == "additive" else None)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(embed_dim, embed_dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)

    def _split_heads(self, t: Tensor) -> Tensor:
        return rearrange(t, "b l (h d) -> b h l d", h=self.num_heads)

    def _project(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        if context is None:  # self-attention: one matmul for q, k, v
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        else:  # cross-attention: queries from x, keys and values from context
            q = F.linear(x, *self._qkv_params(0, 1))
            k, v = F.linear(context, *self._qkv_params(1, 3)).chunk(2, dim=-1)
        return self.q_norm(self._split_heads(q)), self.k_norm(self._split_heads(k)), self._split_heads(v)

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
            mask: Boolean mask broadcastable to ``(B, H, Lq, Lk)``; **True = may attend**. The
                linear kernel takes no such mask (only ``key_mask`` and ``is_causal``).
            is_causal: Causal self-attention (aligned to the end when a cache holds the past).
            need_weights: Also return the attention weights ``(B, H, Lq, Lk)`` the kernel used
                (the linear kernel's implied normalised weights; the streaming kernel's equal
                softmax weights, computed explicitly).
            key_mask: Boolean ``(B, Lk)``; **True = real token** (may be attended to).
            kv_cache: Incremental decoding state, updated in place: self-attention appends the
                new keys and values (the linear kernel: advances its state); a ``static`` cache
                (cross-attention) is filled once.

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
        if self.kernel == "linear":
            result = self._attend_linear(x, context, mask, is_causal, need_weights, key_mask, kv_cache)
        else:
            q, k, v = self._cached_qkv(x, context, kv_cache)
            if key_mask is not None:
                check_key_mask(key_mask, x.shape[0], k.shape[2])
                km = key_mask[:, None, None, :]
                mask = km if mask is None else mask & km
            result = self._attend(q, k, v, mask, is_causal, need_weights)
        out, weights = result if need_weights else (result, None)
        out = self.proj_drop(self.proj(rearrange(out, "b h l d -> b l (h d)")))
        return (out, weights) if need_weights else out

    def _cached_qkv(self, x: Tensor, context: Tensor | None, cache: KVCache | None) -> tuple[Tensor, Tensor, Tensor]:
        if cache is not None and cache.static and cache.filled:
            return self.q_norm(self._split_heads(F.linear(x, *self._qkv_params(0, 1)))), cache.key, cache.value
        q, k, v = self._project(x, context)
        if cache is not None:
            if not cache.static and cache.key is not None:
                k = torch.cat([cache.key, k], dim=2)
                v = torch.cat([cache.value, v], dim=2)
            cache.key, cache.value, cache.length = k, v, k.shape[2]
        return q, k, v

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                need_weights: bool) -> Tensor | tuple[Tensor, Tensor]:
        return attend(q, k, v, self.score, self.kernel, mask=mask, is_causal=is_causal, need_weights=need_weights,
                      dropout_p=self.attn_drop if self.training else 0.0, scale=self.head_dim ** -0.5,
                      block_size=self.block_size)

    def _attend_linear(self, x: Tensor, context: Tensor | None, mask: Tensor | None, is_causal: bool,
                       need_weights: bool, key_mask: Tensor | None, cache: KVCache | None) -> Tensor | tuple[Tensor, Tensor]:
        if mask is not None:
            raise ValueError("kernel='linear' honours key padding (key_mask) and causality (is_causal) only, not an "
                             "arbitrary attention mask; pass key_mask=..., or use kernel='softmax'")
        if cache is not None and cache.static and cache.filled:  # cross-attention to a context seen before
            if need_weights:
                raise ValueError("need_weights with a filled linear cross-attention cache: the keys are no longer "
                                 "kept; ask for weights without a cache")
            return cache.state.readout(self.q_norm(self._split_heads(F.linear(x, *self._qkv_params(0, 1)))))
        q, k, v = self._project(x, context)
        past = cache.length if cache is not None and not cache.static else 0
        if key_mask is not None:
            check_key_mask(key_mask, x.shape[0], past + k.shape[2])
            key_mask = key_mask[:, past:]
        result = linear_attention(q, k, v, key_mask=key_mask, is_causal=is_causal, need_weights=need_weights,
                                  state=cache.state if cache is not None else None, return_state=cache is not None)
        if cache is None:
            return result
        *result, cache.state = result
        cache.length = past + k.shape[2]
        return tuple(result) if need_weights else result[0]

    def _qkv_params(self, start: int, stop: int) -> tuple[Tensor, Tensor | None]:
        """Rows of the stacked projection for q (0, 1), k (1, 2), v (2, 3) or k and v (1, 3)."""
        rows = slice(start * self.embed_dim, stop * self.embed_dim)
        bias = None if self.qkv.bias is None else self.qkv.bias[rows]
        return self.qkv.weight[rows], bias

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, score={self.score_type}, "
                f"kernel={self.kernel}, attn_drop={self.attn_drop}")


def attend(q: Tensor, k: Tensor, v: Tensor, score: nn.Module | None = None, kernel: str = "softmax",
           mask: Tensor | None = None, is_causal: bool = False, need_weights: bool = False, dropout_p: float = 0.0,
           scale: float | None = None, block_size: int = 128,
           projected_keys: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Attention with a score function and a softmax-like kernel, on ``(B, H, L, D)`` tensors.

    Args:
        score: None for the dot product, a :class:`GeneralScore` or an :class:`AdditiveScore`.
        kernel: ``'softmax'``, ``'streaming'`` or ``'argmax'`` (``'linear'`` has its own state and
            mask rules: :func:`~vitlab.attention.linear_attention`).
        scale: Scale of dot-product scores (default ``1 / sqrt(D)``; Luong's and Bahdanau's use 1).
        mask, is_causal, need_weights, dropout_p: As in :func:`scaled_dot_product_attention`.
        projected_keys: Additive score only: ``score.project_keys(k)``, computed once for keys that are
            attended to again and again (the RNN decoder's annotations).
    """
    hard = kernel == "argmax"
    if projected_keys is not None and not isinstance(score, AdditiveScore):
        raise ValueError("projected_keys belongs to the additive score; the dot and general scores take k as is")
    if isinstance(score, AdditiveScore):
        return attend_scores(score(q, k, projected_keys), v, full_mask(q, k, mask, is_causal), hard=hard, dropout_p=dropout_p,
                             need_weights=need_weights)
    if isinstance(score, GeneralScore):
        q = score.transform_query(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if hard:
        return attend_scores((q @ k.transpose(-2, -1)) * scale, v, full_mask(q, k, mask, is_causal), hard=True,
                             dropout_p=dropout_p, need_weights=need_weights)
    if kernel == "streaming" and not need_weights:
        return streaming_attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale, block_size=block_size)
    return scaled_dot_product_attention(q, k, v, mask=mask, is_causal=is_causal, dropout_p=dropout_p,
                                        need_weights=need_weights, scale=scale)


def attention_dropout(dropout: float, kernel: str) -> float:
    """A model's dropout rate as attention-weight dropout: ``dropout`` where ``kernel`` forms the
    weights (softmax, argmax), 0 where it never does (linear, streaming)."""
    return dropout if kernel in KERNELS_WITH_DROPOUT else 0.0


def check_attention_options(score: str, kernel: str, attn_drop: float = 0.0) -> None:
    """Raise a ``ValueError`` naming the allowed values for an unknown or unsupported combination."""
    if score not in SCORES:
        raise ValueError(f"unknown attention score {score!r}; expected one of {', '.join(SCORES)}")
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; expected one of {', '.join(KERNELS)}")
    if kernel == "linear" and score != "dot":
        raise ValueError(f"kernel='linear' factorises the dot product; it cannot use score={score!r} (use score='dot')")
    if kernel == "streaming" and score == "additive":
        raise ValueError("kernel='streaming' streams dot-product scores; score='additive' needs kernel='softmax' or "
                         "'argmax'")
    if attn_drop > 0 and kernel not in KERNELS_WITH_DROPOUT:
        raise ValueError(f"kernel={kernel!r} never forms the attention weights, so it has no attention dropout "
                         f"(attn_drop={attn_drop}); set the attention dropout to 0")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0][:8]
