"""The encoder-decoder Transformer of "Attention Is All You Need", on vitlab's attention core.

Encoder layers are the ViT's :class:`~vitlab.layers.Block`; decoder layers
(:class:`~vitlab.layers.DecoderBlock`) add causal self-attention and cross-attention, all three from
:class:`~vitlab.attention.MultiHeadAttention`, with the same variant options (norm, MLP, score, kernel). Batch first;
key masks are boolean ``(B, L)`` with **True = real token**.
"""
from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.init import trunc_normal_

from ..attention import KernelName, ScoreName, attention_dropout
from ..layers import Block, DecoderBlock, DecoderCache, GradCheckpointing, MlpName, NormName, checkpointed, \
    create_norm, sinusoidal_position_encoding
from .decoding import beam_search, greedy_search
from .hub import HubMixin

__all__ = ["Transformer", "Seq2SeqTransformer"]


class Transformer(nn.Module, GradCheckpointing):
    """The encoder-decoder core on embeddings, batch first (``torch.nn.Transformer``'s layout).

    Args:
        d_model: Width.
        num_heads: Attention heads.
        num_encoder_layers: Encoder blocks.
        num_decoder_layers: Decoder blocks.
        dim_feedforward: Feed-forward hidden width.
        dropout: Dropout on attention weights, after each sub-layer and in the feed-forward.
        activation: ``'relu'`` (the paper) or ``'gelu'``.
        norm_first: Pre-norm (True) or post-norm (False, the paper). A final LayerNorm closes the
            encoder and the decoder either way, as in ``torch.nn.Transformer``.
        norm_eps: Norm epsilon (PyTorch's default, 1e-5).
        variant: Options of every block (``norm_layer``, ``mlp_layer``, ``num_experts``, ``moe_top_k``,
            ``moe_expert_layer``, ``moe_aux_loss_weight``, ``score``, ``kernel``; see
            :class:`~vitlab.layers.Block`). Attention-weight dropout applies where the kernel forms
            the weights (softmax, argmax).
    """

    def __init__(self, d_model: int = 512, num_heads: int = 8, num_encoder_layers: int = 6,
                 num_decoder_layers: int = 6, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = True, norm_eps: float = 1e-5, **variant: Any) -> None:
        super().__init__()
        self.d_model = d_model
        norm_layer = variant.get("norm_layer", "layernorm")
        attn_drop = attention_dropout(dropout, variant.get("kernel", "softmax"))
        self.encoder_layers = nn.ModuleList([
            Block(d_model, num_heads, proj_drop=dropout, attn_drop=attn_drop, act=activation, norm_first=norm_first,
                  norm_eps=norm_eps, mlp_hidden_dim=dim_feedforward, **variant)
            for _ in range(num_encoder_layers)])
        self.encoder_norm = create_norm(norm_layer, d_model, norm_eps)
        self.decoder_layers = nn.ModuleList([
            DecoderBlock(d_model, num_heads, dim_feedforward, dropout, activation, norm_first, norm_eps, **variant)
            for _ in range(num_decoder_layers)])
        self.decoder_norm = create_norm(norm_layer, d_model, norm_eps)

    def encode(self, src: Tensor, src_key_mask: Tensor | None = None) -> Tensor:
        """``src`` ``(B, S, d_model)`` -> memory ``(B, S, d_model)``."""
        for layer in self.encoder_layers:
            src = checkpointed(self.grad_checkpointing, layer, src, key_mask=src_key_mask)
        return self.encoder_norm(src)

    def decode(self, tgt: Tensor, memory: Tensor | None, src_key_mask: Tensor | None = None,
               tgt_key_mask: Tensor | None = None, caches: list[DecoderCache] | None = None) -> Tensor:
        """``tgt`` ``(B, T, d_model)`` attending causally to itself and to ``memory`` -> ``(B, T, d_model)``."""
        for i, layer in enumerate(self.decoder_layers):
            if caches is None:
                tgt = checkpointed(self.grad_checkpointing, layer, tgt, memory, src_key_mask, tgt_key_mask)
            else:
                tgt = layer(tgt, memory, src_key_mask, tgt_key_mask, caches[i])
        return self.decoder_norm(tgt)

    def forward(self, src: Tensor, tgt: Tensor, src_key_mask: Tensor | None = None,
                tgt_key_mask: Tensor | None = None) -> Tensor:
        """Embedded ``src`` ``(B, S, E)`` and ``tgt`` ``(B, T, E)`` -> ``(B, T, E)``; the decoder is causal."""
        return self.decode(tgt, self.encode(src, src_key_mask), src_key_mask, tgt_key_mask)


class Seq2SeqTransformer(nn.Module, HubMixin, GradCheckpointing):
    """Token-to-token Transformer: scaled embeddings + positions, the core, an output projection.

    Args:
        src_vocab_size: Source vocabulary size.
        tgt_vocab_size: Target vocabulary size.
        d_model, num_heads, num_encoder_layers, num_decoder_layers, dim_feedforward, dropout, activation,
            norm_first: As in :class:`Transformer`.
        pad_id, bos_id, eos_id: Special token ids (shared by both vocabularies).
        share_embeddings: One embedding matrix for source, target and the output projection
            (needs one joint vocabulary); otherwise the output projection is still tied to the target
            embedding when ``tie_output``.
        tie_output: Tie the output projection to the target embedding.
        max_len: Longest sequence the position encoding covers.
        pos_embed: ``'sinusoidal'`` (fixed, the paper) or ``'learn'`` (a learned table).
        norm_layer, mlp_layer, num_experts, moe_top_k, moe_expert_layer, moe_aux_loss_weight, score, kernel:
            The block variants (:class:`~vitlab.layers.Block`).
    """

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, d_model: int = 512, num_heads: int = 8,
                 num_encoder_layers: int = 6, num_decoder_layers: int = 6, dim_feedforward: int = 2048,
                 dropout: float = 0.1, activation: str = "relu", norm_first: bool = True, pad_id: int = 0,
                 bos_id: int = 1, eos_id: int = 2, share_embeddings: bool = False, tie_output: bool = True,
                 max_len: int = 1024, pos_embed: Literal["sinusoidal", "learn"] = "sinusoidal",
                 norm_layer: NormName = "layernorm", mlp_layer: MlpName = "mlp", num_experts: int = 4,
                 moe_top_k: int = 2, moe_expert_layer: Literal["mlp", "swiglu"] = "mlp",
                 moe_aux_loss_weight: float = 0.01, score: ScoreName = "dot", kernel: KernelName = "softmax") -> None:
        super().__init__()
        if share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError(f"share_embeddings needs one vocabulary, got src_vocab_size={src_vocab_size} and "
                             f"tgt_vocab_size={tgt_vocab_size}")
        self.config = dict(src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size, d_model=d_model,
                           num_heads=num_heads, num_encoder_layers=num_encoder_layers,
                           num_decoder_layers=num_decoder_layers, dim_feedforward=dim_feedforward, dropout=dropout,
                           activation=activation, norm_first=norm_first, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id,
                           share_embeddings=share_embeddings, tie_output=tie_output, max_len=max_len,
                           pos_embed=pos_embed)
        variant = dict(norm_layer=norm_layer, mlp_layer=mlp_layer, num_experts=num_experts, moe_top_k=moe_top_k,
                       moe_expert_layer=moe_expert_layer, moe_aux_loss_weight=moe_aux_loss_weight, score=score,
                       kernel=kernel)
        self.config.update(variant)
        if pos_embed not in ("sinusoidal", "learn"):
            raise ValueError(f"unknown pos_embed {pos_embed!r} for a text model; expected 'sinusoidal' or 'learn'")
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.d_model = d_model
        self.src_embed = nn.Embedding(src_vocab_size, d_model, padding_idx=pad_id)
        self.tgt_embed = self.src_embed if share_embeddings else nn.Embedding(tgt_vocab_size, d_model,
                                                                              padding_idx=pad_id)
        if pos_embed == "learn":
            self.pos_encoding = nn.Parameter(trunc_normal_(torch.empty(max_len, d_model), std=0.02))
        else:
            self.register_buffer("pos_encoding", sinusoidal_position_encoding(max_len, d_model), persistent=False)
        self.embed_drop = nn.Dropout(dropout)
        self.transformer = Transformer(d_model, num_heads, num_encoder_layers, num_decoder_layers, dim_feedforward,
                                       dropout, activation, norm_first, **variant)
        self.head = nn.Linear(d_model, tgt_vocab_size, bias=False)
        self._init_weights()
        if share_embeddings or tie_output:
            self.head.weight = self.tgt_embed.weight

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() > 1 and "embed" not in name and name != "pos_encoding" and ".score." not in name:
                nn.init.xavier_uniform_(p)
        # source then target, once where tied (a set's order is the modules' addresses, not a function of the seed)
        for emb in dict.fromkeys((self.src_embed, self.tgt_embed)):
            nn.init.normal_(emb.weight, std=self.d_model ** -0.5)  # times sqrt(d_model): unit scale
            with torch.no_grad():
                emb.weight[self.pad_id].zero_()

    def _embed(self, tokens: Tensor, embedding: nn.Embedding, offset: int = 0) -> Tensor:
        if tokens.shape[1] + offset > self.pos_encoding.shape[0]:
            raise ValueError(f"sequence of length {tokens.shape[1] + offset} exceeds max_len={self.pos_encoding.shape[0]}")
        x = embedding(tokens) * math.sqrt(self.d_model)
        return self.embed_drop(x + self.pos_encoding[offset:offset + tokens.shape[1]].to(x.dtype))

    def encode(self, src: Tensor, src_key_mask: Tensor | None = None) -> Tensor:
        """Source ids ``(B, S)`` -> memory ``(B, S, d_model)``."""
        return self.transformer.encode(self._embed(src, self.src_embed), src_key_mask)

    def forward(self, src: Tensor, tgt: Tensor, src_key_mask: Tensor | None = None,
                tgt_key_mask: Tensor | None = None) -> Tensor:
        """Teacher forcing: source ids ``(B, S)``, target input ids ``(B, T)`` -> logits ``(B, T, tgt_vocab)``.

        Key masks default to ``ids != pad_id`` (True = real token).
        """
        src_key_mask = src != self.pad_id if src_key_mask is None else src_key_mask
        tgt_key_mask = tgt != self.pad_id if tgt_key_mask is None else tgt_key_mask
        memory = self.encode(src, src_key_mask)
        out = self.transformer.decode(self._embed(tgt, self.tgt_embed), memory, src_key_mask, tgt_key_mask)
        return self.head(out)

    @torch.no_grad()
    def attention_weights(self, src: Tensor, tgt: Tensor, src_key_mask: Tensor | None = None,
                          layer: int = -1) -> Tensor:
        """Cross-attention weights ``(B, T, S)`` of decoder ``layer`` (default the last), mean over its heads,
        under teacher forcing: row t is where step t looked (as :meth:`RNNSeq2Seq.attention_weights`)."""
        layers = self.transformer.decoder_layers
        if not -len(layers) <= layer < len(layers):
            raise ValueError(f"layer {layer} is out of range: the decoder has {len(layers)} layers "
                             f"(0..{len(layers) - 1}, or -1 for the last)")
        src_key_mask = src != self.pad_id if src_key_mask is None else src_key_mask
        x, memory = self._embed(tgt, self.tgt_embed), self.encode(src, src_key_mask)
        for block in list(layers)[:layer % len(layers) + 1]:
            x, weights = block(x, memory, src_key_mask, tgt != self.pad_id, need_weights=True)
        return weights.mean(1)

    @torch.no_grad()
    def generate(self, src: Tensor, src_key_mask: Tensor | None = None, max_new_tokens: int = 64, beam_size: int = 1,
                 length_penalty: float = 1.0, use_cache: bool = True) -> Tensor:
        """Decode target ids for a batch of sources: greedily (``beam_size=1``) or by beam search
        (:func:`vitlab.text.decoding.beam_search`: an n-best set of finished hypotheses scored
        ``sum(log p) / length ** length_penalty``, length counting EOS).

        Args:
            src: Source ids ``(B, S)``.
            src_key_mask: ``(B, S)``, True = real token; default ``src != pad_id``.
            max_new_tokens: Longest output (EOS included).
            beam_size: Beams per source; 1 is greedy decoding.
            length_penalty: Exponent of the length normalisation (0: raw log-probability).
            use_cache: Keep each layer's keys and values between steps (cross-attention ones computed
                once per source); gives the same tokens as recomputing the whole prefix.

        Returns:
            ``(B, L)`` ids without BOS, ending with EOS (unless cut at ``max_new_tokens``), padded
            with ``pad_id``. PAD and BOS are never generated.
        """
        if beam_size < 1:
            raise ValueError(f"beam_size={beam_size} must be >= 1")
        src_key_mask = src != self.pad_id if src_key_mask is None else src_key_mask
        # Beams live side by side in the batch: row b * k + j is beam j of source b.
        memory = self.encode(src, src_key_mask).repeat_interleave(beam_size, dim=0)
        src_key_mask = src_key_mask.repeat_interleave(beam_size, dim=0)
        caches = [DecoderCache() for _ in self.transformer.decoder_layers] if use_cache else None

        def step(tokens: Tensor, t: int) -> Tensor:
            if caches is not None:
                x = self._embed(tokens[:, -1:], self.tgt_embed, offset=t)
                h = self.transformer.decode(x, memory if t == 0 else None, src_key_mask, caches=caches)
            else:
                h = self.transformer.decode(self._embed(tokens, self.tgt_embed), memory, src_key_mask)
            return self.head(h[:, -1]).float().log_softmax(-1)

        def reorder(index: Tensor) -> None:
            for cache in caches or ():
                cache.reorder(index)

        special = dict(bos_id=self.bos_id, eos_id=self.eos_id, pad_id=self.pad_id, device=src.device)
        if beam_size == 1:
            return greedy_search(step, src.shape[0], max_new_tokens, **special)
        return beam_search(step, reorder, src.shape[0], beam_size, max_new_tokens, length_penalty=length_penalty,
                           **special)
