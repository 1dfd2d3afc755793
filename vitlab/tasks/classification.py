"""Image classification as a training task: ViT + CIFAR-10/ImageFolder data + (mixup) cross-entropy."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from timm.data import Mixup
from timm.loss import BinaryCrossEntropy, SoftTargetCrossEntropy
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from ..data.images import DeviceImageLoader, ImageData, TensorImageDataset, balanced_indices, stratified_indices
from ..data.transforms import CIFAR10_MEAN, CIFAR10_STD, ModelInput, center_crop_transform, eval_transform, \
    rrc_train_transform, src_train_transform, train_transform
from ..data.balance import ClassSampler
from ..data.repeat import RepeatAugSampler
from ..data.shard_stream import ShardLoader, ShardStream, spread
from ..data.shards import ShardIndex, index_shards
from ..data.sources import index_split
from ..data.split import SplitIndex, held_out_count, hold_out, multi_label_reason
from ..errors import ConfigError, DataError
from ..models.hub import image_input_size, read_json
from ..models.pretrained import load_pretrained
from ..runtime import gather_uneven, listed_once
from .base import TaskSetup, build_model
from .calibration import expected_calibration_error
from .distill import DistillationLoss, load_teacher
from .knn import collect_features
from .linear_probe import probe_head
from .multilabel import SCORES as MULTI_LABEL_SCORES, MultiHotMixup, MultiLabelLoss, multilabel_metrics, \
    positive_weights

if TYPE_CHECKING:
    from ..config import Config, DataConfig

__all__ = ["image_classification_task", "resolve_loader", "in_memory", "index_splits", "shard_streams", "load_train_val_data", "load_test_data",
           "eval_dataset", "eval_view",
           "evaluate_classifier", "metrics_from_predictions", "report_metrics", "gather_uneven",
           "training_class_counts", "class_counts", "require_trained_classes", "logit_adjustment", "class_weights",
           "flip_tta", "five_crops_tta",
           "tta_logits", "listed_once"]


def _decode_size(d: DataConfig, size: tuple[int, int], keep_in_memory: bool = True) -> tuple[int, int] | None:
    """The size image files are decoded at: ``data.decode_size``, else the model's input ``size``; None
    (each its own size) for images streamed to ImageNet-style transforms (``data.train_crop=rrc`` or ``src``),
    which crop each image by its own size."""
    if d.train_crop != "pad" and not keep_in_memory and not d.decode_size:
        return None
    return (d.decode_size, d.decode_size) if d.decode_size else tuple(size)


def index_splits(d: DataConfig, classes: list[str] | None = None, seed: int = 0,
                 held_out: dict[str, Any] | None = None) -> tuple[SplitIndex, SplitIndex]:
    """List the training and test splits (nothing decoded), the test labels mapped through the training
    split's classes (or through ``classes``, a trained model's): bad labels fail here, before decoding.

    With ``data.test_size``, the test split is held out of the training split (:func:`hold_out`, chosen by
    ``seed``); a folder whose root holds the class folders itself is that split. ``held_out``: a run's
    record of the split it held out (``{}``: none), which this config and listing must give again (else
    one line); None: no run to agree with."""
    keys = dict(download=d.download, image_key=d.image_key, label_key=d.label_key, exif_transpose=d.exif_transpose)
    multi_label = None if d.multi_label == "auto" else d.multi_label
    split = d.train_split
    if d.test_size and d.dataset == "imagefolder" and not (Path(d.root).expanduser() / split).is_dir():
        split = "."  # the class folders are data.root's own
    train = index_split(d.dataset, d.root, split, **keys, classes=classes, multi_label=multi_label)
    keys["multi_label"] = train.labels.ndim == 2  # every split as the training split holds its labels
    if held_out is not None and held_out.get("test_size", 0) != d.test_size:
        kept = held_out.get("test_size", 0)
        raise ConfigError(f"data.test_size: the run held out {held_out.get('images', 0)} images (data.test_size="
                          f"{kept:g}) and this asks for data.test_size={d.test_size:g}; a run keeps its test split: "
                          f"set data.test_size={kept:g}, or start a new run")
    if not d.test_size:
        return train, index_split(d.dataset, d.root, d.test_split, **keys, classes=train.classes)
    if held_out and held_out.get("seed", seed) != seed:
        raise ConfigError(f"train.seed={seed}: the run held out its test split with train.seed={held_out['seed']}, "
                          f"which chooses those images; a run keeps its test split: set train.seed={held_out['seed']}, "
                          f"or start a new run")
    # A run recorded before the rule was kept held out an equal count of every class.
    train, test = hold_out(train, d.test_size, seed, held_out.get("rule", "balanced") if held_out else "stratified")
    record = test.held_out
    if held_out is not None and held_out != record:
        raise DataError(f"the images held out as the test split changed on disk since the run started ({test.where}: "
                        f"{record['images']} images now, SHA-256 {record['sha256'][:12]}, against {held_out['images']}, "
                        f"{held_out['sha256'][:12]} recorded): its test metrics would be of other images; restore "
                        f"data.root as it was{'' if 'seed' in held_out else ' (and train.seed, if it changed)'}, or "
                        f"start a new run")
    return train, test


def in_memory(d: DataConfig, train: SplitIndex, test: SplitIndex, size: tuple[int, int]) -> tuple[bool, str]:
    """Whether the images are decoded into memory (``data.in_memory``; ``auto``: when the decoded
    training and test splits fit a quarter of the memory here (:func:`_memory_bytes`: a cgroup's limit
    where one is set), shared by the processes started on it, and unless ImageNet-style crops want files
    at their own sizes), and a line that says which and why."""
    h, w = _decode_size(d, size)
    if d.in_memory == "auto" and d.train_crop != "pad" and not d.decode_size and train.pixels is None:
        return False, (f"data: streamed, decoded at their own sizes by {d.num_workers} DataLoader worker(s): "
                       f"data.train_crop={d.train_crop} crops each image at its own size, and in memory the images would be "
                       f"stored at one size, {h} x {w} (data.in_memory=auto; set data.decode_size to keep them in memory "
                       f"at that size)")
    count = (min(d.train_subset + d.val_size, len(train)) if d.train_subset else len(train)) + \
        (min(d.test_subset, len(test)) if d.test_subset else len(test))
    need = count * 3 * h * w
    if d.in_memory != "auto":
        where = "in memory" if d.in_memory else f"streamed (decoded by {d.num_workers} DataLoader worker(s))"
        at = "their own sizes" if _decode_size(d, size, bool(d.in_memory)) is None else f"{h} x {w}"
        return bool(d.in_memory), f"data: {count:,} images at {at}, {where} (data.in_memory={d.in_memory})"
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    budget = _memory_bytes() / 4 / processes
    fits = need <= budget
    return fits, (f"data: {count:,} images at {h} x {w} take {need / 2 ** 30:.2f} GiB decoded, "
                  f"{'within' if fits else 'over'} the budget of {budget / 2 ** 30:.1f} GiB a process (a quarter of "
                  f"the memory this job may use, the machine's or its cgroup's limit, over {processes} process(es)): "
                  + ("in memory" if fits else f"streamed, decoded by {d.num_workers} DataLoader worker(s)")
                  + " (data.in_memory=auto; true or false to choose)")


def _memory_bytes(proc_cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """The memory this process may use: this machine's (POSIX's page count, else psutil's, an Accelerate
    dependency; Windows), or less where a cgroup limits it (a container's, a SLURM job's ``--mem``):
    :func:`_cgroup_memory_limits` of ``proc_cgroup`` under ``cgroup_root``."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        import psutil

        physical = psutil.virtual_memory().total
    return min([physical, *_cgroup_memory_limits(proc_cgroup, cgroup_root)])


def _cgroup_memory_limits(proc_cgroup: Path, root: Path) -> list[int]:
    """The memory limits set on the cgroups of ``proc_cgroup`` (``/proc/self/cgroup``'s lines
    ``ID:CONTROLLERS:PATH``) and on every cgroup above them: cgroup v2's ``memory.max`` (under ``root``, or
    ``root/unified`` beside v1), v1's ``memory/…/memory.limit_in_bytes``. "max" and v1's near-2^63 mean none."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            places = [(base, "memory.max") for base in (root, root / "unified")]
        elif "memory" in controllers.split(","):
            places = [(root / "memory", "memory.limit_in_bytes")]
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for base, name in places:
            for depth in range(len(parts) + 1):  # the group itself and each group above it
                try:
                    value = (base.joinpath(*parts[:depth]) / name).read_text().strip()
                except OSError:
                    continue
                if value.isdigit() and int(value) < 2 ** 60:
                    found.append(int(value))
    return found


def _train_val_rows(d: DataConfig, seed: int, index: SplitIndex) -> tuple[Tensor, Tensor | None]:
    """From the labels alone: the rows of ``index`` a run uses (``data.train_subset`` of them plus its
    validation images, balanced, else all) and, among those, the positions of its validation images
    (``data.val_size``, stratified; None without)."""
    wanted = d.train_subset + d.val_size if d.train_subset else 0
    if d.val_size and d.val_size >= (wanted or len(index)):
        raise ConfigError(f"data.val_size={d.val_size} leaves no training images (the training set has "
                          f"{wanted or len(index)})")
    rows = balanced_indices(index.labels, wanted, seed)  # what index.load(subset=wanted) decodes
    if not d.val_size:
        return rows, None
    return rows, stratified_indices(index.labels[rows], d.val_size, seed + 1, index.classes,
                                    f"data.val_size={d.val_size} of {index.where}")


def training_class_counts(d: DataConfig, seed: int, index: SplitIndex) -> Tensor:
    """How many images of each class a run trained on (its validation images left out), from the labels
    alone: int64 ``(K,)`` (multi-label: the images that show it)."""
    rows, val = _train_val_rows(d, seed, index)
    keep = torch.ones(len(rows), dtype=torch.bool)
    if val is not None:
        keep[val] = False
    return class_counts(index.labels[rows][keep], len(index.classes))


def class_counts(labels: Tensor, num_classes: int) -> Tensor:
    """The images of each class, int64 ``(K,)``: of labels ``(N,)``, or multi-hot rows ``(N, K)`` (its positives)."""
    return labels.sum(0, dtype=torch.long) if labels.ndim == 2 else torch.bincount(labels, minlength=num_classes)


def load_train_val_data(d: DataConfig, seed: int, size: tuple[int, int], index: SplitIndex,
                        keep_in_memory: bool = True) -> tuple[ImageData, ImageData | None]:
    """Decode the training images of ``index`` (at :func:`_decode_size` for the model's input ``size``;
    into memory, or when read with ``keep_in_memory=False``) and hold out the validation set:
    ``data.val_size`` images, stratified (:func:`~vitlab.data.images.stratified_indices`: every class in
    proportion, at least one of each on each side), chosen by ``seed`` (None if 0), before any image is
    decoded. The same config and seed give the same images, so ``vitlab eval --split val`` scores exactly
    the validation images training used."""
    rows, val_index = _train_val_rows(d, seed, index)  # only these are decoded: the training subset and validation
    train = index.load(_decode_size(d, size, keep_in_memory), len(rows) if d.train_subset else 0, seed,
                       keep_in_memory, d.scaled_decode, d.cache_dir or None)
    if val_index is None:
        return train, None
    keep = torch.ones(len(train.labels), dtype=torch.bool)
    keep[val_index] = False
    return train.subset(keep.nonzero().flatten()), train.subset(val_index)


def load_test_data(d: DataConfig, seed: int, size: tuple[int, int], index: SplitIndex,
                   keep_in_memory: bool = True) -> ImageData:
    """Decode the test images of ``index`` (``data.test_subset`` of them, balanced, if set), as
    :func:`load_train_val_data`."""
    return index.load(_decode_size(d, size, keep_in_memory), d.test_subset, seed, keep_in_memory, d.scaled_decode,
                      d.cache_dir or None)


def _eval_transform(size: tuple[int, int], stored: tuple[int, int] | None, crop_pct: float | None) -> v2.Transform:
    """Evaluation's transform: with ``crop_pct`` (``data.train_crop=rrc``) the center crop of
    :func:`~vitlab.data.transforms.center_crop_transform`, else a resize to the model's input ``size``
    (only if the images are ``stored`` at another size); uint8 out."""
    if crop_pct is not None:
        return center_crop_transform(tuple(size), crop_pct)
    return eval_transform(tuple(size) if stored != tuple(size) else None)


def _train_transform(d: DataConfig, size: tuple[int, int], stored: tuple[int, int] | None,
                     mean: tuple[float, ...] = CIFAR10_MEAN) -> v2.Transform:
    """Training's per-image transform for images ``stored`` at a size (``'pad'``) or their own (``'rrc'``, ``'src'``);
    uint8 out. ``mean``: the run's normalization (timm's augmentations fill with it)."""
    augment = dict(hflip=d.hflip, augment=d.augment, randaugment_ops=d.randaugment_ops,
                   randaugment_magnitude=d.randaugment_magnitude, autoaugment_policy=d.autoaugment_policy, mean=mean,
                   color_jitter=d.color_jitter)
    if d.train_crop == "rrc":
        return rrc_train_transform(tuple(size), d.scale, d.ratio, **augment)
    if d.train_crop == "src":
        return src_train_transform(tuple(size), **augment)
    return train_transform(stored, d.crop_padding, out_size=size if stored != tuple(size) else None, **augment)


def eval_dataset(data: ImageData, size: tuple[int, int], crop_pct: float | None = None,
                 tta: str = "none") -> TensorImageDataset:
    """Images as the model sees them in evaluation (:func:`_eval_transform`), before normalization: the
    DataLoader's evaluation data, in training and in ``vitlab eval`` alike. Streamed image files reach the
    center crop undecoded, which decodes them at the scale it needs (where ``data.scaled_decode`` is on).
    ``tta='crops'``: the larger view :func:`five_crops_tta` cuts its five crops from (:func:`crops_view_size`)."""
    stored = tuple(data.images.shape[-2:]) if crop_pct is None else None
    return TensorImageDataset(data, eval_view(size, stored, crop_pct, tta), lazy=crop_pct is not None)


def eval_view(size: tuple[int, int], stored: tuple[int, int] | None, crop_pct: float | None,
              tta: str = "none") -> v2.Transform:
    """Evaluation's transform of an image ``stored`` at a size (:func:`_eval_transform`); for ``tta='crops'`` the
    larger view :func:`five_crops_tta` cuts from (:func:`crops_view_size`)."""
    if tta == "crops":
        size, crop_pct = crops_view_size(size, crop_pct), (1.0 if crop_pct is not None else None)
    return _eval_transform(size, stored, crop_pct)


def streamed_in_shards(d: DataConfig) -> bool:
    """Whether the data is read as shards (:func:`shard_streams`): WebDataset, or a streamed Hugging Face split."""
    return d.dataset == "wds" or (d.dataset == "hf" and d.streaming)


def _index_stream(d: DataConfig, split: str, classes: list[str] | None) -> ShardIndex:
    if d.dataset == "wds":
        return index_shards(d.root, split, classes, d.exif_transpose)
    from ..data.hf import index_hf_stream

    return index_hf_stream(d.root, split, image_key=d.image_key, label_key=d.label_key, classes=classes,
                           exif_transpose=d.exif_transpose)


def shard_streams(d: DataConfig, seed: int, size: tuple[int, int], batch_size: int, num_processes: int = 1,
                  process_index: int = 0,
                  classes: list[str] | None = None, splits: tuple[str, ...] = ("train", "val", "test"),
                  partitions: int = 0, mean: tuple[float, ...] = CIFAR10_MEAN) -> tuple[dict[str, ShardStream], list[str]]:
    """``data.dataset=wds`` or a streamed ``hf``: the streams of the ``splits`` asked for, and the class names. The
    validation images (``data.val_size``) are the heads of the training shards (:func:`spread`), read
    in order for evaluation and passed over by training; ``data.train_subset`` / ``test_subset`` take
    the next ones likewise. Shards are listed (labels checked) before any image is decoded. ``batch_size``
    is this process's; ``partitions``: the training plan's (0: ``data.partitions``, else processes x workers)."""
    stored = _decode_size(d, size, keep_in_memory=False)
    common = dict(seed=seed, num_processes=num_processes, process_index=process_index, num_workers=d.num_workers)
    streams: dict[str, ShardStream] = {}
    train = listed_once(lambda: _index_stream(d, d.train_split, classes), num_processes)
    held = spread(d.val_size, train.counts)
    rest = [c - k for c, k in zip(train.counts, held)]
    used = spread(d.train_subset, rest) if d.train_subset else rest
    if d.val_size and sum(held) >= len(train):
        raise ConfigError(f"data.val_size={d.val_size} leaves no training images ({train.where} hold {len(train)})")
    crop_pct = d.crop_pct if d.train_crop != "pad" else None
    evaluation = _eval_transform(size, stored, crop_pct)
    lazy_eval = d.scaled_decode and crop_pct is not None  # the center crop decodes each file at the scale it needs
    if "train" in splits:
        streams["train"] = ShardStream(train, [(s, k, k + u) for s, (k, u) in enumerate(zip(held, used))],
                                       _train_transform(d, size, stored, mean), batch_size, True, stored,
                                       shuffle_buffer=d.shuffle_buffer, partitions=partitions or d.partitions,
                                       lazy=d.scaled_decode and d.train_crop == "rrc", **common)
    if "val" in splits and d.val_size:
        streams["val"] = ShardStream(train, [(s, 0, k) for s, k in enumerate(held)], evaluation, batch_size, False,
                                     stored, lazy=lazy_eval, **common)
    if "test" in splits:
        test = listed_once(lambda: _index_stream(d, d.test_split, train.classes), num_processes)
        take = spread(d.test_subset, test.counts) if d.test_subset else test.counts
        streams["test"] = ShardStream(test, [(s, 0, k) for s, k in enumerate(take)], evaluation, batch_size, False,
                                      stored, lazy=lazy_eval, **common)
    return streams, train.classes


def _normalization(cfg: Config, model: nn.Module, resume_from: Path | None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Load ``model.pretrained`` into ``model`` (not when resuming: the checkpoint's weights replace
    them) and return the normalization its images need: ``data.mean`` / ``data.std`` where set, else the
    pretrained weights', else CIFAR-10's statistics; on resume the run's own.

    Raises:
        ConfigError: one line, if a resumed run is given other statistics than it started with.
    """
    d = cfg.data
    if resume_from is not None:
        if cfg.model.lora_r:  # the checkpoint holds the adapters and head alone: the base comes from its source
            load_pretrained(model, cfg.model.pretrained, cfg.model.pretrained_file, cfg.model.name)
        meta = read_json(resume_from / "config.json")
        for key in ("mean", "std"):
            given = getattr(d, key)
            if given is not None and tuple(given) != tuple(meta[key]):
                raise ConfigError(f"data.{key}={list(given)} differs from the run's {list(meta[key])} (its checkpoint "
                                  f"{resume_from}); resume with the run's statistics, or start a new run "
                                  f"(another train.output_dir)")
        return tuple(meta["mean"]), tuple(meta["std"])
    mean, std = CIFAR10_MEAN, CIFAR10_STD
    if cfg.model.pretrained:
        pretrained = load_pretrained(model, cfg.model.pretrained, cfg.model.pretrained_file, cfg.model.name)
        mean, std = tuple(pretrained["mean"]), tuple(pretrained["std"])
    return tuple(d.mean or mean), tuple(d.std or std)


def resolve_loader(loader: str, augment: str, device: torch.device, streamed: bool = False,
                   train_crop: str = "pad", color_jitter: float = 0.0, aug_repeats: int = 1) -> str:
    """``data.loader`` made concrete: ``'auto'`` is the device-resident loader on a CUDA device unless
    the transforms need the DataLoader (AutoAugment, TrivialAugment, timm's augmentations, color jitter,
    random resized crops, repeated augmentation) or the images are streamed, else ``'torch'`` (why: docs/performance.md,
    measured on an H100).

    Raises:
        ConfigError: if ``'gpu'`` is asked for images that ``data.in_memory=auto`` chose to stream.
    """
    if loader == "gpu" and streamed:
        raise ConfigError("data.loader=gpu holds the whole data set on the device, and data.in_memory=auto chose to "
                          "stream it (it is larger than the memory budget): use data.loader=torch, or "
                          "data.in_memory=true to keep it in memory anyway")
    if loader != "auto":
        return loader
    on_device = augment in ("none", "randaugment") and train_crop == "pad" and not streamed and not color_jitter \
        and aug_repeats == 1
    return "gpu" if device.type == "cuda" and on_device else "torch"


def image_classification_task(cfg: Config, accelerator: Accelerator, micro_batch: int,
                              resume_from: Path | None = None) -> TaskSetup:
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
    mean, std = _normalization(cfg, model, resume_from)
    size = image_input_size(model)[1:]
    if streamed_in_shards(d):
        return _shards_task(cfg, accelerator, micro_batch, model, mean, std, size, resume_from)
    kept = read_json(resume_from / "trainer_state.json").get("data", {}) if resume_from is not None else None
    # Labels checked before any image is decoded; a held-out test split is the one the run started with.
    train_index, test_index = index_splits(d, seed=t.seed, held_out=None if kept is None else kept.get("held_out", {}))
    teacher = _teacher(cfg, len(train_index.classes), accelerator, mean, std, size)  # before any image is decoded too
    record = test_index.held_out
    if record is not None:
        total = len(train_index) + len(test_index)
        asked = held_out_count(d.test_size, total)
        rule = "stratified: each of the" if record.get("rule") == "stratified" else "balanced over"
        multi = train_index.labels.ndim == 2
        accelerator.print(f"data: held out {record['images']:,} of the {total:,} images under data.root={d.root!r} as "
                          f"the test split, "
                          + (f"at random, keeping an image of each of the {len(train_index.classes)} classes in "
                             f"training" if multi else f"{rule} {len(train_index.classes)} classes")
                          + (" in proportion" if record.get("rule") == "stratified" and not multi else "")
                          + (f" ({asked:,} asked; at least one image of each class on each side)"
                             if asked != record["images"] and not multi else
                             f" ({asked:,} asked)" if asked != record["images"] else "")
                          + f", chosen by train.seed={t.seed} (data.test_size={d.test_size:g}); recorded in "
                          f"the checkpoints: vitlab eval and a resumed run use exactly these")
    if train_index.labels.ndim == 2:  # why, in a line: label sets, images of no class, names split at a space
        accelerator.print(f"data: multi-label (data.multi_label={str(d.multi_label).lower()}, the binary cross-entropy "
                          f"of each class): {multi_label_reason(train_index)}"
                          + ('; in data.dataset=csv a class name with a space is a JSON list, ["stop sign"]'
                             if d.dataset == "csv" else ""))
    if train_index.labels.ndim == 2 and t.cache_features:
        raise ConfigError(f"train.cache_features=True fits one class an image (a multinomial logistic regression); "
                          f"the images under data.root={d.root!r} have sets of labels: train the head of this "
                          f"multi-label run with model.freeze=backbone alone")
    counts = training_class_counts(d, t.seed, train_index)  # from the labels alone, before any image is decoded
    if train_index.labels.ndim == 2:
        _check_multi_label(cfg, train_index.classes, counts)
    weighs = t.class_weights != "none" or t.loss == "logit_adjusted" or d.sampler != "uniform"
    if resume_from is None or weighs:
        require_trained_classes(train_index.classes, counts, train_index.where)
    elif not counts.all():  # a run that began so (a test split held out by the balanced rule of before) goes on
        accelerator.print(f"data: class(es) {[c for c, n in zip(train_index.classes, counts.tolist()) if n == 0]} have "
                          f"no training images; the run began without them and continues so")
    keep, where = in_memory(d, train_index, test_index, size)
    accelerator.print(where)
    train_data, val_data = load_train_val_data(d, t.seed, size, train_index, keep)
    if val_data is not None and len(val_data.labels) != d.val_size:
        accelerator.print(f"data: {len(val_data.labels):,} validation images held out of training (data.val_size="
                          f"{d.val_size}): at least one image of each of the {len(train_data.classes)} classes on each side")
    test = load_test_data(d, t.seed, size, test_index, keep)
    _fit_head(cfg, model, train_data.classes)
    eval_sets = {"test": test} if val_data is None else {"val": val_data, "test": test}
    on_device = resolve_loader(d.loader, d.augment, accelerator.device, not keep, d.train_crop, d.color_jitter,
                               d.aug_repeats) == "gpu"
    sampler = ClassSampler(train_data.labels, d.sampler, t.seed) if d.sampler != "uniform" else None
    if on_device:
        shard = dict(device=accelerator.device, seed=t.seed, num_processes=accelerator.num_processes,
                     process_index=accelerator.process_index, size=size)
        train_loader: Any = DeviceImageLoader(train_data, micro_batch, crop_padding=d.crop_padding, hflip=d.hflip,
                                              augment=d.augment, randaugment_ops=d.randaugment_ops,
                                              randaugment_magnitude=d.randaugment_magnitude, sampler=sampler,
                                              **shard)
        eval_loaders = {name: DeviceImageLoader(data, micro_batch, train=False, **shard)
                        for name, data in eval_sets.items()}
        feature_loader = DeviceImageLoader(train_data, micro_batch, train=False, **shard) if t.cache_features else None
    else:
        stored = tuple(train_data.images.shape[-2:]) if d.train_crop == "pad" else None
        transform = _train_transform(d, size, stored, mean)
        # rrc's crop decodes a streamed file itself, at the scale the crop needs (data.scaled_decode).
        train_set = TensorImageDataset(train_data, transform, seed=t.seed, lazy=d.train_crop == "rrc")
        # Workers live for the whole run: forking new ones every epoch from a process with live threads
        # (gloo's, the last iterator's queue feeders) hung a 2-process run inside os.fork(). They read the
        # epoch, which seeds each image's augmentation with (seed, epoch, image), from shared memory.
        loader_args: dict[str, Any] = dict(num_workers=d.num_workers, pin_memory=accelerator.device.type == "cuda",
                                           persistent_workers=d.num_workers > 0)
        order: dict[str, Any] = dict(shuffle=True)  # Accelerate's seedable sampler
        if d.aug_repeats > 1:
            order = dict(sampler=RepeatAugSampler(len(train_set), d.aug_repeats, t.seed, micro_batch))
        elif sampler is not None:
            order = dict(sampler=sampler)
        train_loader = DataLoader(train_set, batch_size=micro_batch, drop_last=True, **order, **loader_args)
        crop_pct = d.crop_pct if d.train_crop != "pad" else None
        eval_loaders = {name: DataLoader(eval_dataset(data, size, crop_pct), batch_size=micro_batch,
                                         shuffle=False, **loader_args) for name, data in eval_sets.items()}
        feature_loader = DataLoader(eval_dataset(train_data, size, crop_pct), batch_size=micro_batch, shuffle=False,
                                    num_workers=d.num_workers, pin_memory=loader_args["pin_memory"]) \
            if t.cache_features else None
    if len(train_loader) == 0:
        raise ConfigError(f"train.batch_size={t.batch_size} is larger than the {len(train_data.labels)} training images")
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
    task = _task(cfg, model, train_data.classes, mean, std, train_loader, eval_loaders, not on_device,
                 len(train_loader.sampler) if d.aug_repeats > 1 else len(train_data.labels), accelerator, teacher,
                 class_counts(train_data.labels, len(train_data.classes)), multi_label=train_data.labels.ndim == 2)
    if record is not None:
        task.data_state = {"held_out": record}
    task.feature_loader = feature_loader
    return task


def _shards_task(cfg: Config, accelerator: Accelerator, micro_batch: int, model: nn.Module, mean: tuple[float, ...],
                 std: tuple[float, ...], size: tuple[int, int], resume_from: Path | None) -> TaskSetup:
    """Shards (:func:`streamed_in_shards`) streamed (:func:`shard_streams`) by loaders that shard themselves
    over the processes (not prepared by Accelerate). A resumed run keeps the partitions it started with
    (``data`` in ``trainer_state.json``), so its global batches do not depend on its processes or workers."""
    d = cfg.data
    kept = read_json(resume_from / "trainer_state.json").get("data", {}) if resume_from is not None else {}
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
    """What multi-label training data (found so, ``data.multi_label=auto``) cannot take, in one line each,
    before training: a single-label loss, teacher or sampler, a ``train.pos_weight`` of another length, a
    class that no training image shows (``counts``: each class's training images, ``(K,)``; None: streamed
    shards, not counted)."""
    t = cfg.train
    said = "the data's labels are sets (data.multi_label=auto found several classes an image)"
    if cfg.data.sampler != "uniform":
        raise ConfigError(f"data.sampler={cfg.data.sampler} balances one class an image, and {said}; weigh the "
                          f"classes with train.pos_weight=balanced")
    if t.loss != "ce" or t.class_weights != "none":
        key, value = ("train.loss", t.loss) if t.loss != "ce" else ("train.class_weights", t.class_weights)
        raise ConfigError(f"{key}={value} is for one class an image, and {said}: multi-label trains the binary "
                          f"cross-entropy; weigh its classes with train.pos_weight=balanced")
    if cfg.distill.type != "none":
        raise ConfigError(f"distill.type={cfg.distill.type} distills a teacher's softmax, one class an image, and {said}")
    if t.calibrate and t.calibrate_objective != "nll":
        raise ConfigError(f"train.calibrate_objective={t.calibrate_objective} chooses a temperature, for one class an "
                          f"image, and {said}: a multi-label run's calibration is a threshold a class (each its best "
                          f"F1 on the validation images); leave it nll")
    if isinstance(t.pos_weight, list) and len(t.pos_weight) != len(classes):
        raise ConfigError(f"train.pos_weight has {len(t.pos_weight)} numbers for the {len(classes)} classes "
                          f"{classes[:10]}{' ...' if len(classes) > 10 else ''}; give one a class, or balanced")
    if counts is None:
        if t.pos_weight == "balanced":
            raise ConfigError("train.pos_weight=balanced counts each class's training images, which a stream does "
                              "not list; give one number a class (train.pos_weight=[...]) with shards")
        return


def require_trained_classes(classes: list[str], counts: Tensor, where: str) -> None:
    """Refuse, in one line, classes that no training image shows (``counts``: each class's training images,
    ``(K,)``): an empty class folder, a class whose images are all held out, one only the test split shows. A
    model cannot learn such a class, and class weights, a logit-adjusted loss or post-hoc logit adjustment, which
    favour the rarest classes, would predict it for every image (torchvision's ``ImageFolder`` refuses an empty
    class folder likewise).

    Raises:
        DataError: naming the classes and the way out.
    """
    absent = [c for c, n in zip(classes, counts.tolist()) if n == 0]
    if absent:
        raise DataError(f"class(es) {absent[:10]}{' ...' if len(absent) > 10 else ''} of {where} have no training "
                        f"images (an empty class folder, or all their images held out for validation or test): a "
                        f"model cannot learn them, and class weights or logit adjustment would predict them as the "
                        f"rarest; add training images of them, or remove them from the data")


def _fit_head(cfg: Config, model: nn.Module, classes: list[str]) -> None:
    """Give ``model`` a head of the data's classes (unless ``model.num_classes`` says otherwise: an error)."""
    if model.num_classes != len(classes):
        if "num_classes" in cfg.model.args:
            raise ConfigError(f"model.num_classes={model.num_classes} but the data has {len(classes)} classes "
                              f"{classes[:20]}; set model.num_classes={len(classes)}, or leave it out to take "
                              f"the data's")
        model.reset_classifier(len(classes))  # the data decides: a new head, initialised as the model's own


def classification_criterion(mixing: bool, label_smoothing: float, loss: str = "ce",
                             bce_target_thresh: float | None = None, class_counts: Tensor | None = None,
                             logit_adjust_tau: float = 1.0, weighting: str = "none",
                             weighting_beta: float = 0.9999) -> Callable[[Tensor, Tensor], Tensor]:
    """The training loss, chosen as timm's ``train.py`` chooses it: with mixup/cutmix (which smooth the
    targets themselves) soft-target cross-entropy, or binary cross-entropy on the soft targets
    (``loss='bce'``, DeiT III); without, cross-entropy with ``label_smoothing``, or binary cross-entropy on
    the smoothed one-hot targets. ``bce_target_thresh`` binarizes BCE's targets above it (timm's).
    ``loss='logit_adjusted'``: the cross-entropy (soft-target with mixing) of the logits plus
    ``logit_adjust_tau * log`` of the training frequencies of ``class_counts`` (Menon et al. 2021): the model
    learns logits whose plain argmax suits the balanced error. ``weighting`` (``balanced``, ``effective``:
    :func:`class_weights`) weighs the cross-entropy's classes, as torch's ``weight`` does (a weighted mean over
    the targets' weights; with mixing, of the soft targets')."""
    if loss == "bce":
        return BinaryCrossEntropy(smoothing=0.0 if mixing else label_smoothing, target_threshold=bce_target_thresh)
    if weighting != "none":
        if class_counts is None:
            raise ValueError(f"weighting={weighting!r} needs the training class counts")
        weight = class_weights(class_counts, weighting, weighting_beta)
        return _SoftWeighted(weight) if mixing else nn.CrossEntropyLoss(weight=weight, label_smoothing=label_smoothing)
    base = SoftTargetCrossEntropy() if mixing else nn.CrossEntropyLoss(label_smoothing=label_smoothing)
    if loss == "logit_adjusted":
        if class_counts is None:
            raise ValueError("loss='logit_adjusted' needs the training class counts")
        return _Shifted(base, logit_adjustment(class_counts, logit_adjust_tau))  # + tau * log(prior)
    return base


def class_weights(class_counts: Tensor, kind: str, beta: float = 0.9999) -> Tensor:
    """Weights ``(K,)`` of the classes from their training counts: ``balanced``, ``n / (K * n_c)``
    (scikit-learn's ``compute_class_weight('balanced')``); ``effective``, ``(1 - beta) / (1 - beta ** n_c)``
    scaled to sum to ``K`` (the effective number of samples, Cui et al. 2019). Every class must have
    images (:func:`require_trained_classes`)."""
    counts = _positive_counts(class_counts)
    if kind == "balanced":
        return (counts.sum() / (len(counts) * counts)).float()
    if kind != "effective":
        raise ValueError(f"class weights {kind!r}: expected 'balanced' or 'effective'")
    weights = (1 - beta) / (1 - beta ** counts)
    return (weights * len(counts) / weights.sum()).float()


class _SoftWeighted(nn.Module):
    """Cross-entropy of soft targets (mixup's) with class weights: ``sum_i sum_c -w_c t_ic log p_ic`` over
    ``sum_i sum_c w_c t_ic``, what torch's weighted cross-entropy is for one-hot targets."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        weighted = targets * self.weight.to(logits.device, logits.dtype)
        return -(weighted * logits.log_softmax(-1)).sum() / weighted.sum()


class _Shifted(nn.Module):
    """``base(logits + shift, targets)``: a loss of logits moved by a fixed ``shift`` ``(K,)``."""

    def __init__(self, base: nn.Module, shift: Tensor) -> None:
        super().__init__()
        self.base = base
        self.register_buffer("shift", shift, persistent=False)

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        return self.base(logits + self.shift.to(logits.device, logits.dtype), targets)


# What each evaluation of a training run records (val_top1, test_macro_f1, ...; :func:`report_metrics`).
SCORES = ("top1", "top5", "loss", "balanced_top1", "macro_f1")


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
        m = evaluate_classifier(net, loader, acc, num_classes, model_input)
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


@torch.no_grad()
def evaluate_classifier(model: nn.Module, loader: Any, accelerator: Accelerator, num_classes: int,
                        model_input: Callable[[Tensor], Tensor] | None = None, keep_probs: bool = False,
                        temperature: float = 1.0, logit_offset: Tensor | None = None,
                        thresholds: Tensor | None = None, tta: str = "none",
                        input_size: tuple[int, int] | None = None) -> dict[str, Any]:
    """Top-1/top-5 accuracy, mean cross-entropy, per-class accuracy and the confusion matrix; for multi-hot
    labels ``(N, K)`` the multi-label metrics instead (:func:`~vitlab.tasks.multilabel.multilabel_metrics`:
    mAP, F1s at 0.5 and, given per-class ``thresholds``, at them; ``probs`` are then sigmoids).

    ``loader`` must be prepared by ``accelerator`` (or shard itself); every process gets the same result.
    ``model_input`` makes its batches the model's input (:class:`~vitlab.data.transforms.ModelInput`). Accuracies
    are fractions in [0, 1]; ``confusion[i][j]`` counts images of class i predicted as j. ``temperature``
    divides the logits before the loss, the calibration error and the probabilities (a calibrated model's;
    top-1 unchanged); ``logit_offset`` ``(K,)`` is subtracted from them first (post-hoc logit adjustment,
    :func:`logit_adjustment`). With ``keep_probs`` also ``probs``, the predicted probabilities ``(N, num_classes)`` in
    the loader's order, the raw ``logits`` and the ``labels``. ``tta='flip'``: each image's logits are those of the
    mean of its and its mirror's probabilities (:func:`flip_tta`); ``'crops'``: of its five crops' of the model's
    ``input_size`` (:func:`five_crops_tta`; the loader then holds the larger views, :func:`eval_dataset`).
    """
    was_training = model.training
    model.eval()
    logits_all, labels_all = [], []
    exact = getattr(loader, "exact_shards", False)  # a loader that shards itself, nothing repeated
    for images, labels in loader:
        if model_input is not None:
            images = model_input(images)
        with accelerator.autocast():
            logits = tta_logits(model, images, tta, labels.ndim == 2, input_size)
        labels = labels.to(torch.uint8) if labels.dtype == torch.bool else labels  # multi-hot, gathered as bytes
        if not exact:  # an Accelerate-prepared loader: drop the samples it repeated to even out
            logits, labels = accelerator.gather_for_metrics((logits, labels))
        logits_all.append(logits)
        labels_all.append(labels)
    model.train(was_training)
    logits, labels = torch.cat(logits_all), torch.cat(labels_all)
    if exact:
        logits, labels = gather_uneven(accelerator, logits), gather_uneven(accelerator, labels)
    logits, labels = logits.cpu(), labels.cpu()
    scaled = (logits if logit_offset is None else logits - logit_offset) / temperature
    if labels.ndim == 2:
        metrics = multilabel_metrics(scaled, labels, thresholds)
        probs = scaled.sigmoid()
    else:
        metrics = metrics_from_predictions(scaled, labels, num_classes)
        probs = scaled.softmax(-1)
    if keep_probs:
        metrics.update(probs=probs, logits=logits, labels=labels)
    return metrics


def crops_view_size(size: tuple[int, int], crop_pct: float | None) -> tuple[int, int]:
    """The view five-crop TTA cuts from: ``floor(size / crop_pct)`` (the model's ``crop_pct``, timm's 0.875 for a
    model evaluated on the whole image): the image evaluation center-crops, whole (its shorter side at that size,
    its center square), or the whole image resized to it."""
    return tuple(math.floor(s / (crop_pct or 0.875)) for s in size)


def five_crops_tta(model: nn.Module, views: Tensor, size: tuple[int, int], multi_label: bool = False) -> Tensor:
    """Test-time augmentation by five crops (torchvision's ``FiveCrop``: the four corners and the center, of the
    model's input ``size``) of ``views`` ``(b, C, H, W)`` (:func:`crops_view_size`): the logits ``(b, K)`` whose
    probabilities are the mean of the crops' (softmax: the log of the mean; ``multi_label``: the logit of each
    class's mean sigmoid). The center crop is evaluation's own view of a center-cropped model."""
    (h, w), (height, width) = size, views.shape[-2:]
    top, left = int(round((height - h) / 2.0)), int(round((width - w) / 2.0))
    crops = [views[..., :h, :w], views[..., :h, width - w:], views[..., height - h:, :w],
             views[..., height - h:, width - w:], views[..., top:top + h, left:left + w]]
    parts = torch.stack(model(torch.cat(crops)).float().chunk(5))
    if multi_label:
        return torch.logit(parts.sigmoid().mean(0), eps=1e-7)
    return torch.logsumexp(parts.log_softmax(-1), 0) - math.log(5)


def tta_logits(model: nn.Module, images: Tensor, tta: str = "none", multi_label: bool = False,
               size: tuple[int, int] | None = None) -> Tensor:
    """The logits of ``images`` (``tta='none'``), or of the mean prediction of :func:`flip_tta` or
    :func:`five_crops_tta` (which cuts crops of the model's input ``size``)."""
    if tta == "flip":
        return flip_tta(model, images, multi_label)
    if tta == "crops":
        return five_crops_tta(model, images, size, multi_label)
    return model(images).float()


def flip_tta(model: nn.Module, images: Tensor, multi_label: bool = False) -> Tensor:
    """Test-time augmentation by flipping: the logits ``(b, K)`` whose probabilities are the mean of the
    image's and its horizontal mirror's (softmax: the log of the mean; ``multi_label``: the logit of each
    class's mean sigmoid), so that every metric of logits (loss, calibration, top-k) reads the averaged
    prediction. ``images``: the model's input ``(b, C, H, W)``."""
    both = model(torch.cat([images, images.flip(-1)])).float()
    a, b = both.chunk(2)
    if multi_label:
        return torch.logit((a.sigmoid() + b.sigmoid()) / 2, eps=1e-7)
    return torch.logaddexp(a.log_softmax(-1), b.log_softmax(-1)) - math.log(2)


def logit_adjustment(class_counts: Tensor, tau: float) -> Tensor:
    """Post-hoc logit adjustment (Menon et al. 2021, "Long-tail learning via logit adjustment"): the offset
    ``tau * log(prior)`` to subtract from a model's logits, the prior being the training class frequencies
    ``(K,)``, every class with images (:func:`require_trained_classes`). Subtracted, it takes back the head
    classes' head start: ``tau = 1`` is the balanced error's Bayes rule for a model of the training distribution."""
    counts = _positive_counts(class_counts)
    return (tau * (counts / counts.sum()).log()).float()


def _positive_counts(class_counts: Tensor) -> Tensor:
    """The counts as float64, refusing a class without images: weighting or adjusting by its count would make it
    the favourite class (a count of 0, or one taken as 1, is the rarest of all)."""
    if (class_counts <= 0).any():
        missing = (class_counts <= 0).nonzero().flatten().tolist()
        raise ValueError(f"class(es) {missing[:10]} have no training images: their count cannot weigh or adjust "
                         f"them (see require_trained_classes)")
    return class_counts.double()


def metrics_from_predictions(logits: Tensor, labels: Tensor, num_classes: int) -> dict[str, Any]:
    """Metrics from logits ``(N, num_classes)`` and integer labels ``(N,)``."""
    k = min(5, num_classes)
    topk = logits.topk(k, dim=-1).indices
    correct = topk == labels[:, None]
    pred = topk[:, 0]
    confusion = torch.bincount(labels * num_classes + pred, minlength=num_classes ** 2).view(num_classes, num_classes)
    per_class_total = confusion.sum(1).clamp(min=1)
    return {
        "top1": correct[:, 0].float().mean().item(),
        "top5": correct.any(-1).float().mean().item(),
        "loss": F.cross_entropy(logits, labels).item(),
        "per_class": (confusion.diag() / per_class_total).tolist(),
        "confusion": confusion.tolist(),
        "num_images": len(labels),
        "ece": expected_calibration_error(logits.softmax(-1), labels),
        **report_metrics(confusion),
    }


def report_metrics(confusion: Tensor) -> dict[str, Any]:
    """Precision, recall and F1 of every class, their macro and support-weighted means, and the balanced
    accuracy, from a confusion matrix ``(K, K)`` (rows: true class, columns: predicted), as scikit-learn's
    ``precision_recall_fscore_support(zero_division=0)`` and ``balanced_accuracy_score`` give them (tested
    against both): a class that is neither a label nor a prediction is left out of the means, a ratio over
    nothing is 0, and the balanced accuracy is the mean recall of the classes that have images."""
    c = confusion.double()
    tp, true, predicted = c.diag(), c.sum(1), c.sum(0)
    scores = {"precision": torch.where(predicted > 0, tp / predicted, 0.0),
              "recall": torch.where(true > 0, tp / true, 0.0),
              "f1": torch.where(true + predicted > 0, 2 * tp / (true + predicted), 0.0)}
    present = (true + predicted) > 0
    out: dict[str, Any] = {name: v.tolist() for name, v in scores.items()}
    for name, v in scores.items():
        out[f"macro_{name}"] = v[present].mean().item()
        out[f"weighted_{name}"] = ((v * true).sum() / true.sum()).item() if true.sum() > 0 else 0.0
    out["balanced_top1"] = scores["recall"][true > 0].mean().item()
    return out
