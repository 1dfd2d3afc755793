"""Attention kernels other than PyTorch's fused softmax: linear attention and streaming softmax.

- :func:`linear_attention` (Katharopoulos et al. 2020, "Transformers are RNNs"): the softmax
  similarity ``exp(q . k)`` is replaced by ``phi(q) . phi(k)`` with ``phi(x) = elu(x) + 1``, so
  ``sum_j phi(q) . phi(k_j) v_j = phi(q) (sum_j phi(k_j) v_j^T)``: O(L) time and memory. Causal
  attention is a recurrence over a state ``(S, z) = (sum phi(k) v^T, sum phi(k))``
  (:class:`LinearAttentionState`), computed here in chunks (quadratic inside a chunk, the state
  across chunks); cached decoding carries the same state from step to step.
- :func:`streaming_attention` ("FlashAttn = StreamSoftmax(QK^T)V"): the exact softmax attention,
  computed over blocks of keys with a running maximum and sum (online softmax), forward and
  backward, never holding the ``Lq x Lk`` matrix: memory grows with ``Lq x block_size``.

Shapes as in :mod:`vitlab.attention.core`: ``(B, H, L, D)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .core import causal_mask, check_key_mask, check_mask, check_qkv

__all__ = ["linear_attention", "LinearAttentionState", "elu_feature_map", "streaming_attention", "float32_region"]


def float32_region(x: Tensor) -> torch.autocast:
    """Autocast off on ``x``'s device: inside, ``.float()`` tensors stay float32 through every matmul.

    The kernels here keep float32 sums (the online softmax's running max and sum, linear attention's
    state); under a bf16 autocast their matmuls would otherwise be recast to bf16 and the sums lose
    their precision (the streaming backward would then subtract a bf16 log-sum-exp from float32 scores).
    """
    return torch.autocast(device_type=x.device.type, enabled=False)


def elu_feature_map(x: Tensor) -> Tensor:
    """``phi(x) = elu(x) + 1``: positive, so every similarity and normaliser is positive."""
    return F.elu(x) + 1.0


@dataclass
class LinearAttentionState:
    """The recurrent state of causal linear attention over the keys seen so far.

    ``kv``: ``sum_j phi(k_j) v_j^T``, ``(B, H, D, Dv)``; ``k_sum``: ``sum_j phi(k_j)``, ``(B, H, D)``.
    Both in float32.
    """

    kv: Tensor
    k_sum: Tensor

    @classmethod
    def from_keys(cls, phi_k: Tensor, v: Tensor) -> "LinearAttentionState":
        """The state of feature-mapped keys ``(B, H, L, D)`` and values ``(B, H, L, Dv)``."""
        return cls(phi_k.transpose(-2, -1) @ v, phi_k.sum(dim=-2))

    def readout(self, q: Tensor) -> Tensor:
        """Non-causal attention of queries ``(B, H, Lq, D)`` to every key in the state, computed in
        float32 (autocast or not), returned in ``q``'s dtype."""
        with float32_region(q):
            phi_q = elu_feature_map(q.float())
            return _divide(phi_q @ self.kv, phi_q @ self.k_sum.unsqueeze(-1)).to(q.dtype)

    def reorder(self, index: Tensor) -> None:
        self.kv, self.k_sum = self.kv.index_select(0, index), self.k_sum.index_select(0, index)


def _divide(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` with 0 where ``den == 0`` (a query with no key), finite gradients everywhere."""
    empty = den == 0
    return (num / den.masked_fill(empty, 1.0)).masked_fill(empty, 0.0)


def _causal_chunks(phi_q: Tensor, phi_k: Tensor, v: Tensor, state: LinearAttentionState | None,
                   chunk_size: int) -> tuple[Tensor, LinearAttentionState]:
    b, h, length, d = phi_q.shape
    if state is None:
        state = LinearAttentionState(phi_q.new_zeros(b, h, d, v.shape[-1]), phi_q.new_zeros(b, h, d))
    kv, k_sum = state.kv, state.k_sum
    outs = []
    for start in range(0, length, chunk_size):
        qc, kc, vc = (t[:, :, start:start + chunk_size] for t in (phi_q, phi_k, v))
        intra = (qc @ kc.transpose(-2, -1)).tril()  # (B, H, C, C): the chunk's own causal part
        num = qc @ kv + intra @ vc
        den = (qc @ k_sum.unsqueeze(-1)).squeeze(-1) + intra.sum(dim=-1)
        outs.append(_divide(num, den.unsqueeze(-1)))
        kv = kv + kc.transpose(-2, -1) @ vc
        k_sum = k_sum + kc.sum(dim=-2)
    return torch.cat(outs, dim=2), LinearAttentionState(kv, k_sum)


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Tensor | None = None,
    is_causal: bool = False,
    need_weights: bool = False,
    state: LinearAttentionState | None = None,
    return_state: bool = False,
    chunk_size: int = 64,
) -> Tensor | tuple[Tensor, ...]:
    """Kernelized linear attention with ``phi = elu + 1``.

    Non-causal: ``out_i = phi(q_i) (phi(K)^T V) / phi(q_i) (phi(K)^T 1)``. Causal: the same sums over
    keys ``j <= i`` only (plus the keys already in ``state``).

    Args:
        q: ``(B, H, Lq, D)``.
        k: ``(B, H, Lk, D)``.
        v: ``(B, H, Lk, Dv)``.
        key_mask: Boolean ``(B, Lk)``, True = real key. Key padding and causality are the only
            masks linear attention can honour (an arbitrary ``(Lq, Lk)`` mask would need the
            quadratic matrix).
        is_causal: Causal attention; needs ``Lq == Lk`` (the new tokens, after ``state``'s past).
        need_weights: Also return the implied normalised weights ``(B, H, Lq, Lk)`` (quadratic,
            for inspection only; with a ``state`` they cover the new keys only).
        state: Keys already seen (cached decoding): with ``is_causal`` the recurrence continues
            from it; without, the new keys are added to it.
        return_state: Also return the :class:`LinearAttentionState` after these keys.
        chunk_size: Causal chunk length (memory ``O(L * chunk_size)``, time ``O(L * chunk_size * D)``).

    Returns:
        ``out`` ``(B, H, Lq, Dv)`` in ``q``'s dtype, then the weights and/or the state if asked. The
        sums and the state are float32 whatever the inputs' dtype or the autocast.
    """
    with float32_region(q):
        return _linear_attention(q, k, v, key_mask, is_causal, need_weights, state, return_state, chunk_size)


def _linear_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, is_causal: bool, need_weights: bool,
                      state: LinearAttentionState | None, return_state: bool,
                      chunk_size: int) -> Tensor | tuple[Tensor, ...]:
    check_qkv(q, k, v)
    b, _, lq, _ = q.shape
    lk = k.shape[2]
    if is_causal and lq != lk:
        raise ValueError(f"causal linear attention needs as many queries as keys (got {lq} and {lk}); for decoding "
                         f"pass the past as state=LinearAttentionState and only the new tokens as q, k, v")
    phi_q, phi_k, vf = elu_feature_map(q.float()), elu_feature_map(k.float()), v.float()
    if key_mask is not None:
        check_key_mask(key_mask, b, lk)
        keep = key_mask[:, None, :, None].to(phi_k.dtype)
        phi_k, vf = phi_k * keep, vf * keep  # a padded key adds nothing to any sum
    if is_causal:
        out, new_state = _causal_chunks(phi_q, phi_k, vf, state, chunk_size)
    else:
        new_state = LinearAttentionState.from_keys(phi_k, vf)
        if state is not None:
            new_state = LinearAttentionState(state.kv + new_state.kv, state.k_sum + new_state.k_sum)
        out = new_state.readout(q)
    results: tuple[Tensor, ...] = (out.to(q.dtype),)
    if need_weights:
        sim = phi_q @ phi_k.transpose(-2, -1)  # zero at padded keys already
        if is_causal:
            sim = sim.masked_fill(~causal_mask(lq, lk, q.device), 0.0)
        past = (phi_q @ state.k_sum.unsqueeze(-1)) if state is not None else 0.0
        results += (_divide(sim, sim.sum(dim=-1, keepdim=True) + past).to(q.dtype),)
    if return_state:
        results += (new_state,)
    return results[0] if len(results) == 1 else results


class _StreamingSoftmax(torch.autograd.Function):
    """Exact softmax attention over key blocks; backward recomputes each block (FlashAttention's scheme).

    Precision: float32 throughout, forward and backward alike, with autocast off inside both
    (:func:`float32_region`), so the backward's recomputed probabilities use the forward's exact
    log-sum-exp; inputs and gradients keep their dtype.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float,
                block_size: int) -> Tensor:
        with float32_region(q):
            return _StreamingSoftmax._forward(ctx, q, k, v, mask, is_causal, scale, block_size)

    @staticmethod
    def _forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float,
                 block_size: int) -> Tensor:
        qf = q.float()
        b, h, lq, _ = q.shape
        lk = k.shape[2]
        m = q.new_full((b, h, lq), float("-inf"), dtype=torch.float32)  # running max
        l = q.new_zeros((b, h, lq), dtype=torch.float32)                # running sum of exp
        acc = q.new_zeros((b, h, lq, v.shape[-1]), dtype=torch.float32)
        for j0 in range(0, lk, block_size):
            s = _block_scores(qf, k, mask, is_causal, scale, j0, block_size, lk)
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = m_new.masked_fill(torch.isinf(m_new), 0.0)  # rows without an allowed key yet
            alpha = torch.exp(m - m_safe)
            p = torch.exp(s - m_safe.unsqueeze(-1))
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha.unsqueeze(-1) + p @ v[:, :, j0:j0 + block_size].float()
            m = m_new
        empty = l == 0
        out = (acc / l.masked_fill(empty, 1.0).unsqueeze(-1)).masked_fill(empty.unsqueeze(-1), 0.0)
        lse = torch.where(empty, float("inf"), m.masked_fill(empty, 0.0) + torch.log(l.masked_fill(empty, 1.0)))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.is_causal, ctx.scale, ctx.block_size = mask, is_causal, scale, block_size
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        with float32_region(grad_out):
            return _StreamingSoftmax._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        qf, go = q.float(), grad_out.float()
        lk = k.shape[2]
        delta = (go * out).sum(dim=-1, keepdim=True)  # (B, H, Lq, 1)
        dq = torch.zeros_like(qf)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for j0 in range(0, lk, ctx.block_size):
            j1 = min(j0 + ctx.block_size, lk)
            kb, vb = k[:, :, j0:j1].float(), v[:, :, j0:j1].float()
            p = torch.exp(_block_scores(qf, k, ctx.mask, ctx.is_causal, ctx.scale, j0, ctx.block_size, lk)
                          - lse.unsqueeze(-1))
            dv[:, :, j0:j1] = p.transpose(-2, -1) @ go
            ds = p * (go @ vb.transpose(-2, -1) - delta)
            dq += (ds @ kb) * ctx.scale
            dk[:, :, j0:j1] = (ds.transpose(-2, -1) @ qf) * ctx.scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _block_scores(qf: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool, scale: float, j0: int,
                  block_size: int, lk: int) -> Tensor:
    """Masked logits of all queries against keys ``j0 : j0 + block_size``, float32, -inf where masked."""
    j1 = min(j0 + block_size, lk)
    s = (qf @ k[:, :, j0:j1].float().transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask[..., j0:j1], float("-inf"))
    if is_causal:
        lq = qf.shape[2]
        rows = torch.arange(lq, device=qf.device)[:, None] + (lk - lq)  # absolute query positions
        s = s.masked_fill(rows < torch.arange(j0, j1, device=qf.device)[None, :], float("-inf"))
    return s


def streaming_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    block_size: int = 128,
) -> Tensor:
    """Exact softmax attention computed block by block over the keys (online softmax).

    Equal to :func:`~vitlab.attention.scaled_dot_product_attention` (to float32 rounding), with the
    same mask convention (True = may attend, causal aligned to the end, empty rows give 0). Forward
    and backward hold ``(B, H, Lq, block_size)`` logits at a time, never ``(B, H, Lq, Lk)``.
    """
    check_qkv(q, k, v)
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    if mask is not None:
        check_mask(mask, q, k)
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _StreamingSoftmax.apply(q, k, v, mask, is_causal, scale, block_size)
