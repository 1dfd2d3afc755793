"""The schema of a run's configuration: its sections as typed dataclasses, ``model``, ``data`` (images, text pairs or
a language model's text, by the task), ``optim``, ``train``, ``generate``, ``distill``, and the sections of one task
alone (``mae``, ``dino``, ``monitor``). What each key means is said beside it; what values it takes,
:mod:`vitlab.config.rules` and each task's own checks (:mod:`vitlab.tasks.registry`). It imports nothing of vitlab:
every room may read it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


__all__ = ["ModelConfig", "DataConfig", "TextDataConfig", "LMDataConfig", "GenerateConfig", "OptimConfig",
           "TrainConfig", "DistillConfig", "MAEConfig", "DINOConfig", "MonitorConfig", "Config"]


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
    # Where a self-supervised run's views are made: loader, each image by torchvision's transforms in the
    # DataLoader; device, a batch at a time where the model is (vitlab.data.batch_views: torchvision's random
    # resized crops, flips and DINO's colour transforms, each image's drawn from its own generator seeded by the run,
    # the epoch and the image). device: task: mae or dino; streamed images (folders not held in memory, shards) are
    # decoded by the loader's workers at data.decode_size, else the model's input size, and cropped from that.
    views: Literal["loader", "device"] = "loader"
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
    # An image file whose header gives more pixels (width x height) than this is refused before it is decoded,
    # in one line naming it (a small PNG of one colour can decode to gigabytes); 0 = no limit but PIL's own.
    max_image_pixels: int = 0
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
    # The run's length set by the time it may take, in minutes from the start of training (0 = off: train.epochs).
    # A few optimizer steps and one evaluation are timed on the run's own data before the first epoch (and undone),
    # then the run trains the most epochs, up to train.epochs, whose projected time fits; its checkpoints keep the
    # number, so a resumed run keeps its length (vitlab.training.budget).
    budget_minutes: float = 0.0
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
    curves: bool = True       # draw curves.png (loss, metrics, learning rate) when the run finishes (matplotlib)
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
class MAEConfig:
    """``task: mae``, the masked autoencoder (He et al. 2022; :class:`vitlab.models.MaskedAutoencoder`): what its
    training hides and scores. The encoder and decoder are the model's (``model.decoder_embed_dim``, ...)."""

    mask_ratio: float = 0.75          # the share of each image's patches hidden from the encoder, in (0, 1)
    norm_pix_loss: bool = True        # the loss of each patch's pixels normalized within the patch (MAE's)
    pictures: int = 8                 # images in the run's reconstructions.png (original, masked, filled in); 0: none


@dataclass
class DINOConfig:
    """``task: dino``, self-distillation (Caron et al. 2021; :class:`vitlab.models.DINO`): the views of each
    image and the teacher's schedules. The head is the model's (``model.out_dim``, ...)."""

    global_crops: int = 2                                   # large views, at the model's input size
    global_crops_scale: tuple[float, float] = (0.4, 1.0)    # their share of the image's area (DINO's)
    local_crops: int = 6                                    # small views (DINO: 10 at ImageNet's size)
    local_crops_scale: tuple[float, float] = (0.05, 0.4)
    local_size: int = 0                                     # the small views' side in px, whole patches; 0: ~3/7 of the input's
    blur: bool = True                 # DINO's Gaussian blur of the views; false for tiny images (SimCLR's CIFAR views)
    momentum_teacher: float = 0.996   # the teacher's momentum at the first step; to 1 on a half cosine
    teacher_temp: float = 0.04        # the teacher's sharpening temperature after its warmup (DINO: 0.04-0.07)
    warmup_teacher_temp: float = 0.04
    warmup_teacher_temp_epochs: int = 0
    student_temp: float = 0.1
    center_momentum: float = 0.9


@dataclass
class MonitorConfig:
    """A k-NN monitor of self-supervised training (``task: mae``, ``task: dino``): each evaluated epoch, the top-1 of
    the vote of the ``k`` nearest labelled images by the backbone's pooled features (DINO's protocol). The labels
    are read from this data set alone (its class folders, csv or Hugging Face labels), never from the data the
    run trains on. ``root`` '' is no monitor."""

    dataset: Literal["imagefolder", "csv", "hf", "cifar10"] = "imagefolder"
    root: str = ""
    train_split: str = "train"        # the bank of labelled images
    test_split: str = "test"          # the queries, reported only (``test_knn_top1``)
    val_size: int = 0                 # > 0: queries held out of the bank, stratified (``val_knn_top1``: picks best/)
    k: int = 20
    train_subset: int = 0             # the bank's images, balanced; 0: all
    test_subset: int = 0


@dataclass
class Config:
    """A run: ``task`` picks image classification (a ViT), sequence-to-sequence (a text Transformer), a language
    model, or pretraining a ViT backbone without labels (``mae``, ``dino``)."""

    task: str = "classification"      # a task of vitlab.tasks.registry.TASKS
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig | TextDataConfig | LMDataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    mae: MAEConfig = field(default_factory=MAEConfig)
    dino: DINOConfig = field(default_factory=DINOConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
