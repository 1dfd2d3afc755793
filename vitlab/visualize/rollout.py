"""Attention rollout (Abnar & Zuidema 2020) and per-block attention maps of a ViT, as patch-grid heat maps.

Input everywhere: the per-block weights of :meth:`vitlab.models.VisionTransformer.get_attention_maps`,
a list of ``(B, H, N, N)`` tensors (rows are queries and sum to 1; the first ``num_prefix_tokens``
tokens are the CLS token). Only that call takes the explicit attention path; training keeps the fused kernel.
"""
from __future__ import annotations

from typing import Literal, Protocol, Sequence

import torch
from torch import Tensor

__all__ = ["attention_rollout", "cls_attention_map", "block_attention_map", "HeadFusion"]

HeadFusion = Literal["mean", "max", "min"]
_FUSIONS = ("mean", "max", "min")


class _PatchModel(Protocol):
    num_prefix_tokens: int
    global_pool: str  # 'token' (the CLS token's row) or 'avg' (the mean of the patch rows)
    patch_embed: object  # has .grid_size


def _fuse(weights: Tensor, head_fusion: str) -> Tensor:
    """``(B, H, N, N)`` -> ``(B, N, N)``."""
    if head_fusion == "mean":
        return weights.mean(1)
    return weights.amax(1) if head_fusion == "max" else weights.amin(1)


@torch.no_grad()
def attention_rollout(maps: Sequence[Tensor], head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0,
                      num_prefix_tokens: int = 1) -> Tensor:
    """How much each token's final representation draws on each input token, through every block.

    Per block: fuse the heads (``mean``, ``max`` or ``min``); in each row zero the lowest
    ``int(discard_ratio * (N - num_prefix_tokens))`` weights among the patch columns (the CLS column is
    never discarded); add the identity for the residual path; renormalise every row to sum 1. Then
    multiply the blocks from the first to the last: ``R = A_L ... A_2 A_1``.

    Args:
        maps: Per-block weights, each ``(B, H, N, N)``.
        head_fusion: How the heads are combined.
        discard_ratio: In ``[0, 1)``; 0 keeps every weight.
        num_prefix_tokens: Leading tokens (CLS) whose column is never discarded.

    Returns:
        ``(B, N, N)`` with rows that sum to 1; row 0 is the CLS token's rollout.
    """
    if head_fusion not in _FUSIONS:
        raise ValueError(f"head_fusion={head_fusion!r} is not one of {', '.join(_FUSIONS)}")
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio={discard_ratio} must be in [0, 1): the share of each row's weights to zero")
    if not maps:
        raise ValueError("attention_rollout needs the maps of at least one block")
    b, _, n, _ = maps[0].shape
    eye = torch.eye(n, device=maps[0].device, dtype=torch.float32)
    result = eye.expand(b, n, n)
    for weights in maps:
        fused = _fuse(weights.float(), head_fusion)
        k = int(discard_ratio * (n - num_prefix_tokens))
        if k:
            patches = fused[..., num_prefix_tokens:]
            lowest = patches.topk(k, dim=-1, largest=False).indices
            fused = torch.cat([fused[..., :num_prefix_tokens], patches.scatter(-1, lowest, 0.0)], dim=-1)
        a = fused + eye
        result = (a / a.sum(-1, keepdim=True)) @ result
    return result


def _to_grid(rows: Tensor, model: _PatchModel) -> Tensor:
    """Token-to-token weights ``(B, N, N)`` -> the patch grid ``(B, gh, gw)`` as the classifier reads it:
    the CLS token's row (``global_pool='token'``), or the mean over the patch rows (``'avg'``: what the
    average pool reads); registers and other prefix tokens are read by neither."""
    prefix = model.num_prefix_tokens
    read = rows[:, prefix:].mean(1) if getattr(model, "global_pool", "token") == "avg" else rows[:, 0]
    return read[:, prefix:].reshape(rows.shape[0], *model.patch_embed.grid_size)


def cls_attention_map(rollout: Tensor, model: _PatchModel) -> Tensor:
    """The CLS token's rollout over the patches, ``(B, N, N)`` -> ``(B, grid_h, grid_w)``."""
    return _to_grid(rollout, model)


def block_attention_map(maps: Sequence[Tensor], model: _PatchModel, block: int = -1,
                        head: int | Literal["mean"] = "mean") -> Tensor:
    """The raw CLS-to-patch weights of one block and one head (or the mean over heads), ``(B, gh, gw)``."""
    if not -len(maps) <= block < len(maps):
        raise ValueError(f"block {block} is out of range: the model has {len(maps)} blocks (0..{len(maps) - 1}, or -1)")
    weights = maps[block]
    heads = weights.shape[1]
    if head == "mean":
        fused = weights.mean(1)
    elif isinstance(head, int) and -heads <= head < heads:
        fused = weights[:, head]
    else:
        raise ValueError(f"head {head} is out of range: each block has {heads} heads (0..{heads - 1}, or 'mean')")
    return _to_grid(fused.float(), model)
