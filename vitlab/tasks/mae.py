"""Masked autoencoding (He et al. 2022) as a training task: images without labels, each seen through the data's
training view (``data.train_crop``: MAE's random resized crops and flips) with a quarter of its patches (its
mask drawn from the run's seed, the epoch and the image), the model (:class:`~vitlab.models.MaskedAutoencoder`)
filling in the rest. Evaluated, where ``monitor.root`` names labelled images, by the k-NN top-1 of the encoder's
features; finished by a picture of its reconstructions."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from torch import Tensor, nn

from ..data.batch_views import BatchedResizedCrop
from ..errors import need
from ..models.hub import image_input_size
from .base import Resumed, TaskSetup, build_model
from .image_data import train_transform_of
from .pretraining import MaskedDeviceView, MaskedView, check_unlabelled, pretraining_task, unlabelled_data

if TYPE_CHECKING:
    from ..schema import Config

__all__ = ["mae_task", "check_mae", "save_reconstructions"]


def mae_task(cfg: Config, accelerator: Accelerator, micro_batch: int, run_dir: Path,
             resumed: Resumed | None = None) -> TaskSetup:
    """The masked autoencoder of ``model.name`` (``mae_<preset>``) with ``mae.mask_ratio`` and ``mae.norm_pix_loss``,
    its images, loss and k-NN monitor; its views made in the loader, or (``data.views: device``) a batch at a time
    where the model is."""
    d, t = cfg.data, cfg.train
    model = build_model(cfg, mask_ratio=cfg.mae.mask_ratio, norm_pix_loss=cfg.mae.norm_pix_loss)
    patches = model.patch_embed.num_patches
    on_device = d.views == "device"
    device_view = MaskedDeviceView(BatchedResizedCrop(image_input_size(model)[1:], d.scale, d.ratio, d.hflip), patches)
    data = unlabelled_data(cfg, accelerator, micro_batch, model, resumed,
                           lambda stored, size, mean: device_view if on_device else
                           MaskedView(train_transform_of(d, size, stored, mean), patches),
                           lazy=d.train_crop == "rrc" and not on_device)

    def views(inputs: Any) -> tuple[Tensor, Tensor]:
        """A batch's views and masking noise."""
        return device_view.apply(*inputs) if on_device else inputs

    def loss(net: nn.Module, batch: Any) -> Tensor:
        images, noise = views(batch[0])
        return net(data.model_input(images, train=True), noise).loss

    def finish(net: nn.Module, run_dir: Path) -> None:
        if cfg.mae.pictures:
            images = views(next(iter(data.train_loader))[0])[0][:cfg.mae.pictures]
            save_reconstructions(net, images, data.model_input, data.mean, data.std, run_dir / "reconstructions.png",
                                 seed=t.seed)

    return pretraining_task(cfg, data, model, loss, finish=finish)


def check_mae(cfg: Config) -> None:
    """The ``mae`` section's values, then what any run without labels cannot take
    (:func:`~vitlab.tasks.pretraining.check_unlabelled`)."""
    a = cfg.mae
    need(0 < a.mask_ratio < 1, "mae.mask_ratio", a.mask_ratio, "a share in (0, 1) of each image's patches to "
         "hide from the encoder (MAE: 0.75)")
    need(a.pictures >= 0, "mae.pictures", a.pictures, "an integer >= 0 (0: no picture)")
    d = cfg.data
    if d.views == "device":
        said = "with data.views=device (random resized crops and flips, made a batch at a time)"
        need(d.train_crop == "rrc", "data.train_crop", d.train_crop, f"rrc {said}")
        need(d.augment == "none" and d.color_jitter == 0, "data.augment" if d.augment != "none" else
             "data.color_jitter", d.augment if d.augment != "none" else d.color_jitter,
             f"none {said}: other augmentations are made in the loader (data.views=loader)")
    check_unlabelled(cfg)


def save_reconstructions(model: nn.Module, images: Tensor, model_input: Any, mean: tuple[float, ...],
                         std: tuple[float, ...], path: Path, seed: int = 0) -> None:
    """A picture of ``images`` (uint8 ``(B, C, H, W)``) as the model sees and fills them in: each image, its visible
    patches, and its reconstruction (the hidden patches predicted), in rows; the masks drawn from ``seed``."""
    from ..visualize.plots import plot_reconstructions, save_figure

    was_training = model.training
    model.eval()
    x = model_input(images.to(next(model.parameters()).device))
    noise = torch.rand(len(x), model.patch_embed.num_patches, generator=torch.Generator().manual_seed(seed))
    filled, masked = model.reconstruct(x, noise)
    model.train(was_training)
    m, s = torch.tensor(mean).view(1, -1, 1, 1), torch.tensor(std).view(1, -1, 1, 1)
    shown = [(t.detach().float().cpu() * s + m).clamp(0, 1) for t in (x, masked, filled)]
    shown[1] = torch.where(masked.cpu().abs().sum(1, keepdim=True) == 0, torch.full_like(shown[1], 0.5), shown[1])
    save_figure(plot_reconstructions(*shown, titles=("image", f"seen ({100 * (1 - model.mask_ratio):.0f}%)",
                                                     "filled in")), path)
