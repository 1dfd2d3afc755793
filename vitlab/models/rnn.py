"""The RNN encoder-decoder with attention (Bahdanau, Cho & Bengio 2015; seeds 001, 002).

A bidirectional GRU reads the source into annotations ``h_j`` (the two directions concatenated, each
``hidden_dim / 2`` wide). At each target step the decoder's previous state ``s_{t-1}`` is the query,
the annotations are keys and values, and the context ``c_t = sum_j a_tj h_j`` enters the GRU cell with
the previous target token; the output layer reads ``[s_t; c_t; e(y_{t-1})]``. The score is an option of
the same attention core as the Transformer's (:func:`vitlab.attention.attend`): ``additive``
(Bahdanau's ``v^T tanh(W s + U h)``), ``general`` or ``dot`` (Luong's, scaled). Nothing is copied.

The interface is the Transformer's: ``model(src, tgt_in, src_key_mask, tgt_key_mask)`` -> logits
(teacher forcing), ``model.generate(src, ...)`` -> ids by greedy or beam search (shared
:mod:`.decoding`), and ``model.attention_weights(src, tgt_in)`` -> ``(B, T, S)`` for alignment pictures.
"""
from __future__ import annotations


import torch
from torch import Tensor, nn

from ..attention import AdditiveScore, GeneralScore, ScoreName, attend
from ..layers import GradCheckpointing, checkpointed
from .hub import HubMixin
from .decoding import beam_search, greedy_search

__all__ = ["RNNSeq2Seq"]


class RNNSeq2Seq(nn.Module, HubMixin, GradCheckpointing):
    """Bidirectional-GRU encoder, attentive GRU decoder; ids in, logits out.

    Args:
        src_vocab_size, tgt_vocab_size: Vocabulary sizes.
        embed_dim: Token embedding width.
        hidden_dim: Decoder state width = annotation width (each encoder direction has half).
        num_encoder_layers: Stacked bidirectional GRU layers.
        dropout: On embeddings, between encoder layers and before the output layer.
        score: ``'additive'`` (Bahdanau), ``'general'`` or ``'dot'``.
        pad_id, bos_id, eos_id: Special ids.
        share_embeddings: One embedding for source and target (one joint vocabulary).
        tie_output: Tie the output projection to the target embedding.
    """

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, embed_dim: int = 256, hidden_dim: int = 512,
                 num_encoder_layers: int = 1, dropout: float = 0.1, score: ScoreName = "additive", pad_id: int = 0,
                 bos_id: int = 1, eos_id: int = 2, share_embeddings: bool = False, tie_output: bool = False) -> None:
        super().__init__()
        if hidden_dim % 2:
            raise ValueError(f"hidden_dim={hidden_dim} must be even: each encoder direction has hidden_dim / 2")
        if score not in ("dot", "general", "additive"):
            raise ValueError(f"unknown score {score!r}; expected one of dot, general, additive")
        if share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError(f"share_embeddings needs one vocabulary, got {src_vocab_size} and {tgt_vocab_size}")
        self.config = dict(src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size, embed_dim=embed_dim,
                           hidden_dim=hidden_dim, num_encoder_layers=num_encoder_layers, dropout=dropout, score=score,
                           pad_id=pad_id, bos_id=bos_id, eos_id=eos_id, share_embeddings=share_embeddings,
                           tie_output=tie_output)
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.src_embed = nn.Embedding(src_vocab_size, embed_dim, padding_idx=pad_id)
        self.tgt_embed = self.src_embed if share_embeddings else nn.Embedding(tgt_vocab_size, embed_dim,
                                                                              padding_idx=pad_id)
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.GRU(embed_dim, hidden_dim // 2, num_encoder_layers, batch_first=True, bidirectional=True,
                              dropout=dropout if num_encoder_layers > 1 else 0.0)
        self.init_state = nn.Linear(hidden_dim // 2, hidden_dim)  # s_0 = tanh(W h_1 backward), as Bahdanau
        self.score = (AdditiveScore(1, hidden_dim) if score == "additive" else
                      GeneralScore(1, hidden_dim) if score == "general" else None)
        self.decoder = nn.GRUCell(embed_dim + hidden_dim, hidden_dim)
        self.pre_output = nn.Linear(2 * hidden_dim + embed_dim, embed_dim)
        self.head = nn.Linear(embed_dim, tgt_vocab_size, bias=False)
        if tie_output or share_embeddings:
            self.head.weight = self.tgt_embed.weight

    def encode(self, src: Tensor, src_key_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Source ids ``(B, S)`` -> annotations ``(B, S, hidden)`` and the decoder's first state ``(B, hidden)``."""
        lengths = src_key_mask.sum(1).clamp(min=1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(self.drop(self.src_embed(src)), lengths, batch_first=True,
                                                   enforce_sorted=False)
        out, last = self.encoder(packed)
        annotations, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=src.shape[1])
        return annotations, torch.tanh(self.init_state(last[-1]))  # last[-1]: top layer, backward direction

    def _project_keys(self, annotations: Tensor) -> Tensor | None:
        """``U_a h_j`` of the additive score, computed once per source rather than at every step."""
        return self.score.project_keys(annotations[:, None]) if isinstance(self.score, AdditiveScore) else None

    def _step(self, prev: Tensor, state: Tensor, annotations: Tensor, key_mask: Tensor, keys: Tensor | None,
              need_weights: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
        """One decoder step: previous ids ``(B,)``, state ``(B, hidden)``, annotations and their projection
        ``keys`` -> logits ``(B, V)``, new state, attention weights ``(B, S)`` if asked."""
        e = self.drop(self.tgt_embed(prev))
        q, kv = state[:, None, None, :], annotations[:, None]  # one head: (B, 1, 1, hidden), (B, 1, S, hidden)
        result = attend(q, kv, kv, self.score, mask=key_mask[:, None, None, :], need_weights=need_weights,
                        projected_keys=keys)
        context, weights = result if need_weights else (result, None)
        context = context[:, 0, 0]
        # Bahdanau: the context enters the recurrence; the output reads the new state, the context and y_{t-1}.
        state = self.decoder(torch.cat([e, context], dim=-1), state)
        hidden = torch.tanh(self.pre_output(torch.cat([state, context, e], dim=-1)))
        return self.head(self.drop(hidden)), state, (weights[:, 0, 0] if need_weights else None)

    def forward(self, src: Tensor, tgt: Tensor, src_key_mask: Tensor | None = None,
                tgt_key_mask: Tensor | None = None) -> Tensor:
        """Teacher forcing: source ids ``(B, S)``, target input ids ``(B, T)`` -> logits ``(B, T, tgt_vocab)``.
        (``tgt_key_mask`` is accepted for the Transformer's interface; a recurrent decoder needs none.)"""
        return self._teacher_forced(src, tgt, src_key_mask)[0]

    def _teacher_forced(self, src: Tensor, tgt: Tensor, src_key_mask: Tensor | None,
                        need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        src_key_mask = src != self.pad_id if src_key_mask is None else src_key_mask
        annotations, state = self.encode(src, src_key_mask)
        keys = self._project_keys(annotations)
        logits, weights = [], []
        for t in range(tgt.shape[1]):
            out, state, w = checkpointed(self.grad_checkpointing, self._step, tgt[:, t], state, annotations,
                                         src_key_mask, keys, need_weights)
            logits.append(out)
            weights.append(w)
        return torch.stack(logits, 1), (torch.stack(weights, 1) if need_weights else None)

    @torch.no_grad()
    def attention_weights(self, src: Tensor, tgt: Tensor, src_key_mask: Tensor | None = None,
                          layer: int = -1) -> Tensor:
        """Cross-attention weights ``(B, T, S)`` under teacher forcing: row t is where step t looked.
        (``layer``: the Transformer's interface; the RNN has one attention, layer 0 = -1.)"""
        if layer not in (0, -1):
            raise ValueError(f"layer {layer} is out of range: the RNN decoder has one attention (0, or -1)")
        return self._teacher_forced(src, tgt, src_key_mask, need_weights=True)[1]

    @torch.no_grad()
    def generate(self, src: Tensor, src_key_mask: Tensor | None = None, max_new_tokens: int = 64, beam_size: int = 1,
                 length_penalty: float = 1.0, use_cache: bool = True) -> Tensor:
        """Decode like :meth:`vitlab.models.Seq2SeqTransformer.generate` (greedy or beam search); the
        recurrent state is the cache, so ``use_cache`` changes nothing."""
        if beam_size < 1:
            raise ValueError(f"beam_size={beam_size} must be >= 1")
        src_key_mask = src != self.pad_id if src_key_mask is None else src_key_mask
        annotations, state = self.encode(src, src_key_mask)
        annotations = annotations.repeat_interleave(beam_size, 0)
        key_mask = src_key_mask.repeat_interleave(beam_size, 0)
        keys = self._project_keys(annotations)
        states = [state.repeat_interleave(beam_size, 0)]

        def step(tokens: Tensor, t: int) -> Tensor:
            logits, states[0], _ = self._step(tokens[:, -1], states[0], annotations, key_mask, keys)
            return logits.float().log_softmax(-1)

        def reorder(index: Tensor) -> None:
            states[0] = states[0].index_select(0, index)

        special = dict(bos_id=self.bos_id, eos_id=self.eos_id, pad_id=self.pad_id, device=src.device)
        if beam_size == 1:
            return greedy_search(step, src.shape[0], max_new_tokens, **special)
        return beam_search(step, reorder, src.shape[0], beam_size, max_new_tokens, length_penalty=length_penalty,
                           **special)
