"""What the self-supervised tasks (:mod:`.mae`, :mod:`.dino`) share: their images without labels, their views,
and the k-NN monitor, the only place labels enter.

- :func:`unlabelled_images`: the images a run pretrains on: a folder of images in folders of any kind (class
  folders or none), a Hugging Face split with or without a label column, a csv table, CIFAR-10, or shards
  (``data.dataset=wds``, a streamed Hugging Face split); labels, where the source has them, are not read.
- :func:`pretraining_loader`: those images through a task's view (each sample's a function of the run's seed, the
  epoch and the sample: the crops, flips and masks are the same on any processes and workers, and after a resume).
- :func:`monitor_loaders`, :func:`knn_monitor`: a labelled data set of its own (``monitor.*``), whose images vote
  by the backbone's pooled features (DINO's weighted k-NN) each evaluated epoch.
- :func:`unlabelled_data` and :func:`pretraining_task`: what a self-supervised task is built of, but its model,
  views and loss; :func:`check_unlabelled`: what a run without labels cannot take; :func:`evaluate_run`: ``vitlab
  eval`` of such a run.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from accelerate import Accelerator
from torch import Tensor, nn
from torch.utils.data import DataLoader

from ..data.batch_views import BatchedResizedCrop
from ..data.images import TensorImageDataset
from ..data.rules import streamed_in_shards
from ..data.shard_stream import ShardLoader
from ..data.transforms import CIFAR10_MEAN, CIFAR10_STD, ModelInput
from ..errors import ConfigError, DataError, need
from ..inference.view import eval_dataset
from ..models.hub import image_input_size, write_json
from ..runtime import bare_model
from .base import EvalRequest, Resumed, TaskSetup, resumed_statistics
from .image_data import decode_size_of, in_memory, index_splits, load_test_data, load_train_val_data, shard_streams
from .knn import collect_features, knn_predict

if TYPE_CHECKING:
    from ..schema import Config, DataConfig
    from ..data.split import SplitIndex

__all__ = ["unlabelled_images", "pretraining_loader", "normalization", "MaskedView", "MaskedDeviceView", "KNNMonitor",
           "monitor_loaders", "knn_monitor", "backbone_of", "evaluate_backbone", "Unlabelled", "unlabelled_data",
           "pretraining_task", "check_unlabelled", "monitor_validation", "evaluate_run"]


def unlabelled_images(d: DataConfig) -> SplitIndex:
    """The training split of ``d`` listed without its labels (every label 0): for ``imagefolder`` every image under
    ``data.root/<data.train_split>`` (or ``data.root``), in folders of any kind; a Hugging Face split with no label
    column too."""
    from ..data.folder import index_image_tree
    from ..data.sources import index_split

    if d.dataset == "imagefolder":
        return index_image_tree(Path(d.root).expanduser(), d.train_split, d.exif_transpose)
    index = index_split(d.dataset, d.root, d.train_split, download=d.download, image_key=d.image_key,
                        label_key=d.label_key, exif_transpose=d.exif_transpose, labelled=False)
    index.labels = torch.zeros(len(index), dtype=torch.long)  # not read: pretraining sees no labels
    return index


def normalization(cfg: Config, resumed: Resumed | None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The images' normalization: a resumed run's own; else ``data.mean`` / ``data.std`` where set, else CIFAR-10's.

    Raises:
        ConfigError: one line, if a resumed run is given other statistics than it started with.
    """
    d = cfg.data
    if resumed is not None:
        return resumed_statistics(d, resumed)
    return tuple(d.mean or CIFAR10_MEAN), tuple(d.std or CIFAR10_STD)


def pretraining_loader(cfg: Config, accelerator: Accelerator, micro_batch: int, size: tuple[int, int],
                       make_view: Callable[[tuple[int, int] | None], Callable[[Any], Any]], resumed: Resumed | None,
                       lazy: bool = False) -> tuple[Any, bool, int, dict[str, Any]]:
    """The training loader of a self-supervised run: its images (:func:`unlabelled_images`, or shards) through
    the view ``make_view(stored)`` makes for images stored at a size (None: each its own; each sample's view drawn
    from the run's seed, the epoch and the sample); whether Accelerate shards it; the images an epoch; what a resumed
    run keeps (the shards' partitions). ``lazy``: the view decodes each streamed file itself (random resized crops
    at the scale they need)."""
    d, t = cfg.data, cfg.train
    if streamed_in_shards(d):
        view = make_view(decode_size_of(d, size, keep_in_memory=False))
        kept = resumed.data_state if resumed is not None else {}
        streams, _ = shard_streams(d, t.seed, size, micro_batch // accelerator.num_processes,
                                   accelerator.num_processes, accelerator.process_index, splits=("train",),
                                   partitions=kept.get("partitions", 0), train_view=view)
        train = streams["train"]
        accelerator.print(f"data: {train.total:,} images in {len(train.segments)} shards, without labels")
        return ShardLoader(train, accelerator.device, accelerator.device.type == "cuda"), False, \
            train.samples_per_epoch, {"partitions": train.plan.partitions}
    index = unlabelled_images(d)
    keep, where = in_memory(d, index, index.subset(torch.zeros(0, dtype=torch.long), ""), size)
    accelerator.print(f"{where}; {len(index):,} images, without labels ({index.where})")
    data = index.load(decode_size_of(d, size, keep), d.train_subset, t.seed, keep, d.scaled_decode,
                      d.cache_dir or None)
    view = make_view(tuple(data.images.shape[-2:]) if d.train_crop == "pad" else None)
    dataset = TensorImageDataset(data, view, seed=t.seed, lazy=lazy)
    loader = DataLoader(dataset, batch_size=micro_batch, shuffle=True, drop_last=True, num_workers=d.num_workers,
                        pin_memory=accelerator.device.type == "cuda", persistent_workers=d.num_workers > 0)
    if len(loader) == 0:
        raise ConfigError(f"train.batch_size={t.batch_size} is larger than the {len(dataset)} training images")
    return loader, True, len(dataset), {}


@dataclasses.dataclass
class Unlabelled:
    """What a self-supervised task trains and is monitored on (:func:`unlabelled_data`)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    model_input: ModelInput         # uint8 images -> the model's normalized floats
    train_loader: Any
    prepare_train_loader: bool
    train_size: int
    data_state: dict[str, Any]
    monitors: dict[str, KNNMonitor]


def unlabelled_data(cfg: Config, accelerator: Accelerator, micro_batch: int, model: nn.Module, resumed: Resumed | None,
                    make_view: Callable[[tuple[int, int] | None, tuple[int, int], tuple[float, ...]], Any],
                    lazy: bool = False) -> Unlabelled:
    """The images of a self-supervised run of ``model`` through its view, ``make_view(stored, size, mean)`` (the
    size images are stored at, None: each its own; the model's input size; the normalization's mean), and its k-NN
    monitor (:func:`pretraining_loader`, :func:`monitor_loaders`)."""
    mean, std = normalization(cfg, resumed)
    size = image_input_size(model)[1:]
    loader, prepare, train_size, data_state = pretraining_loader(
        cfg, accelerator, micro_batch, size, lambda stored: make_view(stored, size, mean), resumed, lazy=lazy)
    monitors = monitor_loaders(cfg, accelerator, size, micro_batch)
    return Unlabelled(mean, std, ModelInput(mean, std), loader, prepare, train_size, data_state, monitors)


def pretraining_task(cfg: Config, data: Unlabelled, model: nn.Module, loss: Callable[[nn.Module, Any], Tensor],
                     **hooks: Any) -> TaskSetup:
    """A self-supervised task: ``model`` trained by ``loss`` on ``data``, scored by its k-NN monitor (``knn_top1``,
    which picks ``best/``), its ``config.json`` holding the task, the normalization and how its images are read and
    shown (``crop_pct`` where the monitor's evaluation view used it: ``vitlab eval``, ``embed`` and fine-tuning see
    what the monitor saw); ``hooks``: its ``before_step``, ``after_step``, ``finish``
    (:class:`~vitlab.tasks.base.TaskSetup`)."""
    d = cfg.data

    def score(net: nn.Module, monitor: Any, acc: Accelerator) -> dict[str, float]:
        return knn_monitor(backbone_of(net, acc), monitor, acc, data.model_input, cfg.monitor.k)

    meta = {"task": cfg.task, "mean": list(data.mean), "std": list(data.std),
            **({"decode_size": d.decode_size} if d.decode_size and d.dataset != "cifar10" else {}),
            **({"crop_pct": monitor_crop_pct(d)} if monitor_crop_pct(d) is not None else {}),
            **({"exif_transpose": False} if not d.exif_transpose else {})}
    return TaskSetup(model=model, train_loader=data.train_loader, prepare_train_loader=data.prepare_train_loader,
                     eval_loaders=data.monitors, prepare_eval_loaders=False, loss=loss,
                     count=lambda batch: len(batch[1]), evaluate=score, select="knn_top1", meta=meta,
                     train_size=data.train_size, data_state=data.data_state, metrics=("knn_top1",), **hooks)


class MaskedView:
    """A view and its masking noise: ``(view(image), uniform noise (num_patches,))``, both drawn where the sample's
    generator is (:func:`~vitlab.data.images.seeded_transform`): each image's mask is a function of the run's seed,
    the epoch and the image, as MAE's argsort of noise turns it into kept and hidden patches. Pickles."""

    def __init__(self, view: Callable[[Any], Tensor], num_patches: int) -> None:
        self.view, self.num_patches = view, num_patches

    def __call__(self, image: Any) -> tuple[Tensor, Tensor]:
        return self.view(image), torch.rand(self.num_patches)


class MaskedDeviceView:
    """``data.views: device``'s :class:`MaskedView`: in the loader an image as stored and its uniforms, drawn from
    the image's own generator (``(image, uniforms (23 + num_patches,))``, one call); :meth:`apply` makes a batch's
    crops, flips (:class:`~vitlab.data.batch_views.BatchedResizedCrop`, the first 23) and masking noise (the rest,
    uniform as MAE's) where the batch is. Pickles."""

    draws_from = "generator"

    def __init__(self, crop: BatchedResizedCrop, num_patches: int) -> None:
        self.crop, self.num_patches = crop, num_patches

    def __call__(self, image: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        return image, torch.rand(self.crop.uniforms + self.num_patches, generator=generator)

    def apply(self, images: Tensor, uniforms: Tensor) -> tuple[Tensor, Tensor]:
        """float32 views ``(B, C, *size)`` in ``[0, 255]`` of uint8 ``images`` ``(B, C, H, W)``, and their masking
        noise ``(B, num_patches)``."""
        crop, noise = uniforms.split([self.crop.uniforms, self.num_patches], dim=1)
        return self.crop(images, self.crop.params(crop, *images.shape[-2:])), noise


@dataclasses.dataclass
class KNNMonitor:
    """A labelled bank and its queries, prepared loaders of evaluation's view: what :func:`knn_monitor` scores."""

    bank: Any
    queries: Any
    num_classes: int
    num_workers: int = 0  # the loop's worker handling leaves it alone

    def shutdown_workers(self) -> None:
        """Nothing to end: the monitor reads decoded images in the main process."""


def monitor_loaders(cfg: Config, accelerator: Accelerator, size: tuple[int, int], batch_size: int,
                    k: int = 0) -> dict[str, KNNMonitor]:
    """The k-NN monitor's loaders (``monitor.*``; none without ``monitor.root``): its training split is the bank,
    its queries are ``monitor.val_size`` images held out of it (``'val'``, which picks ``best/``) and its test split
    (``'test'``, reported only), decoded into memory at the size training stores its images. ``k``: the neighbours
    that will vote, for the line that says so (0: ``monitor.k``)."""
    m, d = cfg.monitor, cfg.data
    if not m.root:
        return {}
    labelled = dataclasses.replace(d, dataset=m.dataset, root=m.root, train_split=m.train_split,
                                   test_split=m.test_split, val_size=m.val_size, train_subset=m.train_subset,
                                   test_subset=m.test_subset, test_size=0, streaming=False, in_memory=True,
                                   multi_label=False, download=False)
    try:
        train_index, test_index = index_splits(labelled, seed=cfg.train.seed)
    except (ConfigError, DataError) as e:  # said of data.* keys: the monitor's are monitor.*
        raise type(e)(_monitor_words(str(e))) from None
    bank, val = load_train_val_data(labelled, cfg.train.seed, size, train_index)
    test = load_test_data(labelled, cfg.train.seed, size, test_index)
    crop_pct = monitor_crop_pct(d)
    prepare = lambda data: accelerator.prepare(DataLoader(eval_dataset(data, size, crop_pct), batch_size=batch_size))
    monitors = {"test": KNNMonitor(prepare(bank), prepare(test), len(bank.classes))}
    if val is not None:
        monitors["val"] = KNNMonitor(prepare(bank), prepare(val), len(bank.classes))
    accelerator.print(f"monitor: k-NN (k={k or m.k}) of the {len(bank.labels):,} labelled images of {train_index.where} "
                      + (f"for {len(val.labels):,} held out of them (val) and " if val is not None else "for ")
                      + f"{len(test.labels):,} of {test_index.where} (test), by the backbone's pooled features")
    return monitors


def monitor_crop_pct(d: DataConfig) -> float | None:
    """The ``crop_pct`` of the monitor's evaluation view (and of the run's ``config.json``): ``data.crop_pct`` where
    images are cropped (``data.train_crop`` not ``pad``), else none (resized whole)."""
    return d.crop_pct if d.train_crop != "pad" else None


def _monitor_words(message: str) -> str:
    """A listing's message about the monitor's data, in the monitor's keys (``monitor.root``, not ``data.root``); a
    label set, which the monitor's vote cannot take, said so."""
    message = re.sub(r"\bdata\.multi_label\b.*$", "the k-NN monitor votes one class an image: give monitor.root "
                     "images of one class each", message)
    return re.sub(r"\bdata\.(dataset|root|train_split|test_split|val_size|train_subset|test_subset)\b",
                  r"monitor.\1", message)


def backbone_of(net: nn.Module, accelerator: Accelerator) -> nn.Module:
    """The backbone whose features a self-supervised model is worth (:meth:`backbone`), under its wrappers."""
    return bare_model(net, accelerator).backbone()


def knn_monitor(backbone: nn.Module, monitor: KNNMonitor, accelerator: Accelerator,
                model_input: Callable[[Tensor], Tensor], k: int) -> dict[str, float]:
    """The top-1 of the queries by the vote of their ``k`` nearest bank images (cosine similarity of the pooled
    features, votes weighted by ``exp(similarity / 0.07)``: :func:`~vitlab.tasks.knn.knn_predict`)."""
    bank, bank_labels = collect_features(backbone, monitor.bank, accelerator, model_input)
    queries, labels = collect_features(backbone, monitor.queries, accelerator, model_input)
    predicted = knn_predict(bank, bank_labels, queries, monitor.num_classes, k)
    return {"knn_top1": (predicted == labels).double().mean().item()}


def evaluate_backbone(cfg: Config, model: nn.Module, split: str, k: int, batch_size: int,
                      where: str) -> dict[str, Any]:
    """``vitlab eval --knn K`` of a self-supervised run (``model``, loaded, from ``where``): the k-NN top-1 of its
    backbone's pooled features on ``split`` of the run's ``monitor.*`` labelled data (``test``: its test split;
    ``val``: the ``monitor.val_size`` images held out of the bank), the bank its training split.

    Raises:
        ConfigError: one line, before any image is read: no ``--knn`` (the model has no head), no
            ``monitor.root``, ``split`` 'train' (the bank itself), 'val' without ``monitor.val_size``.
    """
    from ..data.transforms import ModelInput
    from ..runtime import create_accelerator

    if not k:
        raise ConfigError(f"{where} holds a task: {cfg.task} run, a backbone without a head: score its features with "
                          f"--knn K (the vote of the K nearest of monitor.root's labelled images, e.g. --knn 20), or "
                          f"fine-tune it: train.py task=classification model.pretrained={where}")
    if not cfg.monitor.root:
        raise ConfigError(f"--knn {k}: {where} was trained without labels, and its run names no labelled images to "
                          f"vote: add monitor.root=DIR (a folder of class folders with {cfg.monitor.train_split}/ and "
                          f"{cfg.monitor.test_split}/, or monitor.dataset=hf|cifar10|csv)")
    if split == "train" or (split == "val" and not cfg.monitor.val_size):
        raise ConfigError(f"--split {split}: a self-supervised run's k-NN votes with its monitor's training split (the "
                          f"bank); score --split test, or --split val with monitor.val_size=N (images held out of it)")
    accelerator = create_accelerator(cfg.train.mixed_precision)
    info = model.pretrained_cfg
    monitors = monitor_loaders(cfg, accelerator, tuple(info["input_size"][1:]), batch_size, k)
    backbone = accelerator.prepare(model.backbone())
    metrics = knn_monitor(backbone, monitors[split], accelerator, ModelInput(info["mean"], info["std"]), k)
    return {**metrics, "knn_k": k, "knn_train_images": len(monitors[split].bank.dataset),
            "num_images": len(monitors[split].queries.dataset)}


def evaluate_run(request: EvalRequest, cfg: Config, model: nn.Module) -> dict[str, Any]:
    """``vitlab eval`` of a self-supervised run: the k-NN top-1 of its backbone on its monitor's labelled images
    (:func:`evaluate_backbone`), printed, and written to ``request.output`` where given."""
    from accelerate import PartialState

    r = request
    metrics = evaluate_backbone(cfg, model, r.split, r.knn, r.batch_size, r.given)
    if PartialState().is_main_process:
        print(f"{r.directory} [{r.split}] ({cfg.task} backbone) k-NN top-1 {100 * metrics['knn_top1']:.2f}% ({r.knn} "
              f"neighbours among the {metrics['knn_train_images']} labelled images of monitor.root, "
              f"{metrics['num_images']} queries)")
        if r.output is not None:
            write_json(r.output, {**metrics, "checkpoint": str(r.directory), "split": r.split})
    return metrics


def monitor_validation(cfg: Config) -> str:
    """'' when the k-NN monitor of ``cfg`` holds out queries (``monitor.val_size``), a self-supervised run's
    validation split, else what to set for them."""
    if cfg.monitor.root and cfg.monitor.val_size:
        return ""
    return "a self-supervised run's is its k-NN monitor's: set monitor.root (labelled images) and monitor.val_size=N"


def check_unlabelled(cfg: Config) -> None:
    """What a run without labels (``task: mae``, ``task: dino``) cannot take (mixing labels, a class sampler, frozen
    or adapted weights, a teacher, the device loader, whose per-batch crops are classification's), and its k-NN
    monitor's values; each task's own section is its own check (:func:`vitlab.tasks.mae.check_mae`,
    :func:`vitlab.tasks.dino.check_dino`), run before this."""
    d, m, t = cfg.data, cfg.monitor, cfg.train
    said = f"with task: {cfg.task} (pretraining without labels)"
    need(m.k >= 1, "monitor.k", m.k, "an integer >= 1 (the neighbours that vote; DINO's 20)")
    for key in ("val_size", "train_subset", "test_subset"):
        need(getattr(m, key) >= 0, f"monitor.{key}", getattr(m, key), "an integer >= 0")
    need(d.loader != "gpu", "data.loader", d.loader, f"torch or auto {said}: its views are the DataLoader's")
    for key in ("mixup_alpha", "cutmix_alpha"):
        need(getattr(d, key) == 0, f"data.{key}", getattr(d, key), f"0 {said}: there are no labels to mix")
    need(d.sampler == "uniform", "data.sampler", d.sampler, f"uniform {said}: there are no classes to balance")
    need(d.aug_repeats == 1, "data.aug_repeats", d.aug_repeats, f"1 {said}")
    need(d.test_size == 0 and d.val_size == 0, "data.val_size" if d.val_size else "data.test_size",
         d.val_size or d.test_size, f"0 {said}: held-out labelled images are the monitor's (monitor.val_size)")
    need(cfg.model.freeze == "none" and not cfg.model.lora_r, "model.freeze" if cfg.model.freeze != "none" else
         "model.lora_r", cfg.model.freeze if cfg.model.freeze != "none" else cfg.model.lora_r,
         f"none {said}: pretraining trains the whole model")
    need(not cfg.model.pretrained, "model.pretrained", cfg.model.pretrained,
         f"'' {said}; fine-tune from the pretrained run instead: task: classification model.pretrained=RUN")
    need(cfg.distill.type == "none", "distill.type", cfg.distill.type, f"'none' {said}")
    need(not t.cache_features, "train.cache_features", t.cache_features, f"false {said}")
