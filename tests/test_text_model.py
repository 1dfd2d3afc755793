"""The text encoder-decoder against torch.nn.Transformer, and decoding."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from vitlab.interop import transformer_from_torch
from vitlab.layers import sinusoidal_position_encoding
from vitlab.text import Seq2SeqTransformer, Transformer

TOL = 1e-5


def _torch_transformer(norm_first: bool, activation: str, d=32, heads=4, enc=2, dec=2, ff=64) -> nn.Transformer:
    ref = nn.Transformer(d_model=d, nhead=heads, num_encoder_layers=enc, num_decoder_layers=dec, dim_feedforward=ff,
                         dropout=0.1, activation=activation, batch_first=True, norm_first=norm_first).eval()
    with torch.no_grad():  # nonzero biases and norm affines, so parity covers them
        for name, p in ref.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return ref


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_matches_torch_transformer_with_padding(norm_first, activation):
    ref = _torch_transformer(norm_first, activation)
    ours = transformer_from_torch(ref).eval()
    src, tgt = torch.randn(3, 7, 32), torch.randn(3, 5, 32)
    src_real = torch.arange(7)[None] < torch.tensor([7, 4, 2])[:, None]
    tgt_real = torch.arange(5)[None] < torch.tensor([5, 3, 1])[:, None]
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    expected = ref(src, tgt, tgt_mask=causal, src_key_padding_mask=~src_real, tgt_key_padding_mask=~tgt_real,
                   memory_key_padding_mask=~src_real, tgt_is_causal=True)
    out = ours(src, tgt, src_key_mask=src_real, tgt_key_mask=tgt_real)
    assert (out[tgt_real] - expected[tgt_real]).abs().max() < TOL  # every real target position


def test_padding_changes_nothing_at_real_positions():
    model = Transformer(d_model=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64).eval()
    src, tgt = torch.randn(1, 4, 32), torch.randn(1, 3, 32)
    plain = model(src, tgt)
    padded = model(torch.cat([src, torch.randn(1, 3, 32)], 1), torch.cat([tgt, torch.randn(1, 2, 32)], 1),
                   src_key_mask=torch.tensor([[True] * 4 + [False] * 3]),
                   tgt_key_mask=torch.tensor([[True] * 3 + [False] * 2]))
    assert (padded[:, :3] - plain).abs().max() < TOL


def test_decoder_is_causal():
    model = Transformer(d_model=32, num_heads=4, num_encoder_layers=1, num_decoder_layers=2, dim_feedforward=64).eval()
    src, tgt = torch.randn(2, 4, 32), torch.randn(2, 6, 32)
    changed = tgt.clone()
    changed[:, 4:] += 1.0
    assert (model(src, tgt)[:, :4] - model(src, changed)[:, :4]).abs().max() == 0


def test_sinusoidal_encoding_follows_the_formula():
    pe = sinusoidal_position_encoding(50, 16)
    for pos, i in [(0, 0), (1, 0), (7, 3), (49, 7), (23, 5)]:
        angle = pos / 10000 ** (2 * i / 16)
        assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-7)
        assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-7)
    with pytest.raises(ValueError, match="even width"):
        sinusoidal_position_encoding(4, 7)


def _seq2seq(**kw) -> Seq2SeqTransformer:
    torch.manual_seed(0)
    args = dict(src_vocab_size=20, tgt_vocab_size=20, d_model=32, num_heads=4, num_encoder_layers=2,
                num_decoder_layers=2, dim_feedforward=64, dropout=0.0)
    return Seq2SeqTransformer(**{**args, **kw}).eval()


def test_embeddings_are_scaled_and_tied():
    model = _seq2seq(share_embeddings=True)
    assert model.src_embed is model.tgt_embed and model.head.weight is model.tgt_embed.weight
    tokens = torch.tensor([[5, 6, 0]])
    expected = model.src_embed(tokens) * math.sqrt(32) + sinusoidal_position_encoding(3, 32)
    assert torch.allclose(model._embed(tokens, model.src_embed), expected)
    assert torch.equal(model.src_embed.weight[0], torch.zeros(32))  # padding row


def test_share_embeddings_needs_one_vocabulary():
    with pytest.raises(ValueError, match="share_embeddings needs one vocabulary"):
        Seq2SeqTransformer(10, 12, d_model=16, num_heads=2, share_embeddings=True)


def _random_sources():
    torch.manual_seed(1)
    src = torch.randint(3, 20, (4, 9))
    src[1, 6:] = 0
    src[3, 3:] = 0
    return src


@pytest.mark.parametrize("beam_size", [1, 3])
def test_decoding_with_cache_gives_the_tokens_of_decoding_without(beam_size):
    model, src = _seq2seq(), _random_sources()
    with_cache = model.generate(src, max_new_tokens=12, beam_size=beam_size, use_cache=True)
    without = model.generate(src, max_new_tokens=12, beam_size=beam_size, use_cache=False)
    assert with_cache.shape == (4, 12)
    assert torch.equal(with_cache, without)


def test_beam_size_one_is_greedy_decoding():
    model, src = _seq2seq(), _random_sources()
    # Greedy by hand: argmax of the full forward pass (PAD and BOS excluded), one token at a time.
    tokens = torch.full((4, 1), model.bos_id)
    for _ in range(10):
        logits = model(src, tokens)[:, -1]
        logits[:, [model.pad_id, model.bos_id]] = float("-inf")
        nxt = logits.argmax(-1)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
    greedy = model.generate(src, max_new_tokens=10, beam_size=1)
    done = torch.zeros(4, dtype=torch.bool)
    for t in range(greedy.shape[1]):  # equal up to each sequence's EOS; padding after it
        assert torch.equal(greedy[~done, t], tokens[~done, t + 1])
        done |= greedy[:, t] == model.eos_id


def test_beam_search_finds_a_sequence_at_least_as_likely_as_greedy():
    model, src = _seq2seq(), _random_sources()

    def logprob(out: torch.Tensor) -> torch.Tensor:
        tgt_in = torch.cat([torch.full((4, 1), model.bos_id), out[:, :-1]], 1)
        lp = model(src, tgt_in).log_softmax(-1).gather(-1, out[..., None])[..., 0]
        real = torch.cat([torch.ones(4, 1, dtype=torch.bool), (out[:, :-1] != model.eos_id).cumprod(1).bool()], 1)
        real &= out != model.pad_id
        return (lp * real).sum(1)

    greedy = model.generate(src, max_new_tokens=8, beam_size=1)
    beam = model.generate(src, max_new_tokens=8, beam_size=4, length_penalty=0.0)
    assert (logprob(beam) >= logprob(greedy) - 1e-4).all()


def test_generation_stops_when_every_sequence_has_ended():
    model, src = _seq2seq(tie_output=False), _random_sources()
    model.head.bias = nn.Parameter(torch.zeros(20))
    with torch.no_grad():
        model.head.bias[model.eos_id] = 100.0  # EOS first, for every source
    for beam_size in (1, 3):
        out = model.generate(src, max_new_tokens=30, beam_size=beam_size)
        assert torch.equal(out, torch.full((4, 1), model.eos_id))
    with pytest.raises(ValueError, match="beam_size=0"):
        model.generate(src, beam_size=0)


def _peaky_seq2seq(vocab: int) -> Seq2SeqTransformer:
    """A random model whose next-token distributions are far from uniform (no near-ties)."""
    torch.manual_seed(3)
    model = Seq2SeqTransformer(vocab, vocab, d_model=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=32, dropout=0.0, tie_output=False).eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 1.0)
    return model


def _candidates(symbols: list[int], eos: int, max_new: int) -> list[list[int]]:
    """Every output beam search can return: symbols then EOS (length <= max_new), or max_new symbols."""
    out: list[list[int]] = []
    for length in range(max_new + 1):
        for body in itertools.product(symbols, repeat=length):
            out.append(list(body) + [eos] if length < max_new else list(body))
    return out


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_beam_search_with_a_beam_over_all_candidates_returns_the_exhaustive_best(length_penalty):
    # 4 symbols, up to 4 new tokens: 1 + 4 + 16 + 64 sequences ending in EOS and 256 cut at 4 = 341.
    vocab, max_new = 7, 4  # ids 0, 1, 2 are PAD, BOS, EOS
    model = _peaky_seq2seq(vocab)
    candidates = _candidates(list(range(3, vocab)), model.eos_id, max_new)
    assert len(candidates) == 341
    src = torch.tensor([[3, 5, 4, 6, 3], [6, 6, 4, 0, 0], [4, 3, 0, 0, 0]])
    for i in range(len(src)):
        # Enumeration: sum log p (teacher forcing, full forward pass) / length ** length_penalty.
        tgt = torch.nn.utils.rnn.pad_sequence([torch.tensor(c) for c in candidates], batch_first=True,
                                              padding_value=model.pad_id)
        tgt_in = torch.cat([torch.full((len(tgt), 1), model.bos_id), tgt[:, :-1]], 1)
        with torch.no_grad():
            logp = model(src[i:i + 1].expand(len(tgt), -1), tgt_in).log_softmax(-1)
        token_logp = logp.gather(-1, tgt[..., None])[..., 0] * (tgt != model.pad_id)
        lengths = torch.tensor([len(c) for c in candidates], dtype=torch.float)
        scores = token_logp.sum(1) / lengths ** length_penalty
        top2 = scores.topk(2).values
        assert top2[0] - top2[1] > 1e-4  # a unique best: the comparison below is meaningful
        best = candidates[int(scores.argmax())]
        found = model.generate(src[i:i + 1], max_new_tokens=max_new, beam_size=len(candidates),
                               length_penalty=length_penalty)
        assert found[0].tolist() == best, (i, length_penalty)
    # The batched search gives each source its own best.
    batched = model.generate(src, max_new_tokens=max_new, beam_size=len(candidates), length_penalty=length_penalty)
    singles = [model.generate(src[i:i + 1], max_new_tokens=max_new, beam_size=len(candidates),
                              length_penalty=length_penalty)[0] for i in range(len(src))]
    for row, single in zip(batched, singles):
        assert row[:len(single)].tolist() == single.tolist() and (row[len(single):] == model.pad_id).all()


@pytest.mark.parametrize("beam_size", [1, 4])
def test_pad_and_bos_are_never_generated(beam_size):
    model, src = _seq2seq(tie_output=False), _random_sources()
    model.head.bias = nn.Parameter(torch.zeros(20))
    with torch.no_grad():
        model.head.bias[[model.pad_id, model.bos_id]] = 100.0  # the model would rather say PAD or BOS
    out = model.generate(src, max_new_tokens=6, beam_size=beam_size)
    assert out.shape == (4, 6)
    assert not (out == model.pad_id).any() and not (out == model.bos_id).any()


def test_the_initial_weights_are_a_function_of_the_seed_alone_wherever_the_modules_lie_in_memory():
    # Each model built while the earlier ones live lies elsewhere in memory: an init that visits its modules in a
    # set's order (by address) drew the two embedding tables in either order, the golden set's seq2seq run saw it.
    kept, weights = [], []
    for _ in range(12):
        torch.manual_seed(0)
        model = Seq2SeqTransformer(src_vocab_size=20, tgt_vocab_size=24, d_model=16, num_heads=2,
                                   num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32)
        kept.append(model)
        weights.append(model.state_dict())
    for other in weights[1:]:
        assert all(torch.equal(other[k], weights[0][k]) for k in weights[0])
