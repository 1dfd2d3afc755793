"""A block's feed-forward network, chosen by name: ``'mlp'`` or ``'swiglu'`` (:mod:`.mlp`), or ``'moe'``
(:mod:`.moe`, a routed mixture of them). The one factory the blocks use."""
from __future__ import annotations

from typing import Literal

from torch import nn

from .mlp import create_dense_mlp
from .moe import MoE

__all__ = ["MlpName", "MLPS", "create_mlp"]

MlpName = Literal["mlp", "swiglu", "moe"]
MLPS: tuple[str, ...] = ("mlp", "swiglu", "moe")


def create_mlp(kind: str, dim: int, hidden_dim: int, act: str | None = None, drop: float = 0.0,
               num_experts: int = 4, moe_top_k: int = 2, moe_expert_layer: str = "mlp",
               moe_aux_loss_weight: float = 0.01) -> nn.Module:
    """The feed-forward network of a block by name: ``'mlp'``, ``'swiglu'`` or ``'moe'`` (a mixture of
    ``num_experts`` networks of kind ``moe_expert_layer``). ``act`` None: GELU for ``mlp``, SiLU for
    ``swiglu``."""
    if kind not in MLPS:
        raise ValueError(f"unknown mlp_layer {kind!r}; expected one of {', '.join(MLPS)}")
    if kind == "moe":
        return MoE(dim, hidden_dim, num_experts, moe_top_k, expert_layer=moe_expert_layer, act=act, drop=drop,
                   aux_loss_weight=moe_aux_loss_weight)
    return create_dense_mlp(kind, dim, hidden_dim, act, drop)
