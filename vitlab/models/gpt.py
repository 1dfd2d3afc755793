"""The decoder-only language model (seed 001, "Transformers for Language Modeling"; the GPT shape of
nanoGPT): token embedding + positions, a stack of causal pre-norm :class:`~vitlab.layers.Block` s,
a final norm and an output projection tied to the embedding.

Every block option applies (``norm_layer``, ``mlp_layer`` with MoE, ``score``, ``kernel``): the LM is
the same block with ``is_causal=True``. Decoding keeps each block's :class:`~vitlab.attention.KVCache`
(the recurrent state for ``kernel='linear'``).
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn.init import trunc_normal_

from ..attention import KernelName, KVCache, ScoreName, attention_dropout
from ..layers import Block, GradCheckpointing, MlpName, NormName, checkpointed, create_norm, \
    sinusoidal_position_encoding
from .decoding import sample_next
from .hub import HubMixin

__all__ = ["GPT"]


class GPT(nn.Module, HubMixin, GradCheckpointing):
    """Decoder-only Transformer language model: ids ``(B, L)`` -> next-token logits ``(B, L, vocab_size)``.

    Args:
        vocab_size: Vocabulary size ``V``.
        block_size: Longest context ``L`` (positions cover it; generation crops to it).
        embed_dim, depth, num_heads, mlp_ratio: Width, blocks, heads, MLP hidden width / width.
        dropout: Dropout on embeddings, attention weights (where the kernel forms them), projections, MLP.
        pos_embed: ``'learn'`` (a learned table, as GPT-2 / nanoGPT) or ``'sinusoidal'``.
        tie_weights: Tie the output projection to the token embedding.
        norm_layer, mlp_layer, act_layer, num_experts, moe_top_k, moe_expert_layer, moe_aux_loss_weight,
            score, kernel: The block variants (:class:`~vitlab.layers.Block`).
    """

    def __init__(self, vocab_size: int, block_size: int = 256, embed_dim: int = 384, depth: int = 6,
                 num_heads: int = 6, mlp_ratio: float = 4.0, dropout: float = 0.0,
                 pos_embed: Literal["learn", "sinusoidal"] = "learn", tie_weights: bool = True,
                 norm_layer: NormName = "layernorm", mlp_layer: MlpName = "mlp",
                 act_layer: Literal["gelu", "silu", "relu"] | None = None, num_experts: int = 4, moe_top_k: int = 2,
                 moe_expert_layer: Literal["mlp", "swiglu"] = "mlp", moe_aux_loss_weight: float = 0.01,
                 score: ScoreName = "dot", kernel: KernelName = "softmax") -> None:
        super().__init__()
        if pos_embed not in ("learn", "sinusoidal"):
            raise ValueError(f"unknown pos_embed {pos_embed!r} for a language model; expected 'learn' or 'sinusoidal'")
        if vocab_size < 1 or block_size < 1:
            raise ValueError(f"vocab_size={vocab_size} and block_size={block_size} must be >= 1")
        self.config = dict(vocab_size=vocab_size, block_size=block_size, embed_dim=embed_dim, depth=depth,
                           num_heads=num_heads, mlp_ratio=mlp_ratio, dropout=dropout, pos_embed=pos_embed,
                           tie_weights=tie_weights, norm_layer=norm_layer, mlp_layer=mlp_layer, act_layer=act_layer,
                           num_experts=num_experts, moe_top_k=moe_top_k, moe_expert_layer=moe_expert_layer,
                           moe_aux_loss_weight=moe_aux_loss_weight, score=score, kernel=kernel)
        self.vocab_size, self.block_size, self.embed_dim = vocab_size, block_size, embed_dim
        self.tok_embed = nn.Embedding(vocab_size, embed_dim)
        if pos_embed == "learn":
            self.pos_embed = nn.Parameter(torch.zeros(block_size, embed_dim))
        else:
            self.register_buffer("pos_embed", sinusoidal_position_encoding(block_size, embed_dim), persistent=False)
        self.drop = nn.Dropout(dropout)
        attn_drop = attention_dropout(dropout, kernel)
        self.blocks = nn.ModuleList([
            Block(embed_dim, num_heads, mlp_ratio, proj_drop=dropout, attn_drop=attn_drop, act=act_layer,
                  norm_layer=norm_layer, mlp_layer=mlp_layer, num_experts=num_experts, moe_top_k=moe_top_k,
                  moe_expert_layer=moe_expert_layer, moe_aux_loss_weight=moe_aux_loss_weight, score=score,
                  kernel=kernel, norm_eps=1e-5)
            for _ in range(depth)])
        self.norm = create_norm(norm_layer, embed_dim, 1e-5)
        self.head = nn.Linear(embed_dim, vocab_size, bias=False)
        self._init_weights()
        if tie_weights:
            self.head.weight = self.tok_embed.weight

    def _init_weights(self) -> None:
        """GPT-2's (as nanoGPT): normal(0, 0.02) for linears and embeddings, zero biases, and normal(0,
        0.02 / sqrt(2 * depth)) for the projections that add to the residual stream (each block's
        attention output and MLP output, every expert's in a MoE), so the stream's variance does not
        grow with depth; SwiGLU gates start open."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif m is not self and hasattr(m, "init_weights"):
                m.init_weights()
        for name, p in self.blocks.named_parameters():
            if name.endswith(("attn.proj.weight", "fc2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * len(self.blocks)))
        if isinstance(self.pos_embed, nn.Parameter):
            trunc_normal_(self.pos_embed, std=0.02)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"pos_embed"} if isinstance(self.pos_embed, nn.Parameter) else set()

    def forward(self, idx: Tensor, caches: list[KVCache] | None = None) -> Tensor:
        """Ids ``(B, L)`` -> logits ``(B, L, vocab_size)``; token ``i`` sees tokens ``<= i``.

        With ``caches`` (one :class:`KVCache` per block, e.g. ``model.new_caches()``), ``idx`` are
        the tokens after those the caches hold, and the caches are advanced.
        """
        if idx.dim() != 2:
            raise ValueError(f"expected token ids (batch, length), got shape {tuple(idx.shape)}")
        offset = len(caches[0]) if caches else 0
        if offset + idx.shape[1] > self.block_size:
            raise ValueError(f"sequence of length {offset + idx.shape[1]} exceeds block_size={self.block_size}; "
                             f"crop the context to the last {self.block_size} tokens")
        x = self.tok_embed(idx) + self.pos_embed[offset:offset + idx.shape[1]].to(self.tok_embed.weight.dtype)
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            if caches is None:
                x = checkpointed(self.grad_checkpointing, block, x, is_causal=True)
            else:
                x = block(x, is_causal=True, kv_cache=caches[i])
        return self.head(self.norm(x))

    @torch.no_grad()
    def get_attention_maps(self, idx: Tensor) -> list[Tensor]:
        """Every block's causal self-attention weights for ids ``(B, L)``: one ``(B, heads, L, L)`` per block
        (rows are queries and sum to 1; the explicit path, which training never takes)."""
        if idx.dim() != 2 or idx.shape[1] > self.block_size:
            raise ValueError(f"expected token ids (batch, length <= block_size={self.block_size}), got shape "
                             f"{tuple(idx.shape)}")
        x = self.tok_embed(idx) + self.pos_embed[:idx.shape[1]].to(self.tok_embed.weight.dtype)
        maps = []
        for block in self.blocks:
            x, weights = block(x, is_causal=True, need_weights=True)
            maps.append(weights)
        return maps

    def new_caches(self) -> list[KVCache]:
        return [KVCache() for _ in self.blocks]

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, use_cache: bool = True,
                 generator: torch.Generator | None = None) -> Tensor:
        """Continue ``idx`` ``(B, L)`` by ``max_new_tokens`` sampled tokens; returns ``(B, L + max_new_tokens)``.

        ``temperature=0`` or ``top_k=1`` is greedy. ``top_k`` keeps the k most likely tokens,
        ``top_p`` the smallest set whose probability reaches p (nucleus); ``generator`` makes sampling
        reproducible. The cache (keys/values, or the linear kernel's state) gives the same tokens as
        recomputing the prefix; once the context exceeds ``block_size`` both recompute on the last
        ``block_size`` tokens, as nanoGPT does.
        """
        caches = self.new_caches() if use_cache else None
        fed = 0  # tokens of idx the caches hold
        for _ in range(max_new_tokens):
            if idx.shape[1] > self.block_size or caches is None:
                logits = self(idx[:, -self.block_size:])[:, -1]
                caches = None if not use_cache or idx.shape[1] > self.block_size else caches
            else:
                logits = self(idx[:, fed:], caches)[:, -1]
                fed = idx.shape[1]
            idx = torch.cat([idx, sample_next(logits, temperature, top_k, top_p, generator)], dim=1)
        return idx
