"""Figures: ViT attention over images (rollout or one block/head), every block x head for one image,
translation alignments and attention patterns, a classifier's most confident mistakes and its confusion matrix.

Every function returns a matplotlib ``Figure`` (the Agg backend: no display needed); :func:`save_figure`
writes it whole or not at all.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.transforms import create_transform, model_view
from .rollout import HeadFusion, attention_rollout, block_attention_map, cls_attention_map

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["attention_heatmaps", "plot_attention", "plot_attention_grid", "plot_alignment", "plot_mistakes",
           "plot_reliability", "plot_reconstructions", "plot_confusion_matrix", "save_figure"]

Method = Literal["rollout", "block"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: "Figure", path: str | Path, dpi: int = 100) -> Path:
    """Write ``fig`` as an image file (format from the suffix) through a temporary file renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=dpi)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's file is private (0600); the figure gets the usual mode
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
        _pyplot().close(fig)
    return path


@torch.no_grad()
def attention_heatmaps(model: nn.Module, images: Sequence[Tensor], method: Method = "rollout", block: int = -1,
                       head: int | Literal["mean"] = "mean", head_fusion: HeadFusion = "mean",
                       discard_ratio: float = 0.0) -> tuple[Tensor, Tensor]:
    """Patch-grid heat maps ``(B, gh, gw)`` and class probabilities ``(B, classes)`` for uint8 RGB images
    ``(3, H, W)`` of any size, preprocessed as the model's ``pretrained_cfg`` says.

    ``method='rollout'``: :func:`~vitlab.visualize.attention_rollout` read from the CLS token;
    ``method='block'``: the raw CLS-to-patch weights of ``block`` and ``head`` (an index or ``'mean'``).
    """
    if method not in ("rollout", "block"):
        raise ValueError(f"method={method!r} is not one of rollout, block")
    model.eval()
    x = torch.stack([create_transform(model)(img) for img in images])
    maps = model.get_attention_maps(x)
    if method == "rollout":
        heat = cls_attention_map(attention_rollout(maps, head_fusion, discard_ratio, model.num_prefix_tokens), model)
    else:
        heat = block_attention_map(maps, model, block, head)
    return heat, model(x).float().softmax(-1)


def _overlay(ax: Any, image: Tensor, heat: Tensor) -> Any:
    """``image`` uint8 ``(3, H, W)``; ``heat`` ``(gh, gw)`` scaled to [0, 1], upsampled to the image, on top.
    Returns the heat map's ``AxesImage`` (for a colour scale)."""
    h, w = image.shape[-2:]
    up = F.interpolate(heat[None, None].float(), size=(h, w), mode="bilinear", align_corners=False)[0, 0]
    up = (up - up.min()) / (up.max() - up.min()).clamp(min=1e-12)
    ax.imshow(image.permute(1, 2, 0).numpy())
    shown = ax.imshow(up.numpy(), cmap="jet", alpha=0.5, vmin=0.0, vmax=1.0)
    ax.axis("off")
    return shown


def _label(model: nn.Module, index: int) -> str:
    names = getattr(model, "pretrained_cfg", {}).get("label_names")
    return names[index] if names and index < len(names) else f"class {index}"


def plot_attention(model: nn.Module, images: Sequence[Tensor], titles: Sequence[str] | None = None,
                   method: Method = "rollout", block: int = -1, head: int | Literal["mean"] = "mean",
                   head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0,
                   true_labels: Sequence[str | None] | None = None, columns: int = 0) -> "Figure":
    """Each image (titled with ``titles`` and its true class, where ``true_labels`` knows it) beside its
    heat map upsampled and overlaid (each map scaled to [0, 1]: its least attended patch 0, its most
    attended 1), titled with the predicted class and its probability. ``columns`` 0: one row per image,
    each map with a colour scale; else a compact grid of that many images a row, each image above its map.
    ``images``: uint8 RGB ``(3, H, W)`` tensors (``vitlab.data.read_image``)."""
    heat, probs = attention_heatmaps(model, images, method, block, head, head_fusion, discard_ratio)
    plt = _pyplot()
    what = (f"rollout ({head_fusion} over heads" + (f", discard {discard_ratio:g})" if discard_ratio else ")")
            if method == "rollout" else f"block {block}, head {head}")
    n = len(images)
    if columns:
        columns = min(columns, n)
        rows = -(-n // columns)
        fig, grid = plt.subplots(2 * rows, columns, figsize=(1.45 * columns, 3.0 * rows + 0.3), squeeze=False,
                                 layout="constrained")
        cells = [(grid[2 * (i // columns), i % columns], grid[2 * (i // columns) + 1, i % columns]) for i in range(n)]
        for ax in grid.flat[:]:
            ax.axis("off")
    else:
        fig, axes = plt.subplots(n, 2, figsize=(5.6, 2.5 * n), squeeze=False, layout="constrained")
        cells = [(axes[i, 0], axes[i, 1]) for i in range(n)]
    for i, image in enumerate(_views(model, images)):  # drawn as the model saw it (resized, cropped)
        p, c = probs[i].max(0)
        top, bottom = cells[i]
        top.imshow(image.permute(1, 2, 0).numpy())
        top.axis("off")
        true = true_labels[i] if true_labels else None
        name = titles[i] if titles else f"image {i}"
        if columns:  # short titles under a narrow cell: the true class, else the name; the prediction
            top.set_title(f"true: {true}" if true else name[:14], fontsize=7)
        else:
            top.set_title(name + (f"\ntrue: {true}" if true else ""), fontsize=8)
        shown = _overlay(bottom, image, heat[i])
        bottom.set_title(f"{_label(model, int(c))} {p:.2f}" if columns else
                         f"predicted: {_label(model, int(c))} {p:.2f}", fontsize=7 if columns else 9)
        if not columns:
            fig.colorbar(shown, ax=bottom, fraction=0.046, pad=0.04).ax.tick_params(labelsize=7)
    fig.suptitle(f"attention: {what}" + ("; above each image: true class, below: predicted" if columns else
                                         "; colour: each map's least (0) to most (1) attended"), fontsize=8)
    return fig


def _views(model: nn.Module, images: Sequence[Any]) -> list[Tensor]:
    """The images as the model sees them before normalization, uint8 ``(3, *input_size)``."""
    return [model_view(model)(image).as_subclass(Tensor) for image in images]


def plot_attention_grid(model: nn.Module, image: Tensor) -> "Figure":
    """Every block (rows) x head (columns) of one image: each head's raw CLS-to-patch weights, overlaid."""
    model.eval()
    with torch.no_grad():
        x = create_transform(model)(image)[None]
        (image,) = _views(model, [image])
        maps = model.get_attention_maps(x)
        p, c = model(x).float().softmax(-1)[0].max(0)
    blocks, heads = len(maps), maps[0].shape[1]
    plt = _pyplot()
    fig, axes = plt.subplots(blocks, heads, figsize=(1.6 * heads, 1.6 * blocks + 0.4), squeeze=False,
                             layout="constrained")
    for b in range(blocks):
        for h in range(heads):
            _overlay(axes[b, h], image, block_attention_map(maps, model, b, h)[0])
            axes[b, h].set_title(f"block {b} head {h}", fontsize=7)
    fig.suptitle(f"predicted {_label(model, int(c))} {p:.2f}", fontsize=9)
    return fig


def plot_alignment(weights: Tensor, source: Sequence[str], target: Sequence[str], title: str = "") -> "Figure":
    """A translation's alignment as in Bahdanau et al. 2015, Figure 3: ``weights`` ``(T, S)``, one row per
    generated token (``target``), one column per source token (``source``); white = 1, black = 0. Any
    query x key weights draw the same way (a language model's causal pattern: the prompt on both axes)."""
    if tuple(weights.shape) != (len(target), len(source)):
        raise ValueError(f"weights of shape {tuple(weights.shape)} do not match {len(target)} target x "
                         f"{len(source)} source tokens")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.2 + 0.42 * len(source), 1.0 + 0.32 * len(target)), layout="constrained")
    ax.imshow(weights.float().numpy(), cmap="gray", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(source)), list(source), rotation=90, fontsize=8)
    ax.set_yticks(range(len(target)), list(target), fontsize=8)
    ax.xaxis.tick_top()
    if title:
        ax.set_xlabel(title, fontsize=8)
    return fig


def plot_mistakes(images: Tensor, labels: Tensor, probs: Tensor, classes: Sequence[str], count: int = 16,
                  columns: int = 4) -> "Figure":
    """The ``count`` most confident mistakes: uint8 ``images`` ``(N, 3, H, W)``, true ``labels`` ``(N,)``,
    predicted probabilities ``probs`` ``(N, classes)``; each titled true class, predicted class, probability."""
    confidence, predicted = probs.float().max(-1)
    wrong = (predicted != labels).nonzero().flatten()
    order = wrong[confidence[wrong].argsort(descending=True)][:count]
    plt = _pyplot()
    rows = max(1, -(-len(order) // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(2.0 * columns, 2.2 * rows), squeeze=False, layout="constrained")
    for ax in axes.flat:
        ax.axis("off")
    for ax, i in zip(axes.flat, order.tolist()):
        ax.imshow(images[i].permute(1, 2, 0).numpy())
        ax.set_title(f"true {classes[labels[i]]}\npred {classes[predicted[i]]} {confidence[i]:.2f}", fontsize=8)
    fig.suptitle(f"the {len(order)} most confident of {len(wrong)} mistakes", fontsize=9)
    return fig


def plot_reconstructions(*rows: Tensor, titles: Sequence[str] = ()) -> "Figure":
    """Images side by side, a row a kind (each ``(B, 3, H, W)`` floats in [0, 1]; a masked autoencoder's images,
    what it saw and what it filled in), a column an image, each row titled at its left."""
    plt = _pyplot()
    count = len(rows[0])
    fig, axes = plt.subplots(len(rows), count, figsize=(1.3 * count + 0.6, 1.4 * len(rows)), squeeze=False,
                             layout="constrained")
    for r, images in enumerate(rows):
        for c in range(count):
            ax = axes[r][c]
            ax.imshow(images[c].permute(1, 2, 0).numpy())
            ax.set_xticks([])
            ax.set_yticks([])
        if r < len(titles):
            axes[r][0].set_ylabel(titles[r], fontsize=8)
    return fig


def plot_confusion_matrix(confusion: Sequence[Sequence[int]], classes: Sequence[str]) -> "Figure":
    """Row-normalised confusion matrix (rows: true class, columns: predicted)."""
    cm = torch.tensor(confusion, dtype=torch.float64)
    frac = cm / cm.sum(1, keepdim=True).clamp(min=1)
    n = len(classes)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.0 + 0.6 * n, 0.8 + 0.6 * n), layout="constrained")
    ax.imshow(frac.numpy(), cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(n), list(classes), rotation=45, ha="right")
    ax.set_yticks(range(n), list(classes))
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    for i in range(n):
        for j in range(n):
            ax.text(j, i, f"{frac[i, j]:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if frac[i, j] > 0.5 else "black")
    return fig


def plot_reliability(confidence: Tensor, accuracy: Tensor, counts: Tensor, ece: float, temperature: float = 1.0
                     ) -> "Figure":
    """A reliability diagram: each confidence bin's accuracy (bars, from
    :func:`~vitlab.tasks.calibration.calibration_bins`) against the diagonal of perfect calibration, the gap
    to its mean confidence shaded, and the expected calibration error in the title."""
    bins = len(counts)
    centers = (torch.arange(bins, dtype=torch.float64) + 0.5) / bins
    seen = counts > 0
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.5, 4.5), layout="constrained")
    ax.bar(centers[seen].numpy(), accuracy[seen].numpy(), width=1 / bins, edgecolor="black", label="accuracy")
    ax.bar(centers[seen].numpy(), (confidence - accuracy)[seen].numpy(), bottom=accuracy[seen].numpy(), width=1 / bins,
           color="red", alpha=0.3, edgecolor="red", label="gap to confidence")
    ax.plot([0, 1], [0, 1], "k--", linewidth=1)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence (top-1 probability)")
    ax.set_ylabel("accuracy")
    ax.set_title(f"ECE {100 * ece:.2f}% ({bins} bins)" + (f", temperature {temperature:.3f}" if temperature != 1 else ""))
    ax.legend(loc="upper left")
    return fig
