"""Mixture of experts as a block's feed-forward network (Shazeer et al. 2017; Switch, Fedus et al. 2021;
Mixtral, Jiang et al. 2024).

Each token goes to ``top_k`` of ``num_experts`` expert MLPs: a learned router scores the experts
(``router``, a bias-free linear) and the token's output is the gate-weighted sum of its top-k experts'
outputs. The gates: for ``top_k >= 2`` the chosen logits soft-maxed among themselves (Mixtral); for
``top_k = 1`` the chosen expert's probability under the softmax over all experts (Switch Transformer,
eq. 2): a softmax over one logit would be exactly 1 and give the router no gradient from the task.
Tokens are dispatched: each expert runs only on the tokens routed to it, so compute grows with
``top_k``, not with ``num_experts``.

Load balancing (Switch Transformer): ``aux_loss = weight * E * sum_e f_e * P_e``, where ``f_e`` is the
fraction of the batch's routing assignments that went to expert ``e`` and ``P_e`` the mean router
probability (softmax over all experts) of ``e``; it is 1 x weight when routing is uniform. The
training loop adds every MoE layer's ``aux_loss`` (:func:`moe_aux_loss`) to the task loss.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .mlp import create_dense_mlp

__all__ = ["MoE", "moe_aux_loss", "expert_utilization"]


class MoE(nn.Module):
    """Top-k routed mixture of expert MLPs on ``(..., dim)``.

    Args:
        dim: Token width.
        hidden_dim: Each expert's hidden width.
        num_experts: Experts ``E``.
        top_k: Experts per token ``k`` (1 <= k <= E).
        expert_layer: Each expert's kind, ``'mlp'`` or ``'swiglu'``.
        act: The experts' activation (None: the kind's default).
        drop: Dropout inside the experts.
        aux_loss_weight: Weight of the load-balancing loss (0 = none).

    After a forward pass in training mode, ``aux_loss`` holds the weighted load-balancing loss and
    ``expert_counts`` ``(E,)`` (not saved) has grown by the assignments each expert received.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int = 4, top_k: int = 2, expert_layer: str = "mlp",
                 act: str | None = None, drop: float = 0.0, aux_loss_weight: float = 0.01) -> None:
        super().__init__()
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(f"a mixture of experts needs num_experts >= 1 and 1 <= moe_top_k <= num_experts; got "
                             f"num_experts={num_experts}, moe_top_k={top_k}")
        if expert_layer not in ("mlp", "swiglu"):  # a mixture of mixtures is not one of the seeds' systems
            raise ValueError(f"moe_expert_layer={expert_layer!r}; expected 'mlp' or 'swiglu'")
        self.num_experts, self.top_k, self.aux_loss_weight = num_experts, top_k, aux_loss_weight
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList([create_dense_mlp(expert_layer, dim, hidden_dim, act, drop) for _ in range(num_experts)])
        # A plain attribute, not a buffer: DDP would overwrite every process's counts with process 0's.
        self.expert_counts: Tensor | None = None
        self.aux_loss: Tensor | None = None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Tokens ``(T, dim)`` -> router probabilities over all experts ``(T, E)`` (float32), chosen
        experts ``(T, k)``, gates ``(T, k)`` (Mixtral's, summing to 1, for k >= 2; Switch's
        full-softmax probability for k = 1)."""
        logits = self.router(x)
        probs = logits.float().softmax(dim=-1)
        top_logits, top_idx = logits.topk(self.top_k, dim=-1)
        gates = probs.gather(-1, top_idx) if self.top_k == 1 else top_logits.float().softmax(dim=-1)
        return probs, top_idx, gates

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (T, dim)
        probs, top_idx, gates = self.route(x)
        expert_of = top_idx.flatten()                                  # (T * k,) one row per assignment
        token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        gate_of = gates.flatten()
        out: Tensor | None = None
        for e, expert in enumerate(self.experts):
            rows = (expert_of == e).nonzero().squeeze(1)
            tokens = token_of[rows]
            # An expert without tokens still runs (on zero rows): its parameters stay in the graph,
            # which DDP needs, at no cost.
            y = expert(x[tokens]) * gate_of[rows, None].to(x.dtype)
            if out is None:
                out = y.new_zeros(x.shape[0], shape[-1])
            out.index_add_(0, tokens, y.to(out.dtype))
        if self.training:
            counts = torch.bincount(expert_of, minlength=self.num_experts).float()
            self.expert_counts = counts if self.expert_counts is None else self.expert_counts + counts
            fraction = counts / expert_of.numel()
            mean_prob = probs.mean(dim=0)
            self.aux_loss = self.aux_loss_weight * self.num_experts * (fraction * mean_prob).sum()
        return out.reshape(*shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}, aux_loss_weight={self.aux_loss_weight}"


def moe_aux_loss(model: nn.Module) -> Tensor | None:
    """The sum of every MoE layer's load-balancing loss from the last training forward pass, or None
    when the model has no mixture of experts."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def expert_utilization(model: nn.Module, reset: bool = True) -> list[Tensor]:
    """Per MoE layer, the count of routing assignments each expert received since the last reset
    ``(E,)`` (sum over this process's tokens); ``reset`` zeroes the counters."""
    counts = []
    for m in model.modules():
        if isinstance(m, MoE):
            counts.append(m.expert_counts if m.expert_counts is not None else
                          torch.zeros(m.num_experts, device=m.router.weight.device))
            if reset:
                m.expert_counts = None
    return counts
