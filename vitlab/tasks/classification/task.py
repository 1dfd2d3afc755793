"""Image classification as a training task: the model (from pretrained weights, if any) and its head of the data's
classes, the splits listed and checked before any image is decoded, the loaders, mixup/cutmix, the loss
(distilled from a teacher, if any), evaluation and what the checkpoint keeps. Multi-label data (several classes an
image) is decided once, from the training split's labels, and trains the same way with the binary cross-entropy
and mAP."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from timm.data import Mixup
from torch import Tensor, nn

from ...data.balance import ClassSampler
from ...data.shard_stream import ShardLoader
from ...data.split import SplitIndex, held_out_count, multi_label_reason
from ...data.transforms import CIFAR10_MEAN, CIFAR10_STD, ModelInput
from ...errors import ConfigError
from ...models.hub import image_input_size
from ...models.pretrained import load_pretrained
from ...schema import Config, DataConfig
from ..base import Resumed, TaskSetup, build_model, resumed_statistics
from ..distill import DistillationLoss, load_teacher
from ..knn import collect_features
from ..linear_probe import probe_head
from ..image_data import build_loaders, class_counts, in_memory, index_splits, load_test_data, load_train_val_data, \
    require_trained_classes, shard_streams, streamed_in_shards, training_class_counts
from ..multilabel import SCORES as MULTI_LABEL_SCORES, MultiHotMixup, MultiLabelLoss, multi_label_problem, \
    positive_weights
from .losses import classification_criterion
from .metrics import SCORES, evaluate_classifier

__all__ = ["image_classification_task", "check_classification", "classification_validation"]


def classification_validation(cfg: Config) -> str:
    """'' when ``cfg`` holds out validation images (``data.val_size``), else what to set for them."""
    return "" if cfg.data.val_size else "set data.val_size=N (e.g. 5000 of CIFAR-10's training images)"


def check_classification(cfg: Config) -> None:
    """What image classification checks of a config beside each section's rules: data said to be multi-label
    (``data.multi_label=true``) with a key multi-label training cannot take
    (:func:`~vitlab.tasks.multilabel.multi_label_problem`; data found multi-label is checked when listed)."""
    if isinstance(cfg.data, DataConfig) and cfg.data.multi_label is True:
        problem = multi_label_problem(cfg, "data.multi_label=true asks for label sets")
        if problem is not None:
            raise problem


def _normalization(cfg: Config, model: nn.Module,
                   resumed: Resumed | None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Load ``model.pretrained`` into ``model`` (not when resuming: the checkpoint's weights replace
    them) and return the normalization its images need: ``data.mean`` / ``data.std`` where set, else the
    pretrained weights', else CIFAR-10's statistics; on resume the run's own.

    Raises:
        ConfigError: one line, if a resumed run is given other statistics than it started with.
    """
    d = cfg.data
    if resumed is not None:
        if cfg.model.lora_r:  # the checkpoint holds the adapters and head alone: the base comes from its source
            load_pretrained(model, cfg.model.pretrained, cfg.model.pretrained_file, cfg.model.name)
        return resumed_statistics(d, resumed)
    mean, std = CIFAR10_MEAN, CIFAR10_STD
    if cfg.model.pretrained:
        pretrained = load_pretrained(model, cfg.model.pretrained, cfg.model.pretrained_file, cfg.model.name)
        mean, std = tuple(pretrained["mean"]), tuple(pretrained["std"])
    return tuple(d.mean or mean), tuple(d.std or std)


def image_classification_task(cfg: Config, accelerator: Accelerator, micro_batch: int, run_dir: Path,
                              resumed: Resumed | None = None) -> TaskSetup:
    """Build the ViT (from ``model.pretrained`` weights, if set), decode the data and define the loss;
    ``micro_batch`` is the global batch per step. Images are kept at ``data.decode_size`` (ImageFolder;
    CIFAR-10 at 32) and resized to the model's input by the loaders."""
    d, t = cfg.data, cfg.train
    mixing = d.mixup_alpha > 0 or d.cutmix_alpha > 0
    if mixing and (micro_batch // accelerator.num_processes) % 2:
        raise ConfigError(f"mixup/cutmix need an even per-process batch; train.batch_size={t.batch_size} gives "
                          f"{micro_batch // accelerator.num_processes}")
    model = build_model(cfg)
    if t.cache_features:
        probe_head(model)  # one linear head, or one line before any image is decoded
    mean, std = _normalization(cfg, model, resumed)
    size = image_input_size(model)[1:]
    if streamed_in_shards(d):
        return _shards_task(cfg, accelerator, micro_batch, model, mean, std, size, resumed)
    kept = resumed.data_state if resumed is not None else None
    # Labels checked before any image is decoded; a held-out test split is the one the run started with.
    train_index, test_index = index_splits(d, seed=t.seed, held_out=None if kept is None else kept.get("held_out", {}))
    multi_label = train_index.labels.ndim == 2  # decided here, once: the training split's labels are sets
    teacher = _teacher(cfg, len(train_index.classes), accelerator, mean, std, size)  # before any image is decoded too
    _check_listing(cfg, accelerator, train_index, test_index, multi_label, resumed is not None)
    keep, where = in_memory(d, train_index, test_index, size)
    accelerator.print(where)
    train_data, val_data = load_train_val_data(d, t.seed, size, train_index, keep)
    if val_data is not None and len(val_data.labels) != d.val_size:
        accelerator.print(f"data: {len(val_data.labels):,} validation images held out of training (data.val_size="
                          f"{d.val_size}): at least one image of each of the {len(train_data.classes)} classes on each side")
    test = load_test_data(d, t.seed, size, test_index, keep)
    _fit_head(cfg, model, train_data.classes)
    eval_sets = {"test": test} if val_data is None else {"val": val_data, "test": test}
    train_loader, eval_loaders, feature_loader, on_device = build_loaders(
        d, t.seed, accelerator, micro_batch, train_data, eval_sets, size, mean, keep, t.cache_features)
    if len(train_loader) == 0:
        raise ConfigError(f"train.batch_size={t.batch_size} is larger than the {len(train_data.labels)} training images")
    _say_sampling(d, accelerator, train_data, train_loader)
    counts = class_counts(train_data.labels, len(train_data.classes))
    task = _task(cfg, model, train_data.classes, mean, std, train_loader, eval_loaders, not on_device,
                 len(train_loader.sampler) if d.aug_repeats > 1 else len(train_data.labels), accelerator, teacher,
                 counts, multi_label=multi_label)
    if test_index.held_out is not None:
        task.data_state = {"held_out": test_index.held_out}
    task.feature_loader = feature_loader
    return task


def _check_listing(cfg: Config, accelerator: Accelerator, train_index: SplitIndex, test_index: SplitIndex,
                   multi_label: bool, resumed: bool) -> None:
    """What the listing alone tells, before any image is decoded: the test split held out (said in a line), why
    the data is multi-label (a line) and what multi-label data cannot take, a class without training images
    (refused; a resumed run that began without it and weighs no class continues, said in a line)."""
    d, t = cfg.data, cfg.train
    if test_index.held_out is not None:
        _say_held_out(cfg, accelerator, train_index, test_index, multi_label)
    if multi_label:  # why, in a line: label sets, images of no class, names split at a space
        accelerator.print(f"data: multi-label (data.multi_label={str(d.multi_label).lower()}, the binary cross-entropy "
                          f"of each class): {multi_label_reason(train_index)}"
                          + ('; in data.dataset=csv a class name with a space is a JSON list, ["stop sign"]'
                             if d.dataset == "csv" else ""))
    counts = training_class_counts(d, t.seed, train_index)
    if multi_label:
        _check_multi_label(cfg, train_index.classes, counts)
    weighs = t.class_weights != "none" or t.loss == "logit_adjusted" or d.sampler != "uniform"
    if not resumed or weighs:
        require_trained_classes(train_index.classes, counts, train_index.where)
    elif not counts.all():  # a run that began so (a test split held out by the balanced rule of before) goes on
        accelerator.print(f"data: class(es) {[c for c, n in zip(train_index.classes, counts.tolist()) if n == 0]} have "
                          f"no training images; the run began without them and continues so")


def _say_held_out(cfg: Config, accelerator: Accelerator, train_index: SplitIndex, test_index: SplitIndex,
                  multi_label: bool) -> None:
    """The line of a test split held out of the training split (``data.test_size``)."""
    d, record = cfg.data, test_index.held_out
    total = len(train_index) + len(test_index)
    asked = held_out_count(d.test_size, total)
    rule = "stratified: each of the" if record.get("rule") == "stratified" else "balanced over"
    accelerator.print(f"data: held out {record['images']:,} of the {total:,} images under data.root={d.root!r} as "
                      f"the test split, "
                      + (f"at random, keeping an image of each of the {len(train_index.classes)} classes in "
                         f"training" if multi_label else f"{rule} {len(train_index.classes)} classes")
                      + (" in proportion" if record.get("rule") == "stratified" and not multi_label else "")
                      + (f" ({asked:,} asked; at least one image of each class on each side)"
                         if asked != record["images"] and not multi_label else
                         f" ({asked:,} asked)" if asked != record["images"] else "")
                      + f", chosen by train.seed={cfg.train.seed} (data.test_size={d.test_size:g}); recorded in "
                      f"the checkpoints: vitlab eval and a resumed run use exactly these")


def _say_sampling(d: DataConfig, accelerator: Accelerator, train_data: Any, train_loader: Any) -> None:
    """The lines of class-balanced sampling and repeated augmentation, where asked for."""
    if d.sampler != "uniform":
        counts = class_counts(train_data.labels, len(train_data.classes))
        share = lambda k: ClassSampler.share(counts, d.sampler, k)
        accelerator.print(f"data: {d.sampler} sampling (data.sampler), {len(train_data.labels):,} draws an epoch with "
                          f"replacement: the largest class {100 * share(int(counts.argmax())):.1f}% of them, the "
                          f"smallest {100 * share(int(counts.argmin())):.1f}% (uniform: "
                          f"{100 * counts.max() / counts.sum():.1f}%, {100 * counts.min() / counts.sum():.1f}%)")
    if d.aug_repeats > 1:
        accelerator.print(f"data: repeated augmentation, {d.aug_repeats} copies of each chosen image, "
                          f"{len(train_loader.sampler):,} samples an epoch of {len(train_data.labels):,} images "
                          f"(data.aug_repeats={d.aug_repeats})")


def _shards_task(cfg: Config, accelerator: Accelerator, micro_batch: int, model: nn.Module, mean: tuple[float, ...],
                 std: tuple[float, ...], size: tuple[int, int], resumed: Resumed | None) -> TaskSetup:
    """Shards (:func:`streamed_in_shards`) streamed (:func:`shard_streams`) by loaders that shard themselves
    over the processes (not prepared by Accelerate). A resumed run keeps the partitions it started with
    (``data`` in ``trainer_state.json``), so its global batches do not depend on its processes or workers."""
    d = cfg.data
    kept = resumed.data_state if resumed is not None else {}
    streams, classes = shard_streams(d, cfg.train.seed, size, micro_batch // accelerator.num_processes,
                                     accelerator.num_processes, accelerator.process_index,
                                     partitions=kept.get("partitions", 0), mean=mean)
    _fit_head(cfg, model, classes)
    teacher = _teacher(cfg, len(classes), accelerator, mean, std, size)
    train = streams.pop("train")
    plan = train.plan
    accelerator.print(f"data: {train.total:,} training samples in {len(train.segments)} shards, cut into "
                      f"{plan.partitions} partitions, {len(plan.parts_of(0, accelerator.num_processes))} a process, "
                      f"read by {train.loader_workers} DataLoader worker(s) a process"
                      + (f" (data.num_workers={d.num_workers}: at most one a partition)"
                         if train.loader_workers < d.num_workers else "")
                      + f"; {train.samples_per_epoch:,} an epoch (whole global batches); "
                      + ", ".join(f"{k} {s.total:,}" for k, s in streams.items())
                      + f" (data.dataset={d.dataset}{', data.streaming=true' if d.streaming else ''})")
    pin = accelerator.device.type == "cuda"
    loaders = {k: ShardLoader(s, accelerator.device, pin) for k, s in streams.items()}
    if d.multi_label is not (train.multi_label if d.multi_label != "auto" else d.multi_label):
        raise ConfigError(f"data.multi_label={str(d.multi_label).lower()}, and {train.where} carry "
                          + ("label sets ('labels')" if train.multi_label else "one class a sample ('cls')")
                          + "; shards are read as written: leave data.multi_label=auto")
    if train.multi_label:
        _check_multi_label(cfg, classes, None)
    task = _task(cfg, model, classes, mean, std, ShardLoader(train, accelerator.device, pin), loaders,
                 False, train.samples_per_epoch, accelerator, teacher, multi_label=train.multi_label)
    task.data_state = {"partitions": plan.partitions}
    return task


def _check_multi_label(cfg: Config, classes: list[str], counts: Tensor | None) -> None:
    """What multi-label training data (found so, ``data.multi_label=auto``) cannot take, in one line each, before
    training: :func:`~vitlab.tasks.multilabel.multi_label_problem`, a ``train.pos_weight`` of another
    length, ``train.pos_weight=balanced`` without ``counts`` (each class's training images, ``(K,)``; None: streamed
    shards, not counted)."""
    t = cfg.train
    problem = multi_label_problem(cfg, "the data's labels are sets (data.multi_label=auto found several classes an "
                                       "image)")
    if problem is not None:
        raise problem
    if isinstance(t.pos_weight, list) and len(t.pos_weight) != len(classes):
        raise ConfigError(f"train.pos_weight has {len(t.pos_weight)} numbers for the {len(classes)} classes "
                          f"{classes[:10]}{' ...' if len(classes) > 10 else ''}; give one a class, or balanced")
    if counts is None and t.pos_weight == "balanced":
        raise ConfigError("train.pos_weight=balanced counts each class's training images, which a stream does "
                          "not list; give one number a class (train.pos_weight=[...]) with shards")


def _fit_head(cfg: Config, model: nn.Module, classes: list[str]) -> None:
    """Give ``model`` a head of the data's classes (unless ``model.num_classes`` says otherwise: an error)."""
    if model.num_classes != len(classes):
        if "num_classes" in cfg.model.args:
            raise ConfigError(f"model.num_classes={model.num_classes} but the data has {len(classes)} classes "
                              f"{classes[:20]}; set model.num_classes={len(classes)}, or leave it out to take "
                              f"the data's")
        model.reset_classifier(len(classes))  # the data decides: a new head, initialised as the model's own


def _teacher(cfg: Config, num_classes: int, accelerator: Accelerator, mean: tuple[float, ...],
             std: tuple[float, ...], size: tuple[int, int]) -> nn.Module | None:
    """The frozen teacher of ``distill`` (None without distillation), read and tried on one image of the
    student's ``size`` before any image is decoded, given the batch normalized by the run's ``mean`` /
    ``std`` in its own normalization."""
    k = cfg.distill
    if k.type == "none":
        return None
    return load_teacher(k.teacher, k.teacher_file, num_classes, accelerator.device, mean, std, tuple(size))


def _task(cfg: Config, model: nn.Module, classes: list[str], mean: tuple[float, ...], std: tuple[float, ...],
          train_loader: Any, eval_loaders: dict[str, Any], prepare: bool, train_size: int, accelerator: Accelerator,
          teacher: nn.Module | None = None, class_counts: Tensor | None = None,
          multi_label: bool = False) -> TaskSetup:
    """The task around its loaders: mixup/cutmix, the loss (distilled from ``teacher``, if given; adjusted by
    the training ``class_counts`` with ``train.loss=logit_adjusted``), evaluation and the checkpoint's metadata.
    ``multi_label``: multi-hot targets, the binary cross-entropy (:mod:`.multilabel`; ``train.pos_weight`` from
    ``class_counts``, the positives of each class among ``train_size`` images), scored and chosen by mAP."""
    d, t = cfg.data, cfg.train
    num_classes = len(classes)
    mixing = d.mixup_alpha > 0 or d.cutmix_alpha > 0
    mixup_class = MultiHotMixup if multi_label else Mixup
    mixup = mixup_class(mixup_alpha=d.mixup_alpha, cutmix_alpha=d.cutmix_alpha, label_smoothing=t.label_smoothing,
                        num_classes=num_classes) if mixing else None
    if multi_label:
        weight = None if t.pos_weight == "none" else torch.tensor(t.pos_weight, dtype=torch.float32) \
            if isinstance(t.pos_weight, list) else positive_weights(class_counts, train_size)
        criterion: Callable[[Tensor, Tensor], Tensor] = MultiLabelLoss(0.0 if mixing else t.label_smoothing, weight)
    else:
        criterion = classification_criterion(mixing, t.label_smoothing, t.loss, t.bce_target_thresh, class_counts,
                                             t.logit_adjust_tau, t.class_weights, t.class_weights_beta)
    model_input = ModelInput(mean, std, d.reprob if d.train_crop != "pad" else 0.0)
    if teacher is not None:
        distill = DistillationLoss(criterion, teacher, cfg.distill.type, cfg.distill.alpha, cfg.distill.tau,
                                   accelerator.autocast)
        if getattr(model, "distilled", False):
            model.set_distilled_training(True)  # both heads' logits in training: the class head's and the distillation head's

    def loss(net: nn.Module, batch: Any) -> torch.Tensor:
        images, labels = batch
        images = model_input(images, train=True)
        if mixup is not None:
            images, labels = mixup(images, labels)
        if teacher is not None:
            return distill(net(images), images, labels)
        return criterion(net(images), labels)

    def count(batch: Any) -> int:
        return len(batch[1])

    scores = MULTI_LABEL_SCORES if multi_label else SCORES

    def score(net: nn.Module, loader: Any, acc: Accelerator) -> dict[str, float]:
        m = evaluate_classifier(net, loader, acc, num_classes, model_input, multi_label=multi_label)
        return {k: m[k] for k in scores}

    meta = {"task": "classification", "classes": classes, "mean": list(mean), "std": list(std),
            **({"decode_size": d.decode_size} if d.decode_size and d.dataset != "cifar10" else {}),
            **({"crop_pct": d.crop_pct} if d.train_crop != "pad" else {}),
            **({"exif_transpose": False} if not d.exif_transpose else {}),
            **({"distill": cfg.distill.type, "distilled_from": cfg.distill.teacher} if teacher is not None else {}),
            **({"multi_label": True} if multi_label else {})}

    def features(net: nn.Module, loader: Any, acc: Accelerator) -> tuple[Tensor, Tensor]:
        return collect_features(net, loader, acc, model_input)

    return TaskSetup(model=model, train_loader=train_loader, prepare_train_loader=prepare,
                     eval_loaders=eval_loaders, prepare_eval_loaders=prepare, loss=loss, count=count,
                     evaluate=score, select="map" if multi_label else "top1", meta=meta, train_size=train_size,
                     metrics=scores, features=features)
