"""Images of none of a classifier's classes. ``vitlab calibrate --unknown SCORE``: the threshold of a score of
:mod:`vitlab.inference.open_set` that keeps a share of the run's validation images (95% by default), kept with the
weights it was fitted on, as the temperature is (a feature score's k-NN bank or Mahalanobis statistics, the pooled
features of the run's training split as evaluation shows its images, in a file beside them), by which ``vitlab
predict``, ``vitlab serve`` and :func:`unknown_scores` answer ``unknown``. ``vitlab eval --unknown-images``: how well
each score tells the images of a split (the test images, by default: the known ones) from images of none of the
classes: the AUROC (the chance that a known image scores above an unknown one), the share of unknown images kept at
the threshold that keeps 95% of the known ones (FPR at 95% TPR), a picture of both sets' scores, and at the stored
threshold, the known images kept, their accuracy and the unknown images rejected."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from .checkpoint import load_model, read_json, resolve_checkpoint
from .config import load_config
from .data.transforms import ModelInput
from .errors import ConfigError, DataError
from .inference.forward import gathered, logits_and_features, pooled_features
from .inference.open_set import (FEATURE_SCORES, LOGIT_SCORES, SCORES, KNNScore, MahalanobisScore, UnknownRule,
                                 ViMScore, auroc, feature_score, fpr_at_tpr, stored_rule, threshold_keeping)
from .inference.view import model_dataset
from .models.calibrated import open_set_name, set_calibration, weights_digest, weights_name
from .data.shards import ShardIndex
from .prediction import BatchPredictor, data_split, files_index, list_images
from .tasks.classification.evaluation import classifier_split

__all__ = ["calibrate_unknown", "evaluate_unknown", "unknown_scores", "SCORES"]


def _logits_and_features(net: Any, images: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.float() for t in logits_and_features(net, images)], dim=1)


def _single_label_run(checkpoint: str | Path, overrides: tuple[str, ...], use_ema: bool,
                      what: str) -> tuple[Path, Any, nn.Module]:
    directory = resolve_checkpoint(checkpoint)
    cfg = load_config(directory / "run_config.yaml", overrides, recorded=True)
    if cfg.task != "classification":
        raise ConfigError(f"{what} scores an image classifier's images; {directory} holds a {cfg.task} run")
    model = load_model(directory, use_ema=use_ema)
    if model.pretrained_cfg.get("multi_label"):
        raise ConfigError(f"{what}: a multi-label run says 'none of my classes' by no class above its threshold "
                          f"(vitlab predict's rows); these scores are for single-label classifiers")
    return directory, cfg, model


def _fitted(scores: Sequence[str], k: int, directory: Path, cfg: Any, model: nn.Module, prepared: nn.Module,
            accelerator: Any, batch_size: int) -> dict[str, KNNScore | MahalanobisScore | ViMScore]:
    """The feature scores among ``scores``, fitted on the pooled features of the run's training split."""
    wanted = [s for s in scores if s in FEATURE_SCORES]
    if not wanted:
        return {}
    try:
        _, loader, _, _, _ = classifier_split(directory, cfg, model, "train", batch_size)
    except (ConfigError, DataError, FileNotFoundError) as e:  # e.g. streamed shards, whose training split is not kept
        raise DataError(f"the {' and '.join(wanted)} score needs the run's training images, which cannot be read "
                        f"({e}); give data.root=... where they are, or a logit score (msp, max_logit, energy)") from None
    model_input = ModelInput(model.pretrained_cfg["mean"], model.pretrained_cfg["std"])
    train, labels = gathered(prepared, loader, accelerator, pooled_features, model_input)
    if "knn" in wanted and len(train) < k:
        raise DataError(f"the k-NN score's k={k} is more than the {len(train)} training images: give a smaller k")
    head = _linear_head(model) if "vim" in wanted else None
    return {name: feature_score(name, k, head).fit(train, labels) for name in wanted}


def _linear_head(model: nn.Module) -> tuple[Tensor, Tensor] | None:
    """ViM's ``(weight, bias)``: the classifier's head, if its logits are one linear map of the pooled features
    (None for a distilled model, whose logits average two heads' of two tokens)."""
    inner = model if hasattr(model, "forward_head") else model.model  # a TimmClassifier holds timm's model
    head = inner.get_classifier()
    return (head.weight, head.bias) if isinstance(head, nn.Linear) else None


@torch.no_grad()
def calibrate_unknown(checkpoint: str | Path, score: str = "vim", keep: float = 0.95, overrides: tuple[str, ...] = (),
                      use_ema: bool = True, batch_size: int = 256, k: int = 50) -> float:
    """The threshold of ``score`` at or above which ``keep`` of the run's validation images lie, kept in the
    checkpoint's ``config.json`` for the weights it was fitted on (with a feature score's bank or statistics in
    ``open_set.<weights file>`` beside them); returns it. ``k``: the k-NN score's neighbour. The default, ``vim``,
    told CIFAR-10's unknown classes from its known ones best of the seven on the split set aside to choose the
    default on (docs/unknown.md).

    Raises:
        ConfigError: one line, before any image is read: a score not of :data:`SCORES`, ``keep`` outside (0, 1), a
            run that is not a single-label classifier or holds out no validation images, ``vim`` on a model whose
            logits are not one linear map of its pooled features (a distilled model).
        DataError: one line: a feature score on a run whose training images cannot be read.
    """
    if score not in SCORES:
        raise ConfigError(f"--unknown {score}: give one of {', '.join(SCORES)}")
    if not 0 < keep < 1:
        raise ConfigError(f"--keep {keep}: give the share of known images to keep, in (0, 1), e.g. 0.95")
    if k < 1:
        raise ConfigError(f"--unknown-k {k}: give the neighbour whose distance is the k-NN score, 1 or more")
    directory, cfg, model = _single_label_run(checkpoint, overrides, use_ema, "vitlab calibrate --unknown")
    if score == "vim" and _linear_head(model) is None:
        raise ConfigError("--unknown vim needs logits that are one linear map of the pooled features, and this "
                          "model's are not (a distilled model's two heads): give another score, e.g. knn")
    accelerator, loader, _, _, _ = classifier_split(directory, cfg, model, "val", batch_size)
    prepared = accelerator.prepare(model)
    info = model.pretrained_cfg
    val, _ = gathered(prepared, loader, accelerator, _logits_and_features, ModelInput(info["mean"], info["std"]))
    fitted = _fitted([score], k, directory, cfg, model, prepared, accelerator, batch_size)
    c = len(info["label_names"])
    rule = UnknownRule(score, 0.0, keep, k=k if score == "knn" else None, fitted=fitted.get(score))
    values = rule.scores(val[:, :c], val[:, c:])
    rule.threshold = threshold_keeping(values, keep)
    weights = weights_name(read_json(directory / "config.json"), use_ema)  # what is fitted belongs to these weights
    if accelerator.is_main_process:
        state = open_set_name(weights) if rule.needs_features else None
        if state:
            rule.save_state(directory / state)
        set_calibration(directory, weights, weights_digest(model), unknown=rule.record(state))
        kept = float((values >= rule.threshold).double().mean())
        print(f"unknown images by {score}: threshold {rule.threshold:.6g} keeps {100 * kept:.2f}% of the {len(values)} "
              f"validation images of {directory} ({100 * keep:g}% asked); kept in {directory / 'config.json'} for "
              f"{weights}: predict and serve answer 'unknown' below it (--unknown off: not)")
    return rule.threshold


@torch.no_grad()
def unknown_scores(model: nn.Module, images: Tensor, rule: UnknownRule | None = None) -> dict[str, Tensor]:
    """The score of each of ``images`` (uint8 ``(B, 3, H, W)`` at the model's input size, as evaluation shows them)
    by the rule ``vitlab calibrate --unknown`` kept for ``model``'s weights (or ``rule``): ``{"scores": (B,),
    "unknown": (B,) bool}`` (below the threshold), on the CPU.

    Raises:
        ConfigError: one line, if no rule is given and none was fitted on the model's weights.
    """
    rule = rule or stored_rule(model.pretrained_cfg)
    if rule is None:
        raise ConfigError("this model was never calibrated for unknown images: run vitlab calibrate --checkpoint RUN "
                          "--unknown SCORE first, or give a rule")
    was_training = model.training
    predictor = BatchPredictor(model.eval(), device=next(model.parameters()).device,
                               names=list(model.pretrained_cfg["label_names"]), unknown=rule)  # predict's pass
    try:
        _, scores = predictor.predictions(images)
    finally:
        predictor.close()
        model.train(was_training)
    return {"scores": scores, "unknown": scores < rule.threshold}


@torch.no_grad()
def evaluate_unknown(checkpoint: str | Path, unknown: list[str], split: str = "test", overrides: tuple[str, ...] = (),
                     use_ema: bool = True, batch_size: int = 256, k: int = 50,
                     output: str | Path | None = None) -> dict[str, Any]:
    """Each score's AUROC and FPR at 95% TPR, ``split`` of the run at ``checkpoint`` the known images and the files
    ``unknown`` names (files, folders, globs) the unknown ones; with the rule ``vitlab calibrate --unknown`` kept,
    at its threshold: the share of known images kept, their top-1 accuracy, and the share of unknown images
    rejected. Printed, written to ``output`` (JSON) and drawn beside it (or in the checkpoint) as
    ``unknown_scores.png``. ``k``: the k-NN score's neighbour."""
    directory, cfg, model = _single_label_run(checkpoint, overrides, use_ema, "--unknown-images")
    info = model.pretrained_cfg
    unknown_index = _unknown_set(model, list(unknown))
    rule = stored_rule(info)
    accelerator, loader, classes, _, _ = classifier_split(directory, cfg, model, split, batch_size)
    prepared = accelerator.prepare(model)
    model_input = ModelInput(info["mean"], info["std"])
    known, labels = gathered(prepared, loader, accelerator, _logits_and_features, model_input)
    unknown_loader = accelerator.prepare(DataLoader(model_dataset(model, unknown_index), batch_size=batch_size,
                                                    num_workers=cfg.data.num_workers))
    other, _ = gathered(prepared, unknown_loader, accelerator, _logits_and_features, model_input)
    rated = [s for s in SCORES if s != "vim" or _linear_head(model) is not None]  # ViM needs one linear head
    fitted = _fitted(rated, k, directory, cfg, model, prepared, accelerator, batch_size)
    c = len(classes)
    score = lambda name, rows: (LOGIT_SCORES[name](rows[:, :c]) if name in LOGIT_SCORES else
                                fitted[name](rows[:, c:]))
    values = {name: (score(name, known), score(name, other)) for name in rated}
    result: dict[str, Any] = {name: {"auroc": auroc(a, b), "fpr_at_95_tpr": fpr_at_tpr(a, b)}
                              for name, (a, b) in values.items()}
    at_threshold = _at_threshold(rule, known, other, labels, c) if rule is not None else None
    if accelerator.is_main_process:
        print(f"{directory}: {len(known):,} {split} images (known) against {len(other):,} unknown images; "
              f"k-NN bank: {len(fitted['knn'].bank):,} training images, k {k}")
        for name, r in result.items():
            print(f"  {name:<12} AUROC {r['auroc']:.4f} | FPR at 95% TPR {r['fpr_at_95_tpr']:.4f}")
        if "vim" not in result:
            print("  vim          not rated: this model's logits are not one linear map of its pooled features")
        if at_threshold is not None:
            print(f"  at the stored threshold of {rule.score} ({rule.threshold:.6g}, fitted to keep "
                  f"{100 * rule.keep:g}% of the validation images): known kept {100 * at_threshold['known_kept']:.2f}%"
                  f", their top-1 {100 * at_threshold['top1_of_kept']:.2f}%, unknown rejected "
                  f"{100 * at_threshold['unknown_rejected']:.2f}%")
        where = Path(output).parent if output else directory
        if output:
            Path(output).write_text(json.dumps({"split": split, "known": len(known), "unknown": len(other), "k": k,
                                                "scores": result, "stored_threshold": at_threshold}, indent=1) + "\n")
        _picture(values, result, where / "unknown_scores.png")
    return {**result, **({"stored_threshold": at_threshold} if at_threshold is not None else {})}


def _unknown_set(model: nn.Module, given: list[str]) -> Any:
    """The images of none of the model's classes, listed: files, folders and globs, or a data set (``data.*`` keys
    naming its split as predict's do: a csv table, a Hugging Face split, an image folder). One line if a folder or a
    class of theirs is named like one of the model's classes, or for shards (streamed: list them in a table)."""
    keys = [g for g in given if g.startswith("data.") and "=" in g]
    if keys and len(keys) < len(given):
        raise ConfigError("--unknown-images: give image files, folders and globs, or a data set (data.* keys), not both")
    classes = set(model.pretrained_cfg["label_names"])
    if not keys:
        files = list_images(given)
        named = {p.name for f in files for p in Path(f).parents} & classes
        if named:
            raise DataError(f"--unknown-images: the folder {sorted(named)[0]!r} is named like one of the run's classes; "
                            f"unknown images are of none of them")
        return files_index(model, files)
    index = data_split(model, keys, own_classes=True)  # its split: data.test_split's
    if isinstance(index, ShardIndex):
        raise ConfigError("--unknown-images: shards are streamed, not listed; give the images as a folder, a csv "
                          "table (data.dataset=csv) or a Hugging Face split read whole")
    named = set(index.classes) & classes
    if named:
        raise DataError(f"--unknown-images: the data set's class {sorted(named)[0]!r} is one of the run's classes; "
                        f"unknown images are of none of them")
    return index


def _at_threshold(rule: UnknownRule, known: Tensor, other: Tensor, labels: Tensor, c: int) -> dict[str, Any]:
    """The stored rule on the known images (their logits and features ``known``, classes ``labels``) and the unknown
    ones: the share of known images kept, the top-1 accuracy of those kept, the share of unknown ones rejected."""
    kept = rule.scores(known[:, :c], known[:, c:]) >= rule.threshold
    rejected = rule.scores(other[:, :c], other[:, c:]) < rule.threshold
    right = known[:, :c].argmax(1) == labels
    return {"score": rule.score, "threshold": rule.threshold, "keep": rule.keep,
            "known_kept": float(kept.double().mean()),
            "top1_of_kept": float(right[kept].double().mean()) if kept.any() else 0.0,
            "unknown_rejected": float(rejected.double().mean())}


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
