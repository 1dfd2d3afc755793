"""Knowledge distillation of an image classifier (DeiT, Touvron et al. 2021): the loss, and the frozen
teacher it asks.

:class:`DistillationLoss` is DeiT's ``DistillationLoss``: ``(1 - alpha) * base + alpha * distill`` on the
batch the student sees (augmented and mixed), with the distillation term on the student's distillation
head (a model with ``distilled=True`` returns ``(head, head_dist)`` in training) or on its one head
(logit distillation, as timm's). :func:`load_teacher` reads the teacher once, frozen, in evaluation mode,
given the batch in its own normalization.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import CheckpointError, ConfigError

__all__ = ["DistillationLoss", "Renormalized", "load_teacher"]


class DistillationLoss(nn.Module):
    """DeiT's loss: ``(1 - alpha) * base_criterion(head, labels) + alpha * distill``.

    ``distill`` is, for ``kind='soft'``, the KL divergence of the student's distillation logits from the
    teacher's, both softened by ``tau`` (log-softmaxes, summed, times ``tau**2``, over the number of
    elements); for ``kind='hard'``, the cross-entropy to the teacher's argmax. The teacher sees
    ``inputs``, without gradients, inside ``autocast`` (the run's mixed precision).

    Args:
        base_criterion: The task's loss of the student's class head.
        teacher: The teacher, frozen (:func:`load_teacher`).
        kind: ``'soft'`` or ``'hard'``.
        alpha: The distillation term's weight.
        tau: The soft term's temperature.
        autocast: A context for the teacher's forward pass (default: none).
    """

    def __init__(self, base_criterion: Callable[[Tensor, Tensor], Tensor], teacher: nn.Module, kind: str,
                 alpha: float = 0.5, tau: float = 1.0,
                 autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> None:
        super().__init__()
        if kind not in ("soft", "hard"):
            raise ValueError(f"kind={kind!r}: expected 'soft' or 'hard'")
        self.base_criterion, self.kind, self.alpha, self.tau, self.autocast = base_criterion, kind, alpha, tau, autocast
        self._teacher = [teacher]  # a list: not a submodule of the loss (never saved, never given to an optimizer)

    def forward(self, outputs: Tensor | tuple[Tensor, Tensor], inputs: Tensor, labels: Tensor) -> Tensor:
        """``outputs``: the student's logits ``(B, K)``, or ``(head, head_dist)``; ``inputs``: the batch it saw;
        ``labels``: class indices ``(B,)`` or soft targets ``(B, K)`` (mixup)."""
        logits, logits_dist = outputs if isinstance(outputs, tuple) else (outputs, outputs)
        base = self.base_criterion(logits, labels)
        with torch.no_grad(), self.autocast():
            teacher = self._teacher[0](inputs).float()
        if self.kind == "soft":
            tau = self.tau
            distill = F.kl_div(F.log_softmax(logits_dist.float() / tau, dim=1), F.log_softmax(teacher / tau, dim=1),
                               reduction="sum", log_target=True) * (tau * tau) / logits_dist.numel()
        else:
            distill = F.cross_entropy(logits_dist, teacher.argmax(dim=1))
        return base * (1 - self.alpha) + distill * self.alpha


def _from_weights_file(path: Path, where: str) -> nn.Module:
    """A vitlab checkpoint's ``model.safetensors`` or ``ema.safetensors``, built from the ``config.json`` beside it."""
    from ..models.hub import CONFIG_NAME
    from ..models.registry import load_model

    if path.name not in ("model.safetensors", "ema.safetensors") or not (path.parent / CONFIG_NAME).is_file():
        raise ConfigError(f"{where} is a weights file without the {CONFIG_NAME} beside it that says its architecture; "
                          f"for timm's weights set distill.teacher=timm:<name> and distill.teacher_file={str(path)!r}, "
                          f"else give the vitlab run or checkpoint directory")
    try:
        return load_model(path.parent, use_ema=path.name == "ema.safetensors")
    except CheckpointError as e:
        raise ConfigError(f"{where}: {e}") from None


class Renormalized(nn.Module):
    """``teacher`` given a batch normalized by the run's ``mean`` / ``std`` as normalized by its own
    (``teacher_mean`` / ``teacher_std``): ``teacher(x * std / teacher_std + (mean - teacher_mean) / teacher_std)``,
    per channel, the same pixels its training normalized its way. The teacher is its only submodule."""

    def __init__(self, teacher: nn.Module, mean: tuple[float, ...], std: tuple[float, ...],
                 teacher_mean: tuple[float, ...], teacher_std: tuple[float, ...]) -> None:
        super().__init__()
        self.teacher = teacher
        m, s, tm, ts = (torch.tensor(v, dtype=torch.float64).view(-1, 1, 1) for v in (mean, std, teacher_mean, teacher_std))
        self.register_buffer("scale", (s / ts).float(), persistent=False)
        self.register_buffer("shift", ((m - tm) / ts).float(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.teacher(torch.addcmul(self.shift.to(x.dtype), x, self.scale.to(x.dtype)))


def load_teacher(source: str, file: str, num_classes: int, device: torch.device | str,
                 mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None,
                 input_size: tuple[int, int] | None = None) -> nn.Module:
    """The teacher ``source`` names (``distill.teacher``), frozen in evaluation mode on ``device``:
    ``timm:<name>`` (timm's pretrained weights, or ``file``: a local copy of them, or the weights of a
    ``timm:<name>`` model vitlab trained), a vitlab run, checkpoint or ``save_pretrained`` directory (its EMA
    weights where it kept them), or a checkpoint's ``model.safetensors`` / ``ema.safetensors``.

    ``mean`` / ``std``: the run's normalization. Where the teacher's own (its ``pretrained_cfg``: timm's for
    timm's weights, its run's for vitlab's) differs, the teacher comes :class:`Renormalized` from the run's
    to its own; where it is the same, or not known, the teacher is given the run's batch as it is.

    ``input_size``: the student's images ``(H, W)``, which the teacher is given as they are (as DeiT does: no
    resizing); a teacher that does not take them (a ViT built for another size) is refused here, on one
    image, before the run decodes any.

    Raises:
        ConfigError: one line, if the teacher cannot be had, gives other than ``num_classes`` classes, or
            does not take ``input_size`` images.
    """
    from ..models.registry import load_model

    where = f"distill.teacher={source!r}"
    if source.startswith("timm:"):
        from ..models.pretrained import timm_model

        try:
            teacher = timm_model(source.removeprefix("timm:"), file, "distill.teacher_file")
        except (CheckpointError, OSError, RuntimeError) as e:
            raise ConfigError(f"{where}: {str(e).splitlines()[0]}; without network, set distill.teacher_file to a "
                              f"local copy of its weights") from None
    elif Path(source).expanduser().is_dir():
        try:
            teacher = load_model(Path(source).expanduser())
        except CheckpointError as e:
            raise ConfigError(f"{where}: {e}") from None
    elif Path(source).expanduser().is_file():
        teacher = _from_weights_file(Path(source).expanduser(), where)
    else:
        raise ConfigError(f"{where} is neither timm:<name> nor a vitlab run, checkpoint or save_pretrained "
                          f"directory")
    classes = getattr(teacher, "num_classes", None)
    if classes != num_classes:
        raise ConfigError(f"{where} gives {classes} classes, the data {num_classes}: a teacher is trained on the "
                          f"student's classes")
    if getattr(teacher, "distilled", False):
        teacher.set_distilled_training(False)
    own = getattr(teacher, "pretrained_cfg", None) or {}
    if mean is not None and std is not None and own.get("mean") is not None and own.get("std") is not None and \
            (tuple(own["mean"]), tuple(own["std"])) != (tuple(mean), tuple(std)):
        teacher = Renormalized(teacher, mean, std, tuple(own["mean"]), tuple(own["std"]))
    teacher = teacher.to(device).eval().requires_grad_(False)
    if input_size is not None:
        _check_input_size(teacher, where, own, tuple(input_size), device)
    return teacher


def _check_input_size(teacher: nn.Module, where: str, own: dict[str, Any], size: tuple[int, int],
                      device: torch.device | str) -> None:
    """Refuse, in one line, a ``teacher`` that fails on one black image of the student's ``size``."""
    try:
        with torch.no_grad():
            teacher(torch.zeros(1, 3, *size, device=device))
    except (RuntimeError, ValueError, AssertionError) as e:
        built = tuple(own.get("input_size", ())[-2:])
        takes = f"takes {built[0]} x {built[1]} images" if len(built) == 2 else \
            f"fails on images of the student's size ({type(e).__name__}: {str(e).splitlines()[0]})"
        raise ConfigError(f"{where} {takes} and the student's are {size[0]} x {size[1]} (model.img_size), which a "
                          f"teacher is given as they are, as in DeiT; train the teacher at the student's size, or the "
                          f"student at the teacher's") from None
