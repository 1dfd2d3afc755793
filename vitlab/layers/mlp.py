"""Dense position-wise feed-forward networks, chosen by name: ``mlp`` (two linears) or ``swiglu`` (gated).

Parameter names follow timm: ``Mlp`` has ``fc1``, ``fc2``; ``SwiGLU`` has ``fc1_g`` (gate), ``fc1_x``
(value) and ``fc2``, as ``timm.layers.SwiGLU``.
"""
from __future__ import annotations

from typing import Callable

from torch import Tensor, nn

__all__ = ["Mlp", "SwiGLU", "get_activation", "create_dense_mlp", "ACTIVATIONS"]

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU}


def get_activation(name: str) -> nn.Module:
    """An activation module by name: ``'gelu'`` (exact, as in ViT), ``'relu'`` or ``'silu'``."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; expected one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]()


class Mlp(nn.Module):
    """``fc2(drop(act(fc1(x))))`` on ``(..., dim)``."""

    def __init__(self, dim: int, hidden_dim: int, act: str = "gelu", drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = get_activation(act)
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class SwiGLU(nn.Module):
    """Gated MLP (Shazeer 2020): ``fc2(drop(act(fc1_g(x)) * fc1_x(x)))`` on ``(..., dim)``.

    With ``act='silu'`` this is SwiGLU; timm's ``SwiGLU`` takes the block's activation the same way.
    Three matrices instead of two: at equal ``hidden_dim`` it has 1.5x the MLP's parameters.
    """

    def __init__(self, dim: int, hidden_dim: int, act: str = "silu", drop: float = 0.0) -> None:
        super().__init__()
        self.fc1_g = nn.Linear(dim, hidden_dim)
        self.fc1_x = nn.Linear(dim, hidden_dim)
        self.act = get_activation(act)
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = nn.Dropout(drop)

    def init_weights(self) -> None:
        """timm's gate initialisation: weight near zero, bias one (the gate starts open)."""
        nn.init.ones_(self.fc1_g.bias)
        nn.init.normal_(self.fc1_g.weight, std=1e-6)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1_g(x)) * self.fc1_x(x))))


def create_dense_mlp(kind: str, dim: int, hidden_dim: int, act: str | None = None, drop: float = 0.0) -> nn.Module:
    """A dense feed-forward network by name: ``'mlp'`` (:class:`Mlp`) or ``'swiglu'`` (:class:`SwiGLU`);
    ``act`` None: GELU for ``mlp``, SiLU for ``swiglu``. (A block's network, mixtures of experts
    included, comes from :func:`vitlab.layers.ffn.create_mlp`.)"""
    if kind == "mlp":
        return Mlp(dim, hidden_dim, act or "gelu", drop)
    if kind == "swiglu":
        return SwiGLU(dim, hidden_dim, act or "silu", drop)
    raise ValueError(f"unknown dense mlp {kind!r}; expected 'mlp' or 'swiglu'")
