"""Positions: learned ViT grids resampled to new image sizes; fixed 2-D sin-cos grids (MAE, "Better plain
ViT baselines"); the 1-D sinusoidal encoding of the 2017 paper."""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["resample_pos_embed", "sinusoidal_position_encoding", "sincos_2d_position_encoding", "PosEmbedName",
           "POS_EMBEDS"]

PosEmbedName = Literal["learn", "sincos", "none"]
POS_EMBEDS: tuple[str, ...] = ("learn", "sincos", "none")


def resample_pos_embed(
    pos_embed: Tensor,
    new_grid: tuple[int, int],
    old_grid: tuple[int, int],
    num_prefix_tokens: int = 1,
    antialias: bool = True,
) -> Tensor:
    """Resample a learned positional embedding to another patch grid, as timm does.

    The prefix (CLS) positions are kept; the grid positions are interpolated bicubically
    (antialiased, PyTorch's PIL-like kernel, as timm; ``antialias=False``: the plain bicubic kernel, as
    transformers' ``interpolate_pos_encoding``), in float32.

    Args:
        pos_embed: ``(1, num_prefix_tokens + old_h * old_w, E)``.
        new_grid: Target grid ``(h, w)`` in patches.
        old_grid: Source grid ``(h, w)`` in patches.
        num_prefix_tokens: Leading non-grid tokens (1 for the CLS token).

    Returns:
        ``(1, num_prefix_tokens + h * w, E)`` in the dtype of ``pos_embed``.
    """
    expected = num_prefix_tokens + old_grid[0] * old_grid[1]
    if pos_embed.dim() != 3 or pos_embed.shape[1] != expected:
        raise ValueError(
            f"pos_embed of shape {tuple(pos_embed.shape)} does not fit a {old_grid[0]}x{old_grid[1]} grid "
            f"with {num_prefix_tokens} prefix token(s): expected (1, {expected}, embed_dim)")
    if tuple(new_grid) == tuple(old_grid):
        return pos_embed
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    dim = pos_embed.shape[-1]
    grid = grid.float().reshape(1, old_grid[0], old_grid[1], dim).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=tuple(new_grid), mode="bicubic", align_corners=False, antialias=antialias)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)


def sinusoidal_position_encoding(max_len: int, dim: int) -> Tensor:
    """The fixed encoding of Vaswani et al. (2017), ``(max_len, dim)``, float32.

    ``PE[pos, 2i] = sin(pos / 10000^(2i / dim))`` and ``PE[pos, 2i + 1] = cos(pos / 10000^(2i / dim))``.
    """
    if dim % 2:
        raise ValueError(f"sinusoidal position encoding needs an even width, got dim={dim}")
    position = torch.arange(max_len, dtype=torch.float64)[:, None]
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    pe = torch.zeros(max_len, dim, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(position * inv_freq)
    pe[:, 1::2] = torch.cos(position * inv_freq)
    return pe.float()


def sincos_2d_position_encoding(grid: tuple[int, int], dim: int, temperature: float = 10000.0,
                                layout: Literal["timm", "mae"] = "timm") -> Tensor:
    """Fixed 2-D sin-cos positions of a ``(h, w)`` patch grid, ``(h * w, dim)``, float32, row-major.

    A quarter of the channels each, with ``f_i = temperature^(-i / (dim / 4))``, ``y`` the row and ``x`` the column
    index: ``[sin(y * f), sin(x * f), cos(y * f), cos(x * f)]``, the layout of timm's ``build_sincos2d_pos_embed``;
    ``layout='mae'``: ``[sin(x * f), cos(x * f), sin(y * f), cos(y * f)]``, the masked autoencoder's
    (``get_2d_sincos_pos_embed`` of He et al.'s code, transformers' ``ViTMAE``). Being a function of the grid, it
    is recomputed exactly (not interpolated) at any other image size.
    """
    if dim % 4:
        raise ValueError(f"2-D sin-cos positions need a width divisible by 4, got embed_dim={dim}")
    quarter = dim // 4
    freq = temperature ** (-torch.arange(quarter, dtype=torch.float64) / quarter)
    y, x = torch.meshgrid(torch.arange(grid[0], dtype=torch.float64), torch.arange(grid[1], dtype=torch.float64),
                          indexing="ij")
    angles = torch.stack([y.flatten(), x.flatten()], dim=1)[:, :, None] * freq  # (N, 2, dim / 4)
    if layout == "mae":
        return torch.cat([angles[:, 1].sin(), angles[:, 1].cos(), angles[:, 0].sin(), angles[:, 0].cos()],
                         dim=1).float()
    return torch.cat([angles.sin(), angles.cos()], dim=1).flatten(1).float()
