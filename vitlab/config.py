"""Run configuration: YAML files mapped onto typed dataclasses, with ``key.sub=value`` overrides.

Every key is checked before anything runs: unknown keys (with close matches), wrong types and
invalid values raise :class:`ConfigError`, whose message names the key, the value and what is
allowed.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import difflib
import signal
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .data.transforms import AUGMENTS, timm_augment_problem
from .errors import ConfigError
from .models import list_models, preset_class
from .models.freeze import check_freeze
from .models.timm_classifier import TIMM_PREFIX, TimmClassifier, timm_problem

__all__ = ["ConfigError", "Config", "ModelConfig", "DataConfig", "TextDataConfig", "LMDataConfig", "OptimConfig", "TrainConfig",
           "GenerateConfig", "load_config", "config_to_dict", "config_to_flat", "save_config"]


@dataclass
class ModelConfig:
    """``name``: a preset (``vitlab.list_models()``); ``args``: overrides of its constructor arguments,
    written in YAML beside ``name`` (``model.depth=4``).

    ``pretrained`` starts an image model from weights (fine-tuning): ``timm:<name>`` (timm's weights,
    downloaded by timm, or read from ``pretrained_file`` offline), a ``.safetensors`` / ``.pth`` file
    of a timm or vitlab ViT, or a vitlab run / checkpoint / ``save_pretrained`` directory. The head is
    reset to the data's classes and the positional embedding resampled to the model's ``img_size``.
    ``grad_checkpointing`` recomputes each block's activations in the backward pass (less memory).
    ``freeze``: what of an image classifier does not train (:mod:`vitlab.models.freeze`): ``none``,
    ``backbone`` (a linear probe), ``blocks:N`` (the embeddings and the first N blocks), ``attn_only``.
    ``lora_r`` > 0: LoRA through peft (:mod:`vitlab.models.lora`) of rank ``lora_r`` and scale ``lora_alpha /
    lora_r`` on the linear layers ``lora_targets`` name, the rest of the pretrained model frozen but its head.
    """

    name: str = "vit_cifar_small_patch4_32"
    args: dict[str, Any] = field(default_factory=dict)
    pretrained: str = ""
    pretrained_file: str = ""
    grad_checkpointing: bool = False
    freeze: str = "none"
    lora_r: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: ["attn.qkv", "attn.proj"])


@dataclass
class DataConfig:
    dataset: Literal["cifar10", "imagefolder", "csv", "hf", "wds"] = "cifar10"
    root: str = "./data"      # hf: a Hub id, a DatasetDict.save_to_disk directory or a folder of parquet files;
                              # wds: a folder of WebDataset shards <split>-*.tar (and classes.txt);
                              # csv: a folder with <split>.csv (columns image, labels) and the images they name
    download: bool = True
    train_split: str = "train"  # imagefolder: folder names; hf: split names; wds: names or shard patterns
    test_split: str = "test"
    image_key: str = ""       # hf: the image and label columns ('' = image/img, label/labels/fine_label)
    label_key: str = ""
    train_subset: int = 0     # use only N training images, balanced across classes; 0 = all
    test_subset: int = 0      # likewise for the test set
    val_size: int = 0         # hold out N training images (stratified) for validation/best-checkpoint choice
    # Several classes an image (multi-hot targets, binary cross-entropy, mAP): auto, when the labels are sets
    # (a csv row with other than one name, a Hugging Face column of lists); true also for one class an image.
    multi_label: bool | Literal["auto"] = "auto"
    # No test split (one folder of class folders, a data set with only 'train'): hold out this share (< 1) or
    # count (>= 1) of data.train_split, stratified (each class in proportion, at least one image of each on
    # each side) and chosen by train.seed, as the test split; the run records it, and eval and resume use
    # exactly those images. 0 = read data.test_split.
    test_size: float = 0.0
    # The normalization, (x - mean) / std per channel (timm's --mean / --std): null = the pretrained
    # weights' (model.pretrained), else CIFAR-10's statistics. The run keeps it (eval, predict, a teacher).
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    # Training crops: pad (CIFAR-style: a random crop of the stored images with crop_padding of zeros) or
    # rrc (ImageNet-style, as timm: a random resized crop of each image at its own size, of an area in
    # `scale` and an aspect ratio in `ratio`; evaluation then resizes the shorter side to
    # img_size / crop_pct and crops the center).
    train_crop: Literal["pad", "rrc", "src"] = "pad"
    crop_padding: int = 4     # pad: random crop with this zero padding; 0 = no crop
    scale: tuple[float, float] = (0.08, 1.0)       # rrc
    ratio: tuple[float, float] = (0.75, 1.3333333333333333)  # rrc
    crop_pct: float = 0.875   # rrc: evaluation's center crop (timm's default)
    reprob: float = 0.0       # rrc: random erasing probability (per-pixel noise, as timm's mode='pixel')
    hflip: bool = True
    # none, randaugment, trivialaugment, autoaugment (torchvision's), or a timm spec string: rand-m9-mstd0.5-inc1
    # (DeiT's RandAugment), augmix-m5-w3, original-mstd0.5, 3a (DeiT III's 3-Augment): timm's own ops.
    augment: str = "none"
    autoaugment_policy: Literal["cifar10", "imagenet", "svhn"] = "cifar10"
    color_jitter: float = 0.0  # ColorJitter(x, x, x) after the augmentation (timm's --color-jitter; DeiT III: 0.3); 0 = off
    randaugment_ops: int = 2
    randaugment_magnitude: int = 9
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    num_workers: int = 2
    # torch: DataLoader with per-image torchvision transforms (all augmentations);
    # gpu: the whole data set on the accelerator's device, crop + flip + RandAugment there per image
    # (no workers; AutoAugment is not available there). On a CPU-only machine "gpu" runs on the CPU.
    # auto: gpu when training on a CUDA device (a DataLoader there starves the GPU), torch otherwise
    # and for AutoAugment.
    loader: Literal["auto", "torch", "gpu"] = "auto"
    # ImageFolder images are resized to decode_size x decode_size once, when decoded (0 = the model's
    # input size); the loaders resize each batch to the model's input size (CIFAR-10 stays 32 x 32 in
    # memory while a fine-tuned ViT sees 224 x 224).
    decode_size: int = 0
    # Photos upright: image files are turned by their EXIF orientation tag when decoded (as PIL's
    # ImageOps.exif_transpose and Hugging Face datasets do), in training, eval, predict and attention
    # alike; false: the stored pixels, as timm's loader reads them (a portrait phone photo lies on its side).
    exif_transpose: bool = True
    # Decode a JPEG only as large as its crop (or data.decode_size) needs: libjpeg-turbo's DCT scaling by 1/2
    # or 1/4, then the box cut from the smaller image (about 50 dB from the full decode; docs/large_data.md).
    # false: every file decoded whole, for pixels equal to timm's loader.
    scaled_decode: bool = True
    # Where the decoded training and test images live: true, in memory (decoded once, before training);
    # false, streamed (each image decoded when a DataLoader worker reads it: data larger than memory);
    # auto, in memory when the decoded training split fits a quarter of the machine's memory shared by
    # its processes, streamed otherwise (the run says which and why). The same images give the same
    # weights either way.
    in_memory: bool | Literal["auto"] = "auto"
    # A folder that keeps a split of image files decoded into memory (at data.decode_size) for the next run,
    # checked against the files' sizes and modification times ('' = none): the next start reads it instead
    # of decoding every photo again.
    cache_dir: str = ""
    # wds and streamed hf: each partition of the epoch's shards is shuffled through a buffer of this many
    # (raw, encoded) samples, after the shards' order is shuffled each epoch.
    shuffle_buffer: int = 1000
    # wds and streamed hf: the epoch's shards are cut into this many partitions, each giving its share
    # of every global batch (0 = the processes x DataLoader workers of the run's first launch). Fixed
    # for the run and kept in its checkpoint, so a resumed run may use any number of processes that
    # divides it, with any number of workers, and trains on the same global batches.
    partitions: int = 0
    # hf: read a Hub id or a folder of parquet files as an IterableDataset (streaming=True: never whole on
    # disk), its data files streamed as wds shards are (the same guarantees: every sample once an epoch,
    # resumable to the sample).
    streaming: bool = False
    # Repeated augmentation (DeiT: 3; timm's --aug-repeats): each chosen image this many times an epoch,
    # each copy augmented independently, the copies on different processes; the epoch keeps its length
    # (N // 256 * 256 samples), so it sees about N / aug_repeats distinct images. 1 = off. Images read by
    # index (in memory or streamed folders and hf splits), through the DataLoader.
    aug_repeats: int = 1
    # Skewed classes: each epoch's N images drawn with replacement, a class in proportion to its count ** q:
    # class_balanced (q = 0, every class equally often) or sqrt (q = 1/2); uniform: each image once. The
    # draws depend on train.seed and the epoch alone (any processes or workers, resumable inside an epoch).
    sampler: Literal["uniform", "class_balanced", "sqrt"] = "uniform"


@dataclass
class TextDataConfig:
    """Data of ``task: seq2seq``: a synthetic task or parallel text files."""

    dataset: Literal["copy", "reverse", "sort", "parallel"] = "reverse"
    # Synthetic tasks: random symbol sequences.
    vocab_size: int = 32         # synthetic: symbols + 3 special tokens; parallel: BPE vocabulary size
    min_len: int = 4
    max_len: int = 16
    num_train: int = 20000
    num_test: int = 1000
    # Parallel text: <root>/<split>.<lang>[.gz], one sentence a line, aligned across languages.
    root: str = ""
    src_lang: str = "de"
    tgt_lang: str = "en"
    train_split: str = "train"
    valid_split: str = "val"
    test_split: str = "test_2016_flickr"
    max_tokens: int = 128        # longer tokenized sentences are cut to this
    # Batching: by token count when batch_tokens > 0 (per global batch), else train.batch_size sentences.
    batch_tokens: int = 0
    num_workers: int = 0


@dataclass
class LMDataConfig:
    """Data of ``task: lm``: a text corpus split by position, random windows of ``block_size`` tokens."""

    dataset: Literal["text", "tinyshakespeare"] = "text"
    root: str = ""               # text: a UTF-8 file or a folder of .txt files; tinyshakespeare: the folder
                                 # holding tinyshakespeare/input.txt
    download: bool = True        # tinyshakespeare: fetch char-rnn's input.txt into root if absent
    tokenizer: Literal["char", "bpe"] = "char"
    vocab_size: int = 4096       # bpe only
    val_fraction: float = 0.1    # the last part of the text validates (as nanoGPT)
    block_size: int = 256        # context length of a training window (the model's block_size)
    steps_per_epoch: int = 0     # optimizer steps per epoch; 0 = training tokens / (batch x block_size)
    eval_batches: int = 0        # evaluate on only N validation batches during training (0 = all)


@dataclass
class GenerateConfig:
    """Decoding for evaluation and ``vitlab translate`` (``task: seq2seq``)."""

    beam_size: int = 1
    length_penalty: float = 1.0
    max_new_tokens: int = 0      # 0 = source length + 50
    eval_subset: int = 0         # decode only the first N sentences of each split at each epoch's evaluation
                                 # (0 = all); the run's last evaluation decodes the whole test split


@dataclass
class OptimConfig:
    # timm's optimizer names (timm.optim.list_optimizers(); create_optimizer_v2): adamw, adam, sgd (Nesterov
    # momentum, as timm's), momentum (plain), lamb, lars, lion, adafactor, ...
    opt: str = "adamw"
    lr: float = 1e-3          # peak learning rate, reached after warmup
    min_lr: float = 1e-5      # the least the schedule goes to
    weight_decay: float = 0.05
    betas: tuple[float, float] | None = None  # null = the optimizer's own (AdamW, LAMB: 0.9, 0.999; Lion: 0.9, 0.99)
    eps: float | None = None  # null = the optimizer's own (AdamW's: 1e-8)
    momentum: float = 0.9     # sgd, momentum, lars, ... (timm's --momentum)
    warmup_epochs: float = 5.0
    warmup_lr: float = 0.0    # the warmup's start (timm's --warmup-lr); its first step is one warmup step above
    # After warmup (timm's schedulers, every length counted in optimizer steps): cosine to min_lr (cycle_limit
    # cycles, each cycle_mul times the one before and its peak cycle_decay times), poly (power decay_rate),
    # step (x decay_rate every decay_epochs), multistep (x decay_rate at each of decay_milestones), plateau
    # (x decay_rate after patience_epochs evaluations without a better validation metric: train.best_metric's),
    # or inverse_sqrt (Vaswani et al. 2017: lr * sqrt(warmup / step)).
    schedule: Literal["cosine", "poly", "step", "multistep", "plateau", "inverse_sqrt"] = "cosine"
    cooldown_epochs: float = 0.0  # the last epochs at min_lr (inside train.epochs; timm adds them)
    decay_epochs: float = 30.0
    decay_milestones: list[float] = field(default_factory=lambda: [30.0, 60.0])
    decay_rate: float = 0.1
    patience_epochs: int = 10
    cycle_limit: int = 1
    cycle_mul: float = 1.0
    cycle_decay: float = 0.1
    grad_clip: float = 1.0    # max global grad norm; 0 = no clipping
    layer_decay: float = 0.0  # layer-wise lr decay (BEiT / timm): block i of n gets lr * layer_decay ** (n + 1 - i);
                              # 0 = off (a ViT only)
    # The learning rate from a recipe's base (timm's, DeiT's): lr_base * global batch / lr_base_size (linear),
    # or its square root (sqrt: timm's rule for Adam-like optimizers); 0 = off, optim.lr is the peak. An
    # optim.lr given beside it wins, as timm's --lr does (lr_base is then set to 0).
    lr_base: float = 0.0
    lr_base_size: int = 256
    lr_base_scale: Literal["linear", "sqrt"] = "linear"

    def peak_lr(self, batch_size: int) -> float:
        """The peak learning rate for a global batch of ``batch_size``: ``lr``, or scaled from ``lr_base``."""
        if not self.lr_base:
            return self.lr
        ratio = batch_size / self.lr_base_size
        return self.lr_base * (ratio ** 0.5 if self.lr_base_scale == "sqrt" else ratio)


@dataclass
class TrainConfig:
    epochs: int = 100
    batch_size: int = 128     # global, across processes and accumulation steps
    grad_accum_steps: int = 1
    mixed_precision: Literal["no", "fp16", "bf16"] = "no"
    label_smoothing: float = 0.1
    # ce: cross-entropy; bce: binary cross-entropy per class (DeiT III; timm's BinaryCrossEntropy), its targets
    # binarized above bce_target_thresh if set (timm's --bce-target-thresh); logit_adjusted: cross-entropy of the
    # logits plus logit_adjust_tau x log(the training class frequencies) (Menon et al. 2021), for skewed classes.
    loss: Literal["ce", "bce", "logit_adjusted"] = "ce"
    bce_target_thresh: float | None = None
    logit_adjust_tau: float = 1.0
    # Class weights of the cross-entropy, from the training class counts: balanced (n / (K n_c), scikit-learn's)
    # or effective (the effective number of samples, Cui et al. 2019: (1 - beta) / (1 - beta ** n_c), summing to K).
    class_weights: Literal["none", "balanced", "effective"] = "none"
    class_weights_beta: float = 0.9999
    # Multi-label: the weight of each class's positive term in the binary cross-entropy (torch's pos_weight):
    # balanced = its negatives / positives in the training images, or one number a class.
    pos_weight: Literal["none", "balanced"] | list[float] = "none"
    ema_decay: float = 0.0    # 0 = no EMA; else timm ModelEmaV3 with this decay
    save_every: int = 1       # epochs between checkpoints
    save_every_steps: int = 0  # also write last/ every N optimizer steps, inside epochs (0 = at epoch ends only)
    keep_last: int = 0        # keep the K newest last/ checkpoints as checkpoints/step_<global step>/ (0 = none)
    resume: Literal["auto", "no"] = "auto"  # auto: continue the run in output_dir if it has a checkpoint
    stop_signals: str = "SIGTERM"  # on these (comma-separated; "" = none): checkpoint, exit 75 (EX_TEMPFAIL)
    # Experiment trackers through Accelerate (the run's scalars and its whole config; project: the run's
    # directory name); all: every one installed. mlflow writes a file store in <run>/mlruns unless
    # MLFLOW_TRACKING_URI says otherwise.
    log_with: Literal["tensorboard", "wandb", "mlflow", "aim", "all", "none"] = "tensorboard"
    eval_every: int = 1       # epochs between evaluations; 0 = only after the last epoch
    # The validation metric that chooses best/ (any val_ key of metrics.jsonl: val_macro_f1, val_balanced_top1,
    # val_loss, ...; transformers' metric_for_best_model); "" = the task's (val_top1, val_bleu, val_loss).
    # greater_is_better: null = lower is better for a name ending in "loss", higher for any other.
    best_metric: str = ""
    greater_is_better: bool | None = None
    # Stop when the best metric has not improved for this many epochs (at an evaluated epoch); 0 = never.
    # The schedule still spans train.epochs; the run is then finished (its last/ is its final epoch).
    early_stop_patience: int = 0
    # At the end of a finished run (train.py, vitlab train): fit the model's calibration on the validation split
    # (data.val_size) and keep it in its checkpoint, as vitlab calibrate does: the temperature (temperature
    # scaling), or a multi-label model's threshold a class. The temperature of the least validation NLL (Guo et
    # al. 2017), or of the least validation ECE (ece: Mukhoti et al. 2020; vitlab calibrate --objective).
    calibrate: bool = False
    calibrate_objective: Literal["nll", "ece"] = "nll"
    # With model.freeze=backbone: the backbone's features of every training image computed once (the evaluation
    # transform) and the head fitted on them by L-BFGS, scikit-learn's multinomial logistic regression (the linear
    # probe of CLIP's protocol; vitlab.tasks.linear_probe) instead of the training loop. probe_l2: its L2
    # strength (C = 1 / (probe_l2 N)); null = chosen on the validation split (data.val_size), or 1 / N (C = 1,
    # scikit-learn's default) without one.
    cache_features: bool = False
    probe_l2: float | None = None
    output_dir: str = "runs/vit_cifar10"
    seed: int = 0
    log_every: int = 50       # optimizer steps between training-metric log lines
    compile: bool = False     # torch.compile the model (checkpoints are the same either way)


@dataclass
class DistillConfig:
    """Knowledge distillation (DeiT, Touvron et al. 2021) of a classification run from a frozen teacher."""

    type: Literal["none", "soft", "hard"] = "none"  # soft: KL to the teacher's tempered softmax; hard: its argmax
    # timm:<name> (timm's pretrained weights; distill.teacher_file: a local copy of them), or a vitlab run,
    # checkpoint or save_pretrained directory (any vitlab image classifier).
    teacher: str = ""
    teacher_file: str = ""
    alpha: float = 0.5        # loss = (1 - alpha) * the task's loss + alpha * the distillation loss
    tau: float = 1.0          # soft: the temperature


@dataclass
class Config:
    """A run: ``task`` picks image classification (a ViT) or sequence-to-sequence (a text Transformer)."""

    task: Literal["classification", "seq2seq", "lm"] = "classification"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig | TextDataConfig | LMDataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)


_SECTIONS = ("model", "data", "optim", "train", "generate", "distill")
_SECTION_TYPES = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "train": TrainConfig,
                  "generate": GenerateConfig, "distill": DistillConfig}
# Set by the data and tokenizer, not by the config.
_DERIVED_MODEL_ARGS = {"src_vocab_size", "tgt_vocab_size", "pad_id", "bos_id", "eos_id", "vocab_size", "block_size"}


def _close(key: str, options: typing.Iterable[str]) -> str:
    matches = difflib.get_close_matches(key, list(options), n=3, cutoff=0.5)
    return f"; did you mean {', '.join(matches)}?" if matches else ""


def _check_optimizer(name: str) -> None:
    """``optim.opt`` is one of timm's optimizers (``lookahead_`` before any), or one line with the close names."""
    from timm.optim import get_optimizer_info, list_optimizers

    try:
        get_optimizer_info(name.lower().removeprefix("lookahead_"))
    except ValueError:
        known = list_optimizers()
        hint = _close(name.lower(), known) or f" ({len(known)}: timm.optim.list_optimizers())"
        raise ConfigError(f"optim.opt={name!r} is not one of timm's optimizers{hint}") from None


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a type annotation; accept ints for floats and lists for tuples."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if isinstance(value, bool) and ("no" if not value else "yes") in allowed:
            value = "no" if not value else "yes"  # YAML 1.1 reads an unquoted no / yes as a boolean
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not allowed; expected one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r} has the wrong type; expected {_type_name(annotation)}")
    if origin is tuple:
        args = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}={value!r} has the wrong type; expected a list of {len(args)} numbers")
        return tuple(_coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} has the wrong type; expected a list")
        (arg,) = typing.get_args(annotation)
        return [_coerce(f"{key}[{i}]", v, arg) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} has the wrong type; expected a mapping")
        return value
    if annotation is type(None):
        if value is not None:
            raise ConfigError(f"{key}={value!r}: expected null")
        return None
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if annotation is int and isinstance(value, bool) or not isinstance(value, annotation):
        raise ConfigError(f"{key}={value!r} has the wrong type; expected {_type_name(annotation)}, "
                          f"got {type(value).__name__}")
    return value


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _check_values(cfg: Config) -> None:
    def need(cond: bool, key: str, value: Any, allowed: str) -> None:
        if not cond:
            raise ConfigError(f"{key}={value!r} is invalid; expected {allowed}")

    d, o, t, g = cfg.data, cfg.optim, cfg.train, cfg.generate
    k = cfg.distill
    if k.type != "none":
        need(cfg.task == "classification", "distill.type", k.type, "'none' unless task: classification")
        if not k.teacher:
            raise ConfigError(f"distill.type={k.type} needs distill.teacher: timm:<name>, or a vitlab run, checkpoint "
                              f"or save_pretrained directory")
        need(0 <= k.alpha <= 1, "distill.alpha", k.alpha, "a number in [0, 1]")
        need(k.tau > 0, "distill.tau", k.tau, "a number > 0")
    if isinstance(d, DataConfig):
        for key in ("train_subset", "test_subset", "val_size", "crop_padding", "num_workers", "decode_size",
                    "partitions"):
            need(getattr(d, key) >= 0, f"data.{key}", getattr(d, key), "an integer >= 0")
        need(0 <= d.randaugment_magnitude <= 30, "data.randaugment_magnitude", d.randaugment_magnitude, "0..30")
        need(d.randaugment_ops >= 1, "data.randaugment_ops", d.randaugment_ops, "an integer >= 1")
        need(d.test_size >= 0, "data.test_size", d.test_size, "a share in (0, 1), a count >= 1, or 0 (read "
             "data.test_split)")
        need(d.test_size == 0 or d.test_size < 1 or d.test_size == int(d.test_size), "data.test_size", d.test_size,
             "a share in (0, 1) or a whole count")
        need(d.test_size == 0 or not (d.dataset == "wds" or d.streaming), "data.test_size", d.test_size,
             "0 with shards (data.dataset=wds, data.streaming=true): hold out shards as a test split instead "
             "(vitlab shards --split)")
        for key in ("mean", "std"):
            values = getattr(d, key)
            if values is not None and max(values) > 1:
                raise ConfigError(f"data.{key}={list(values)} is on the 0-255 scale; vitlab's (timm's) are on the 0-1 "
                                  f"scale: data.{key}={[round(v / 255, 6) for v in values]}")
        need(d.mean is None or min(d.mean) >= 0, "data.mean", list(d.mean or ()), "three numbers in [0, 1]")
        need(d.std is None or min(d.std) > 0, "data.std", d.std, "three numbers in (0, 1]")
        need(d.aug_repeats >= 1, "data.aug_repeats", d.aug_repeats, "an integer >= 1 (1 = off; DeiT: 3)")
        need(d.aug_repeats == 1 or d.loader != "gpu", "data.aug_repeats", d.aug_repeats,
             "1 with data.loader=gpu (repeated augmentation orders the DataLoader's samples: data.loader=torch)")
        need(d.aug_repeats == 1 or not (d.dataset == "wds" or d.streaming), "data.aug_repeats", d.aug_repeats,
             "1 with shards (data.dataset=wds, data.streaming=true): a stream reads each sample once; repeated "
             "augmentation needs images read by index (imagefolder, hf)")
        need(0 <= d.color_jitter <= 1, "data.color_jitter", d.color_jitter, "a number in [0, 1] (0 = off)")
        need(d.loader != "gpu" or d.color_jitter == 0, "data.color_jitter", d.color_jitter,
             "0 with data.loader=gpu (color jitter is a DataLoader transform: data.loader=torch)")
        problem = timm_augment_problem(d.augment) if d.augment not in AUGMENTS else None
        need(problem is None, "data.augment", d.augment, f"one of {', '.join(AUGMENTS)}, or a timm spec "
             f"(rand-m9-mstd0.5-inc1, augmix-m5-w3, original, 3a); {problem}")
        for key in ("mixup_alpha", "cutmix_alpha"):
            need(getattr(d, key) >= 0, f"data.{key}", getattr(d, key), "a number >= 0 (0 = off)")
        need(d.loader != "gpu" or d.augment in ("none", "randaugment"), "data.augment", d.augment,
             "'none' or 'randaugment' with data.loader=gpu (use data.loader=torch for the others)")
        need(d.loader != "gpu" or d.train_crop == "pad", "data.train_crop", d.train_crop,
             "'pad' with data.loader=gpu (random resized crops need data.loader=torch)")
        need(0 < d.scale[0] <= d.scale[1] <= 1, "data.scale", list(d.scale), "[min, max] with 0 < min <= max <= 1")
        need(0 < d.ratio[0] <= d.ratio[1], "data.ratio", list(d.ratio), "[min, max] with 0 < min <= max")
        need(0 < d.crop_pct <= 1, "data.crop_pct", d.crop_pct, "a number in (0, 1]")
        need(0 <= d.reprob <= 1, "data.reprob", d.reprob, "a probability in [0, 1]")
        need(d.reprob == 0 or d.train_crop != "pad", "data.reprob", d.reprob,
             "0 with data.train_crop=pad (random erasing comes with the ImageNet-style transforms, train_crop=rrc)")
        need(d.dataset != "wds" or d.in_memory is not True, "data.in_memory", d.in_memory,
             "auto or false with data.dataset=wds (shards are streamed; data.dataset=imagefolder or hf keeps images "
             "in memory)")
        need(d.dataset != "wds" or d.loader != "gpu", "data.loader", d.loader,
             "torch or auto with data.dataset=wds (shards are streamed by DataLoader workers)")
        need(d.shuffle_buffer >= 1, "data.shuffle_buffer", d.shuffle_buffer, "a number of samples >= 1")
        need(d.sampler == "uniform" or not (d.dataset == "wds" or d.streaming), "data.sampler", d.sampler,
             "uniform with shards (data.dataset=wds, data.streaming=true): a stream reads each sample once")
        need(d.sampler == "uniform" or d.aug_repeats == 1, "data.sampler", d.sampler,
             "uniform with data.aug_repeats > 1 (each orders the epoch its own way)")
        need(d.sampler == "uniform" or d.multi_label is not True, "data.sampler", d.sampler,
             "uniform with data.multi_label=true (an image of several classes has no one class to balance)")
        need(not d.streaming or d.dataset == "hf", "data.streaming", d.streaming,
             "false unless data.dataset=hf (a Hub id or a folder of parquet files read with streaming=True)")
        need(not d.streaming or (d.in_memory is not True and d.loader != "gpu"), "data.streaming", d.streaming,
             "false with data.in_memory=true or data.loader=gpu (a streamed data set is read by DataLoader workers)")
        need(d.loader != "gpu" or d.in_memory is not False, "data.in_memory", d.in_memory,
             "true or auto with data.loader=gpu (the device loader holds the whole data set; stream with "
             "data.loader=torch)")
    elif isinstance(d, LMDataConfig):
        need(bool(d.root), "data.root", d.root, "a UTF-8 text file or a folder of .txt files" if d.dataset == "text"
             else "the folder that holds (or is to hold) tinyshakespeare/input.txt, e.g. ./data")
        need(0 < d.val_fraction < 1, "data.val_fraction", d.val_fraction, "a number in (0, 1)")
        need(d.block_size >= 1, "data.block_size", d.block_size, "an integer >= 1")
        need(d.vocab_size >= 257 or d.tokenizer == "char", "data.vocab_size", d.vocab_size,
             "at least 257 for a byte-level BPE")
        for key in ("steps_per_epoch", "eval_batches"):
            need(getattr(d, key) >= 0, f"data.{key}", getattr(d, key), "an integer >= 0")
    else:
        need(d.vocab_size >= (4 if d.dataset != "parallel" else 64), "data.vocab_size", d.vocab_size,
             "at least 4 (synthetic) or 64 (BPE)")
        need(1 <= d.min_len <= d.max_len, "data.min_len", d.min_len, f"1 <= min_len <= data.max_len={d.max_len}")
        for key in ("num_train", "num_test", "max_tokens"):
            need(getattr(d, key) >= 1, f"data.{key}", getattr(d, key), "an integer >= 1")
        for key in ("batch_tokens", "num_workers"):
            need(getattr(d, key) >= 0, f"data.{key}", getattr(d, key), "an integer >= 0")
        need(d.dataset != "parallel" or bool(d.root), "data.root", d.root,
             "the folder of the parallel text files (data.dataset=parallel)")
    need(g.beam_size >= 1, "generate.beam_size", g.beam_size, "an integer >= 1")
    need(g.max_new_tokens >= 0, "generate.max_new_tokens", g.max_new_tokens, "an integer >= 0 (0 = source + 50)")
    need(g.eval_subset >= 0, "generate.eval_subset", g.eval_subset, "an integer >= 0 (0 = all)")
    need(o.lr > 0, "optim.lr", o.lr, "a number > 0")
    need(t.loss == "ce" or cfg.task == "classification", "train.loss", t.loss, "'ce' unless task: classification")
    need(t.bce_target_thresh is None or 0 <= t.bce_target_thresh < 1, "train.bce_target_thresh", t.bce_target_thresh,
         "null or a number in [0, 1)")
    need(t.logit_adjust_tau >= 0, "train.logit_adjust_tau", t.logit_adjust_tau, "a number >= 0 (1: Menon et al.'s)")
    need(t.class_weights == "none" or t.loss == "ce", "train.class_weights", t.class_weights,
         "'none' with train.loss=bce or logit_adjusted (each weighs the classes its own way)")
    need(t.class_weights == "none" or not isinstance(d, DataConfig) or not (d.dataset == "wds" or d.streaming),
         "train.class_weights", t.class_weights, "'none' with shards (data.dataset=wds, data.streaming=true): the "
         "weights need the count of each class before training, which a stream does not list")
    need(0 < t.class_weights_beta < 1, "train.class_weights_beta", t.class_weights_beta, "a number in (0, 1)")
    multi = isinstance(d, DataConfig) and d.multi_label is True
    need(not multi or (t.loss == "ce" and t.class_weights == "none"), "train.loss" if t.loss != "ce" else
         "train.class_weights", t.loss if t.loss != "ce" else t.class_weights,
         "left out with data.multi_label=true (its loss is the binary cross-entropy; train.pos_weight weighs its classes)")
    need(not multi or k.type == "none", "distill.type", k.type, "'none' with data.multi_label=true (a teacher's "
         "softmax gives one class an image)")
    need(not isinstance(t.pos_weight, list) or all(w > 0 for w in t.pos_weight), "train.pos_weight", t.pos_weight,
         "none, balanced, or a positive number a class")
    need(t.loss != "logit_adjusted" or not isinstance(d, DataConfig) or not (d.dataset == "wds" or d.streaming),
         "train.loss", t.loss, "'ce' or 'bce' with shards (data.dataset=wds, data.streaming=true): the logit-adjusted "
         "loss needs the count of each class before training, which a stream does not list")
    need(o.lr_base >= 0, "optim.lr_base", o.lr_base, "a number >= 0 (0 = off)")
    need(o.lr_base_size >= 1, "optim.lr_base_size", o.lr_base_size, "a batch size >= 1")
    peak = o.peak_lr(t.batch_size)
    need(0 <= o.min_lr <= peak, "optim.min_lr", o.min_lr, f"a number in [0, optim.lr={o.lr}]" if not o.lr_base else
         f"a number in [0, the peak learning rate {peak:.5g}] (optim.lr_base x train.batch_size / optim.lr_base_size)")
    need(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "a number >= 0")
    need(o.betas is None or all(0 <= b < 1 for b in o.betas), "optim.betas", o.betas and list(o.betas),
         "null (the optimizer's own) or two numbers in [0, 1)")
    need(o.warmup_epochs >= 0, "optim.warmup_epochs", o.warmup_epochs, "a number >= 0")
    _check_optimizer(o.opt)
    need(o.eps is None or o.eps > 0, "optim.eps", o.eps, "null (the optimizer's own) or a number > 0")
    need(0 <= o.momentum < 1, "optim.momentum", o.momentum, "a number in [0, 1)")
    need(0 <= o.warmup_lr <= peak, "optim.warmup_lr", o.warmup_lr,
         f"a number in [0, the peak learning rate {peak:.5g}]")
    need(0 <= o.cooldown_epochs < t.epochs, "optim.cooldown_epochs", o.cooldown_epochs,
         f"a number in [0, train.epochs={t.epochs}): the last epochs at optim.min_lr")
    decaying = o.schedule in ("cosine", "poly")  # the schedules with a cooldown and cycles (timm's)
    need(decaying or not o.cooldown_epochs, "optim.cooldown_epochs", o.cooldown_epochs,
         f"0 with optim.schedule={o.schedule} (only cosine and poly end in a cooldown at optim.min_lr)")
    need(decaying or (o.cycle_limit == 1 and o.cycle_mul == 1.0), "optim.cycle_limit", o.cycle_limit,
         f"1 with optim.schedule={o.schedule} (only cosine and poly restart in cycles)")
    need(o.decay_epochs > 0, "optim.decay_epochs", o.decay_epochs, "a number of epochs > 0")
    need(o.decay_milestones == sorted(o.decay_milestones) and all(m > 0 for m in o.decay_milestones),
         "optim.decay_milestones", o.decay_milestones, "epochs > 0 in increasing order, e.g. [30, 60]")
    need(o.decay_rate > 0, "optim.decay_rate", o.decay_rate, "a number > 0 (a factor; poly: the power)")
    need(o.patience_epochs >= 0, "optim.patience_epochs", o.patience_epochs, "an integer >= 0")
    need(o.cycle_limit >= 1, "optim.cycle_limit", o.cycle_limit, "an integer >= 1")
    need(o.cycle_mul > 0, "optim.cycle_mul", o.cycle_mul, "a number > 0")
    need(o.cycle_decay > 0, "optim.cycle_decay", o.cycle_decay, "a number > 0")
    need(o.grad_clip >= 0, "optim.grad_clip", o.grad_clip, "a number >= 0 (0 = off)")
    need(0 <= o.layer_decay <= 1, "optim.layer_decay", o.layer_decay, "a number in [0, 1] (0 = off; e.g. 0.65)")
    need(o.layer_decay == 0 or cfg.task == "classification", "optim.layer_decay", o.layer_decay,
         "0 for a text model (layer-wise decay is for fine-tuning a ViT)")
    m = cfg.model
    check_freeze(m.freeze)
    need(m.lora_r >= 0, "model.lora_r", m.lora_r, "an integer >= 0 (0 = no LoRA; 4-16 usual)")
    if m.lora_r:
        if not m.pretrained:
            raise ConfigError(f"model.lora_r={m.lora_r} adapts pretrained weights: set model.pretrained (timm:<name>, "
                              f"a weights file or a vitlab run)")
        need(m.freeze == "none", "model.freeze", m.freeze, f"none with model.lora_r={m.lora_r} (LoRA freezes all but "
             f"its adapters and the head itself)")
        need(m.lora_alpha > 0, "model.lora_alpha", m.lora_alpha, "a number > 0 (the adapters' scale is alpha / r)")
        need(0 <= m.lora_dropout < 1, "model.lora_dropout", m.lora_dropout, "a number in [0, 1)")
        need(bool(m.lora_targets), "model.lora_targets", m.lora_targets, "the names of linear layers, e.g. "
             "[attn.qkv, attn.proj]")
        if importlib.util.find_spec("peft") is None:
            raise ConfigError(f"model.lora_r={m.lora_r} needs the peft library: pip install 'vitlab[lora]'")
    need(m.freeze == "none" or cfg.task == "classification", "model.freeze", m.freeze,
         "none for a text model (freezing is for fine-tuning an image classifier)")
    need(not m.pretrained or cfg.task == "classification", "model.pretrained", m.pretrained,
         "'' for a text model (fine-tuning from pretrained weights is for image models)")
    need(not m.pretrained_file or m.pretrained.startswith("timm:"), "model.pretrained_file", m.pretrained_file,
         "'' unless model.pretrained=timm:<name> (it is the local copy of timm's weights for that name)")
    need(t.epochs >= 1, "train.epochs", t.epochs, "an integer >= 1")
    need(t.batch_size >= 1, "train.batch_size", t.batch_size, "an integer >= 1")
    need(t.grad_accum_steps >= 1, "train.grad_accum_steps", t.grad_accum_steps, "an integer >= 1")
    need(t.batch_size % t.grad_accum_steps == 0, "train.batch_size", t.batch_size,
         f"a multiple of train.grad_accum_steps={t.grad_accum_steps}")
    need(0 <= t.label_smoothing < 1, "train.label_smoothing", t.label_smoothing, "a number in [0, 1)")
    need(0 <= t.ema_decay < 1, "train.ema_decay", t.ema_decay, "a number in [0, 1) (0 = no EMA)")
    need(t.save_every >= 1, "train.save_every", t.save_every, "an integer >= 1")
    need(t.save_every_steps >= 0, "train.save_every_steps", t.save_every_steps, "an integer >= 0 (0 = epoch ends only)")
    need(t.keep_last >= 0, "train.keep_last", t.keep_last, "an integer >= 0")
    stoppable = {s.name for s in signal.Signals} - {"SIGKILL", "SIGSTOP"}
    need(all(name.strip() in stoppable for name in t.stop_signals.split(",") if name.strip()), "train.stop_signals",
         t.stop_signals, "comma-separated signal names such as SIGTERM,SIGUSR1 (not SIGKILL or SIGSTOP), or ''")
    need(t.eval_every >= 0, "train.eval_every", t.eval_every, "an integer >= 0 (0 = only after the last epoch)")
    need(t.log_every >= 1, "train.log_every", t.log_every, "an integer >= 1")
    need(not t.best_metric or t.best_metric.startswith("val_"), "train.best_metric", t.best_metric,
         "a validation metric of metrics.jsonl, val_<name> (val_top1, val_macro_f1, val_loss, ...), or '' (the task's)")
    need(t.early_stop_patience >= 0, "train.early_stop_patience", t.early_stop_patience, "an integer >= 0 (0 = never)")
    need(not t.calibrate or cfg.task == "classification", "train.calibrate", t.calibrate,
         "false unless task: classification (it calibrates an image classifier)")
    plateau = cfg.optim.schedule == "plateau"
    if (t.best_metric or t.early_stop_patience or t.calibrate or plateau) and cfg.task == "classification" \
            and isinstance(d, DataConfig) and not d.val_size:
        key = "train.best_metric" if t.best_metric else "train.early_stop_patience" if t.early_stop_patience \
            else "train.calibrate" if t.calibrate else "optim.schedule"
        section, name = key.split(".")
        raise ConfigError(f"{key}={getattr(getattr(cfg, section), name)!r} reads the validation split, and this run "
                          f"holds out none: set data.val_size=N (e.g. 5000 of CIFAR-10's training images)")
    need(bool(t.output_dir), "train.output_dir", t.output_dir, "a directory path")
    if t.cache_features:
        _check_probe(cfg)
    need(t.probe_l2 is None or (t.cache_features and t.probe_l2 > 0), "train.probe_l2", t.probe_l2,
         "a number > 0 with train.cache_features=true (the linear probe's L2 strength), or null")


def _check_probe(cfg: Config) -> None:
    """``train.cache_features``: a linear probe, one class an image, on a split read whole, without a teacher."""
    d = cfg.data
    if cfg.model.freeze != "backbone":
        raise ConfigError(f"train.cache_features=True fits the head alone on the backbone's features: set "
                          f"model.freeze=backbone (model.freeze={cfg.model.freeze!r} trains more than the head)")
    if isinstance(d, DataConfig) and d.multi_label is True:
        raise ConfigError("train.cache_features=True fits one class an image (a multinomial logistic regression); a "
                          "multi-label run (data.multi_label) trains its head with model.freeze=backbone alone")
    if cfg.distill.type != "none":
        raise ConfigError(f"distill.type={cfg.distill.type!r}: train.cache_features fits the head alone on the "
                          f"backbone's features, without a teacher; leave out distill.*")
    if isinstance(d, DataConfig) and (d.dataset == "wds" or (d.dataset == "hf" and d.streaming)):
        raise ConfigError(f"data.dataset={d.dataset!r}: train.cache_features reads each training image once from a "
                          f"split, not from streamed shards; train the head with model.freeze=backbone alone")


_MODEL_OPTIONS = ["name", "pretrained", "pretrained_file", "grad_checkpointing", "freeze", "lora_r", "lora_alpha",
                  "lora_dropout", "lora_targets"]
_TASK_MODELS = {"classification": ("VisionTransformer",), "seq2seq": ("Seq2SeqTransformer", "RNNSeq2Seq"),
                "lm": ("GPT",)}
_TASK_DEFAULT_MODELS = {"classification": ModelConfig.name, "seq2seq": "transformer_tiny", "lm": "gpt_char_tiny"}
_TASK_DATA = {"classification": DataConfig, "seq2seq": TextDataConfig, "lm": LMDataConfig}


def _task_presets(task: str) -> list[str]:
    return [n for n in list_models() if preset_class(n).__name__ in _TASK_MODELS[task]]


def _build_model_section(raw: dict[str, Any], task: str) -> ModelConfig:
    raw = dict(raw)
    default = _TASK_DEFAULT_MODELS[task]
    name = _coerce("model.name", raw.pop("name", default), str)
    if name.startswith(TIMM_PREFIX):
        return _timm_model_section(name, raw, task)
    presets = _task_presets(task)
    if name not in presets:
        raise ConfigError(f"model.name={name!r} is not a {task} preset{_close(name, presets)} "
                          f"(available: {', '.join(presets)})")
    hints = {k: v for k, v in typing.get_type_hints(preset_class(name).__init__).items()
             if k != "return" and k not in _DERIVED_MODEL_ARGS}
    option_types = typing.get_type_hints(ModelConfig)
    options = {key: _coerce(f"model.{key}", raw.pop(key), option_types[key])
               for key in _MODEL_OPTIONS[1:] if key in raw}
    args = dict(raw.pop("args", {}) or {})
    args.update(raw)
    for key, value in args.items():
        if key not in hints:
            raise ConfigError(f"unknown key model.{key}{_close(key, list(hints) + _MODEL_OPTIONS)} "
                              f"(model keys: {', '.join(_MODEL_OPTIONS)}, {', '.join(hints)})")
        args[key] = _coerce(f"model.{key}", value, hints[key])
    return ModelConfig(name=name, args=args, **options)


def _timm_model_section(name: str, raw: dict[str, Any], task: str) -> ModelConfig:
    """``model.name: timm:<name>``: timm's classifier; its arguments are timm's, checked by timm when the
    model is built (before any data is read), those vitlab sets itself (classes, input size) here."""
    if task != "classification":
        raise ConfigError(f"model.name={name!r}: timm models are image classifiers, and this is a {task} config")
    problem = timm_problem(name.removeprefix(TIMM_PREFIX))
    if problem:
        raise ConfigError(f"model.name={name!r}: {problem}")
    option_types = typing.get_type_hints(ModelConfig)
    options = {key: _coerce(f"model.{key}", raw.pop(key), option_types[key])
               for key in _MODEL_OPTIONS[1:] if key in raw}
    args = dict(raw.pop("args", {}) or {})
    args.update(raw)
    hints = typing.get_type_hints(TimmClassifier.__init__)
    for key in ("num_classes", "img_size", "in_chans"):
        if key in args:
            args[key] = _coerce(f"model.{key}", args[key], hints[key])
    return ModelConfig(name=name, args=args, **options)


def _build_section(name: str, raw: Any, task: str) -> Any:
    cls = _TASK_DATA[task] if name == "data" else _SECTION_TYPES[name]
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"section {name!r} must be a mapping of keys to values, got {raw!r}")
    if cls is ModelConfig:
        return _build_model_section(raw, task)
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in raw.items():
        if key not in hints:
            raise ConfigError(f"unknown key {name}.{key}{_close(key, hints)} (allowed: {', '.join(hints)})")
        values[key] = _coerce(f"{name}.{key}", value, hints[key])
    return cls(**values)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key.sub=value (e.g. train.epochs=5)")
    key, text = item.split("=", 1)
    path = key.strip().split(".")
    if len(path) != 2 or not all(path):
        raise ConfigError(f"override key {key!r} must be section.key (e.g. optim.lr=1e-3)")
    return path, yaml.safe_load(text) if text.strip() else ""


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = (),
                base: dict[str, Any] | None = None, recorded: bool = False) -> Config:
    """Read a YAML config (or ``base``, a dict of the same form), apply overrides, validate.

    An ``optim.lr`` given beside ``optim.lr_base`` is the learning rate, as timm's ``--lr`` beside its
    ``--lr-base``: ``optim.lr_base`` becomes 0. ``recorded``: ``path`` is a config a run wrote
    (``run_config.yaml``), taken as it ran: there (every key written) ``optim.lr_base`` keeps its meaning, and
    only an ``optim.lr`` among ``overrides`` wins over it.

    Raises:
        ConfigError: on a missing file, unknown key, wrong type or invalid value.
    """
    raw: dict[str, Any] = {}
    if base is not None:
        raw = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            folder = path.parent if path.parent.is_dir() else Path("configs")
            shipped = sorted(str(p) for p in folder.glob("*.yaml")) if folder.is_dir() else []
            raise ConfigError(f"config file {str(path)!r} does not exist"
                              + (f"; the configs in {folder}: {', '.join(shipped)}" if shipped else ""))
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}".splitlines()[0]) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(path)!r} must be a mapping of sections, got {type(raw).__name__}")
    lr_given = not recorded and isinstance(raw.get("optim"), dict) and "lr" in raw["optim"]
    for item in overrides:
        if item.startswith("task="):
            raw["task"] = item.split("=", 1)[1]
            continue
        (section, key), value = _parse_override(item)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raw[section] = {}
        raw[section][key] = value
    for section in raw:
        if section not in (*_SECTIONS, "task"):
            raise ConfigError(f"unknown section {section!r}{_close(section, _SECTIONS)} "
                              f"(sections: task, {', '.join(_SECTIONS)})")
    task = _coerce("task", raw.get("task", "classification"), typing.get_type_hints(Config)["task"])
    cfg = Config(task=task, **{name: _build_section(name, raw.get(name), task) for name in _SECTIONS})
    if lr_given or "optim.lr" in {item.split("=", 1)[0].strip() for item in overrides}:
        cfg.optim.lr_base = 0.0
    _check_values(cfg)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain YAML-able data; the model section in its YAML form (name + arguments)."""
    out: dict[str, Any] = {"task": cfg.task}
    out.update({name: dataclasses.asdict(getattr(cfg, name)) for name in _SECTIONS})
    m = cfg.model
    out["model"] = {"name": m.name, **{k: getattr(m, k) for k in _MODEL_OPTIONS[1:] if getattr(m, k)}, **m.args}
    if cfg.optim.lr_base:  # optim.lr would win over it when the file is read again
        del out["optim"]["lr"]
    for section in out.values():
        if not isinstance(section, dict):
            continue
        for key, value in section.items():
            if isinstance(value, tuple):
                section[key] = list(value)
    return out


def config_to_flat(cfg: Config) -> dict[str, Any]:
    """The config as ``{"section.key": value}``, values that are not numbers, strings or booleans as strings:
    what trackers log as hyperparameters and what a resume compares."""
    flat: dict[str, Any] = {}
    for section, values in config_to_dict(cfg).items():
        for key, value in (values.items() if isinstance(values, dict) else [("", values)]):
            name = f"{section}.{key}" if key else section
            flat[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
