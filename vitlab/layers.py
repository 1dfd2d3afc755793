"""Building blocks shared by the ViT and the text Transformer: MLP, stochastic depth, pre-norm block.

Parameter names follow timm (``norm1``, ``attn``, ``norm2``, ``mlp.fc1``, ``mlp.fc2``) so that a
timm ViT checkpoint maps onto vitlab one key to one key.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import Tensor, nn

from .attention import MultiHeadAttention

__all__ = ["LayerNorm", "Mlp", "DropPath", "Block", "get_activation"]

#: LayerNorm as in timm's and Google's ViT: eps 1e-6 (PyTorch's default is 1e-5).
LayerNorm: Callable[..., nn.LayerNorm] = partial(nn.LayerNorm, eps=1e-6)

_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {"gelu": nn.GELU, "relu": nn.ReLU}


def get_activation(name: str) -> nn.Module:
    """An activation module by name: ``'gelu'`` (exact, as in ViT) or ``'relu'``."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; expected one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()


class Mlp(nn.Module):
    """Position-wise feed-forward network ``fc2(drop(act(fc1(x))))`` on ``(..., dim)``."""

    def __init__(self, dim: int, hidden_dim: int, act: str = "gelu", drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = get_activation(act)
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class DropPath(nn.Module):
    """Stochastic depth: in training, drop a sample's whole residual branch with probability ``p``.

    Kept samples are scaled by ``1 / (1 - p)`` so the expectation is unchanged; identity in eval.
    """

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"drop path probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        shape = (x.shape[0],) + (1,) * (x.dim() - 1)  # one draw per sample
        return x * x.new_empty(shape).bernoulli_(keep).div_(keep)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Block(nn.Module):
    """Transformer encoder block on ``(B, N, dim)``: the ViT block and the text encoder layer.

    Pre-norm (``norm_first=True``, ViT): ``x = x + drop_path(attn(norm1(x)))``, then
    ``x = x + drop_path(mlp(norm2(x)))``. Post-norm (the 2017 paper): ``x = norm1(x + attn(x))``,
    then ``x = norm2(x + mlp(x))``.

    Args:
        dim: Token width.
        num_heads: Attention heads.
        mlp_ratio: MLP hidden width as a multiple of ``dim`` (ignored if ``mlp_hidden_dim`` is given).
        qkv_bias: Bias on the query/key/value projections.
        proj_drop: Dropout after the attention projection and in the MLP.
        attn_drop: Dropout on attention weights.
        drop_path: Stochastic depth rate.
        act: MLP activation, ``'gelu'`` or ``'relu'``.
        norm_first: Pre-norm (True) or post-norm (False).
        norm_eps: LayerNorm epsilon (1e-6 as in ViT; PyTorch's Transformer uses 1e-5).
        mlp_hidden_dim: MLP hidden width.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        act: str = "gelu",
        norm_first: bool = True,
        norm_eps: float = 1e-6,
        mlp_hidden_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = MultiHeadAttention(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop)
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, mlp_hidden_dim or int(dim * mlp_ratio), act=act, drop=proj_drop)
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: Tensor, mask: Tensor | None = None, key_mask: Tensor | None = None,
                need_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """``x`` ``(B, N, dim)``; ``mask`` / ``key_mask`` as in :class:`MultiHeadAttention` (True = may attend /
        real token). Returns ``(B, N, dim)``, or ``(x, weights)`` with weights ``(B, H, N, N)`` if asked."""
        h = self.norm1(x) if self.norm_first else x
        attn = self.attn(h, mask=mask, key_mask=key_mask, need_weights=need_weights)
        attn, weights = attn if need_weights else (attn, None)
        if self.norm_first:
            x = x + self.drop_path1(attn)
            x = x + self.drop_path2(self.mlp(self.norm2(x)))
        else:
            x = self.norm1(x + self.drop_path1(attn))
            x = self.norm2(x + self.drop_path2(self.mlp(x)))
        return (x, weights) if need_weights else x


def drop_path_rates(drop_path_rate: float, depth: int) -> list[float]:
    """Stochastic depth rates rising linearly from 0 to ``drop_path_rate`` over the blocks."""
    return [x.item() for x in torch.linspace(0, drop_path_rate, depth)] if depth > 0 else []
