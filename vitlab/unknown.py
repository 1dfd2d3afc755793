"""``vitlab eval --unknown-images``: how well each score of :mod:`vitlab.inference.open_set` tells the images of a
classifier's split (its test images, by default: the known ones) from images of none of its classes. For each
score: the AUROC (the chance that a known image scores above an unknown one) and the share of unknown images kept
at the threshold that keeps 95% of the known ones (FPR at 95% TPR); a picture of both sets' scores. The k-NN bank and
the Mahalanobis statistics are the pooled features of the run's training split, as evaluation shows its images."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from .checkpoint import load_model, resolve_checkpoint
from .config import load_config
from .data.transforms import ModelInput
from .errors import ConfigError, DataError
from .inference.forward import gathered, pooled_features
from .inference.open_set import FEATURE_SCORES, LOGIT_SCORES, KNNScore, MahalanobisScore, auroc, fpr_at_tpr
from .inference.view import model_dataset
from .prediction import files_index, list_images
from .tasks.classification.evaluation import classifier_split

__all__ = ["evaluate_unknown", "SCORES"]

SCORES = (*LOGIT_SCORES, *FEATURE_SCORES)


def _logits_and_features(net: Any, images: torch.Tensor) -> torch.Tensor:
    return torch.cat([net(images).float(), pooled_features(net, images).float()], dim=1)


@torch.no_grad()
def evaluate_unknown(checkpoint: str | Path, unknown: list[str], split: str = "test", overrides: tuple[str, ...] = (),
                     use_ema: bool = True, batch_size: int = 256, k: int = 50,
                     output: str | Path | None = None) -> dict[str, dict[str, float]]:
    """Each score's AUROC and FPR at 95% TPR, ``split`` of the run at ``checkpoint`` the known images and the files
    ``unknown`` names (files, folders, globs) the unknown ones; printed, written to ``output`` (JSON) and drawn
    beside it (or in the checkpoint) as ``unknown_scores.png``. ``k``: the k-NN score's neighbour."""
    directory = resolve_checkpoint(checkpoint)
    cfg = load_config(directory / "run_config.yaml", overrides, recorded=True)
    if cfg.task != "classification":
        raise ConfigError(f"--unknown-images rates an image classifier's scores; {directory} holds a {cfg.task} run")
    model = load_model(directory, use_ema=use_ema)
    info = model.pretrained_cfg
    if info.get("multi_label"):
        raise ConfigError("--unknown-images: a multi-label run says 'none of my classes' by no class above its "
                          "threshold (vitlab predict's rows); these scores are for single-label classifiers")
    files = list_images(list(unknown))
    named = {p.name for f in files for p in Path(f).parents} & set(info["label_names"])
    if named:
        raise DataError(f"--unknown-images: the folder {sorted(named)[0]!r} is named like one of the run's classes; "
                        f"unknown images are of none of them")
    accelerator, loader, classes, _, _ = classifier_split(directory, cfg, model, split, batch_size)
    prepared = accelerator.prepare(model)
    model_input = ModelInput(info["mean"], info["std"])
    known, _ = gathered(prepared, loader, accelerator, _logits_and_features, model_input)
    unknown_loader = accelerator.prepare(DataLoader(model_dataset(model, files_index(model, files)),
                                                    batch_size=batch_size, num_workers=cfg.data.num_workers))
    other, _ = gathered(prepared, unknown_loader, accelerator, _logits_and_features, model_input)
    _, train_loader, _, _, _ = classifier_split(directory, cfg, model, "train", batch_size)
    train, train_labels = gathered(prepared, train_loader, accelerator, pooled_features, model_input)
    if len(train) < k:
        raise DataError(f"--unknown-images: the k-NN score's k={k} is more than the {len(train)} training images")
    c = len(classes)
    fitted = {"knn": KNNScore(k).fit(train), "mahalanobis": MahalanobisScore().fit(train, train_labels)}
    score = lambda name, rows: (LOGIT_SCORES[name](rows[:, :c]) if name in LOGIT_SCORES else
                                fitted[name](rows[:, c:]))
    values = {name: (score(name, known), score(name, other)) for name in SCORES}
    result = {name: {"auroc": auroc(a, b), "fpr_at_95_tpr": fpr_at_tpr(a, b)} for name, (a, b) in values.items()}
    if accelerator.is_main_process:
        print(f"{directory}: {len(known):,} {split} images (known) against {len(other):,} unknown images; "
              f"k-NN bank: {len(train):,} training images, k {k}")
        for name, r in result.items():
            print(f"  {name:<12} AUROC {r['auroc']:.4f} | FPR at 95% TPR {r['fpr_at_95_tpr']:.4f}")
        where = Path(output).parent if output else directory
        if output:
            Path(output).write_text(json.dumps({"split": split, "known": len(known), "unknown": len(other),
                                                "k": k, "scores": result}, indent=1) + "\n")
        _picture(values, result, where / "unknown_scores.png")
    return result


def _picture(values: dict[str, tuple[torch.Tensor, torch.Tensor]], result: dict[str, dict[str, float]],
             path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .visualize import save_figure

    fig, axes = plt.subplots(1, len(values), figsize=(3.2 * len(values), 2.6))
    for ax, (name, (known, unknown)) in zip(axes, values.items()):
        both = torch.cat([known, unknown])
        bins = torch.linspace(float(both.min()), float(both.max()) + 1e-9, 41).tolist()
        ax.hist(known.tolist(), bins=bins, alpha=0.6, label="known", density=True)
        ax.hist(unknown.tolist(), bins=bins, alpha=0.6, label="unknown", density=True)
        ax.set_title(f"{name}: AUROC {result[name]['auroc']:.3f}", fontsize=9)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
