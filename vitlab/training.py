"""The training loop on Hugging Face Accelerate: config -> task -> loop -> checkpoints.

One straight line for every task (image classification, sequence-to-sequence) on one CPU, one GPU
or several processes (``accelerate launch``). ``train.batch_size`` is global: Accelerate splits each
batch across processes (``split_batches=True``), and gradient accumulation splits it further in time.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from timm.utils import ModelEmaV3
from torch import nn
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from .config import Config, config_to_dict, save_config
from .errors import ConfigError, TrainingError
from .seeding import seed_process
from .layers import expert_utilization, moe_aux_loss
from .tasks import TaskSetup

__all__ = ["train", "create_accelerator", "param_groups", "lr_multiplier", "plot_curves"]


def param_groups(model: nn.Module, weight_decay: float, lr: float = 1.0,
                 layer_decay: float = 0.0) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on norms, biases, embeddings tables named by ``no_weight_decay()``
    (the ViT's CLS token and positional embedding) and other 1-d parameters.

    With ``layer_decay`` in (0, 1), timm's layer-wise decay (``param_groups_layer_decay``, over the
    model's ``group_matcher``): the head keeps ``lr``, each block below gets ``layer_decay`` times the
    one above, the embeddings the least; each group's ``lr`` is set, so the schedule scales them all.
    """
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    if 0 < layer_decay < 1:
        from timm.optim import param_groups_layer_decay

        if not hasattr(model, "group_matcher"):
            raise ConfigError(f"optim.layer_decay needs a model with layers by depth (a ViT), not "
                              f"{type(model).__name__}")
        groups = param_groups_layer_decay(model, weight_decay, no_weight_decay_list=skip, layer_decay=layer_decay)
        return [{**g, "lr": lr * g["lr_scale"]} for g in groups]
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, min_ratio: float, schedule: str = "cosine") -> float:
    """Learning-rate factor at optimizer step ``step``: linear warmup to 1 over ``warmup_steps``, then
    ``'cosine'`` decay to ``min_ratio`` at ``total_steps``, or ``'inverse_sqrt'``: ``sqrt(warmup / step)``
    (the schedule of Vaswani et al. 2017 with ``optim.lr`` as its peak)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "inverse_sqrt":
        return max(min_ratio, math.sqrt(warmup_steps / (step + 1)))
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _plain(model: nn.Module) -> nn.Module:
    """The module under a ``torch.compile`` wrapper (the same parameters)."""
    return getattr(model, "_orig_mod", model)


def _check_run_dir(run_dir: Path, resume: bool) -> None:
    has_run = (run_dir / "checkpoints").exists() or (run_dir / "metrics.jsonl").exists()
    if has_run and not resume:
        raise ConfigError(f"train.output_dir={str(run_dir)!r} already holds a run; continue it with "
                          f"--resume {run_dir}, or choose another train.output_dir")


def _save_checkpoint(accelerator: Accelerator, run_dir: Path, name: str, cfg: Config, task: TaskSetup,
                     model: nn.Module, ema: ModelEmaV3 | None, optimizer: Any, state: dict[str, Any]) -> None:
    """Write checkpoints/<name>/ atomically: into a temporary directory, then swapped in."""
    final = run_dir / "checkpoints" / name
    tmp = final.with_name(f".{name}.tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        ckpt.save_model(_plain(accelerator.unwrap_model(model)), tmp, cfg.model.name, task.meta,
                        ema.module if ema is not None else None)
        task.save_files(tmp)
        ckpt.save_optimizer(optimizer, tmp)
        ckpt.write_json(tmp / "trainer_state.json", state)
        save_config(cfg, tmp / "run_config.yaml")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        ckpt.replace_dir(tmp, final)
    accelerator.wait_for_everyone()


def _setup_task(cfg: Config, accelerator: Accelerator, micro_batch: int, run_dir: Path,
                resume_from: Path | None) -> TaskSetup:
    if cfg.task == "seq2seq":
        from .tasks.seq2seq import seq2seq_task

        return seq2seq_task(cfg, accelerator, micro_batch, run_dir, resume_from)
    if cfg.task == "lm":
        from .tasks.lm import lm_task

        return lm_task(cfg, accelerator, micro_batch, run_dir, resume_from)
    from .tasks.classification import image_classification_task

    return image_classification_task(cfg, accelerator, micro_batch, resume_from)


def create_accelerator(mixed_precision: str = "no", **kwargs: Any) -> Accelerator:
    """An ``Accelerator`` that also works for several processes on a machine without GPUs: there
    Accelerate's gloo (multi-CPU) path needs ``cpu=True``, otherwise each process would silently
    work alone. ``ACCELERATE_USE_CPU=1`` (what ``accelerate launch --cpu`` sets) keeps every process
    on the CPU on a machine with GPUs too.

    Raises:
        ConfigError: before any process group starts, if more processes were started on this machine
            than it has GPUs (NCCL needs a GPU of its own for each process).
    """
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    on_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    gpus = torch.cuda.device_count()
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if launched and not on_cpu and 0 < gpus < local_processes:
        raise ConfigError(f"{local_processes} processes were started on this machine, which has {gpus} GPU(s): each "
                          f"process needs a GPU of its own; start {gpus} (torchrun --nproc_per_node {gpus}, accelerate "
                          f"launch --num_processes {gpus}), or run them on the CPU with ACCELERATE_USE_CPU=1 "
                          f"(accelerate launch --cpu)")
    return Accelerator(cpu=launched and not gpus, mixed_precision=mixed_precision, **kwargs)


def _resume_state(resume_from: Path, run_dir: Path) -> dict[str, Any]:
    """The trainer state of ``last/``, with the best metric of ``best/`` when it exists: ``best/`` may
    have been written after ``last/`` (with ``train.save_every > 1``) and must not be overwritten by
    a worse epoch after the resume."""
    state = ckpt.read_json(resume_from / "trainer_state.json")
    best_file = run_dir / "checkpoints" / "best" / "trainer_state.json"
    if best_file.is_file():
        best = ckpt.read_json(best_file)
        state.update(best_metric=best["best_metric"], best_epoch=best["best_epoch"])
    return state


def train(cfg: Config, resume: str | Path | None = None, stop_after_epoch: int | None = None) -> dict[str, Any]:
    """Train ``cfg``; with ``resume`` (a run directory) continue from its last checkpoint.

    Model selection uses the validation split only: ``checkpoints/best/`` is written when the task
    has a ``'val'`` loader, chosen on its metric; otherwise there is no ``best/`` and the run's
    figure is the final epoch's test metric. ``stop_after_epoch`` ends the run early after that
    epoch's checkpoint, as an interruption would (the schedule still spans ``train.epochs``); tests
    use it to check that resuming is exact. Returns a summary: the last evaluation, the best
    validation metric (if any), epochs, wall time.
    """
    start_time = time.time()
    run_dir = Path(resume) if resume is not None else Path(cfg.train.output_dir)
    # Everything that can be wrong with the input is checked before data is loaded.
    resume_from = ckpt.resolve_checkpoint(run_dir, "last") if resume is not None else None
    _check_run_dir(run_dir, resume is not None)
    t = cfg.train
    accelerator = create_accelerator(
        t.mixed_precision, log_with="tensorboard", project_dir=str(run_dir),
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True, data_seed=t.seed),
    )
    micro_batch = t.batch_size // t.grad_accum_steps
    if micro_batch % accelerator.num_processes:
        raise ConfigError(f"train.batch_size={t.batch_size} / train.grad_accum_steps={t.grad_accum_steps} = "
                          f"{micro_batch} is not divisible by the {accelerator.num_processes} processes")
    set_seed(t.seed)  # the initial weights depend on train.seed only: equal on every process
    task = _setup_task(cfg, accelerator, micro_batch, run_dir, resume_from)
    model = task.model
    optimizer = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay, cfg.optim.lr, cfg.optim.layer_decay),
                                  lr=cfg.optim.lr, betas=cfg.optim.betas,
                                  fused=accelerator.device.type == "cuda" or None)
    if t.compile:
        model = torch.compile(model)  # checkpoints strip the wrapper: they load compiled or not
    model, optimizer = accelerator.prepare(model, optimizer)
    eval_loaders = ({k: accelerator.prepare(v) for k, v in task.eval_loaders.items()} if task.prepare_eval_loaders
                    else task.eval_loaders)
    train_loader = accelerator.prepare(task.train_loader) if task.prepare_train_loader else task.train_loader
    # Gradient accumulation is done here, not by Accelerate: each optimizer step takes exactly
    # grad_accum_steps micro-batches, a partial group at the end of an epoch is dropped (as
    # drop_last drops a partial batch), so no gradient carries into the next epoch.
    accum = t.grad_accum_steps
    steps_per_epoch = len(train_loader) // accum
    if steps_per_epoch == 0:
        raise ConfigError(f"one epoch has {len(train_loader)} micro-batches, fewer than train.grad_accum_steps="
                          f"{accum}; lower train.batch_size or train.grad_accum_steps")
    total_steps = steps_per_epoch * t.epochs
    warmup_steps = max(1, round(cfg.optim.warmup_epochs * steps_per_epoch))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda s: lr_multiplier(
        s, warmup_steps, total_steps, cfg.optim.min_lr / cfg.optim.lr, cfg.optim.schedule))
    ema = ModelEmaV3(_plain(accelerator.unwrap_model(model)), decay=t.ema_decay) if t.ema_decay > 0 else None
    scaler = accelerator.scaler  # fp16 only

    state: dict[str, Any] = {"epoch": 0, "global_step": 0, "best_metric": None, "best_epoch": None}
    if resume_from is not None:
        saved = _resume_state(resume_from, run_dir)
        ckpt.load_weights(_plain(accelerator.unwrap_model(model)), resume_from / "model.safetensors")
        if ema is not None:
            ckpt.load_weights(ema.module, resume_from / "ema.safetensors")
        ckpt.load_optimizer(optimizer.optimizer, resume_from)
        scheduler.load_state_dict(saved.pop("scheduler"))
        grad_scaler = saved.pop("grad_scaler", None)
        if scaler is not None and grad_scaler is not None:
            scaler.load_state_dict(grad_scaler)
        state.update(saved)
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

    step_aux = torch.zeros((), device=accelerator.device)  # MoE balancing loss summed over steps since the last log

    def optimizer_step(group: list[Any]) -> torch.Tensor:
        """Forward and backward over one global batch (this process's micro-batches), then one update.
        Returns this process's share of the global mean loss (the task's loss; MoE balancing adds to the
        gradient and is logged apart as ``moe_aux_loss``)."""
        nonlocal step_aux
        # Each micro-batch's mean loss, weighted by its share of the global batch: the step's loss is
        # the mean over the global batch, wherever its examples ran. DDP averages gradients over
        # processes, hence the factor num_processes. Even batches give weights of exactly 1 / k.
        counts = [task.count(b) for b in group]
        total = accelerator.reduce(torch.tensor(float(sum(counts)), device=accelerator.device), reduction="sum")
        step_loss = torch.zeros((), device=accelerator.device)
        for i, batch in enumerate(group):
            with contextlib.nullcontext() if i == len(group) - 1 else accelerator.no_sync(model):
                loss = task.loss(model, batch) * (counts[i] * accelerator.num_processes / total)
                aux = moe_aux_loss(model)  # mixture-of-experts load balancing, already weighted
                accelerator.backward(loss if aux is None else loss + aux / len(group))
            step_loss += loss.detach()
            if aux is not None:
                step_aux += aux.detach() / len(group)
        if cfg.optim.grad_clip > 0:
            accelerator.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return step_loss

    n_params = sum(p.numel() for p in model.parameters())
    has_moe = bool(expert_utilization(model))
    selection = (f"best/ chosen on {'ema_' if ema is not None else ''}val_{task.select}" if "val" in eval_loaders
                 else "no validation split: no best/, the final epoch's test metric is the result")
    accelerator.print(f"model {cfg.model.name}: {n_params / 1e6:.2f}M params | train {task.train_size} examples, "
                      f"{steps_per_epoch} steps/epoch x {t.epochs} epochs | {accelerator.num_processes} process(es) "
                      f"on {accelerator.device} | mixed precision {t.mixed_precision} | {selection} | run dir {run_dir}")
    model.train()
    summary: dict[str, Any] = {}
    for epoch in range(state["epoch"] + 1, t.epochs + 1):
        seed_process(t.seed, accelerator.process_index, epoch)
        # Shuffling depends on (seed, epoch) only, so a resumed run sees the batches it would have seen.
        (train_loader if hasattr(train_loader, "set_epoch") else train_loader.batch_sampler).set_epoch(epoch)
        epoch_start = time.time()
        running, seen = torch.zeros((), device=accelerator.device), 0
        epoch_loss, epoch_steps = torch.zeros((), device=accelerator.device), 0
        bar = tqdm(train_loader, desc=f"epoch {epoch}/{t.epochs}", leave=False, dynamic_ncols=True,
                   disable=None if accelerator.is_main_process else True)  # None: off when not a TTY
        group: list[Any] = []
        data_time, waiting_since = 0.0, time.perf_counter()  # time spent waiting for batches
        for batch in bar:
            data_time += time.perf_counter() - waiting_since
            group.append(batch)
            if len(group) == accum:
                step_loss = optimizer_step(group)
                running += step_loss
                epoch_loss += step_loss
                epoch_steps += 1
                group = []
                seen += 1
                state["global_step"] += 1
                if ema is not None:
                    ema.update(_plain(accelerator.unwrap_model(model)), step=state["global_step"])
                if state["global_step"] % t.log_every == 0:
                    mean_loss = _checked_mean(accelerator, running / seen, epoch, state["global_step"])
                    lr = max(scheduler.get_last_lr())
                    bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}")
                    record = {"split": "train", "epoch": epoch, "step": state["global_step"], "loss": mean_loss,
                              "lr": lr}
                    if has_moe:
                        record["moe_aux_loss"] = accelerator.reduce(step_aux / seen, reduction="mean").item()
                        step_aux.zero_()
                    log(record)
                    running.zero_()
                    seen = 0
            waiting_since = time.perf_counter()
        if seen:
            _checked_mean(accelerator, running / seen, epoch, state["global_step"])
        epoch_time = time.time() - epoch_start
        record: dict[str, Any] = {"split": "eval", "epoch": epoch, "step": state["global_step"],
                                  "train_loss": accelerator.reduce(epoch_loss / max(epoch_steps, 1),
                                                                   reduction="mean").item(),
                                  "epoch_time": epoch_time, "data_time": data_time,
                                  "examples_per_s": task.train_size / epoch_time, "lr": max(scheduler.get_last_lr())}
        if has_moe:  # share of routing assignments per expert, per MoE layer, over all processes this epoch
            counts = [accelerator.reduce(c, reduction="sum") for c in expert_utilization(model)]
            record["expert_utilization"] = [[round(x, 4) for x in (c / c.sum().clamp(min=1)).tolist()]
                                            for c in counts]
        is_best = False
        if epoch == t.epochs or (t.eval_every and epoch % t.eval_every == 0):
            eval_start = time.time()
            for name, loader in eval_loaders.items():
                for prefix, net in [("", model)] + ([("ema_", ema.module)] if ema is not None else []):
                    record.update({f"{prefix}{name}_{k}": v for k, v in task.evaluate(net, loader, accelerator).items()})
            if "val" in eval_loaders:
                metric = record[("ema_" if ema is not None else "") + "val_" + task.select]
                best = state["best_metric"]
                if best is None or (metric < best if task.select_lower else metric > best):
                    state.update(best_metric=metric, best_epoch=epoch)
                    is_best = True
            record["eval_time"] = time.time() - eval_start
        # One line per epoch, evaluated or not, so a run without evaluations still shows its progress.
        accelerator.print(f"epoch {epoch}: " + ", ".join(
            f"{k} {v:.4f}" for k, v in record.items() if k.startswith(("train_loss", "val", "test", "ema")))
            + f" | {epoch_time:.1f}s ({record['examples_per_s']:.0f} examples/s)"
            + (f" | expert use {record['expert_utilization']}" if has_moe else ""))
        log(record)
        summary = record
        state["epoch"] = epoch
        checkpoint_state = {**state, "scheduler": scheduler.state_dict(),
                            **({"grad_scaler": scaler.state_dict()} if scaler is not None else {})}
        if is_best:
            _save_checkpoint(accelerator, run_dir, "best", cfg, task, model, ema, optimizer.optimizer, checkpoint_state)
        if epoch % t.save_every == 0 or epoch == t.epochs or epoch == stop_after_epoch:
            _save_checkpoint(accelerator, run_dir, "last", cfg, task, model, ema, optimizer.optimizer, checkpoint_state)
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
    flat: dict[str, Any] = {}
    for section, values in config_to_dict(cfg).items():
        for key, value in (values.items() if isinstance(values, dict) else [("", values)]):
            name = f"{section}.{key}" if key else section
            flat[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
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
    metric_keys = {k for r in evals for k in r if k.startswith(("val_", "test_", "ema_")) and not k.endswith("_loss")}
    for key in sorted(metric_keys):
        axes[1].plot([r["epoch"] for r in evals if key in r], [r[key] for r in evals if key in r], "o-", label=key)
    axes[2].plot([r["step"] / steps_per_epoch for r in trains], [r["lr"] for r in trains])
    for ax, title in zip(axes, ("loss", "evaluation metrics", "learning rate")):
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0].legend()
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
