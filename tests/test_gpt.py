"""The decoder-only language model: causality, tied output, cached decoding, sampling."""
from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.models import GPT, sample_next


def _tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=30, block_size=24, embed_dim=32, depth=2, num_heads=4, **kw).eval()


def test_logits_of_a_position_depend_only_on_the_tokens_up_to_it():
    model = _tiny()
    idx = torch.randint(0, 30, (2, 12))
    changed = idx.clone()
    changed[:, 7:] = torch.randint(0, 30, (2, 5))
    torch.testing.assert_close(model(changed)[:, :7], model(idx)[:, :7])
    assert not torch.allclose(model(changed)[:, 7:], model(idx)[:, 7:])
    assert model(idx).shape == (2, 12, 30)
    assert model.head.weight is model.tok_embed.weight


@pytest.mark.parametrize("variant", [{}, dict(kernel="linear"), dict(pos_embed="sinusoidal", norm_layer="rmsnorm",
                                                                       mlp_layer="swiglu"),
                                     dict(mlp_layer="moe", num_experts=2, moe_top_k=1)],
                         ids=["softmax", "linear", "sinusoidal-rms-swiglu", "moe"])
def test_greedy_decoding_with_the_cache_equals_recomputing_token_for_token(variant):
    model = _tiny(**variant)
    prompt = torch.randint(0, 30, (3, 5))
    cached = model.generate(prompt, 30, temperature=0.0)  # runs past block_size=24: both crop alike
    assert torch.equal(cached, model.generate(prompt, 30, temperature=0.0, use_cache=False))
    assert torch.equal(cached, model.generate(prompt, 30, top_k=1))
    assert cached.shape == (3, 35) and torch.equal(cached[:, :5], prompt)


def test_sampling_is_reproducible_from_a_seed():
    model = _tiny()
    prompt = torch.zeros(2, 1, dtype=torch.long)
    a = model.generate(prompt, 20, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, 20, generator=torch.Generator().manual_seed(3))
    c = model.generate(prompt, 20, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_top_k_and_top_p_keep_exactly_the_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, top_k=2, generator=g).unique().tolist()) == {0, 1}
    # Nucleus 0.8: 0.5 + 0.2 < 0.8 <= 0.5 + 0.2 + 0.15, so the first three tokens, renormalised.
    draws = sample_next(logits, top_p=0.8, generator=g).flatten()
    assert set(draws.unique().tolist()) == {0, 1, 2}
    freq = torch.bincount(draws, minlength=5).float() / len(draws)
    torch.testing.assert_close(freq[:3], torch.tensor([0.5, 0.2, 0.15]) / 0.85, atol=0.03, rtol=0)
    assert torch.equal(sample_next(logits[:2], temperature=0.0), torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, top_p=1.5)


def test_presets_have_nanogpts_shapes_and_need_a_vocabulary():
    small = vitlab.create_model("gpt_char_small", vocab_size=65)
    assert (small.block_size, small.embed_dim, len(small.blocks), small.blocks[0].attn.num_heads) == (256, 384, 6, 6)
    assert small.config["dropout"] == 0.2
    with pytest.raises(ValueError, match="vocab_size"):
        vitlab.create_model("gpt_char_tiny")
    with pytest.raises(ValueError, match="exceeds block_size=24"):
        _tiny()(torch.zeros(1, 25, dtype=torch.long))


def test_init_is_gpt2s_with_residual_projections_scaled_by_depth():
    # GPT-2 (Radford et al. 2019, sec. 2.3) and nanoGPT's model.py: N(0, 0.02) everywhere, except the
    # projections that write into the residual stream (attention output, MLP output: nanoGPT's
    # c_proj), N(0, 0.02 / sqrt(2 * n_layer)).
    torch.manual_seed(0)
    model = vitlab.create_model("gpt_char_small", vocab_size=65)  # 6 blocks, 384 wide
    residual = 0.02 / (2 * 6) ** 0.5
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        expected = residual if name.endswith(("attn.proj.weight", "mlp.fc2.weight")) else 0.02
        assert p.std().item() == pytest.approx(expected, rel=0.03), name
