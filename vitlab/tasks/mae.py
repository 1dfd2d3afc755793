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

from ..data.transforms import ModelInput
from ..models.hub import image_input_size
from .base import TaskSetup, build_model
from .classification.data import train_transform_of
from .pretraining import MaskedView, backbone_of, knn_monitor, monitor_loaders, normalization, pretraining_loader

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["mae_task", "save_reconstructions"]


def mae_task(cfg: Config, accelerator: Accelerator, micro_batch: int, resume_from: Path | None = None) -> TaskSetup:
    """The masked autoencoder of ``model.name`` (``mae_<preset>``) with ``mae.mask_ratio`` and ``mae.norm_pix_loss``,
    its images, loss and k-NN monitor."""
    d, t = cfg.data, cfg.train
    model = build_model(cfg, mask_ratio=cfg.mae.mask_ratio, norm_pix_loss=cfg.mae.norm_pix_loss)
    mean, std = normalization(cfg, resume_from)
    size = image_input_size(model)[1:]
    patches = model.patch_embed.num_patches
    make_view = lambda stored: MaskedView(train_transform_of(d, size, stored, mean), patches)
    train_loader, prepare, train_size, data_state = pretraining_loader(
        cfg, accelerator, micro_batch, size, make_view, resume_from, lazy=d.train_crop == "rrc")
    monitors = monitor_loaders(cfg, accelerator, size, micro_batch)
    model_input = ModelInput(mean, std)

    def loss(net: nn.Module, batch: Any) -> Tensor:
        (images, noise), _ = batch
        return net(model_input(images, train=True), noise).loss

    def score(net: nn.Module, monitor: Any, acc: Accelerator) -> dict[str, float]:
        return knn_monitor(backbone_of(net, acc), monitor, acc, model_input, cfg.monitor.k)

    def finish(net: nn.Module, run_dir: Path) -> None:
        if cfg.mae.pictures:
            save_reconstructions(net, next(iter(train_loader))[0][0][:cfg.mae.pictures], model_input, mean, std,
                                 run_dir / "reconstructions.png", seed=t.seed)

    meta = {"task": "mae", "mean": list(mean), "std": list(std),
            **({"decode_size": d.decode_size} if d.decode_size and d.dataset != "cifar10" else {}),
            **({"crop_pct": d.crop_pct} if d.train_crop != "pad" else {}),
            **({"exif_transpose": False} if not d.exif_transpose else {})}
    return TaskSetup(model=model, train_loader=train_loader, prepare_train_loader=prepare, eval_loaders=monitors,
                     prepare_eval_loaders=False, loss=loss, count=lambda batch: len(batch[1]), evaluate=score,
                     select="knn_top1", meta=meta, train_size=train_size, data_state=data_state, metrics=("knn_top1",),
                     finish=finish)


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
