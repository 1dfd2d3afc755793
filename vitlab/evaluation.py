"""Evaluating a trained run on a split (``vitlab eval``), fitting its temperature or thresholds (``vitlab
calibrate``), and recording an evaluation with the checkpoint.

The run's own config and seed rebuild exactly its data split (``--split val`` is exactly the
held-out images or sentences); its task's entry (:mod:`vitlab.tasks.registry`) says which options it takes and
evaluates it (a classifier: :mod:`vitlab.tasks.classification.evaluation`), on the images as :mod:`vitlab.inference`
shows them.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Literal

import torch.nn.functional as F
from accelerate import PartialState

from .checkpoint import load_model, read_json, resolve_checkpoint
from .config import load_config
from .errors import ConfigError
from .models.calibrated import set_calibration, update_config, weights_digest, weights_name
from .tasks.base import EvalRequest
from .tasks.registry import EVAL_OPTIONS, get_task

__all__ = ["evaluate_checkpoint", "record_evaluation", "calibrate_checkpoint"]


def evaluate_checkpoint(checkpoint: str | Path, split: str = "test", overrides: tuple[str, ...] = (),
                        use_ema: bool = True, batch_size: int = 256, output: str | Path | None = None,
                        record: bool = False, predictions: str | Path | None = None,
                        adjust_logits: float | None = None, tta: str = "none", knn: int = 0) -> dict[str, Any]:
    """Evaluate a run (its best checkpoint) or a checkpoint directory on ``split`` (train, val, test) of
    its own data; print the metrics on the main process and write them to ``output`` (JSON) if given.
    A classifier also gets its confusion matrix (JSON + PNG) beside ``output`` or in the checkpoint, and with
    ``predictions`` a CSV of every image: its name in the split, its class, the predicted class and every
    class's probability, in the split's order (any metric can be recomputed from it).
    ``adjust_logits`` (``tau``): a classifier's logits less ``tau * log`` of its training class frequencies
    (post-hoc logit adjustment, Menon et al. 2021: for the balanced error of a model trained on skewed classes).
    ``record`` adds the result to the checkpoint (:func:`record_evaluation`) for its model card. ``tta='flip'``: a
    classifier's predictions are the mean of each image's and its mirror's (:func:`~vitlab.inference.tta.flip_tta`).
    ``knn``: also the top-1 of the ``knn`` nearest training images' vote by the model's pooled features (DINO's
    protocol, :mod:`vitlab.tasks.knn`), as ``knn_top1``; of a self-supervised run (``task: mae``, ``dino``: no
    head) that alone, its bank and queries the labelled images of its ``monitor.*`` (changed by ``overrides``)."""
    directory = resolve_checkpoint(checkpoint)
    cfg = load_config(directory / "run_config.yaml", overrides, recorded=True)
    if knn < 0:
        raise ConfigError(f"--knn {knn}: give the number of neighbours, 1 or more (0: no k-NN)")
    task = get_task(cfg.task)
    asked = {"knn": knn or None, "tta": None if tta == "none" else tta, "adjust_logits": adjust_logits,
             "predictions": predictions}
    for option, value in asked.items():
        if value is None or option in task.eval_options:
            continue
        flag = "--" + option.replace("_", "-")
        said = (f"{flag} {value}: a .csv file of an image classifier's predictions" if option == "predictions" else
                f"{flag} is for {EVAL_OPTIONS[option]}" if option == "adjust_logits" else
                f"{flag} {value} is for {EVAL_OPTIONS[option]}")
        raise ConfigError(f"{said}; {directory} holds a {cfg.task} run")
    if predictions is not None and Path(predictions).suffix != ".csv":
        raise ConfigError(f"--predictions {predictions}: a .csv file of an image classifier's predictions")
    model = load_model(directory, use_ema=use_ema)
    request = EvalRequest(directory, str(checkpoint), split, batch_size, Path(output) if output else None,
                          Path(predictions) if predictions else None, adjust_logits, tta, knn)
    metrics = task.evaluate(request, cfg, model)
    if record and PartialState().is_main_process:
        command = ["vitlab", "eval", "--checkpoint", str(checkpoint), "--split", split, *overrides]
        record_evaluation(directory, split, metrics, shlex.join(command + ([] if use_ema else ["--no-ema"])))
    return metrics


def calibrate_checkpoint(checkpoint: str | Path, split: str = "val", overrides: tuple[str, ...] = (),
                         use_ema: bool = True, batch_size: int = 256,
                         objective: Literal["nll", "ece"] = "nll") -> float | list[float]:
    """Temperature scaling (Guo et al. 2017) of a classifier run: the temperature that minimises the
    negative log-likelihood of its ``split`` (its validation images), or (``objective='ece'``) their expected
    calibration error, fitted on the logits of every image
    (:func:`~vitlab.tasks.calibration.fit_temperature`) and written into the checkpoint's ``config.json``,
    where ``load_model``, ``vitlab eval`` and ``vitlab predict`` take it (top-1 unchanged). Returns it.
    A multi-label run gets instead a threshold a class, the one of its best F1 on those images
    (:func:`~vitlab.tasks.multilabel.choose_thresholds`), kept there too (``thresholds``): eval reports the
    F1s at them, predict names the classes at or above them. Returns those.

    Raises:
        ConfigError: one line, if the run is not a classifier, or holds out no validation images.
    """
    from .data.transforms import ModelInput
    from .tasks.calibration import expected_calibration_error, fit_temperature
    from .tasks.classification import evaluate_classifier
    from .tasks.classification.evaluation import classifier_split

    if split == "test":
        raise ConfigError("a temperature fitted on the test split would make its test metrics chosen on it; calibrate "
                          "on the validation split (data.val_size)")
    directory = resolve_checkpoint(checkpoint)
    cfg = load_config(directory / "run_config.yaml", overrides, recorded=True)
    if not get_task(cfg.task).calibrates:
        raise ConfigError(f"vitlab calibrate fits an image classifier's temperature; {directory} holds a {cfg.task} run")
    model = load_model(directory, use_ema=use_ema)
    info = model.pretrained_cfg
    if info.get("multi_label") and objective != "nll":
        raise ConfigError(f"--objective {objective} chooses a temperature, for one class an image; {directory} holds a "
                          f"multi-label classifier, whose calibration is a threshold a class (each its best F1 on "
                          f"the validation images): leave out --objective")
    multi_label = bool(info.get("multi_label"))
    accelerator, loader, classes, _, _ = classifier_split(directory, cfg, model, split, batch_size)
    metrics = evaluate_classifier(accelerator.prepare(model), loader, accelerator, len(classes),
                                  ModelInput(info["mean"], info["std"]), keep_probs=True, multi_label=multi_label)
    logits, labels = metrics["logits"], metrics["labels"]
    weights = weights_name(read_json(directory / "config.json"), use_ema)  # what is fitted belongs to these weights
    if multi_label:
        return _choose_thresholds(directory, weights, weights_digest(model), metrics, split, classes,
                                  accelerator.is_main_process)
    temperature = fit_temperature(logits, labels, objective)
    if accelerator.is_main_process:
        set_calibration(directory, weights, weights_digest(model), temperature=temperature)
        nll = lambda t: F.cross_entropy(logits / t, labels).item()
        ece = lambda t: expected_calibration_error((logits / t).softmax(-1), labels)
        kind = "temperature" if objective == "nll" else "temperature of the least calibration error"
        print(f"{kind} {temperature:.4f} fitted on the {len(labels)} {'validation' if split == 'val' else split} "
              f"images of {directory}: their loss {nll(1.0):.4f} -> {nll(temperature):.4f}, calibration error (ECE) "
              f"{100 * ece(1.0):.2f}% -> {100 * ece(temperature):.2f}%; kept in {directory / 'config.json'} for "
              f"{weights}: eval and predict use it with those weights")
    return temperature


def _choose_thresholds(directory: Path, weights: str, digest: str, metrics: dict[str, Any], split: str,
                       classes: list[str], main: bool) -> list[float]:
    """A multi-label run's thresholds (:func:`calibrate_checkpoint`): chosen on ``metrics``' probabilities,
    kept in ``config.json`` (written whole, then renamed into place)."""
    from .tasks.multilabel import choose_thresholds, f1_scores

    probs, labels = metrics["probs"], metrics["labels"].bool()
    thresholds = choose_thresholds(probs, labels)
    if main:
        set_calibration(directory, weights, digest, thresholds=thresholds.tolist())
        before, after = f1_scores(probs >= 0.5, labels), f1_scores(probs >= thresholds, labels)
        print(f"thresholds of the {len(classes)} classes chosen on the {len(labels)} "
              f"{'validation' if split == 'val' else split} images of {directory} (each its best F1): macro F1 "
              f"{before['macro_f1']:.4f} at 0.5 -> {after['macro_f1']:.4f}, micro F1 {before['micro_f1']:.4f} -> "
              f"{after['micro_f1']:.4f}; kept in {directory / 'config.json'} for {weights}: eval and predict use "
              f"them with those weights")
    return thresholds.tolist()


def record_evaluation(directory: Path, split: str, metrics: dict[str, Any], command: str) -> None:
    """Add an evaluation (its scalar metrics and the command) to the checkpoint's ``config.json``, where
    ``save_pretrained``'s model card lists it (:func:`~vitlab.models.calibrated.update_config`)."""
    scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    update_config(directory, lambda meta: meta.setdefault("evaluations", []).append(
        {"split": split, "metrics": scalars, "command": command}))
