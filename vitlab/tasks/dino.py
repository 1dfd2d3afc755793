"""Self-distillation (DINO, Caron et al. 2021) as a training task: images without labels, each seen as
``dino.global_crops`` large and ``dino.local_crops`` small views (DINO's crops, flips, colour jitter, grey, blur
and solarization, drawn from the run's seed, the epoch and the image); the student (:class:`~vitlab.models.DINO`)
learns every view's distribution from the teacher's of the large ones (:func:`~vitlab.models.dino.dino_loss`), the
teacher following the student after every step on a momentum going to 1 on a half cosine, its temperature warming
up over ``dino.warmup_teacher_temp_epochs``. Evaluated, where ``monitor.root`` names labelled images, by the k-NN
top-1 of the teacher's features.

Not taken from lightly, whose ``DINOLoss``, ``DINOProjectionHead`` and ``DINOTransform`` are these: it depends on
PyTorch Lightning, and its views draw from Python's global generator, not one seeded by the sample, which a run
resumed inside an epoch, or on other processes, must redraw alike."""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelerate import Accelerator
import torch
from torch import Tensor, nn
from torchvision.transforms import v2

from ..data.batch_views import (BatchedColorJitter, BatchedGaussianBlur, BatchedGrayscale, BatchedResizedCrop,
                                 BatchedSolarize, BatchedViews)
from ..errors import ConfigError, need
from ..models.dino import cosine_momentum, dino_loss, teacher_temperature, update_center
from ..runtime import bare_model
from .base import Resumed, TaskSetup, build_model
from .pretraining import check_unlabelled, pretraining_task, unlabelled_data

if TYPE_CHECKING:
    from ..schema import Config, DINOConfig

__all__ = ["dino_task", "check_dino", "MultiCropView", "MultiCropDeviceView", "dino_views", "local_view_size"]


class MultiCropView:
    """An image's views: ``global_crops`` of the large view transforms (in turn) and ``local_crops`` of the small
    one, a tuple of uint8 tensors. Pickles."""

    def __init__(self, large: list[v2.Transform], small: v2.Transform, global_crops: int, local_crops: int) -> None:
        self.large, self.small, self.global_crops, self.local_crops = large, small, global_crops, local_crops

    def __call__(self, image: Tensor) -> tuple[Tensor, ...]:
        views = [self.large[i % len(self.large)](image) for i in range(self.global_crops)]
        return tuple(views + [self.small(image) for _ in range(self.local_crops)])


class MultiCropDeviceView(MultiCropView):
    """``data.views: device``'s :class:`MultiCropView`: in the loader an image as stored and the uniforms of all its
    views, drawn from the image's own generator in one call (``(image, uniforms (uniforms,))``); :meth:`apply` makes
    the batch's views where the batch is, each view's parameters of its own uniforms
    (:class:`~vitlab.data.batch_views.BatchedViews`). Pickles."""

    draws_from = "generator"

    def views(self) -> list[BatchedViews]:
        return [self.large[i % len(self.large)] for i in range(self.global_crops)] + [self.small] * self.local_crops

    @property
    def uniforms(self) -> int:
        return sum(view.uniforms for view in self.views())

    def __call__(self, image: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        return image, torch.rand(self.uniforms, generator=generator)

    def apply(self, images: Tensor, uniforms: Tensor) -> list[Tensor]:
        """float32 views ``(B, C, h, w)`` in ``[0, 255]`` of uint8 ``images`` ``(B, C, H, W)``, large then small."""
        views = self.views()
        return [view(images, view.params(u, *images.shape[-2:]))
                for view, u in zip(views, uniforms.split([view.uniforms for view in views], dim=1))]


JITTER = (0.4, 0.4, 0.2, 0.1)   # DINO's colour jitter: brightness, contrast, saturation, hue
JITTER_P, GREY_P, SOLARIZE_P = 0.8, 0.2, 0.2
BLUR_P = (1.0, 0.1, 0.5)        # the first large view's, the second's, the small views'


def _blur(size: int) -> tuple[int, tuple[float, float]]:
    """DINO's Gaussian blur (radius 0.1-2 px at 224 px) scaled to an image of ``size`` px: kernel size, sigma."""
    top = 2.0 * size / 224
    return 2 * max(1, math.ceil(3 * top)) + 1, (0.1 * size / 224, top)


def local_view_size(size: tuple[int, int], patch: int, s: DINOConfig) -> int:
    """The small views' side: ``dino.local_size``, or the multiple of the patch nearest 3/7 of the input's height
    (DINO's 96 px of 224 at patch 16; 12 px of 32 at patch 4). Raises ``ConfigError`` where it is no multiple of
    the patch (the backbone takes whole patches)."""
    if s.local_size and s.local_size % patch:
        raise ConfigError(f"dino.local_size={s.local_size} is not a multiple of the model's patch size {patch}; "
                          f"use e.g. {max(patch, round(s.local_size / patch) * patch)}")
    return s.local_size or max(patch, round(size[0] * 3 / 7 / patch) * patch)


def dino_views(size: tuple[int, int], local: int, s: DINOConfig, device: bool = False) -> MultiCropView:
    """DINO's views (``DataAugmentationDINO``) of uint8 images, for a model of input ``size``: random resized crops
    (bicubic) of ``dino.global_crops_scale`` at ``size`` and of ``dino.local_crops_scale`` at ``local`` px
    (:func:`local_view_size`), each flipped, colour-jittered (0.4, 0.4, 0.2, 0.1; p 0.8), made grey
    (p 0.2) and blurred (p 1.0, 0.1 and 0.5 for the first large, the second large and the small views; not with
    ``dino.blur`` false), the second large one solarized (p 0.2). ``device``: the same views made a batch at a time
    (:class:`MultiCropDeviceView`)."""
    sizes = [tuple(size), tuple(size), (local, local)]
    scales = [s.global_crops_scale, s.global_crops_scale, s.local_crops_scale]
    if device:
        def view(i: int) -> BatchedViews:
            blur = [BatchedGaussianBlur(*_blur(sizes[i][0]), BLUR_P[i])] if s.blur else []
            return BatchedViews(BatchedResizedCrop(sizes[i], scales[i]), BatchedColorJitter(*JITTER, JITTER_P),
                                BatchedGrayscale(GREY_P), *blur, *([BatchedSolarize(128 / 255, SOLARIZE_P)] * (i == 1)))
        return MultiCropDeviceView([view(0), view(1)], view(2), s.global_crops, s.local_crops)

    def view(i: int) -> v2.Compose:
        blur = [v2.RandomApply([v2.GaussianBlur(*_blur(sizes[i][0]))], p=BLUR_P[i])] if s.blur else []
        return v2.Compose([
            v2.RandomResizedCrop(sizes[i], scale=scales[i], interpolation=v2.InterpolationMode.BICUBIC, antialias=True),
            v2.RandomHorizontalFlip(), v2.RandomApply([v2.ColorJitter(*JITTER)], p=JITTER_P),
            v2.RandomGrayscale(GREY_P),
            *blur, *([v2.RandomSolarize(128, p=SOLARIZE_P)] * (i == 1))])
    return MultiCropView([view(0), view(1)], view(2), s.global_crops, s.local_crops)


def dino_task(cfg: Config, accelerator: Accelerator, micro_batch: int, run_dir: Path,
              resumed: Resumed | None = None) -> TaskSetup:
    """DINO of ``model.name`` (``dino_<preset>``): its views, loss, teacher schedules and k-NN monitor."""
    t, s = cfg.train, cfg.dino
    model = build_model(cfg)
    patch = model.student_backbone.patch_embed.patch_size[0]
    on_device = cfg.data.views == "device"
    made = {}  # the view, kept for the loss where it is made on the device

    def views(stored: Any, size: tuple[int, int], mean: Any) -> MultiCropView:
        made["view"] = dino_views(size, local_view_size(size, patch, s), s, device=on_device)
        return made["view"]

    data = unlabelled_data(cfg, accelerator, micro_batch, model, resumed, views)
    steps_per_epoch = len(data.train_loader) // t.grad_accum_steps
    now = {"temp": s.warmup_teacher_temp}  # the teacher's temperature of the step being run

    def before_step(step: int) -> None:
        now["temp"] = teacher_temperature(step // steps_per_epoch, s.warmup_teacher_temp_epochs, s.warmup_teacher_temp,
                                          s.teacher_temp)

    def after_step(net: nn.Module, step: int) -> None:
        net.update_teacher(cosine_momentum(step, steps_per_epoch * t.epochs, s.momentum_teacher))

    def loss(net: nn.Module, batch: Any) -> Tensor:
        crops = made["view"].apply(*batch[0]) if on_device else batch[0]
        crops = [data.model_input(c, train=True) for c in crops]
        bare = bare_model(net, accelerator)
        with accelerator.autocast():  # the student's forward is under it (Accelerate's prepared model)
            teacher = bare.teacher_forward(crops[:s.global_crops])
        value = dino_loss(net(crops), teacher, bare.center, s.global_crops, s.student_temp, now["temp"])
        update_center(bare.center, teacher, s.center_momentum)
        return value

    return pretraining_task(cfg, data, model, loss, before_step=before_step, after_step=after_step)


def check_dino(cfg: Config) -> None:
    """The ``dino`` section's values, then what any run without labels cannot take
    (:func:`~vitlab.tasks.pretraining.check_unlabelled`)."""
    s = cfg.dino
    need(s.global_crops >= 1 and s.global_crops + s.local_crops >= 2, "dino.global_crops", s.global_crops,
         "at least 1, and at least 2 views in all with dino.local_crops (the loss pairs the teacher's large views "
         "with the student's other views; DINO: 2 large, 6-10 small)")
    need(s.local_crops >= 0, "dino.local_crops", s.local_crops, "an integer >= 0")
    for key in ("global_crops_scale", "local_crops_scale"):
        low, high = getattr(s, key)
        need(0 < low <= high <= 1, f"dino.{key}", [low, high], "[min, max] with 0 < min <= max <= 1")
    need(s.local_size >= 0, "dino.local_size", s.local_size,
         "an integer >= 0 (0: the multiple of the patch nearest 3/7 of the model's input)")
    for key in ("teacher_temp", "warmup_teacher_temp", "student_temp"):
        need(getattr(s, key) > 0, f"dino.{key}", getattr(s, key), "a temperature > 0")
    need(0 <= s.momentum_teacher < 1, "dino.momentum_teacher", s.momentum_teacher, "a number in [0, 1) (DINO: 0.996)")
    need(0 <= s.center_momentum < 1, "dino.center_momentum", s.center_momentum, "a number in [0, 1) (DINO: 0.9)")
    need(0 <= s.warmup_teacher_temp_epochs <= cfg.train.epochs, "dino.warmup_teacher_temp_epochs",
         s.warmup_teacher_temp_epochs, f"an integer in [0, train.epochs={cfg.train.epochs}]")
    check_unlabelled(cfg)
