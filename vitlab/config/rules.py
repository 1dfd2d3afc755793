"""The rules of a run's configuration, checked before anything runs, each key's in the section that owns it:
:func:`check_values` calls each section's check (distillation, data by the task's kind, generation, the optimizer,
the model, training) and the rules between sections. A broken rule is one :class:`~vitlab.errors.ConfigError`
line naming the key, its value and what it may be. What a way of reading data takes (shards, the device-resident
loader) is stated once where it is also used (:mod:`vitlab.data.rules`); the rules of one task alone (multi-label
data, a self-supervised run's sections) are its own, checked after these (its entry in
:mod:`vitlab.tasks.registry`)."""
from __future__ import annotations

import importlib.util
import signal
from typing import Any

from ..data.rules import SHARDS, device_loader_problems, streamed_in_shards
from ..data.transforms import AUGMENTS, timm_augment_problem
from ..errors import ConfigError, close_matches, need
from ..models.freeze import check_freeze
from ..schema import Config, DataConfig, LMDataConfig
from ..tasks.registry import get_task

__all__ = ["check_values"]


def check_values(cfg: Config) -> None:
    """Every rule of ``cfg``, section by section, then those between sections."""
    _check_distill(cfg)
    if isinstance(cfg.data, DataConfig):
        _check_image_data(cfg.data)
        need(cfg.data.views == "loader" or get_task(cfg.task).device_views, "data.views", cfg.data.views,
             f"loader with task: {cfg.task} (its views are made in the loader; device: task: mae)")
    elif isinstance(cfg.data, LMDataConfig):
        _check_lm_data(cfg.data)
    else:
        _check_text_data(cfg.data)
    _check_generate(cfg)
    _check_losses(cfg)
    _check_optim(cfg)
    _check_model(cfg)
    _check_train(cfg)


def _check_distill(cfg: Config) -> None:
    k = cfg.distill
    if k.type == "none":
        return
    need(cfg.task == "classification", "distill.type", k.type, "'none' unless task: classification")
    if not k.teacher:
        raise ConfigError(f"distill.type={k.type} needs distill.teacher: timm:<name>, or a vitlab run, checkpoint "
                          f"or save_pretrained directory")
    need(0 <= k.alpha <= 1, "distill.alpha", k.alpha, "a number in [0, 1]")
    need(k.tau > 0, "distill.tau", k.tau, "a number > 0")


def _check_image_data(d: DataConfig) -> None:
    for key in ("train_subset", "test_subset", "val_size", "crop_padding", "num_workers", "decode_size",
                "partitions"):
        need(getattr(d, key) >= 0, f"data.{key}", getattr(d, key), "an integer >= 0")
    need(0 <= d.randaugment_magnitude <= 30, "data.randaugment_magnitude", d.randaugment_magnitude, "0..30")
    need(d.randaugment_ops >= 1, "data.randaugment_ops", d.randaugment_ops, "an integer >= 1")
    need(d.test_size >= 0, "data.test_size", d.test_size, "a share in (0, 1), a count >= 1, or 0 (read "
         "data.test_split)")
    need(d.test_size == 0 or d.test_size < 1 or d.test_size == int(d.test_size), "data.test_size", d.test_size,
         "a share in (0, 1) or a whole count")
    need(d.test_size == 0 or not streamed_in_shards(d), "data.test_size", d.test_size,
         f"0 with {SHARDS}: hold out shards as a test split instead (vitlab shards --split)")
    for key in ("mean", "std"):
        values = getattr(d, key)
        if values is not None and max(values) > 1:
            raise ConfigError(f"data.{key}={list(values)} is on the 0-255 scale; vitlab's (timm's) are on the 0-1 "
                              f"scale: data.{key}={[round(v / 255, 6) for v in values]}")
    need(d.mean is None or min(d.mean) >= 0, "data.mean", list(d.mean or ()), "three numbers in [0, 1]")
    need(d.std is None or min(d.std) > 0, "data.std", d.std, "three numbers in (0, 1]")
    need(d.aug_repeats >= 1, "data.aug_repeats", d.aug_repeats, "an integer >= 1 (1 = off; DeiT: 3)")
    need(d.aug_repeats == 1 or not streamed_in_shards(d), "data.aug_repeats", d.aug_repeats,
         f"1 with {SHARDS}: a stream reads each sample once; repeated augmentation needs images read by index "
         f"(imagefolder, hf)")
    need(0 <= d.color_jitter <= 1, "data.color_jitter", d.color_jitter, "a number in [0, 1] (0 = off)")
    problem = timm_augment_problem(d.augment) if d.augment not in AUGMENTS else None
    need(problem is None, "data.augment", d.augment, f"one of {', '.join(AUGMENTS)}, or a timm spec "
         f"(rand-m9-mstd0.5-inc1, augmix-m5-w3, original, 3a); {problem}")
    for key in ("mixup_alpha", "cutmix_alpha"):
        need(getattr(d, key) >= 0, f"data.{key}", getattr(d, key), "a number >= 0 (0 = off)")
    need(0 < d.scale[0] <= d.scale[1] <= 1, "data.scale", list(d.scale), "[min, max] with 0 < min <= max <= 1")
    need(0 < d.ratio[0] <= d.ratio[1], "data.ratio", list(d.ratio), "[min, max] with 0 < min <= max")
    need(0 < d.crop_pct <= 1, "data.crop_pct", d.crop_pct, "a number in (0, 1]")
    need(0 <= d.reprob <= 1, "data.reprob", d.reprob, "a probability in [0, 1]")
    need(d.reprob == 0 or d.train_crop != "pad", "data.reprob", d.reprob,
         "0 with data.train_crop=pad (random erasing comes with the ImageNet-style transforms, train_crop=rrc)")
    need(d.dataset != "wds" or d.in_memory is not True, "data.in_memory", d.in_memory,
         "auto or false with data.dataset=wds (shards are streamed; data.dataset=imagefolder or hf keeps images "
         "in memory)")
    need(d.shuffle_buffer >= 1, "data.shuffle_buffer", d.shuffle_buffer, "a number of samples >= 1")
    need(d.max_image_pixels >= 0, "data.max_image_pixels", d.max_image_pixels, "a number of pixels (width x height), "
         "or 0 for no limit")
    need(d.max_image_pixels == 0 or not streamed_in_shards(d), "data.max_image_pixels", d.max_image_pixels,
         "0 with shards (data.dataset=wds, a streamed hf split): their images are read as they stream, without a "
         "header check")
    need(d.sampler == "uniform" or not streamed_in_shards(d), "data.sampler", d.sampler,
         f"uniform with {SHARDS}: a stream reads each sample once")
    need(d.sampler == "uniform" or d.aug_repeats == 1, "data.sampler", d.sampler,
         "uniform with data.aug_repeats > 1 (each orders the epoch its own way)")
    need(not d.streaming or d.dataset == "hf", "data.streaming", d.streaming,
         "false unless data.dataset=hf (a Hub id or a folder of parquet files read with streaming=True)")
    need(not d.streaming or d.in_memory is not True, "data.streaming", d.streaming,
         "false with data.in_memory=true or data.loader=gpu (a streamed data set is read by DataLoader workers)")
    if d.loader == "gpu":
        for key, value, allowed in device_loader_problems(d.augment, d.train_crop, d.color_jitter, d.aug_repeats,
                                                          d.dataset, d.streaming, d.in_memory):
            need(False, key, value, allowed)


def _check_lm_data(d: LMDataConfig) -> None:
    need(bool(d.root), "data.root", d.root, "a UTF-8 text file or a folder of .txt files" if d.dataset == "text"
         else "the folder that holds (or is to hold) tinyshakespeare/input.txt, e.g. ./data")
    need(0 < d.val_fraction < 1, "data.val_fraction", d.val_fraction, "a number in (0, 1)")
    need(d.block_size >= 1, "data.block_size", d.block_size, "an integer >= 1")
    need(d.vocab_size >= 257 or d.tokenizer == "char", "data.vocab_size", d.vocab_size,
         "at least 257 for a byte-level BPE")
    for key in ("steps_per_epoch", "eval_batches"):
        need(getattr(d, key) >= 0, f"data.{key}", getattr(d, key), "an integer >= 0")


def _check_text_data(d: Any) -> None:
    need(d.vocab_size >= (4 if d.dataset != "parallel" else 64), "data.vocab_size", d.vocab_size,
         "at least 4 (synthetic) or 64 (BPE)")
    need(1 <= d.min_len <= d.max_len, "data.min_len", d.min_len, f"1 <= min_len <= data.max_len={d.max_len}")
    for key in ("num_train", "num_test", "max_tokens"):
        need(getattr(d, key) >= 1, f"data.{key}", getattr(d, key), "an integer >= 1")
    for key in ("batch_tokens", "num_workers"):
        need(getattr(d, key) >= 0, f"data.{key}", getattr(d, key), "an integer >= 0")
    need(d.dataset != "parallel" or bool(d.root), "data.root", d.root,
         "the folder of the parallel text files (data.dataset=parallel)")


def _check_generate(cfg: Config) -> None:
    g = cfg.generate
    need(g.beam_size >= 1, "generate.beam_size", g.beam_size, "an integer >= 1")
    need(g.max_new_tokens >= 0, "generate.max_new_tokens", g.max_new_tokens, "an integer >= 0 (0 = source + 50)")
    need(g.eval_subset >= 0, "generate.eval_subset", g.eval_subset, "an integer >= 0 (0 = all)")


def _check_losses(cfg: Config) -> None:
    """The training loss and how it weighs the classes, against the data: shards list no class counts, and
    multi-label data (``data.multi_label=true``) trains the binary cross-entropy."""
    d, t = cfg.data, cfg.train
    shards = isinstance(d, DataConfig) and streamed_in_shards(d)
    need(cfg.optim.lr > 0, "optim.lr", cfg.optim.lr, "a number > 0")
    need(t.loss == "ce" or cfg.task == "classification", "train.loss", t.loss, "'ce' unless task: classification")
    need(t.bce_target_thresh is None or 0 <= t.bce_target_thresh < 1, "train.bce_target_thresh", t.bce_target_thresh,
         "null or a number in [0, 1)")
    need(t.logit_adjust_tau >= 0, "train.logit_adjust_tau", t.logit_adjust_tau, "a number >= 0 (1: Menon et al.'s)")
    need(t.class_weights == "none" or t.loss == "ce", "train.class_weights", t.class_weights,
         "'none' with train.loss=bce or logit_adjusted (each weighs the classes its own way)")
    need(t.class_weights == "none" or not shards, "train.class_weights", t.class_weights, f"'none' with {SHARDS}: "
         f"the weights need the count of each class before training, which a stream does not list")
    need(0 < t.class_weights_beta < 1, "train.class_weights_beta", t.class_weights_beta, "a number in (0, 1)")
    need(not isinstance(t.pos_weight, list) or all(w > 0 for w in t.pos_weight), "train.pos_weight", t.pos_weight,
         "none, balanced, or a positive number a class")
    need(t.loss != "logit_adjusted" or not shards, "train.loss", t.loss, f"'ce' or 'bce' with {SHARDS}: the "
         f"logit-adjusted loss needs the count of each class before training, which a stream does not list")


def _check_optimizer(name: str) -> None:
    """``optim.opt`` is one of timm's optimizers (``lookahead_`` before any), or one line with the close names."""
    from timm.optim import get_optimizer_info, list_optimizers

    try:
        get_optimizer_info(name.lower().removeprefix("lookahead_"))
    except ValueError:
        known = list_optimizers()
        hint = close_matches(name.lower(), known) or f" ({len(known)}: timm.optim.list_optimizers())"
        raise ConfigError(f"optim.opt={name!r} is not one of timm's optimizers{hint}") from None


def _check_optim(cfg: Config) -> None:
    o, t = cfg.optim, cfg.train
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


def _check_model(cfg: Config) -> None:
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


def _check_train(cfg: Config) -> None:
    t = cfg.train
    for key in ("epochs", "batch_size", "grad_accum_steps"):
        need(getattr(t, key) >= 1, f"train.{key}", getattr(t, key), "an integer >= 1")
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
    need(t.budget_minutes >= 0, "train.budget_minutes", t.budget_minutes, "a number of minutes >= 0 (0 = off)")
    need(not (t.budget_minutes and t.cache_features), "train.budget_minutes", t.budget_minutes,
         "0 with train.cache_features=true (the linear probe is one fit, not epochs)")
    need(t.eval_every >= 0, "train.eval_every", t.eval_every, "an integer >= 0 (0 = only after the last epoch)")
    need(t.log_every >= 1, "train.log_every", t.log_every, "an integer >= 1")
    need(not t.best_metric or t.best_metric.startswith("val_"), "train.best_metric", t.best_metric,
         "a validation metric of metrics.jsonl, val_<name> (val_top1, val_macro_f1, val_loss, ...), or '' (the task's)")
    need(t.early_stop_patience >= 0, "train.early_stop_patience", t.early_stop_patience, "an integer >= 0 (0 = never)")
    need(not t.calibrate or cfg.task == "classification", "train.calibrate", t.calibrate,
         "false unless task: classification (it calibrates an image classifier)")
    _check_validation(cfg)
    need(bool(t.output_dir), "train.output_dir", t.output_dir, "a directory path")
    if t.cache_features:
        _check_probe(cfg)
    need(t.probe_l2 is None or (t.cache_features and t.probe_l2 > 0), "train.probe_l2", t.probe_l2,
         "a number > 0 with train.cache_features=true (the linear probe's L2 strength), or null")


def _check_validation(cfg: Config) -> None:
    """What reads the validation split (the best metric, early stopping, calibration, a plateau schedule) needs
    one, as the run's task holds it out (its entry's ``validation``: ``data.val_size`` of an image classifier,
    ``monitor.val_size`` of a self-supervised run, its k-NN monitor's queries)."""
    t = cfg.train
    plateau = cfg.optim.schedule == "plateau"
    if not (t.best_metric or t.early_stop_patience or t.calibrate or plateau):
        return
    key = "train.best_metric" if t.best_metric else "train.early_stop_patience" if t.early_stop_patience \
        else "train.calibrate" if t.calibrate else "optim.schedule"
    section, name = key.split(".")
    said = f"{key}={getattr(getattr(cfg, section), name)!r} reads the validation split, and this run holds out none"
    validation = get_task(cfg.task).validation
    fix = validation(cfg) if validation is not None else ""
    if fix:
        raise ConfigError(f"{said}: {fix}")


def _check_probe(cfg: Config) -> None:
    """``train.cache_features``: a linear probe, one class an image, on a split read whole, without a teacher."""
    d = cfg.data
    if cfg.model.freeze != "backbone":
        raise ConfigError(f"train.cache_features=True fits the head alone on the backbone's features: set "
                          f"model.freeze=backbone (model.freeze={cfg.model.freeze!r} trains more than the head)")
    if cfg.distill.type != "none":
        raise ConfigError(f"distill.type={cfg.distill.type!r}: train.cache_features fits the head alone on the "
                          f"backbone's features, without a teacher; leave out distill.*")
    if isinstance(d, DataConfig) and streamed_in_shards(d):
        raise ConfigError(f"data.dataset={d.dataset!r}: train.cache_features reads each training image once from a "
                          f"split, not from streamed shards; train the head with model.freeze=backbone alone")
