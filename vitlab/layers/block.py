"""Transformer blocks shared by every model: the encoder block (the ViT's and the text encoder's) and the
decoder block (causal self-attention + cross-attention).

Parameter names follow timm (``norm1``, ``attn``, ``norm2``, ``mlp.fc1``, ``mlp.fc2``) so that a timm ViT
checkpoint maps onto vitlab one key to one key. Every variant is an option of the same block:
``norm_layer`` (layernorm | rmsnorm), ``mlp_layer`` (mlp | swiglu | moe, with ``num_experts``,
``moe_top_k``, ``moe_expert_layer``, ``moe_aux_loss_weight``), the attention's ``score``, ``kernel`` and
``qk_norm`` (:class:`~vitlab.attention.MultiHeadAttention`), and LayerScale (``init_values``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..attention import KVCache, MultiHeadAttention, attention_dropout
from .drop import DropPath
from .ffn import create_mlp
from .norm import create_norm

__all__ = ["Block", "DecoderBlock", "DecoderCache", "LayerScale"]


class LayerScale(nn.Module):
    """A learned per-channel scale of a residual branch, ``x * gamma`` on ``(..., dim)``, ``gamma``
    starting at ``init_values`` (Touvron et al. 2021, CaiT; DeiT III): timm's ``LayerScale``, its name."""

    def __init__(self, dim: int, init_values: float = 1e-5) -> None:
        super().__init__()
        self.init_values = init_values
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))

    def init_weights(self) -> None:
        nn.init.constant_(self.gamma, self.init_values)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class Block(nn.Module):
    """Transformer encoder block on ``(B, N, dim)``: the ViT block and the text encoder layer.

    Pre-norm (``norm_first=True``, ViT): ``x = x + drop_path(attn(norm1(x)))``, then
    ``x = x + drop_path(mlp(norm2(x)))``. Post-norm (the 2017 paper): ``x = norm1(x + attn(x))``,
    then ``x = norm2(x + mlp(x))``.

    Args:
        dim: Token width.
        num_heads: Attention heads.
        mlp_ratio: MLP hidden width as a multiple of ``dim`` (ignored if ``mlp_hidden_dim`` is given).
        qkv_bias: Bias on the query/key/value projections.
        proj_drop: Dropout after the attention projection and in the MLP.
        attn_drop: Dropout on attention weights.
        drop_path: Stochastic depth rate.
        act: MLP activation (None: GELU for ``mlp``, SiLU for ``swiglu``).
        norm_first: Pre-norm (True) or post-norm (False).
        norm_eps: Norm epsilon (1e-6 as in ViT; PyTorch's Transformer uses 1e-5).
        mlp_hidden_dim: MLP hidden width.
        norm_layer: ``'layernorm'`` or ``'rmsnorm'``.
        mlp_layer: ``'mlp'``, ``'swiglu'`` or ``'moe'``.
        num_experts, moe_top_k, moe_expert_layer, moe_aux_loss_weight: The mixture of experts
            (``mlp_layer='moe'``), see :class:`~vitlab.layers.MoE`.
        score, kernel: The attention's score function and kernel.
        init_values: LayerScale on both residual branches (``ls1``, ``ls2``), starting at this value; None: none.
        qk_norm: Normalize queries and keys per head with the block's norm (timm's ``qk_norm``).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        act: str | None = None,
        norm_first: bool = True,
        norm_eps: float = 1e-6,
        mlp_hidden_dim: int | None = None,
        norm_layer: str = "layernorm",
        mlp_layer: str = "mlp",
        num_experts: int = 4,
        moe_top_k: int = 2,
        moe_expert_layer: str = "mlp",
        moe_aux_loss_weight: float = 0.01,
        score: str = "dot",
        kernel: str = "softmax",
        init_values: float | None = None,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.norm1 = create_norm(norm_layer, dim, norm_eps)
        self.attn = MultiHeadAttention(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop,
                                       score=score, kernel=kernel, qk_norm=norm_layer if qk_norm else None)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = create_norm(norm_layer, dim, norm_eps)
        self.mlp = create_mlp(mlp_layer, dim, mlp_hidden_dim or int(dim * mlp_ratio), act, proj_drop, num_experts,
                              moe_top_k, moe_expert_layer, moe_aux_loss_weight)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: Tensor, mask: Tensor | None = None, key_mask: Tensor | None = None,
                need_weights: bool = False, is_causal: bool = False,
                kv_cache: KVCache | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """``x`` ``(B, N, dim)``; ``mask`` / ``key_mask`` as in :class:`MultiHeadAttention` (True = may attend /
        real token); ``is_causal`` and ``kv_cache`` make it a decoder-only block. Returns ``(B, N, dim)``, or
        ``(x, weights)`` with weights ``(B, H, N, N)`` if asked."""
        h = self.norm1(x) if self.norm_first else x
        attn = self.attn(h, mask=mask, key_mask=key_mask, need_weights=need_weights, is_causal=is_causal,
                         kv_cache=kv_cache)
        attn, weights = attn if need_weights else (attn, None)
        if self.norm_first:
            x = x + self.drop_path1(self.ls1(attn))
            x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        else:
            x = self.norm1(x + self.drop_path1(self.ls1(attn)))
            x = self.norm2(x + self.drop_path2(self.ls2(self.mlp(x))))
        return (x, weights) if need_weights else x


@dataclass
class DecoderCache:
    """One decoder layer's decoding state: its self-attention keys/values (growing) and its
    cross-attention keys/values (projected once from the encoder output)."""

    self_attn: KVCache = field(default_factory=KVCache)
    cross_attn: KVCache = field(default_factory=lambda: KVCache(static=True))

    def reorder(self, index: Tensor) -> None:
        self.self_attn.reorder(index)
        self.cross_attn.reorder(index)


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention over the encoder output, feed-forward; pre- or post-norm.

    Takes the variant options of :class:`Block` (norm, MLP, attention score and kernel); attention-weight
    dropout applies where the kernel forms the weights (softmax, argmax).
    """

    def __init__(self, dim: int, num_heads: int, dim_feedforward: int, dropout: float = 0.1, act: str | None = "relu",
                 norm_first: bool = True, norm_eps: float = 1e-5, norm_layer: str = "layernorm",
                 mlp_layer: str = "mlp", num_experts: int = 4, moe_top_k: int = 2, moe_expert_layer: str = "mlp",
                 moe_aux_loss_weight: float = 0.01, score: str = "dot", kernel: str = "softmax") -> None:
        super().__init__()
        attn = dict(attn_drop=attention_dropout(dropout, kernel), proj_drop=dropout, score=score, kernel=kernel)
        self.norm_first = norm_first
        self.norm1 = create_norm(norm_layer, dim, norm_eps)
        self.self_attn = MultiHeadAttention(dim, num_heads, **attn)
        self.norm2 = create_norm(norm_layer, dim, norm_eps)
        self.cross_attn = MultiHeadAttention(dim, num_heads, **attn)
        self.norm3 = create_norm(norm_layer, dim, norm_eps)
        self.mlp = create_mlp(mlp_layer, dim, dim_feedforward, act, dropout, num_experts, moe_top_k, moe_expert_layer,
                              moe_aux_loss_weight)

    def forward(self, x: Tensor, memory: Tensor | None, memory_key_mask: Tensor | None = None,
                tgt_key_mask: Tensor | None = None, cache: DecoderCache | None = None,
                need_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """``x`` ``(B, T, dim)`` (only the new positions when ``cache`` holds the past), ``memory``
        ``(B, S, dim)`` (may be None once ``cache`` holds the cross-attention keys). With ``need_weights``
        also the cross-attention weights ``(B, H, T, S)`` (the explicit path; training never asks)."""
        self_cache = cache.self_attn if cache is not None else None
        cross_cache = cache.cross_attn if cache is not None else None
        weights: list[Tensor] = []

        def self_attn(h: Tensor) -> Tensor:
            return self.self_attn(h, is_causal=True, key_mask=tgt_key_mask, kv_cache=self_cache)

        def cross_attn(h: Tensor) -> Tensor:
            if not need_weights:
                return self.cross_attn(h, memory, key_mask=memory_key_mask, kv_cache=cross_cache)
            out, w = self.cross_attn(h, memory, key_mask=memory_key_mask, kv_cache=cross_cache, need_weights=True)
            weights.append(w)
            return out

        if self.norm_first:
            x = x + self_attn(self.norm1(x))
            x = x + cross_attn(self.norm2(x))
            x = x + self.mlp(self.norm3(x))
        else:
            x = self.norm1(x + self_attn(x))
            x = self.norm2(x + cross_attn(x))
            x = self.norm3(x + self.mlp(x))
        return (x, weights[0]) if need_weights else x
