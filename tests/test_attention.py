"""The attention core against PyTorch's own attention, and its defining properties."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vitlab.attention import KVCache, MultiHeadAttention, causal_mask, scaled_dot_product_attention
from vitlab.interop import mha_from_torch

TOL = 1e-5


def qkv(b=2, h=3, lq=5, lk=7, d=8, dtype=torch.float32):
    return (torch.randn(b, h, lq, d, dtype=dtype), torch.randn(b, h, lk, d, dtype=dtype),
            torch.randn(b, h, lk, d, dtype=dtype))


def reference_attention(q, k, v, mask=None):
    """softmax(QK^T/sqrt(d)) V written out in float64, the textbook formula."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


# ---------------------------------------------------------------- scaled_dot_product_attention

def test_unmasked_matches_textbook_formula_and_torch():
    q, k, v = qkv()
    out = scaled_dot_product_attention(q, k, v)
    assert (out.double() - reference_attention(q, k, v)).abs().max() < TOL
    assert (out - F.scaled_dot_product_attention(q, k, v)).abs().max() < TOL


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
def test_fused_and_explicit_paths_agree(masked, is_causal):
    q, k, v = qkv(lq=6, lk=6)
    mask = torch.rand(2, 1, 6, 6) > 0.3 if masked else None
    fused = scaled_dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)
    explicit, _ = scaled_dot_product_attention(q, k, v, mask=mask, is_causal=is_causal, need_weights=True)
    assert (fused - explicit).abs().max() < TOL


def test_weights_are_a_distribution_over_keys():
    q, k, v = qkv()
    _, w = scaled_dot_product_attention(q, k, v, need_weights=True)
    assert w.shape == (2, 3, 5, 7)
    assert (w >= 0).all()
    assert (w.sum(-1) - 1).abs().max() < 1e-6


def test_masked_keys_get_exactly_zero_weight():
    q, k, v = qkv()
    key_mask = torch.tensor([[1, 1, 0, 1, 0, 1, 1], [1, 0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    mask = key_mask[:, None, None, :]
    out, w = scaled_dot_product_attention(q, k, v, mask=mask, need_weights=True)
    assert torch.equal(w.masked_select(~mask.expand_as(w)), torch.zeros(int((~mask.expand_as(w)).sum())))
    assert (w.sum(-1) - 1).abs().max() < 1e-6
    assert (out.double() - reference_attention(q, k, v, mask)).abs().max() < TOL
    # Changing a masked key or value changes nothing.
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 2] += 100.0
    v2[0, :, 2] -= 100.0
    assert torch.equal(scaled_dot_product_attention(q, k2, v2, mask=mask), scaled_dot_product_attention(q, k, v, mask=mask))


@pytest.mark.parametrize("need_weights", [False, True])
def test_query_with_all_keys_masked_gets_zero_output_and_finite_gradients(need_weights):
    q, k, v = qkv()
    for t in (q, k, v):
        t.requires_grad_(True)
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool)
    mask[1, :, 3] = False  # query 3 of sequence 1 sees nothing
    res = scaled_dot_product_attention(q, k, v, mask=mask, need_weights=need_weights)
    out = res[0] if need_weights else res
    assert torch.isfinite(out).all()
    assert torch.equal(out[1, :, 3], torch.zeros_like(out[1, :, 3]))
    if need_weights:
        assert torch.equal(res[1][1, :, 3], torch.zeros(3, 7))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # The other rows are exactly what the unmasked formula gives.
    ref = reference_attention(q.detach(), k.detach(), v.detach())
    assert (out[0].detach().double() - ref[0]).abs().max() < TOL


def test_causal_mask_is_aligned_to_the_end():
    assert torch.equal(causal_mask(3, 3), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    assert torch.equal(causal_mask(2, 4), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool))


def test_causal_equals_torch_is_causal_on_square_inputs():
    q, k, v = qkv(lq=6, lk=6)
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (out - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max() < TOL


def test_causal_with_fewer_queries_matches_the_last_rows_of_full_attention():
    q, k, v = qkv(lq=7, lk=7)
    full = scaled_dot_product_attention(q, k, v, is_causal=True)
    tail = scaled_dot_product_attention(q[:, :, -2:], k, v, is_causal=True)
    assert (tail - full[:, :, -2:]).abs().max() < TOL


def test_causal_changing_later_tokens_changes_no_earlier_output():
    torch.manual_seed(1)
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 8, 16)
    y = x.clone()
    y[:, 5:] = torch.randn(2, 3, 16)
    out_x, out_y = mha(x, is_causal=True), mha(y, is_causal=True)
    assert torch.equal(out_x[:, :5], out_y[:, :5])
    assert (out_x[:, 5:] - out_y[:, 5:]).abs().max() > 1e-3


def test_self_attention_is_permutation_equivariant_without_positions():
    mha = MultiHeadAttention(24, 3).eval()
    x = torch.randn(2, 9, 24)
    perm = torch.randperm(9)
    assert (mha(x)[:, perm] - mha(x[:, perm])).abs().max() < TOL


@pytest.mark.parametrize("bad_mask, message", [
    (torch.ones(2, 3, 5, 6, dtype=torch.bool), r"\(2, 3, 5, 6\) does not broadcast to .*\(2, 3, 5, 7\)"),
    (torch.ones(3, 1, 1, 7, dtype=torch.bool), r"does not broadcast"),
    (torch.ones(1, 1, 2, 3, 5, 7, dtype=torch.bool), r"does not broadcast"),
    (torch.ones(5, 7), r"must be boolean .*float32"),
])
def test_mask_of_wrong_shape_or_dtype_is_rejected(bad_mask, message):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=message):
        scaled_dot_product_attention(q, k, v, mask=bad_mask)


# ---------------------------------------------------------------- MultiHeadAttention

def test_embed_dim_not_divisible_by_heads_is_rejected():
    with pytest.raises(ValueError, match=r"embed_dim=10 is not divisible by num_heads=3.*\[1, 2, 5, 10\]"):
        MultiHeadAttention(10, 3)


def test_input_of_wrong_width_is_rejected():
    with pytest.raises(ValueError, match=r"embed_dim=16\), got \(2, 5, 12\)"):
        MultiHeadAttention(16, 4)(torch.randn(2, 5, 12))


def test_key_mask_of_wrong_shape_is_rejected():
    with pytest.raises(ValueError, match=r"key_mask must be boolean \(batch, k_len\) = \(2, 5\)"):
        MultiHeadAttention(16, 4)(torch.randn(2, 5, 16), key_mask=torch.ones(2, 4, dtype=torch.bool))


def test_returns_per_head_weights():
    out, w = MultiHeadAttention(16, 4)(torch.randn(2, 5, 16), torch.randn(2, 3, 16), need_weights=True)
    assert out.shape == (2, 5, 16) and w.shape == (2, 4, 5, 3)


def test_incremental_self_attention_cache_matches_full_causal_pass():
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 6, 16)
    full = mha(x, is_causal=True)
    cache = KVCache()
    steps = [mha(x[:, i:i + 1], is_causal=True, kv_cache=cache) for i in range(6)]
    assert len(cache) == 6
    assert (torch.cat(steps, 1) - full).abs().max() < TOL


def test_static_cross_attention_cache_projects_context_once():
    mha = MultiHeadAttention(16, 4).eval()
    x, ctx = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    cache = KVCache(static=True)
    first = mha(x, ctx, kv_cache=cache)
    again = mha(x, None, kv_cache=cache)  # context not needed any more
    assert len(cache) == 5
    assert torch.equal(first, again)
    assert (first - mha(x, ctx)).abs().max() < TOL


# ---------------------------------------------------------------- parity with torch.nn.MultiheadAttention

def _torch_mha(embed_dim, num_heads, bias):
    return nn.MultiheadAttention(embed_dim, num_heads, bias=bias, batch_first=True).eval()


def _randomize(module: nn.Module) -> nn.Module:
    """PyTorch initialises MHA biases to zero; make them nonzero so parity checks the biases too.

    The weights keep PyTorch's own (Xavier) initialisation, so activations have a realistic scale.
    """
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.1)
    return module


CONFIGS = [(16, 1, True), (16, 4, True), (24, 3, False), (64, 8, True)]


@pytest.mark.parametrize("embed_dim, num_heads, bias", CONFIGS)
def test_self_attention_matches_torch(embed_dim, num_heads, bias):
    ref = _randomize(_torch_mha(embed_dim, num_heads, bias))
    mha = mha_from_torch(ref)
    x = torch.randn(3, 7, embed_dim)
    expected, expected_w = ref(x, x, x, need_weights=True, average_attn_weights=False)
    out, w = mha(x, need_weights=True)
    assert (out - expected).abs().max() < TOL
    assert (w - expected_w).abs().max() < TOL
    assert (mha(x) - expected).abs().max() < TOL  # fused path too


@pytest.mark.parametrize("embed_dim, num_heads, bias", CONFIGS)
def test_cross_attention_with_key_padding_matches_torch(embed_dim, num_heads, bias):
    ref = _randomize(_torch_mha(embed_dim, num_heads, bias))
    mha = mha_from_torch(ref)
    x, ctx = torch.randn(3, 5, embed_dim), torch.randn(3, 9, embed_dim)
    lengths = torch.tensor([9, 4, 1])
    real = torch.arange(9)[None] < lengths[:, None]  # vitlab: True = real token
    expected, _ = ref(x, ctx, ctx, key_padding_mask=~real)  # torch: True = padding
    for need_weights in (False, True):
        out = mha(x, ctx, key_mask=real, need_weights=need_weights)
        out = out[0] if need_weights else out
        assert (out - expected).abs().max() < TOL


@pytest.mark.parametrize("embed_dim, num_heads, bias", CONFIGS)
def test_causal_self_attention_with_padding_matches_torch(embed_dim, num_heads, bias):
    ref = _randomize(_torch_mha(embed_dim, num_heads, bias))
    mha = mha_from_torch(ref)
    x = torch.randn(2, 6, embed_dim)
    real = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]], dtype=torch.bool)  # left padding
    future = nn.Transformer.generate_square_subsequent_mask(6).isinf()  # torch: True = not allowed
    expected, _ = ref(x, x, x, attn_mask=future, key_padding_mask=~real)
    via_flag = mha(x, is_causal=True, key_mask=real)
    via_mask = mha(x, mask=~future, key_mask=real)  # translating torch's mask: invert it
    # Row 0 of sequence 1 sees only padding: torch returns NaN there, vitlab zeros; compare the rest.
    valid = ~torch.isnan(expected)
    assert valid.sum() == expected.numel() - embed_dim
    for out in (via_flag, via_mask):
        assert (out[valid] - expected[valid]).abs().max() < TOL
    assert torch.isfinite(via_flag).all()


def test_all_padding_row_is_zero_where_torch_gives_nan():
    ref = _randomize(_torch_mha(16, 4, True))
    mha = mha_from_torch(ref)
    x = torch.randn(1, 3, 16)
    nothing = torch.zeros(1, 3, dtype=torch.bool)
    torch_out, _ = ref(x, x, x, key_padding_mask=~nothing)
    assert torch.isnan(torch_out).all()
    # vitlab: no key -> zero attention output, then the output projection adds its bias.
    assert torch.equal(mha(x, key_mask=nothing), ref.out_proj.bias.expand(1, 3, 16))


def test_mha_from_torch_rejects_what_it_cannot_represent():
    with pytest.raises(ValueError, match="kdim/vdim"):
        mha_from_torch(nn.MultiheadAttention(16, 4, kdim=8, vdim=8, batch_first=True))
    with pytest.raises(ValueError, match="add_bias_kv"):
        mha_from_torch(nn.MultiheadAttention(16, 4, add_bias_kv=True, batch_first=True))


def test_gradients_reach_every_parameter_through_cross_attention():
    mha = MultiHeadAttention(16, 4)
    out = mha(torch.randn(2, 3, 16), torch.randn(2, 5, 16))
    out.pow(2).sum().backward()
    for name, p in mha.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
