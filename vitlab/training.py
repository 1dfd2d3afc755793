"""The training loop on Hugging Face Accelerate: config -> data -> model -> loop -> checkpoints.

One straight line, the same on one CPU, one GPU or several processes (``accelerate launch``).
``train.batch_size`` is global: Accelerate splits each batch across processes
(``split_batches=True``), and gradient accumulation splits it further in time.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration, PartialState
from accelerate.utils import set_seed
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.utils import ModelEmaV3
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from .config import Config, config_to_dict, load_config, save_config
from .data import CIFAR10_MEAN, CIFAR10_STD, ImageData, TensorImageDataset, balanced_indices, eval_transform, \
    load_split, train_transform
from .errors import ConfigError, TrainingError
from .evaluation import evaluate
from .registry import create_model
from .vit import VisionTransformer

__all__ = ["train", "build_model", "param_groups", "warmup_cosine", "plot_curves"]


def build_model(cfg: Config) -> VisionTransformer:
    """The model of ``cfg.model``; invalid arguments raise :class:`ConfigError` naming the key."""
    try:
        return create_model(cfg.model.name, **cfg.model.args)
    except ValueError as e:
        raise ConfigError(f"model ({cfg.model.name} with {cfg.model.args or 'no overrides'}): {e}") from None


def param_groups(model: VisionTransformer, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on norms, biases, the CLS token and positional embeddings."""
    skip = model.no_weight_decay()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup from ~0 to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _split_data(cfg: Config, size: tuple[int, int]) -> tuple[ImageData, ImageData | None, ImageData]:
    """Decode train (minus a held-out validation set, if ``data.val_size``) and test, subsets applied."""
    d, seed = cfg.data, cfg.train.seed
    # Only the images used are decoded: the training subset plus the validation images.
    wanted = d.train_subset + d.val_size if d.train_subset else 0
    train = load_split(d.dataset, d.root, "train", download=d.download, subset=wanted, seed=seed, size=size)
    val = None
    if d.val_size > 0:
        if d.val_size >= len(train.labels):
            raise ConfigError(f"data.val_size={d.val_size} leaves no training images (the training set has "
                              f"{len(train.labels)})")
        val_index = balanced_indices(train.labels, d.val_size, seed=seed + 1)
        keep = torch.ones(len(train.labels), dtype=torch.bool)
        keep[val_index] = False
        val, train = train.subset(val_index), train.subset(keep.nonzero().flatten())
    test = load_split(d.dataset, d.root, "test", download=d.download, subset=d.test_subset, seed=seed, size=size)
    if test.classes != train.classes:
        raise ConfigError(f"data.root={d.root!r}: the test classes {test.classes} differ from the train classes "
                          f"{train.classes}")
    return train, val, test


def _check_run_dir(run_dir: Path, resume: bool) -> None:
    has_run = (run_dir / "checkpoints").exists() or (run_dir / "metrics.jsonl").exists()
    if has_run and not resume:
        raise ConfigError(f"train.output_dir={str(run_dir)!r} already holds a run; continue it with "
                          f"--resume {run_dir}, or choose another train.output_dir")


def _save_checkpoint(accelerator: Accelerator, run_dir: Path, name: str, cfg: Config, model: nn.Module,
                     ema: ModelEmaV3 | None, optimizer: Any, state: dict[str, Any], classes: list[str]) -> None:
    """Write checkpoints/<name>/ atomically: into a temporary directory, then swapped in."""
    final = run_dir / "checkpoints" / name
    tmp = final.with_name(f".{name}.tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    ckpt.save_rng(tmp, accelerator.process_index)
    if accelerator.is_main_process:
        ckpt.save_model(accelerator.unwrap_model(model), tmp, cfg.model.name, classes, CIFAR10_MEAN, CIFAR10_STD,
                        ema=ema.module if ema is not None else None)
        ckpt.save_optimizer(optimizer, tmp)
        ckpt.write_json(tmp / "trainer_state.json", state)
        save_config(cfg, tmp / "run_config.yaml")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        ckpt.replace_dir(tmp, final)
    accelerator.wait_for_everyone()


def train(cfg: Config, resume: str | Path | None = None, stop_after_epoch: int | None = None) -> dict[str, Any]:
    """Train ``cfg``; with ``resume`` (a run directory) continue from its last checkpoint.

    ``stop_after_epoch`` ends the run early after that epoch's checkpoint, as an interruption would
    (the schedule still spans ``train.epochs``); tests use it to check that resuming is exact.
    Returns a summary: best and final metrics, epochs, wall time.
    """
    start_time = time.time()
    run_dir = Path(resume) if resume is not None else Path(cfg.train.output_dir)
    # Everything that can be wrong with the input is checked before data is loaded.
    resume_from = ckpt.resolve_checkpoint(run_dir, "last") if resume is not None else None
    _check_run_dir(run_dir, resume is not None)
    t = cfg.train
    set_seed(t.seed)  # the initial weights depend on train.seed only
    model = build_model(cfg)
    # Several processes on a machine without GPUs: Accelerate's gloo (multi-CPU) path needs cpu=True,
    # otherwise each process would silently train alone.
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    accelerator = Accelerator(
        cpu=launched and not torch.cuda.is_available(), mixed_precision=t.mixed_precision, gradient_accumulation_steps=t.grad_accum_steps,
        log_with="tensorboard", project_dir=str(run_dir),
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True, data_seed=t.seed),
    )
    micro_batch = t.batch_size // t.grad_accum_steps
    if micro_batch % accelerator.num_processes:
        raise ConfigError(f"train.batch_size={t.batch_size} / train.grad_accum_steps={t.grad_accum_steps} = "
                          f"{micro_batch} is not divisible by the {accelerator.num_processes} processes")
    mixing = cfg.data.mixup_alpha > 0 or cfg.data.cutmix_alpha > 0
    if mixing and (micro_batch // accelerator.num_processes) % 2:
        raise ConfigError(f"mixup/cutmix need an even per-process batch; train.batch_size={t.batch_size} gives "
                          f"{micro_batch // accelerator.num_processes}")

    size = model.patch_embed.img_size
    train_data, val_data, test_data = _split_data(cfg, size)
    num_classes = len(train_data.classes)
    if model.num_classes != num_classes:
        raise ConfigError(f"model.num_classes={model.num_classes} but the data has {num_classes} classes "
                          f"{train_data.classes}; set model.num_classes={num_classes}")
    d = cfg.data
    train_set = TensorImageDataset(train_data, train_transform(size, d.crop_padding, d.hflip, d.augment,
                                                               d.randaugment_ops, d.randaugment_magnitude))
    # Workers are not persistent: fresh ones each epoch are seeded from the (checkpointed) main RNG,
    # which keeps a resumed run exactly equal to an uninterrupted one.
    loader_args = dict(num_workers=d.num_workers, pin_memory=torch.cuda.is_available())
    train_loader = DataLoader(train_set, batch_size=micro_batch, shuffle=True, drop_last=True, **loader_args)
    eval_sets = {"test": test_data} if val_data is None else {"val": val_data, "test": test_data}
    eval_loaders = {name: DataLoader(TensorImageDataset(data, eval_transform()), batch_size=micro_batch,
                                     shuffle=False, **loader_args) for name, data in eval_sets.items()}
    if len(train_loader) == 0:
        raise ConfigError(f"train.batch_size={t.batch_size} is larger than the {len(train_set)} training images")

    optimizer = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                  betas=cfg.optim.betas, fused=torch.cuda.is_available() or None)
    model, optimizer, train_loader, *prepared = accelerator.prepare(model, optimizer, train_loader,
                                                                    *eval_loaders.values())
    eval_loaders = dict(zip(eval_loaders, prepared))
    steps_per_epoch = len(train_loader) // t.grad_accum_steps
    total_steps = steps_per_epoch * t.epochs
    warmup_steps = max(1, round(cfg.optim.warmup_epochs * steps_per_epoch))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda s: warmup_cosine(
        s, warmup_steps, total_steps, cfg.optim.min_lr / cfg.optim.lr))
    ema = ModelEmaV3(accelerator.unwrap_model(model), decay=t.ema_decay) if t.ema_decay > 0 else None
    mixup = Mixup(mixup_alpha=d.mixup_alpha, cutmix_alpha=d.cutmix_alpha, label_smoothing=t.label_smoothing,
                  num_classes=num_classes) if mixing else None
    criterion = SoftTargetCrossEntropy() if mixing else nn.CrossEntropyLoss(label_smoothing=t.label_smoothing)

    state = {"epoch": 0, "global_step": 0, "best_metric": -1.0, "best_epoch": 0}
    if resume_from is not None:
        saved = ckpt.read_json(resume_from / "trainer_state.json")
        accelerator.unwrap_model(model).load_state_dict(ckpt.load_tensors(resume_from / "model.safetensors"))
        if ema is not None:
            ema.module.load_state_dict(ckpt.load_tensors(resume_from / "ema.safetensors"))
        ckpt.load_optimizer(optimizer.optimizer, resume_from)
        scheduler.load_state_dict(saved.pop("scheduler"))
        state.update(saved)
        ckpt.load_rng(resume_from, accelerator.process_index)
    run_dir.mkdir(parents=True, exist_ok=True)
    if accelerator.is_main_process:
        save_config(cfg, run_dir / "config.yaml")
    accelerator.init_trackers("tensorboard", config=_flat_hparams(cfg))
    metrics_file = run_dir / "metrics.jsonl"

    def log(record: dict[str, Any]) -> None:
        accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"},
                        step=record["step"])
        if accelerator.is_main_process:
            with metrics_file.open("a") as f:
                f.write(json.dumps(record) + "\n")

    n_params = sum(p.numel() for p in model.parameters())
    accelerator.print(f"model {cfg.model.name}: {n_params / 1e6:.2f}M params | train {len(train_set)} images, "
                      f"{steps_per_epoch} steps/epoch x {t.epochs} epochs | {accelerator.num_processes} process(es) "
                      f"on {accelerator.device} | mixed precision {t.mixed_precision} | run dir {run_dir}")
    model.train()
    summary: dict[str, Any] = {}
    for epoch in range(state["epoch"] + 1, t.epochs + 1):
        train_loader.set_epoch(epoch)
        epoch_start = time.time()
        running, seen = torch.zeros((), device=accelerator.device), 0
        bar = tqdm(train_loader, desc=f"epoch {epoch}/{t.epochs}", disable=None if accelerator.is_main_process else True,  # None: off when not a TTY
                   leave=False, dynamic_ncols=True)
        for images, labels in bar:
            if mixup is not None:
                images, labels = mixup(images, labels)
            with accelerator.accumulate(model):
                loss = criterion(model(images), labels)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.optim.grad_clip > 0:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            running += loss.detach()
            seen += 1
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            state["global_step"] += 1
            if ema is not None:
                ema.update(accelerator.unwrap_model(model), step=state["global_step"])
            if state["global_step"] % t.log_every == 0:
                mean_loss = _checked_mean(accelerator, running / seen, epoch, state["global_step"])
                running.zero_()
                seen = 0
                lr = scheduler.get_last_lr()[0]
                bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}")
                log({"split": "train", "epoch": epoch, "step": state["global_step"], "loss": mean_loss, "lr": lr})
        if seen:
            _checked_mean(accelerator, running / seen, epoch, state["global_step"])
        epoch_time = time.time() - epoch_start
        record: dict[str, Any] = {"split": "eval", "epoch": epoch, "step": state["global_step"],
                                  "epoch_time": epoch_time, "images_per_s": len(train_set) / epoch_time,
                                  "lr": scheduler.get_last_lr()[0]}
        is_best = False
        if epoch % t.eval_every == 0 or epoch == t.epochs:
            for name, loader in eval_loaders.items():
                for prefix, net in [("", model)] + ([("ema_", ema.module)] if ema is not None else []):
                    m = evaluate(net, loader, accelerator, num_classes)
                    record.update({f"{prefix}{name}_top1": m["top1"], f"{prefix}{name}_top5": m["top5"],
                                   f"{prefix}{name}_loss": m["loss"]})
            select = ("ema_" if ema is not None else "") + ("val" if val_data is not None else "test") + "_top1"
            if record[select] > state["best_metric"]:
                state.update(best_metric=record[select], best_epoch=epoch)
                is_best = True
            accelerator.print(f"epoch {epoch}: " + ", ".join(
                f"{k} {v:.4f}" for k, v in record.items() if k.endswith(("top1", "loss"))) +
                f" | {epoch_time:.1f}s ({record['images_per_s']:.0f} img/s)")
        log(record)
        summary = record
        state["epoch"] = epoch
        checkpoint_state = {**state, "scheduler": scheduler.state_dict()}
        if is_best:
            _save_checkpoint(accelerator, run_dir, "best", cfg, model, ema, optimizer.optimizer, checkpoint_state,
                             train_data.classes)
        if epoch % t.save_every == 0 or epoch == t.epochs or epoch == stop_after_epoch:
            _save_checkpoint(accelerator, run_dir, "last", cfg, model, ema, optimizer.optimizer, checkpoint_state,
                             train_data.classes)
        if epoch == stop_after_epoch:
            break
    accelerator.end_training()
    if accelerator.is_main_process and state["epoch"] == t.epochs:
        plot_curves(metrics_file, run_dir / "curves.png")
    return {**summary, "best_metric": state["best_metric"], "best_epoch": state["best_epoch"],
            "epochs_done": state["epoch"], "wall_time": time.time() - start_time, "run_dir": str(run_dir)}


def _checked_mean(accelerator: Accelerator, local_mean: torch.Tensor, epoch: int, step: int) -> float:
    """The loss averaged over processes; stop (on every process alike) if it is not finite."""
    value = accelerator.reduce(local_mean.detach().float(), reduction="mean").item()
    if not math.isfinite(value):
        raise TrainingError(f"the training loss became {value} at epoch {epoch}, step {step}; training stopped "
                            f"and the checkpoints on disk were left as they were. Lower optim.lr, keep "
                            f"optim.grad_clip > 0, or use train.mixed_precision=bf16 instead of fp16")
    return value


def _flat_hparams(cfg: Config) -> dict[str, Any]:
    flat = {}
    for section, values in config_to_dict(cfg).items():
        for key, value in values.items():
            flat[f"{section}.{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def plot_curves(metrics_file: Path, path: Path) -> None:
    """Training curves from ``metrics.jsonl``: loss, accuracy and learning rate against epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    evals = [r for r in records if r["split"] == "eval"]
    trains = [r for r in records if r["split"] == "train"]
    steps_per_epoch = max(1, evals[0]["step"]) if evals else 1
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot([r["step"] / steps_per_epoch for r in trains], [r["loss"] for r in trains], label="train")
    for key in sorted({k for r in evals for k in r if k.endswith("_loss")}):
        axes[0].plot([r["epoch"] for r in evals if key in r], [r[key] for r in evals if key in r], "o-", label=key)
    for key in sorted({k for r in evals for k in r if k.endswith("_top1")}):
        axes[1].plot([r["epoch"] for r in evals if key in r], [r[key] for r in evals if key in r], "o-", label=key)
    axes[2].plot([r["step"] / steps_per_epoch for r in trains], [r["lr"] for r in trains])
    for ax, title in zip(axes, ("loss", "top-1 accuracy", "learning rate")):
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0].legend()
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """``train.py`` / ``vitlab train``: ``--config FILE [--resume RUN_DIR] [key.sub=value ...]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="train.py", description="Train a ViT on CIFAR-10 with Accelerate.")
    parser.add_argument("--config", help="YAML config (optional with --resume: the run's own config is used)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="e.g. train.epochs=5 optim.lr=1e-3")
    args = parser.parse_args(argv)
    from .cli import run_command

    def run() -> None:
        if args.config is None and args.resume is None:
            raise ConfigError("pass --config configs/<name>.yaml (or --resume <run dir>)")
        if args.resume is not None and args.config is None:
            base_file = Path(args.resume) / "config.yaml"
            if not base_file.is_file():
                raise ConfigError(f"--resume {args.resume}: no config.yaml there; pass --config as well")
            args.config = str(base_file)
        cfg = load_config(args.config, args.overrides)
        if args.resume is not None:
            cfg.train.output_dir = str(args.resume)
        summary = train(cfg, resume=args.resume)
        if PartialState().is_main_process:
            print(json.dumps({k: summary[k] for k in summary if "top1" in k or k in (
                "best_metric", "best_epoch", "epochs_done", "wall_time", "run_dir")}))

    run_command(run)
