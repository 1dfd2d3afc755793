"""Score functions and kernels of the one attention core, against independent formulas."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vitlab.attention import (AdditiveScore, KVCache, LinearAttentionState, MultiHeadAttention, additive_attention,
                              attend, general_attention, linear_attention, scaled_dot_product_attention,
                              streaming_attention)



@pytest.fixture(autouse=True)
def _float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def _qkv(b=2, h=3, lq=7, lk=7, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, lq, d, generator=g), torch.randn(b, h, lk, d, generator=g),
            torch.randn(b, h, lk, d + 1, generator=g))


def phi(x):
    return F.elu(x) + 1


def test_linear_attention_equals_the_explicit_factorised_product():
    q, k, v = _qkv(lq=5, lk=9)
    key_mask = torch.ones(2, 9, dtype=torch.bool)
    key_mask[1, 6:] = False
    out = linear_attention(q, k, v, key_mask=key_mask)
    for b in range(2):
        kb, vb = phi(k[b][:, key_mask[b]]), v[b][:, key_mask[b]]
        ref = (phi(q[b]) @ (kb.transpose(-2, -1) @ vb)) / (phi(q[b]) @ kb.sum(-2, keepdim=True).transpose(-2, -1))
        torch.testing.assert_close(out[b], ref, rtol=1e-6, atol=1e-6)  # computed in float32 inside


def test_causal_linear_attention_equals_its_recurrent_form():
    q, k, v = _qkv(lq=150, lk=150)  # more than two chunks of 64
    out = linear_attention(q, k, v, is_causal=True)
    s = torch.zeros(2, 3, 8, 9)
    z = torch.zeros(2, 3, 8)
    rnn = []
    for i in range(150):  # S_i = S_{i-1} + phi(k_i) v_i^T, z_i = z_{i-1} + phi(k_i)
        s = s + phi(k[:, :, i, :, None]) * v[:, :, i, None, :]
        z = z + phi(k[:, :, i])
        qi = phi(q[:, :, i])
        rnn.append((qi[..., None, :] @ s).squeeze(-2) / (qi * z).sum(-1, keepdim=True))
    torch.testing.assert_close(out, torch.stack(rnn, dim=2), rtol=1e-5, atol=1e-5)


def test_linear_attention_weights_are_the_implied_normalised_similarities():
    q, k, v = _qkv()
    out, w = linear_attention(q, k, v, is_causal=True, need_weights=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 7))
    assert (w.triu(1) == 0).all()
    torch.testing.assert_close(out, w @ v, rtol=1e-5, atol=1e-5)


def test_linear_attention_rejects_a_general_mask():
    attn = MultiHeadAttention(16, 2, kernel="linear")
    with pytest.raises(ValueError, match="key padding .* and causality"):
        attn(torch.randn(1, 4, 16), mask=torch.ones(4, 4, dtype=torch.bool))


@pytest.mark.parametrize("kernel", ["linear", "streaming", "softmax", "argmax"])
def test_cached_decoding_equals_the_full_causal_computation(kernel):
    torch.manual_seed(0)
    attn = MultiHeadAttention(24, 3, kernel=kernel).eval()
    x = torch.randn(2, 11, 24)
    full = attn(x, is_causal=True)
    cache = KVCache()
    steps = [attn(x[:, :4], is_causal=True, kv_cache=cache)]  # a prefix, then one token at a time
    steps += [attn(x[:, i:i + 1], is_causal=True, kv_cache=cache) for i in range(4, 11)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-6, atol=1e-6)
    assert len(cache) == 11
    if kernel == "linear":
        assert cache.key is None and isinstance(cache.state, LinearAttentionState)  # constant-size state


def test_linear_cross_attention_cache_is_filled_once():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 2, kernel="linear").eval()
    x, ctx = torch.randn(2, 3, 16), torch.randn(2, 6, 16)
    key_mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    ref = attn(x, ctx, key_mask=key_mask)
    cache = KVCache(static=True)
    first = attn(x[:, :1], ctx, key_mask=key_mask, kv_cache=cache)
    rest = attn(x[:, 1:], None, kv_cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], 1), ref)


@pytest.mark.parametrize("causal", [False, True])
def test_streaming_softmax_equals_the_explicit_path_forward_and_backward(causal):
    q, k, v = (t.float().requires_grad_() for t in _qkv(lq=37, lk=53))
    mask = torch.ones(2, 1, 1, 53, dtype=torch.bool)
    mask[0, ..., 40:] = False
    mask[1, ..., :] = False  # every key masked: zero output, no NaN
    mask[1, ..., 50] = True
    ref = scaled_dot_product_attention(q, k, v, mask=mask, is_causal=causal, need_weights=True)[0]
    out = streaming_attention(q, k, v, mask=mask, is_causal=causal, block_size=8)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    g_ref = torch.autograd.grad(ref, (q, k, v), grad)
    g_out = torch.autograd.grad(out, (q, k, v), grad)
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()


def _saved_bytes(fn, *args):
    """Bytes autograd keeps for the backward pass of ``fn(*args)``."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args).sum()
    return total


def test_streaming_keeps_memory_linear_in_length_where_the_explicit_path_is_quadratic():
    def sizes(fn, length):
        q, k, v = (torch.randn(1, 1, length, 16, dtype=torch.float32, requires_grad=True) for _ in range(3))
        return _saved_bytes(fn, q, k, v)

    stream = lambda q, k, v: streaming_attention(q, k, v, block_size=64)  # noqa: E731
    explicit = lambda q, k, v: scaled_dot_product_attention(q, k, v, need_weights=True)[0]  # noqa: E731
    assert sizes(stream, 1024) == 2 * sizes(stream, 512)             # O(L): q, k, v, out, lse
    assert sizes(explicit, 1024) > 3.5 * sizes(explicit, 512)        # O(L^2): the weights


def test_argmax_attention_takes_the_best_keys_value_with_straight_through_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv())
    attn = MultiHeadAttention(8, 1, kernel="argmax")
    scores = q @ k.transpose(-2, -1) / 8 ** 0.5
    out, w = attn._attend(q, k, v, None, False, need_weights=True)
    best = scores.argmax(-1)
    torch.testing.assert_close(out, torch.gather(v, 2, best[..., None].expand(-1, -1, -1, v.shape[-1])))
    torch.testing.assert_close(w, F.one_hot(best, 7).to(w.dtype), rtol=0, atol=1e-12)
    grad = torch.randn_like(out)
    soft = scores.softmax(-1)
    # Straight-through: the weights' gradient is the softmax's, taken at the one-hot forward value.
    expected_dq = torch.autograd.grad((soft @ v.detach()), q, grad, retain_graph=True)[0]
    torch.testing.assert_close(torch.autograd.grad(out, q, grad)[0], expected_dq)


def test_general_score_is_q_w_k_and_starts_as_the_dot_score():
    q, k, v = _qkv()
    w = torch.randn(3, 8, 8)
    out = general_attention(q, k, v, w)
    scores = torch.stack([torch.stack([q[b, h] @ w[h] @ k[b, h].T for h in range(3)]) for b in range(2)]) / 8 ** 0.5
    torch.testing.assert_close(out, scores.softmax(-1) @ v)
    torch.testing.assert_close(general_attention(q, k, v, torch.eye(8).repeat(3, 1, 1)),
                               scaled_dot_product_attention(q, k, v))


def test_additive_score_is_bahdanaus_mlp_over_each_pair():
    q, k, v = _qkv(lq=4, lk=5)
    w_q, w_k, w_v = torch.randn(3, 8, 6), torch.randn(3, 8, 6), torch.randn(3, 6)
    mask = torch.ones(4, 5, dtype=torch.bool).tril()
    out, weights = additive_attention(q, k, v, w_q, w_k, w_v, mask=mask, need_weights=True)
    ref = torch.empty(2, 3, 4, 5)
    for b in range(2):
        for h in range(3):
            for i in range(4):
                for j in range(5):
                    ref[b, h, i, j] = w_v[h] @ torch.tanh(q[b, h, i] @ w_q[h] + k[b, h, j] @ w_k[h])
    ref_w = ref.masked_fill(~mask, float("-inf")).softmax(-1)
    torch.testing.assert_close(weights, ref_w)
    torch.testing.assert_close(out, ref_w @ v)


def test_additive_keys_projected_once_give_the_same_attention():
    q, k, v = _qkv(lq=4, lk=5)
    score = AdditiveScore(3, 8)
    expected = attend(q, k, v, score)
    torch.testing.assert_close(attend(q, k, v, score, projected_keys=score.project_keys(k)), expected)
    with pytest.raises(ValueError, match="additive score"):
        attend(q, k, v, None, projected_keys=score.project_keys(k))


@pytest.mark.parametrize("score,kernel", [("dot", "softmax"), ("general", "softmax"), ("additive", "softmax"),
                                          ("dot", "linear"), ("dot", "streaming"), ("general", "streaming"),
                                          ("dot", "argmax"), ("additive", "argmax")])
def test_every_variant_honours_key_padding_and_returns_its_weights(score, kernel):
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 2, score=score, kernel=kernel).eval()
    x = torch.randn(2, 6, 16)
    key_mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    out, w = attn(x, key_mask=key_mask, is_causal=True, need_weights=True)
    assert (w[1, :, :, 3:] == 0).all() and (w.triu(1) == 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 6))
    # Changing a padded token changes nothing for anyone.
    x2 = x.clone()
    x2[1, 4:] = torch.randn(2, 16)
    torch.testing.assert_close(attn(x2, key_mask=key_mask, is_causal=True)[1, :4], out[1, :4])


@pytest.mark.parametrize("score,kernel,match", [("dot", "flash", "unknown attention kernel"),
                                                ("cosine", "softmax", "unknown attention score"),
                                                ("general", "linear", "cannot use score='general'"),
                                                ("additive", "streaming", "needs kernel='softmax'")])
def test_bad_combinations_name_the_allowed_values(score, kernel, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(16, 2, score=score, kernel=kernel)


def _autocast_case(length: int, d: int = 32, score_std: float = 2.0, seed: int = 0):
    """bf16 q, k, v (as a bf16 autocast projection gives them) whose scaled scores q.k / sqrt(d) have
    standard deviation ``score_std``, and an output gradient of bf16 values."""
    g = torch.Generator().manual_seed(seed)
    s = score_std ** 0.5
    q, k = (torch.randn(1, 2, length, d, generator=g) * s for _ in range(2))
    v, grad = torch.randn(1, 2, length, d, generator=g), torch.randn(1, 2, length, d, generator=g)
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), grad.bfloat16().float()  # a bf16 output's gradient is bf16


def _grads_under_bf16(fn, q, k, v, grad):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(q, k, v)
    out.float().backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _grads_in_float64(fn, q, k, v, grad):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad.double())
    return out.detach(), q.grad, k.grad, v.grad


def _max_error(result, exact) -> float:
    return (result.double() - exact).abs().max().item()


def _rounding(exact) -> float:
    """The error of the exact result rounded once to bf16: what a kernel that computes in fp32 and
    returns bf16 may add (up to half a unit in the last place of the largest entry)."""
    return _max_error(exact.bfloat16(), exact) + 1e-6


@pytest.mark.parametrize("causal", [False, True])
def test_streaming_softmax_under_bf16_autocast_computes_in_float32(causal):
    # Against float64 on the same bf16 inputs: values and gradients are the exact ones rounded once to
    # bf16, and so no worse than PyTorch's fused kernel under the same autocast.
    q, k, v, grad = _autocast_case(256)
    attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    reference = _grads_in_float64(attend, q, k, v, grad)
    ours = _grads_under_bf16(lambda q, k, v: streaming_attention(q, k, v, is_causal=causal, block_size=64), q, k, v, grad)
    sdpa = _grads_under_bf16(attend, q, k, v, grad)
    for name, mine, fused, exact in zip(("out", "dq", "dk", "dv"), ours, sdpa, reference):
        assert mine.dtype == torch.bfloat16
        err = _max_error(mine, exact)
        assert err <= _rounding(exact) and err <= _max_error(fused, exact), (name, err, _max_error(fused, exact))


@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_under_bf16_autocast_keeps_its_float32_state(causal):
    q, k, v, grad = _autocast_case(512, score_std=1.0)

    def explicit(q, k, v):  # the defining formula, quadratic: phi(Q) phi(K)^T (causal: j <= i), normalised
        sim = phi(q) @ phi(k).transpose(-2, -1)
        if causal:
            sim = sim.tril()
        return (sim / sim.sum(-1, keepdim=True)) @ v

    reference = _grads_in_float64(explicit, q, k, v, grad)
    ours = _grads_under_bf16(lambda q, k, v: linear_attention(q, k, v, is_causal=causal), q, k, v, grad)
    for name, mine, exact in zip(("out", "dq", "dk", "dv"), ours, reference):
        assert _max_error(mine, exact) <= _rounding(exact), (name, _max_error(mine, exact), _rounding(exact))
