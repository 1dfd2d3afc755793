"""``vitlab eval`` of an image classifier (single- or multi-label): the run's own split rebuilt (same config, same
seed; ``--split val`` exactly the held-out images), scored on the images as :mod:`vitlab.inference` shows them, with
test-time augmentation, logit adjustment and the k-NN vote where asked; its lines, and its files (the metrics, the
confusion matrix, the reliability diagram, the most confident mistakes, every image's probabilities).
:func:`classifier_split` is ``vitlab calibrate``'s too."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from ...data.shard_stream import ShardLoader
from ...data.transforms import ModelInput
from ...errors import ConfigError
from ...inference.files import write_eval_predictions
from ...inference.view import eval_dataset
from ...models.hub import read_json, write_json
from ...runtime import create_accelerator
from ...schema import Config
from ...visualize import plot_confusion_matrix, plot_mistakes, plot_reliability, save_figure
from ..base import EvalRequest
from ..calibration import calibration_bins
from ..image_data import in_memory, index_splits, load_test_data, load_train_val_data, require_trained_classes, \
    shard_streams, streamed_in_shards, training_class_counts
from ..knn import collect_features, knn_predict
from .losses import logit_adjustment
from .metrics import evaluate_classifier

__all__ = ["evaluate_run", "classifier_split"]


def classifier_split(directory: Path, cfg: Config, model: nn.Module, split: str, batch_size: int,
                      tta: str = "none", check_listing: Callable[[Any], None] | None = None
                      ) -> tuple[Any, Any, list[str], Any, Any]:
    """The accelerator, a prepared loader of ``split`` of the run's own data, its class names and (unless
    streamed from shards) its decoded images and the run's training split, listed; ``check_listing`` is given
    that listing before any image is decoded."""

    info = model.pretrained_cfg
    size = tuple(info["input_size"][1:])
    d = cfg.data
    if split == "val" and d.val_size == 0:
        raise ConfigError(f"the run at {directory} held out no validation images (data.val_size=0); evaluate "
                          f"--split test, or train with data.val_size=N")
    # The run's own split (same config, same seed): --split val is exactly the held-out images, decoded
    # at the size training stored them and resized as its evaluation loaders did.
    # Labels are mapped through the model's classes: a split with a class it was not trained on is one line.
    accelerator = create_accelerator(cfg.train.mixed_precision)
    if streamed_in_shards(d):
        if tta == "crops":
            raise ConfigError("--tta crops reads each image at a larger view than evaluation's, which shards streamed "
                              "by their own evaluation transform do not give; use --tta flip, or a folder or Hub split")
        if split == "train":
            raise ConfigError("--split train is not kept for data.dataset=wds (its epochs are streamed in an order of "
                              "their own); evaluate --split val or test")
        streams, classes = shard_streams(d, cfg.train.seed, size, batch_size, accelerator.num_processes,
                                         accelerator.process_index,
                                         classes=list(info["label_names"]), splits=(split,))
        return accelerator, ShardLoader(streams[split], accelerator.device), classes, None, None
    state = directory / "trainer_state.json"  # a training checkpoint's: the test split it held out, if any
    held_out = read_json(state).get("data", {}).get("held_out", {}) if state.is_file() else None
    train_index, test_index = index_splits(d, classes=list(info["label_names"]), seed=cfg.train.seed,
                                           held_out=held_out)
    if check_listing is not None:
        check_listing(train_index)
    keep, _ = in_memory(d, train_index, test_index, size)
    data = (load_test_data(d, cfg.train.seed, size, test_index, keep) if split == "test" else
            dict(zip(("train", "val"), load_train_val_data(d, cfg.train.seed, size, train_index, keep)))[split])
    loader = accelerator.prepare(DataLoader(eval_dataset(data, size, info.get("crop_pct"), tta),
                                            batch_size=batch_size, num_workers=d.num_workers))
    return accelerator, loader, data.classes, data, train_index


def evaluate_run(request: EvalRequest, cfg: Config, model: nn.Module) -> dict[str, Any]:
    """``vitlab eval`` of an image classifier: top-1, top-5, the loss, the calibration error, the averages and each
    class's (a multi-label one's: mAP and F1s), printed and written as :class:`~vitlab.tasks.base.EvalRequest`
    asks."""
    r = request
    directory, split, batch_size, output, predictions = r.directory, r.split, r.batch_size, r.output, r.predictions
    adjust_logits, tta, knn = r.adjust_logits, r.tta, r.knn
    info = model.pretrained_cfg
    _check_classifier_options(directory, cfg, info, predictions, adjust_logits, tta, knn)
    counts: list[Tensor] = []  # the training images of each class, for --adjust-logits

    def count_classes(train_index: Any) -> None:
        counts.append(training_class_counts(cfg.data, cfg.train.seed, train_index))
        require_trained_classes(train_index.classes, counts[0], train_index.where)

    accelerator, loader, classes, data, train_index = classifier_split(
        directory, cfg, model, split, batch_size, tta, count_classes if adjust_logits is not None else None)
    if info.get("multi_label"):
        return _evaluate_multi_label(directory, model, split, loader, accelerator, classes, data, output, predictions,
                                     tta)
    temperature = info.get("temperature", 1.0)
    offset = None if adjust_logits is None else logit_adjustment(counts[0], adjust_logits)
    prepared = accelerator.prepare(model)
    metrics = evaluate_classifier(prepared, loader, accelerator, len(classes), ModelInput(info["mean"], info["std"]),
                                  keep_probs=True, temperature=temperature, logit_offset=offset, tta=tta,
                                  input_size=tuple(info["input_size"][1:]))
    probs, labels = metrics.pop("probs"), metrics.pop("labels")
    metrics.pop("logits")
    metrics["temperature"] = temperature
    if knn:
        metrics.update(_knn_top1(directory, cfg, model, prepared, batch_size, knn, loader, accelerator, len(classes)))
    if tta != "none":
        metrics["tta"] = tta
    if adjust_logits is not None:
        metrics["adjust_logits"] = adjust_logits
    if accelerator.is_main_process:
        _print_classifier(directory, split, metrics, classes, adjust_logits, knn)
        _write_classifier(directory, split, metrics, classes, probs, labels, data, output, predictions,
                          accelerator.num_processes)
    return metrics


def _check_classifier_options(directory: Path, cfg: Config, info: dict[str, Any], predictions: Path | None,
                              adjust_logits: float | None, tta: str, knn: int) -> None:
    """What ``vitlab eval`` of a classifier cannot do, in one line each, before any image is read."""

    for option, value in (("--predictions", predictions), ("--adjust-logits", adjust_logits)):
        if value is not None and streamed_in_shards(cfg.data):
            raise ConfigError(f"{option} {value}: shards are read as a stream, without the names of their images or "
                              f"the count of each class here; evaluate an ImageFolder or Hugging Face split")
    if knn and tta == "crops":
        raise ConfigError(f"--knn {knn} reads the images at the model's own size; leave out --tta crops (or use flip)")
    if knn and (info.get("multi_label") or streamed_in_shards(cfg.data)):
        raise ConfigError(f"--knn {knn}: the neighbours' vote gives one class an image from the training split's "
                          f"images by position; {directory} holds a multi-label classifier or reads shards")
    if adjust_logits is not None and info.get("multi_label"):
        raise ConfigError(f"--adjust-logits {adjust_logits}: logit adjustment is for one class an image, and {directory} "
                          f"holds a multi-label classifier")


def _print_classifier(directory: Path, split: str, metrics: dict[str, Any], classes: list[str],
                      adjust_logits: float | None, knn: int) -> None:
    """``vitlab eval``'s lines of a classifier: the split, top-1, top-5, the loss, the calibration error, the
    averages, and each class's accuracy, precision, F1 and images."""
    tta, temperature = metrics.get("tta", "none"), metrics["temperature"]
    print(f"checkpoint {directory} | {split} split: {metrics['num_images']} images"
          + (" | each the mean of it and its mirror (--tta flip)" if tta == "flip" else
             " | each the mean of its five crops (--tta crops)" if tta == "crops" else "")
          + (f" | logits adjusted by -{adjust_logits:g} x log(the training class frequencies) (Menon et al. 2021)"
             if adjust_logits is not None else ""))
    print(f"top-1 {100 * metrics['top1']:.2f}%  top-5 {100 * metrics['top5']:.2f}%  loss {metrics['loss']:.4f}"
          + (f"  | k-NN top-1 {100 * metrics['knn_top1']:.2f}% ({knn} neighbours among the {metrics['knn_train_images']} "
             f"training images, by the pooled features)" if knn else ""))
    print(f"calibration error (ECE, 15 bins) {100 * metrics['ece']:.2f}%"
          + (f" at temperature {temperature:.4f} (vitlab calibrate)" if temperature != 1.0 else
             " (uncalibrated: vitlab calibrate fits a temperature on the validation split)"))
    print(f"balanced top-1 {100 * metrics['balanced_top1']:.2f}%  macro precision {metrics['macro_precision']:.4f}  "
          f"recall {metrics['macro_recall']:.4f}  F1 {metrics['macro_f1']:.4f}  weighted F1 {metrics['weighted_f1']:.4f}")
    support = [sum(row) for row in metrics["confusion"]]
    print(f"  {'class':>20s} {'accuracy':>8s} {'precision':>9s} {'F1':>6s} {'images':>7s}")
    for i, name in enumerate(classes):  # a class's accuracy is its recall
        print(f"  {name:>20s} {100 * metrics['per_class'][i]:7.2f}% {metrics['precision'][i]:9.4f} "
              f"{metrics['f1'][i]:6.4f} {support[i]:7d}")


def _write_classifier(directory: Path, split: str, metrics: dict[str, Any], classes: list[str], probs: Tensor,
                      labels: Tensor, data: Any, output: Path | None, predictions: Path | None, processes: int) -> None:
    """``vitlab eval``'s files of a classifier, beside ``output`` or in the checkpoint: the confusion matrix (JSON
    and picture), the reliability diagram, the most confident mistakes (one process: the data's order), the
    predictions (``--predictions``), the metrics (``--output``)."""

    out_dir = output.parent if output else directory
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "confusion_matrix.json", {"classes": classes, "matrix": metrics["confusion"]})
    save_figure(plot_confusion_matrix(metrics["confusion"], classes), out_dir / "confusion_matrix.png", dpi=120)
    print(f"confusion matrix: {out_dir / 'confusion_matrix.json'}, {out_dir / 'confusion_matrix.png'}")
    save_figure(plot_reliability(*calibration_bins(probs, labels), metrics["ece"], metrics["temperature"]),
                out_dir / "reliability.png", dpi=120)
    print(f"reliability diagram: {out_dir / 'reliability.png'}")
    if processes == 1 and data is not None:  # probabilities in the data's order (one process)
        save_figure(plot_mistakes(data.images, data.labels, probs, data.classes), out_dir / "mistakes.png")
        print(f"most confident mistakes: {out_dir / 'mistakes.png'}")
    if predictions is not None:
        write_eval_predictions(predictions, data.key, data.labels, probs, classes)
        print(f"predictions of the {len(probs)} images: {predictions}")
    if output:
        per_class = dict(zip(classes, metrics["per_class"]))
        averages = {f"{how}_{name}": metrics[f"{how}_{name}"] for how in ("macro", "weighted")
                    for name in ("precision", "recall", "f1")}
        tta, knn, adjust = metrics.get("tta", "none"), "knn_top1" in metrics, metrics.get("adjust_logits")
        write_json(output, {"top1": metrics["top1"], "top5": metrics["top5"], "loss": metrics["loss"],
                            "balanced_top1": metrics["balanced_top1"], **averages, "ece": metrics["ece"],
                            "temperature": metrics["temperature"], **({"tta": tta} if tta != "none" else {}),
                            **({k: metrics[k] for k in ("knn_top1", "knn_k", "knn_train_images")} if knn else {}),
                            **({"adjust_logits": adjust} if adjust is not None else {}),
                            "per_class": per_class,
                            **{f"per_class_{name}": dict(zip(classes, metrics[name])) for name in ("precision", "f1")},
                            "num_images": metrics["num_images"], "checkpoint": str(directory), "split": split})


def _evaluate_multi_label(directory: Path, model: nn.Module, split: str, loader: Any, accelerator: Any,
                          classes: list[str], data: Any, output: Path | None, predictions: Path | None,
                          tta: str = "none") -> dict[str, Any]:
    """``vitlab eval`` of a multi-label classifier: mAP, F1s at 0.5 and at its thresholds (``vitlab
    calibrate``), each class's AP and F1, printed and written as :func:`evaluate_checkpoint` says."""

    info = model.pretrained_cfg
    thresholds = torch.tensor(info["thresholds"]) if info.get("thresholds") is not None else None
    metrics = evaluate_classifier(accelerator.prepare(model), loader, accelerator, len(classes),
                                  ModelInput(info["mean"], info["std"]), keep_probs=True, thresholds=thresholds,
                                  tta=tta, input_size=tuple(info["input_size"][1:]), multi_label=True)
    probs, labels = metrics.pop("probs"), metrics.pop("labels")
    metrics.pop("logits")
    if not accelerator.is_main_process:
        return metrics
    tuned = "_tuned" if thresholds is not None else ""
    print(f"checkpoint {directory} | {split} split: {metrics['num_images']} images, {len(classes)} classes, "
          f"{sum(metrics['positives'])} labels")
    print(f"mAP {100 * metrics['map']:.2f}%  micro mAP {100 * metrics['micro_map']:.2f}%  loss {metrics['loss']:.4f}")
    print(f"at 0.5: macro F1 {metrics['macro_f1']:.4f}  micro F1 {metrics['micro_f1']:.4f}  example-based F1 "
          f"{metrics['example_f1']:.4f}")
    if thresholds is not None:
        print(f"at the thresholds chosen on the validation split (vitlab calibrate): macro F1 "
              f"{metrics['macro_f1_tuned']:.4f}  micro F1 {metrics['micro_f1_tuned']:.4f}  example-based F1 "
              f"{metrics['example_f1_tuned']:.4f}")
    else:
        print("  (vitlab calibrate chooses a threshold a class on the validation split)")
    print(f"  {'class':>20s} {'AP':>7s} {'F1':>6s} {'threshold':>9s} {'images':>7s}")
    for i, name in enumerate(classes):
        threshold = 0.5 if thresholds is None else thresholds[i].item()
        print(f"  {name:>20s} {metrics['ap'][i]:7.4f} {metrics['f1' + tuned][i]:6.4f} {threshold:9.4f} "
              f"{metrics['positives'][i]:7d}")
    if predictions is not None:
        write_eval_predictions(predictions, data.key, labels, probs, classes, thresholds)
        print(f"predictions of the {len(probs)} images: {predictions}")
    if output:
        scalars = {k: v for k, v in metrics.items() if isinstance(v, float)}
        write_json(output, {**scalars, "per_class_ap": dict(zip(classes, metrics["ap"])),
                            "per_class_f1": dict(zip(classes, metrics["f1" + tuned])),
                            **({"thresholds": dict(zip(classes, thresholds.tolist()))} if thresholds is not None else {}),
                            "num_images": metrics["num_images"], "checkpoint": str(directory), "split": split})
    return metrics


def _knn_top1(directory: Path, cfg: Config, model: nn.Module, prepared: nn.Module, batch_size: int, k: int,
              loader: Any, accelerator: Any, num_classes: int) -> dict[str, Any]:
    """``vitlab eval --knn K``: the split's top-1 by the vote of its ``k`` nearest training images (their pooled
    features, the run's training images as evaluation shows them; :mod:`vitlab.tasks.knn`)."""

    info = model.pretrained_cfg
    model_input = ModelInput(info["mean"], info["std"])
    _, train_loader, _, _, _ = classifier_split(directory, cfg, model, "train", batch_size)
    train_features, train_labels = collect_features(prepared, train_loader, accelerator, model_input)
    features, labels = collect_features(prepared, loader, accelerator, model_input)
    predicted = knn_predict(train_features, train_labels, features, num_classes, k)
    return {"knn_top1": (predicted == labels).double().mean().item(), "knn_k": k,
            "knn_train_images": len(train_labels)}
