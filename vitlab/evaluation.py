"""Evaluating a trained run on a split (``vitlab eval``), fitting its temperature or thresholds (``vitlab
calibrate``), and recording an evaluation with the checkpoint.

The run's own config and seed rebuild exactly its data split (``--split val`` is exactly the
held-out images or sentences); the task's metric code (:mod:`vitlab.tasks`) scores it, on the images as
:mod:`vitlab.inference` shows them.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Callable, Literal

import torch.nn.functional as F
from accelerate import PartialState
from torch import Tensor, nn
from torch.utils.data import DataLoader

from .checkpoint import load_model, read_json, resolve_checkpoint, write_json
from .config import Config, load_config
from .errors import ConfigError
from .inference.files import write_eval_predictions
from .models.hub import set_calibration, update_config, weights_name
from .runtime import create_accelerator
from .visualize import plot_confusion_matrix, plot_mistakes, plot_reliability, save_figure

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
    classifier's predictions are the mean of each image's and its mirror's (:func:`~vitlab.tasks.classification.flip_tta`).
    ``knn``: also the top-1 of the ``knn`` nearest training images' vote by the model's pooled features (DINO's
    protocol, :mod:`vitlab.tasks.knn`), as ``knn_top1``; of a self-supervised run (``task: mae``, ``dino``: no
    head) that alone, its bank and queries the labelled images of its ``monitor.*`` (changed by ``overrides``)."""
    directory = resolve_checkpoint(checkpoint)
    cfg = load_config(directory / "run_config.yaml", overrides, recorded=True)
    if knn < 0:
        raise ConfigError(f"--knn {knn}: give the number of neighbours, 1 or more (0: no k-NN)")
    if knn and cfg.task in ("seq2seq", "lm"):
        raise ConfigError(f"--knn {knn} is for an image model; {directory} holds a {cfg.task} run")
    if tta != "none" and cfg.task != "classification":
        raise ConfigError(f"--tta {tta} is for an image classifier; {directory} holds a {cfg.task} run")
    if adjust_logits is not None and cfg.task != "classification":
        raise ConfigError(f"--adjust-logits is for an image classifier; {directory} holds a {cfg.task} run")
    if predictions is not None and (cfg.task != "classification" or Path(predictions).suffix != ".csv"):
        raise ConfigError(f"--predictions {predictions}: a .csv file of an image classifier's predictions"
                          + ("" if cfg.task == "classification" else f"; {directory} holds a {cfg.task} run"))
    model = load_model(directory, use_ema=use_ema)
    if cfg.task in ("mae", "dino"):
        metrics = _evaluate_backbone(directory, cfg, model, split, batch_size, Path(output) if output else None, knn,
                                     str(checkpoint))
    elif cfg.task == "classification":
        metrics = _evaluate_classifier(directory, cfg, model, split, batch_size, Path(output) if output else None,
                                       Path(predictions) if predictions else None, adjust_logits, tta, knn)
    else:
        run = _evaluate_lm if cfg.task == "lm" else _evaluate_seq2seq
        metrics = run(directory, cfg, model, split, batch_size, Path(output) if output else None)
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

    if split == "test":
        raise ConfigError("a temperature fitted on the test split would make its test metrics chosen on it; calibrate "
                          "on the validation split (data.val_size)")
    directory = resolve_checkpoint(checkpoint)
    cfg = load_config(directory / "run_config.yaml", overrides, recorded=True)
    if cfg.task != "classification":
        raise ConfigError(f"vitlab calibrate fits an image classifier's temperature; {directory} holds a {cfg.task} run")
    model = load_model(directory, use_ema=use_ema)
    info = model.pretrained_cfg
    if info.get("multi_label") and objective != "nll":
        raise ConfigError(f"--objective {objective} chooses a temperature, for one class an image; {directory} holds a "
                          f"multi-label classifier, whose calibration is a threshold a class (each its best F1 on "
                          f"the validation images): leave out --objective")
    multi_label = bool(info.get("multi_label"))
    accelerator, loader, classes, _, _ = _classifier_split(directory, cfg, model, split, batch_size)
    metrics = evaluate_classifier(accelerator.prepare(model), loader, accelerator, len(classes),
                                  ModelInput(info["mean"], info["std"]), keep_probs=True, multi_label=multi_label)
    logits, labels = metrics["logits"], metrics["labels"]
    weights = weights_name(read_json(directory / "config.json"), use_ema)  # what is fitted belongs to these weights
    if multi_label:
        return _choose_thresholds(directory, weights, metrics, split, classes, accelerator.is_main_process)
    temperature = fit_temperature(logits, labels, objective)
    if accelerator.is_main_process:
        set_calibration(directory, weights, temperature=temperature)
        nll = lambda t: F.cross_entropy(logits / t, labels).item()
        ece = lambda t: expected_calibration_error((logits / t).softmax(-1), labels)
        kind = "temperature" if objective == "nll" else "temperature of the least calibration error"
        print(f"{kind} {temperature:.4f} fitted on the {len(labels)} {'validation' if split == 'val' else split} "
              f"images of {directory}: their loss {nll(1.0):.4f} -> {nll(temperature):.4f}, calibration error (ECE) "
              f"{100 * ece(1.0):.2f}% -> {100 * ece(temperature):.2f}%; kept in {directory / 'config.json'} for "
              f"{weights}: eval and predict use it with those weights")
    return temperature


def _choose_thresholds(directory: Path, weights: str, metrics: dict[str, Any], split: str, classes: list[str],
                       main: bool) -> list[float]:
    """A multi-label run's thresholds (:func:`calibrate_checkpoint`): chosen on ``metrics``' probabilities,
    kept in ``config.json`` (written whole, then renamed into place)."""
    from .tasks.multilabel import choose_thresholds, f1_scores

    probs, labels = metrics["probs"], metrics["labels"].bool()
    thresholds = choose_thresholds(probs, labels)
    if main:
        set_calibration(directory, weights, thresholds=thresholds.tolist())
        before, after = f1_scores(probs >= 0.5, labels), f1_scores(probs >= thresholds, labels)
        print(f"thresholds of the {len(classes)} classes chosen on the {len(labels)} "
              f"{'validation' if split == 'val' else split} images of {directory} (each its best F1): macro F1 "
              f"{before['macro_f1']:.4f} at 0.5 -> {after['macro_f1']:.4f}, micro F1 {before['micro_f1']:.4f} -> "
              f"{after['micro_f1']:.4f}; kept in {directory / 'config.json'} for {weights}: eval and predict use "
              f"them with those weights")
    return thresholds.tolist()


def record_evaluation(directory: Path, split: str, metrics: dict[str, Any], command: str) -> None:
    """Add an evaluation (its scalar metrics and the command) to the checkpoint's ``config.json``, where
    ``save_pretrained``'s model card lists it (:func:`~vitlab.models.hub.update_config`)."""
    scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    update_config(directory, lambda meta: meta.setdefault("evaluations", []).append(
        {"split": split, "metrics": scalars, "command": command}))


def _evaluate_lm(directory: Path, cfg: Config, model: nn.Module, split: str, batch_size: int,
                 output: Path | None) -> dict[str, Any]:
    from .data.corpus import WindowLoader, load_lm_tokenizer
    from .tasks.lm import evaluate_lm, load_lm_data

    if split == "test":
        split = "val"  # a language-model run has a training and a validation part of its text
    d = cfg.data
    _, train_tokens, val_tokens = load_lm_data(d, load_lm_tokenizer(model.pretrained_cfg["tokenizer"]))
    accelerator = create_accelerator(cfg.train.mixed_precision)
    tokens = val_tokens if split == "val" else train_tokens
    loader = WindowLoader(tokens, d.block_size, batch_size, accelerator.device, train=False,
                          num_processes=accelerator.num_processes, process_index=accelerator.process_index)
    metrics = evaluate_lm(accelerator.prepare(model), loader, accelerator, d.tokenizer == "char")
    if accelerator.is_main_process:
        print(f"checkpoint {directory} | {split} split: {loader.num_targets} tokens")
        print("  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        if output:
            write_json(output, {**metrics, "num_tokens": loader.num_targets,
                                "checkpoint": str(directory), "split": split})
    return metrics


def _evaluate_seq2seq(directory: Path, cfg: Config, model: nn.Module, split: str, batch_size: int,
                      output: Path | None) -> dict[str, Any]:
    from .data.text import load_tokenizer
    from .tasks.seq2seq import collate_indexed, evaluate_seq2seq, load_text_split

    tokenizer = load_tokenizer(model.pretrained_cfg["tokenizer"]) if model.pretrained_cfg["tokenizer"] else None
    dataset = load_text_split(cfg.data, split, cfg.train.seed, tokenizer)
    accelerator = create_accelerator(cfg.train.mixed_precision)
    loader = DataLoader(dataset, batch_size=batch_size, collate_fn=collate_indexed)
    g = cfg.generate
    metrics = evaluate_seq2seq(accelerator.prepare(model), accelerator.prepare(loader), accelerator, dataset,
                               tokenizer, g.beam_size, g.length_penalty, g.max_new_tokens)
    if accelerator.is_main_process:
        print(f"checkpoint {directory} | {split} split: {len(dataset)} pairs | beam {g.beam_size}")
        print("  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        if output:
            write_json(output, {**metrics, "num_pairs": len(dataset), "checkpoint": str(directory), "split": split,
                                "beam_size": g.beam_size})
    return metrics


def _evaluate_backbone(directory: Path, cfg: Config, model: nn.Module, split: str, batch_size: int,
                       output: Path | None, knn: int, given: str) -> dict[str, Any]:
    """A self-supervised run (``task: mae``, ``dino``): the k-NN top-1 of its backbone on its monitor's labelled
    images (:func:`vitlab.tasks.pretraining.evaluate_backbone`)."""
    from .tasks.pretraining import evaluate_backbone

    metrics = evaluate_backbone(cfg, model, split, knn, batch_size, given)
    if PartialState().is_main_process:
        print(f"{directory} [{split}] ({cfg.task} backbone) k-NN top-1 {100 * metrics['knn_top1']:.2f}% ({knn} "
              f"neighbours among the {metrics['knn_train_images']} labelled images of monitor.root, "
              f"{metrics['num_images']} queries)")
        if output is not None:
            write_json(output, {**metrics, "checkpoint": str(directory), "split": split})
    return metrics


def _classifier_split(directory: Path, cfg: Config, model: nn.Module, split: str, batch_size: int,
                      tta: str = "none", check_listing: Callable[[Any], None] | None = None
                      ) -> tuple[Any, Any, list[str], Any, Any]:
    """The accelerator, a prepared loader of ``split`` of the run's own data, its class names and (unless
    streamed from shards) its decoded images and the run's training split, listed; ``check_listing`` is given
    that listing before any image is decoded."""
    from .data.shard_stream import ShardLoader
    from .inference.view import eval_dataset
    from .tasks.classification import in_memory, index_splits, load_test_data, load_train_val_data, shard_streams, \
        streamed_in_shards

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


def _evaluate_classifier(directory: Path, cfg: Config, model: nn.Module, split: str, batch_size: int,
                         output: Path | None, predictions: Path | None = None,
                         adjust_logits: float | None = None, tta: str = "none", knn: int = 0) -> dict[str, Any]:
    from .data.transforms import ModelInput
    from .tasks.classification import evaluate_classifier, logit_adjustment, require_trained_classes, \
        training_class_counts

    info = model.pretrained_cfg
    _check_classifier_options(directory, cfg, info, predictions, adjust_logits, tta, knn)
    counts: list[Tensor] = []  # the training images of each class, for --adjust-logits

    def count_classes(train_index: Any) -> None:
        counts.append(training_class_counts(cfg.data, cfg.train.seed, train_index))
        require_trained_classes(train_index.classes, counts[0], train_index.where)

    accelerator, loader, classes, data, train_index = _classifier_split(
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
    from .tasks.classification import streamed_in_shards

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
    from .tasks.calibration import calibration_bins

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
    import torch

    from .data.transforms import ModelInput
    from .tasks.classification import evaluate_classifier

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
    from .data.transforms import ModelInput
    from .tasks.knn import collect_features, knn_predict

    info = model.pretrained_cfg
    model_input = ModelInput(info["mean"], info["std"])
    _, train_loader, _, _, _ = _classifier_split(directory, cfg, model, "train", batch_size)
    train_features, train_labels = collect_features(prepared, train_loader, accelerator, model_input)
    features, labels = collect_features(prepared, loader, accelerator, model_input)
    predicted = knn_predict(train_features, train_labels, features, num_classes, k)
    return {"knn_top1": (predicted == labels).double().mean().item(), "knn_k": k,
            "knn_train_images": len(train_labels)}
