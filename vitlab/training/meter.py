"""What a training epoch sums as it goes, on the device, and the checked mean of its loss."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from ..errors import TrainingError
from ..layers import expert_utilization

__all__ = ["Meter", "checked_mean", "epoch_expert_counts"]


@dataclass
class Meter:
    """One process's sums over the epoch's optimizer steps: its task loss since the last log line
    (``window``) and over the epoch (``total``), the MoE balancing loss since the last log line, the
    examples all processes trained on (``samples``: what the task counts, images or target tokens), the
    seconds spent and waiting for data. Kept in a checkpoint written inside an epoch."""

    window: torch.Tensor
    total: torch.Tensor
    moe_aux: torch.Tensor
    samples: torch.Tensor
    window_steps: int = 0
    steps: int = 0
    seconds: float = 0.0
    data_seconds: float = 0.0
    expert_counts: list[list[float]] | None = None  # routing counts of the epoch before a resume

    @classmethod
    def start(cls, device: torch.device, saved: dict[str, Any] | None = None) -> "Meter":
        saved = dict(saved or {})
        tensors = {k: torch.tensor(saved.pop(k, 0.0), device=device) for k in ("window", "total", "moe_aux")}
        samples = torch.tensor(int(saved.pop("samples", 0)), dtype=torch.long, device=device)
        return cls(**tensors, samples=samples, **saved)

    def state_dict(self) -> dict[str, Any]:
        return {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}


def epoch_expert_counts(model: nn.Module, meter: Meter, reset: bool = False) -> list[torch.Tensor]:
    """This process's routing counts per MoE layer over the epoch so far (before and after a resume)."""
    counts = expert_utilization(model, reset=reset)
    if meter.expert_counts is None:
        return counts
    return [c + torch.tensor(before, device=c.device) for c, before in zip(counts, meter.expert_counts)]


def checked_mean(accelerator: Accelerator, local_mean: torch.Tensor, epoch: int, step: int) -> float:
    """The loss averaged over processes; stop (on every process alike) if it is not finite."""
    value = accelerator.reduce(local_mean.detach().float(), reduction="mean").item()
    if not math.isfinite(value):
        raise TrainingError(f"the training loss became {value} at epoch {epoch}, step {step}; training stopped "
                            f"and the checkpoints on disk were left as they were. Lower optim.lr, keep "
                            f"optim.grad_clip > 0, or use train.mixed_precision=bf16 instead of fp16")
    return value
