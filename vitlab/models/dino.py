"""Self-distillation without labels (DINO, Caron et al. 2021, "Emerging Properties in Self-Supervised Vision
Transformers"): a student ViT and its projection head learn to give every view of an image the distribution its
teacher, an exponential moving average of the student, gives the image's two large views.

- :class:`DINOHead`: DINO's projection head (a 3-layer MLP with GELU, an L2-normalized bottleneck, a
  weight-normalized last layer whose norm is fixed at 1 unless ``norm_last_layer=False``).
- :class:`DINO`: the student (backbone + head, trained) and the teacher (a copy, moved towards the student after
  every step: :meth:`DINO.update_teacher`) and the loss's center, a buffer, so that a checkpoint holds all of it.
- :func:`dino_loss`: the cross-entropy between the teacher's centered, sharpened distributions of the large views
  and the student's of every other view, averaged over the pairs; and the center's update, its batch mean taken
  over every process.

The backbone is vitlab's :class:`~vitlab.models.VisionTransformer` (no head, ``dynamic_img_size``: the small
views run at their own size); its pooled features (the teacher's: :meth:`DINO.backbone`) are what k-NN, a linear
probe or fine-tuning read.
"""
from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.init import trunc_normal_
from torch.nn.utils.parametrizations import weight_norm

from ..layers import GradCheckpointing
from .hub import HubMixin
from .vit import VisionTransformer

__all__ = ["DINOHead", "DINO", "dino_loss", "update_center", "cosine_momentum", "teacher_temperature"]


class DINOHead(nn.Module):
    """DINO's projection head: ``Linear -> GELU -> Linear -> GELU -> Linear`` to the ``bottleneck_dim``, L2-normalized,
    then a weight-normalized ``Linear`` without bias to ``out_dim`` (its norm fixed at 1: ``norm_last_layer``)."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int = 2048, bottleneck_dim: int = 256,
                 norm_last_layer: bool = True) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim),
                                 nn.GELU(), nn.Linear(hidden_dim, bottleneck_dim))
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        self.last_layer = weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        norm = self.last_layer.parametrizations.weight.original0
        with torch.no_grad():
            norm.fill_(1.0)
        norm.requires_grad_(not norm_last_layer)

    def forward(self, x: Tensor) -> Tensor:
        """Pooled features ``(B, in_dim)`` to logits ``(B, out_dim)``."""
        return self.last_layer(F.normalize(self.mlp(x), dim=-1, p=2))


class DINO(nn.Module, HubMixin, GradCheckpointing):
    """The student and teacher of DINO over a :class:`VisionTransformer` backbone.

    Args:
        img_size, patch_size, in_chans, embed_dim, depth, num_heads, mlp_ratio, qkv_bias, drop_path_rate, norm_eps:
            The backbone's, as :class:`VisionTransformer`'s (a CLS token, learned positions).
        out_dim, hidden_dim, bottleneck_dim, norm_last_layer: The projection head's (:class:`DINOHead`).
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 384,
        depth: int = 12,
        num_heads: int = 6,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path_rate: float = 0.1,
        norm_eps: float = 1e-6,
        out_dim: int = 65536,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
        norm_last_layer: bool = True,
    ) -> None:
        config: dict[str, Any] = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__()
        if out_dim < 2:
            raise ValueError(f"out_dim={out_dim}: the head's distribution needs at least 2 outputs (DINO: 65536)")
        self.config = config
        self.student_backbone = VisionTransformer(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=0, embed_dim=embed_dim,
            depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop_path_rate=drop_path_rate,
            norm_eps=norm_eps, dynamic_img_size=True)
        self.student_head = DINOHead(embed_dim, out_dim, hidden_dim, bottleneck_dim, norm_last_layer)
        self.teacher_backbone = copy.deepcopy(self.student_backbone)
        self.teacher_head = copy.deepcopy(self.student_head)
        for part in (self.teacher_backbone, self.teacher_head):
            part.requires_grad_(False)
        self.register_buffer("center", torch.zeros(1, out_dim))

    def train(self, mode: bool = True) -> DINO:
        """The student in ``mode``; the teacher always in eval mode (no drop path: DINO's teacher is built without
        it)."""
        super().train(mode)
        self.teacher_backbone.eval()
        self.teacher_head.eval()
        return self

    @property
    def patch_embed(self) -> nn.Module:
        """The backbone's patch embedding (what the model's input size is read from)."""
        return self.student_backbone.patch_embed

    @staticmethod
    def _multi_crop(backbone: nn.Module, head: nn.Module, crops: list[Tensor]) -> Tensor:
        """Every crop's head output, crop by crop ``(len(crops) * B, out_dim)``; crops of one size run together."""
        features, start = [], 0
        while start < len(crops):
            end = start
            while end < len(crops) and crops[end].shape[-2:] == crops[start].shape[-2:]:
                end += 1
            features.append(backbone.forward_head(backbone.forward_features(torch.cat(crops[start:end])),
                                                  pre_logits=True))
            start = end
        return head(torch.cat(features))

    def forward(self, crops: list[Tensor]) -> Tensor:
        """The student's logits of every view ``(len(crops) * B, out_dim)``, view by view (the two large ones first)."""
        return self._multi_crop(self.student_backbone, self.student_head, list(crops))

    @torch.no_grad()
    def teacher_forward(self, crops: list[Tensor]) -> Tensor:
        """The teacher's logits of the large views ``(len(crops) * B, out_dim)``."""
        return self._multi_crop(self.teacher_backbone, self.teacher_head, list(crops))

    @torch.no_grad()
    def update_teacher(self, momentum: float) -> None:
        """Move every teacher weight towards the student's: ``t = momentum * t + (1 - momentum) * s``."""
        for student, teacher in ((self.student_backbone, self.teacher_backbone),
                                 (self.student_head, self.teacher_head)):
            for s, t in zip(student.parameters(), teacher.parameters()):
                t.mul_(momentum).add_(s.detach(), alpha=1 - momentum)

    def backbone(self) -> VisionTransformer:
        """The teacher's backbone as a :class:`VisionTransformer` without a head (its weights, not a copy), carrying
        the model's ``pretrained_cfg``: DINO evaluates, and fine-tuning starts from, the teacher."""
        self.teacher_backbone.pretrained_cfg = dict(getattr(self, "pretrained_cfg", {}) or {})
        return self.teacher_backbone


def dino_loss(student_out: Tensor, teacher_out: Tensor, center: Tensor, global_crops: int, student_temp: float,
              teacher_temp: float) -> Tensor:
    """DINO's loss: the teacher's distributions of the ``global_crops`` large views, ``softmax((t - center) /
    teacher_temp)``, against the student's ``log_softmax(s / student_temp)`` of every other view, the
    cross-entropy ``-sum(p log q)`` averaged over the images and then over the pairs (the repository's
    ``DINOLoss.forward``). ``student_out`` ``(V * B, K)`` and ``teacher_out`` ``(global_crops * B, K)`` view by view."""
    student = (student_out.float() / student_temp).chunk(student_out.shape[0] // (teacher_out.shape[0] //
                                                                                   global_crops))
    teacher = F.softmax((teacher_out.float() - center) / teacher_temp, dim=-1).detach().chunk(global_crops)
    total, terms = student_out.new_zeros((), dtype=torch.float32), 0
    for i, q in enumerate(teacher):
        for v, s in enumerate(student):
            if v != i:
                total = total + torch.sum(-q * F.log_softmax(s, dim=-1), dim=-1).mean()
                terms += 1
    return total / terms


@torch.no_grad()
def update_center(center: Tensor, teacher_out: Tensor, momentum: float) -> None:
    """The center's update in place: ``center * momentum + (1 - momentum) * mean(teacher_out)``, the mean over the
    whole global batch (summed over every process of a group)."""
    total = teacher_out.float().sum(dim=0, keepdim=True)
    count = torch.full((), float(len(teacher_out)), device=teacher_out.device)  # torch.tensor: a copy that waits
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
        torch.distributed.all_reduce(count)
    center.mul_(momentum).add_(total / count, alpha=1 - momentum)


def cosine_momentum(step: int, total_steps: int, base: float) -> float:
    """The teacher's momentum after optimizer step ``step`` (0-based) of ``total_steps``: from ``base`` to 1 on a
    half cosine (DINO's ``cosine_scheduler(base, 1, ...)``)."""
    return 1 - (1 - base) * (1 + math.cos(math.pi * step / max(total_steps, 1))) / 2


def teacher_temperature(epoch: int, warmup_epochs: int, warmup_temp: float, temp: float) -> float:
    """The teacher's temperature in ``epoch`` (0-based): linear from ``warmup_temp`` to ``temp`` over ``warmup_epochs``
    (both ends included, as ``np.linspace``), then ``temp``."""
    if epoch >= warmup_epochs:
        return temp
    if warmup_epochs == 1:
        return warmup_temp
    return warmup_temp + (temp - warmup_temp) * epoch / (warmup_epochs - 1)
