"""Stochastic depth (Huang et al. 2016), as in timm's ``DropPath``."""
from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["DropPath", "drop_path_rates"]


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


def drop_path_rates(drop_path_rate: float, depth: int) -> list[float]:
    """Stochastic depth rates rising linearly from 0 to ``drop_path_rate`` over the blocks."""
    return [x.item() for x in torch.linspace(0, drop_path_rate, depth)] if depth > 0 else []
