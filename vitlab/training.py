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
import secrets
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from timm.utils import ModelEmaV3
from torch import nn

from . import checkpoint as ckpt
from .config import Config, config_to_dict, load_config, save_config
from .errors import PREEMPTED_EXIT_CODE, CheckpointError, ConfigError, Preempted, TrainingError
from .layers import expert_utilization, moe_aux_loss
from .progress import Progress
from .preemption import StopSignals, elastic_restart_advice, ignore_in_workers
from .seeding import rng_state, seed_process, set_rng_state
from .tasks import TaskSetup, bare_model

__all__ = ["train", "summary_of", "interrupted_message", "resolve_resume", "set_epoch", "create_accelerator", "param_groups", "lr_multiplier", "plot_curves"]


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
            raise ConfigError(f"optim.layer_decay needs a model with layers by depth (a ViT, a timm model), not "
                              f"{type(model).__name__}")
        try:
            groups = param_groups_layer_decay(model, weight_decay, no_weight_decay_list=skip, layer_decay=layer_decay)
        except ValueError as e:  # a timm model without layer groups
            raise ConfigError(f"optim.layer_decay: {e}; set optim.layer_decay=0") from None
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
    if launched and on_cpu:
        _hide_gpus()
    gpus = torch.cuda.device_count()
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if launched and not on_cpu and 0 < gpus < local_processes:
        raise ConfigError(f"{local_processes} processes were started on this machine, which has {gpus} GPU(s): each "
                          f"process needs a GPU of its own; start {gpus} (torchrun --nproc_per_node {gpus}, accelerate "
                          f"launch --num_processes {gpus}), or run them on the CPU with ACCELERATE_USE_CPU=1 "
                          f"(accelerate launch --cpu)")
    return Accelerator(cpu=launched and not gpus, mixed_precision=mixed_precision, **kwargs)


def _hide_gpus() -> None:
    """Hide the GPUs from this process, as ``CUDA_VISIBLE_DEVICES=`` would: processes launched to run on
    the CPU must not reach a GPU. Accelerate's ``wait_for_everyone`` passes the local rank to
    ``torch.distributed.barrier(device_ids=...)`` also for gloo, and torch then names ``cuda:<rank>``
    wherever CUDA is available: on a machine with one GPU the process of rank 1 failed (seen on an H100).
    Takes effect only before anything in the process asked CUDA for its devices (say so if too late)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if torch.cuda.is_initialized():
        raise ConfigError("ACCELERATE_USE_CPU is set but CUDA was initialised before the Accelerator was created; "
                          "start the processes with CUDA_VISIBLE_DEVICES= as well")


# Keys that change how a run is watched, stored or stopped, never its numbers: train.resume=auto
# continues a run across a change of them and says which changed. data.in_memory too, where it does not
# change the pixels (:func:`_result_neutral`).
RESULT_NEUTRAL_KEYS = frozenset({"train.resume", "train.log_with", "train.stop_signals", "train.log_every",
                                 "train.save_every", "train.save_every_steps", "train.keep_last", "data.num_workers",
                                 "data.in_memory"})


def _result_neutral(key: str, cfg: Config) -> bool:
    """Whether a change of ``key`` leaves ``cfg``'s numbers as they were: one of :data:`RESULT_NEUTRAL_KEYS`,
    but not ``data.in_memory`` for ImageNet-style crops of files without ``data.decode_size`` (held in
    memory they are stored at the model's input size first; streamed, cropped at their own sizes)."""
    if key == "data.in_memory" and getattr(cfg.data, "train_crop", "pad") != "pad" and not cfg.data.decode_size:
        return False
    return key in RESULT_NEUTRAL_KEYS


def _newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run directory, ``last/`` or ``best/`` (``best/`` is the newer
    when the run died after a better epoch and before ``last/`` was due, with ``train.save_every`` > 1)."""
    found = []
    for which in ("last", "best"):
        try:  # the directory, or its .old twin left by a crash between the renames of a checkpoint write
            directory: Path | None = ckpt.resolve_checkpoint(run_dir / "checkpoints" / which)
        except CheckpointError:
            directory = None
        if directory is not None and (directory / "trainer_state.json").is_file():
            found.append((ckpt.read_json(directory / "trainer_state.json")["global_step"], which == "last", directory))
    return max(found)[2] if found else None


def resolve_resume(path: str | Path) -> tuple[Path, Path]:
    """The run directory and the checkpoint ``--resume PATH`` continues: PATH is a run directory (its
    newest checkpoint) or a checkpoint inside one (``RUN/checkpoints/step_800``), whose run it continues.

    Raises:
        ConfigError: one line, if PATH is neither.
    """
    path = Path(path)
    if (path / "trainer_state.json").is_file():
        if path.parent.name != "checkpoints":
            raise ConfigError(f"--resume {path}: a checkpoint continues the run it belongs to, and this one is not in "
                              f"a run's checkpoints/ folder; give the run directory or RUN/checkpoints/<name>")
        return path.parent.parent, path
    checkpoint = _newest_checkpoint(path)
    if checkpoint is None:
        raise ConfigError(f"--resume {path}: no checkpoint there (expected a run directory with checkpoints/last/ or "
                          f"a checkpoint directory RUN/checkpoints/<name>)")
    return path, checkpoint


# Keys that decide which samples each step of an epoch reads (with the processes' count, which the
# epoch's plan makes irrelevant): changed inside an epoch, the rest of it could not be what it was.
SAMPLE_KEYS = ("train.batch_size", "train.grad_accum_steps", "train.seed", "data.dataset", "data.root",
               "data.train_split", "data.val_size", "data.train_subset", "data.partitions", "data.shuffle_buffer",
               "data.streaming", "data.image_key", "data.label_key", "data.aug_repeats",
               "data.test_size")


def _refuse_other_samples(cfg: Config, checkpoint: Path) -> None:
    """Refuse, in one line, ``--resume CHECKPOINT key=value`` that changes a key deciding the samples of an
    epoch (:data:`SAMPLE_KEYS`) from a checkpoint written inside one: that epoch would continue on other
    samples than it began with. At an epoch's end any change starts the next epoch cleanly."""
    state = ckpt.read_json(checkpoint / "trainer_state.json")
    if not state.get("epoch_step") or not (checkpoint / "run_config.yaml").is_file():
        return
    saved, wanted = _flat_hparams(load_config(checkpoint / "run_config.yaml", recorded=True)), _flat_hparams(cfg)
    changed = [f"{k} {saved.get(k)} -> {wanted.get(k)}" for k in SAMPLE_KEYS if saved.get(k) != wanted.get(k)]
    if changed:
        epoch = state["epoch"] + 1
        raise ConfigError(f"--resume {checkpoint}: {', '.join(changed)} inside epoch {epoch} (the checkpoint is at its "
                          f"step {state['epoch_step']}) would continue that epoch on other samples than it began with; "
                          f"finish epoch {epoch} as it was (--resume {checkpoint} train.epochs={epoch}), then change it")


def _find_resume_point(cfg: Config, resume: str | Path | None) -> tuple[Path, Path | None, str]:
    """The run directory, the checkpoint to continue from (None: a new run) and a line to print about
    it (or ''), decided before any data is read.

    ``resume`` (a run directory, or a checkpoint in one) continues that run with ``cfg`` as it is now
    (more epochs, say). Otherwise ``train.output_dir`` decides. With ``train.resume: auto`` a directory
    holding a run (a checkpoint, or the ``config.yaml`` a run writes first) must hold ``cfg``'s run: the
    keys that differ are one line, except the result-neutral ones (:func:`_result_neutral`), which are continued across and
    named; the run continues from its newest checkpoint, or starts anew if it died before its first.
    With ``train.resume: no`` any run there is refused.
    """
    if resume is not None:
        run_dir, checkpoint = resolve_resume(resume)
        cfg.train.output_dir = str(run_dir)
        _refuse_other_samples(cfg, checkpoint)
        return run_dir, checkpoint, ""
    run_dir = Path(cfg.train.output_dir)
    checkpoint = _newest_checkpoint(run_dir)
    saved_file = checkpoint / "run_config.yaml" if checkpoint is not None else run_dir / "config.yaml"
    if cfg.train.resume == "no":
        if checkpoint is not None or saved_file.is_file() or (run_dir / "metrics.jsonl").exists():
            raise ConfigError(f"train.output_dir={str(run_dir)!r} already holds a run and train.resume=no; continue "
                              f"it with train.resume=auto (or --resume {run_dir}), or choose another train.output_dir")
        return run_dir, None, ""
    if not saved_file.is_file():
        return run_dir, None, ""
    saved, wanted = _flat_hparams(load_config(saved_file, recorded=True)), _flat_hparams(cfg)
    changed = [k for k in sorted(saved.keys() | wanted.keys()) if saved.get(k) != wanted.get(k)]
    differ = [f"{k}: {saved.get(k)!r} there, {wanted.get(k)!r} now" for k in changed if not _result_neutral(k, cfg)]
    if differ:
        raise ConfigError(f"train.output_dir={str(run_dir)!r} holds a run with another config ({'; '.join(differ)}); "
                          f"run its own config to continue it, change it on purpose with --resume {run_dir} "
                          f"key=value, or choose another train.output_dir")
    neutral = [f"{k} {saved.get(k)} -> {wanted.get(k)}" for k in changed if k != "train.resume"]
    note = f"continuing with keys that do not change the result changed: {', '.join(neutral)}" if neutral else ""
    return run_dir, checkpoint, note if checkpoint is not None else ""


TRACKERS = ("tensorboard", "wandb", "mlflow", "aim")  # each the name of its pip package too


def _trackers(log_with: str) -> list[str]:
    """The trackers ``train.log_with`` names (``all``: every one installed; ``none``: none).

    Raises:
        ConfigError: naming the package, if a tracker asked for by name is not installed (Accelerate
            would leave it out without a word).
    """
    from accelerate.tracking import get_available_trackers

    available = {str(t) for t in get_available_trackers()}
    if log_with == "all":
        return [name for name in TRACKERS if name in available]
    if log_with == "none":
        return []
    if log_with not in available:
        raise ConfigError(f"train.log_with={log_with}: the {log_with} package is not installed; pip install "
                          f"{log_with}, or choose train.log_with=tensorboard or none")
    return [log_with]


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


@dataclass
class _Meter:
    """One process's sums over the epoch's optimizer steps: its task loss since the last log line
    (``window``) and over the epoch (``total``), the MoE balancing loss since the last log line, the
    examples all processes trained on (``samples``: what the task counts, images or target tokens), the
    seconds spent and waiting for data. Kept in a checkpoint written inside an epoch."""

    window: torch.Tensor
    total: torch.Tensor
    moe_aux: torch.Tensor
    samples: torch.Tensor
    window_steps: int = 0
    steps: int = 0
    seconds: float = 0.0
    data_seconds: float = 0.0
    expert_counts: list[list[float]] | None = None  # routing counts of the epoch before a resume

    @classmethod
    def start(cls, device: torch.device, saved: dict[str, Any] | None = None) -> "_Meter":
        saved = dict(saved or {})
        tensors = {k: torch.tensor(saved.pop(k, 0.0), device=device) for k in ("window", "total", "moe_aux")}
        samples = torch.tensor(int(saved.pop("samples", 0)), dtype=torch.long, device=device)
        return cls(**tensors, samples=samples, **saved)

    def state_dict(self) -> dict[str, Any]:
        return {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}


class _Loop:
    """A run set up to train: model, optimizer, schedule, EMA and loaders prepared by Accelerate, its
    state restored from ``resume_from``. Its parts: :meth:`step` (one optimizer step),
    :meth:`train_epoch`, :meth:`end_epoch` (evaluation, logs, checkpoint policy), :meth:`save`."""

    def __init__(self, cfg: Config, run_dir: Path, resume_from: Path | None) -> None:
        t = cfg.train
        self.cfg, self.run_dir = cfg, run_dir
        trackers = _trackers(t.log_with)
        self.accelerator = acc = create_accelerator(
            t.mixed_precision, log_with=trackers or None, project_dir=str(run_dir / "tensorboard"),
            # non_blocking: batches pinned by the DataLoader go to the GPU without the host waiting for it
            dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True, data_seed=t.seed,
                                                      non_blocking=True),
        )
        micro_batch = t.batch_size // t.grad_accum_steps
        if micro_batch % acc.num_processes:
            raise ConfigError(f"train.batch_size={t.batch_size} / train.grad_accum_steps={t.grad_accum_steps} = "
                              f"{micro_batch} is not divisible by the {acc.num_processes} processes")
        set_seed(t.seed)  # the initial weights depend on train.seed only: equal on every process
        self.task = task = _setup_task(cfg, acc, micro_batch, run_dir, resume_from)
        for loader in (task.train_loader, *task.eval_loaders.values()):
            ignore_in_workers(loader, t.stop_signals)  # before Accelerate copies them
        model = task.model
        lr = cfg.optim.peak_lr(t.batch_size)  # optim.lr, or scaled from optim.lr_base by the global batch
        optimizer = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay, lr, cfg.optim.layer_decay),
                                      lr=lr, betas=cfg.optim.betas, fused=acc.device.type == "cuda" or None)
        self.model, self.optimizer = acc.prepare(model, optimizer)
        if t.compile:  # after prepare: DDP's buckets are compiled with the model (checkpoints strip the wrapper)
            self.model = torch.compile(self.model)
        self.eval_loaders = ({k: acc.prepare(v) for k, v in task.eval_loaders.items()} if task.prepare_eval_loaders
                             else task.eval_loaders)
        self.train_loader = acc.prepare(task.train_loader) if task.prepare_train_loader else task.train_loader
        # Gradient accumulation is done here, not by Accelerate: each optimizer step takes exactly
        # grad_accum_steps micro-batches, a partial group at the end of an epoch is dropped (as
        # drop_last drops a partial batch), so no gradient carries into the next epoch.
        self.accum = t.grad_accum_steps
        self.steps_per_epoch = len(self.train_loader) // self.accum
        if self.steps_per_epoch == 0:
            raise ConfigError(f"one epoch has {len(self.train_loader)} micro-batches, fewer than "
                              f"train.grad_accum_steps={self.accum}; lower train.batch_size or train.grad_accum_steps")
        total_steps, warmup_steps = self.steps_per_epoch * t.epochs, max(1, round(cfg.optim.warmup_epochs
                                                                               * self.steps_per_epoch))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer.optimizer, lambda s: lr_multiplier(
            s, warmup_steps, total_steps, cfg.optim.min_lr / lr, cfg.optim.schedule))
        self.ema = ModelEmaV3(self.plain_model, decay=t.ema_decay) if t.ema_decay > 0 else None
        self.scaler = acc.scaler  # fp16 only
        self.has_moe = bool(expert_utilization(self.model))
        # epoch: epochs done; epoch_step: optimizer steps done in the next one (a checkpoint inside it).
        self.state: dict[str, Any] = {"epoch": 0, "epoch_step": 0, "global_step": 0, "best_metric": None,
                                      "best_epoch": None, **({"data": task.data_state} if task.data_state else {})}
        self.process_state: dict[str, Any] | None = None  # this process's RNG and sums, inside an epoch
        self.meter = _Meter.start(acc.device)
        self.started = time.time()
        self.last_evaluation: dict[str, Any] = {}  # the record of the last evaluated epoch
        keep_lines = self._load(resume_from) if resume_from is not None else 0
        self.wall_time_before = self.state.get("wall_time", 0.0)  # of the run's earlier commands
        self.saved_step = self.state["global_step"] if resume_from is not None else None  # last/'s step
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_file = run_dir / "metrics.jsonl"
        self.metrics_lines = _truncate_lines(self.metrics_file, keep_lines) if acc.is_main_process else 0
        if acc.is_main_process:
            save_config(cfg, run_dir / "config.yaml")
        if "mlflow" in trackers and not os.environ.get("MLFLOW_TRACKING_URI") and acc.is_main_process:
            import mlflow

            # A file store in the run, no server (MLflow 3 keeps it in maintenance mode, behind this switch).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        if trackers:
            self._start_trackers(trackers, resumed=resume_from is not None)
        n_params = sum(p.numel() for p in self.model.parameters())
        selection = (f"best/ chosen on {'ema_' if self.ema is not None else ''}val_{task.select}"
                     if "val" in self.eval_loaders else "no validation split: no best/, the final epoch's test metric "
                                                        "is the result")
        workers = getattr(task.train_loader, "num_workers", 0)
        acc.print(f"model {cfg.model.name}: {n_params / 1e6:.2f}M params | train {task.train_size} examples, "
                  f"{self.steps_per_epoch} steps/epoch x {t.epochs} epochs | {acc.num_processes} process(es) on "
                  f"{acc.device}, {torch.get_num_threads()} torch thread(s) each"
                  f"{f', {workers} DataLoader workers' if workers else ''} | mixed precision {t.mixed_precision} | "
                  f"{selection} | run dir {run_dir}"
                  + (f" | resumed at epoch {self.state['epoch'] + 1}, step {self.state['epoch_step']}"
                     if resume_from is not None else ""))

    def _start_trackers(self, trackers: list[str], resumed: bool) -> None:
        """Start the experiment trackers: a new run gets new tracker runs and its config as
        hyperparameters; a resumed run continues the tracker runs its checkpoint names (``trackers`` in
        ``trainer_state.json``: MLflow's run id, the W&B id, Aim's run hash), so a job requeued 20 times
        is one run in each. (TensorBoard appends to its directory by itself.)"""
        acc, ids = self.accelerator, dict(self.state.get("trackers") or {})
        kwargs: dict[str, dict[str, Any]] = {}
        if "mlflow" in trackers and ids.get("mlflow"):
            kwargs["mlflow"] = {"run_id": ids["mlflow"]}
        if "wandb" in trackers:
            ids.setdefault("wandb", secrets.token_hex(4))  # W&B run ids: [a-z0-9]
            kwargs["wandb"] = {"id": ids["wandb"], "resume": "allow"}
        if "aim" in trackers and ids.get("aim"):
            kwargs["aim"] = {"run_hash": ids["aim"]}
        # A continued run keeps the hyperparameters it started with (MLflow refuses a changed one).
        acc.init_trackers(self.run_dir.resolve().name, config=None if resumed else _flat_hparams(self.cfg),
                          init_kwargs=kwargs)
        if acc.is_main_process:
            if "mlflow" in trackers:
                ids["mlflow"] = acc.get_tracker("mlflow", unwrap=True).info.run_id
            if "aim" in trackers:
                ids["aim"] = acc.get_tracker("aim", unwrap=True).hash
            self.state["trackers"] = {k: v for k, v in ids.items() if k in trackers}

    @property
    def plain_model(self) -> nn.Module:
        """The model without DDP's and ``torch.compile``'s wrappers (the same parameters)."""
        return bare_model(self.model, self.accelerator)

    def _load(self, resume_from: Path) -> int | None:
        """Restore weights, EMA, optimizer, schedule, scaler and position; returns how many lines of
        ``metrics.jsonl`` the checkpoint had seen (None: all, for a checkpoint that did not count)."""
        acc = self.accelerator
        saved = _resume_state(resume_from, self.run_dir)
        ckpt.load_weights(self.plain_model, resume_from / "model.safetensors")
        if self.ema is not None:
            ckpt.load_weights(self.ema.module, resume_from / "ema.safetensors")
        ckpt.load_optimizer(self.optimizer.optimizer, resume_from)
        self.scheduler.load_state_dict(saved.pop("scheduler"))
        grad_scaler = saved.pop("grad_scaler", None)
        if self.scaler is not None and grad_scaler is not None:
            self.scaler.load_state_dict(grad_scaler)
        num_processes, lines = saved.pop("num_processes", acc.num_processes), saved.pop("metrics_lines", None)
        self.last_evaluation = ckpt.read_json(resume_from / "config.json").get("training", {}).get("evaluation", {})
        self.state.update(saved)
        if self.state["epoch_step"]:
            if num_processes == acc.num_processes:
                self.process_state = ckpt.read_json(resume_from / f"process_{acc.process_index}.json")
            else:
                acc.print(f"the checkpoint was written by {num_processes} processes, not {acc.num_processes}: the rest "
                          f"of epoch {self.state['epoch'] + 1} reads the samples the run would have read, augmented "
                          f"alike, but what each process draws for the model (dropout, drop path, mixup) is drawn "
                          f"afresh")
        return lines

    def log(self, record: dict[str, Any]) -> None:
        self.accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"},
                             step=record["step"])
        if self.accelerator.is_main_process:
            with self.metrics_file.open("a") as f:
                f.write(json.dumps(record) + "\n")
            self.metrics_lines += 1

    def step(self, group: list[Any]) -> None:
        """Forward and backward over one global batch (this process's micro-batches ``group``), then one
        update of the weights, the schedule and the EMA; the task loss (this process's share of the
        global mean) and the MoE balancing loss go to the meter."""
        acc, model, meter = self.accelerator, self.model, self.meter
        # Each micro-batch's mean loss, weighted by its share of the global batch: the step's loss is
        # the mean over the global batch, wherever its examples ran. DDP averages gradients over
        # processes, hence the factor num_processes. Even batches give weights of exactly 1 / k.
        counts = [self.task.count(b) for b in group]
        # torch.full launches a fill kernel with the number as its argument; torch.tensor(x, device=cuda)
        # would copy from pageable host memory, which waits for the GPU to finish the step before.
        total = acc.reduce(torch.full((), float(sum(counts)), device=acc.device), reduction="sum")
        meter.samples += total.long()  # on the device: no host sync per step
        for i, batch in enumerate(group):
            with contextlib.nullcontext() if i == len(group) - 1 else acc.no_sync(model):
                loss = self.task.loss(model, batch) * (counts[i] * acc.num_processes / total)
                aux = moe_aux_loss(model)  # mixture-of-experts load balancing, already weighted
                acc.backward(loss if aux is None else loss + aux / len(group))
            meter.window += loss.detach()
            meter.total += loss.detach()
            if aux is not None:
                meter.moe_aux += aux.detach() / len(group)
        if self.cfg.optim.grad_clip > 0:
            acc.clip_grad_norm_(model.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        meter.window_steps += 1
        meter.steps += 1
        self.state["global_step"] += 1
        self.state["epoch_step"] += 1
        if self.ema is not None:
            self.ema.update(self.plain_model, step=self.state["global_step"])

    def _batches(self, epoch: int, skip: int) -> Iterable[Any]:
        """The epoch's training micro-batches (in the order of (seed, epoch)) from the ``skip``-th on."""
        loader = self.train_loader
        set_epoch(loader, epoch)
        if skip == 0:
            return loader
        if hasattr(loader, "batches_from"):  # vitlab's device-resident loaders
            return loader.batches_from(skip)
        skipped = self.accelerator.skip_first_batches(loader, skip)  # a DataLoader: its sampler skips
        # Its epoch: the new loader sets it on the sampler and the dataset as it starts. Accelerate before
        # 1.15 started it at 0, so a run resumed inside an epoch drew epoch 0's order and augmentations.
        skipped.iteration = getattr(loader, "iteration", epoch)
        return skipped

    def train_epoch(self, epoch: int, stop: StopSignals) -> bool:
        """Train ``epoch`` from its step ``state['epoch_step']`` (0, or where a checkpoint inside it was
        written), with a checkpoint every ``train.save_every_steps``. Returns False if the processes
        agreed to stop (:class:`StopSignals`) before its last step."""
        t, acc, state = self.cfg.train, self.accelerator, self.state
        seed_process(t.seed, acc.process_index, epoch)
        resumed, self.process_state = self.process_state, None
        self.meter = _Meter.start(acc.device, resumed["meter"] if resumed else None)
        skip = state["epoch_step"] * self.accum
        with Progress(self._batches(epoch, skip), desc=f"epoch {epoch}/{t.epochs}", total=len(self.train_loader),
                      initial=skip, enabled=acc.is_main_process, unit="batches") as bar:
            return self._train_batches(epoch, stop, bar, resumed)

    def _train_batches(self, epoch: int, stop: StopSignals, bar: Progress, resumed: dict[str, Any] | None) -> bool:
        t, acc, state, meter = self.cfg.train, self.accelerator, self.state, self.meter
        started, waiting_since = time.time() - meter.seconds, time.perf_counter()
        group: list[Any] = []
        for batch in bar:
            meter.data_seconds += time.perf_counter() - waiting_since
            group.append(batch)
            if len(group) == self.accum:
                if resumed is not None:  # where the checkpoint left the global generators (the loader has started)
                    set_rng_state(resumed["rng"], acc.device)
                    resumed = None
                self.step(group)
                group = []
                if state["global_step"] % t.log_every == 0:
                    self._log_window(epoch, bar)
                meter.seconds = time.time() - started
                if state["epoch_step"] < self.steps_per_epoch:  # the epoch's end has its own checkpoint policy
                    if t.save_every_steps and state["global_step"] % t.save_every_steps == 0:
                        self.save("last")
                    if stop.agreed():
                        return False
            waiting_since = time.perf_counter()
        if meter.window_steps:
            _checked_mean(acc, meter.window / meter.window_steps, epoch, state["global_step"])
        meter.seconds = time.time() - started
        return True

    def _log_window(self, epoch: int, bar: Progress) -> None:
        """A training log line: the mean loss since the last one (checked finite), the learning rate."""
        acc, meter = self.accelerator, self.meter
        mean_loss = _checked_mean(acc, meter.window / meter.window_steps, epoch, self.state["global_step"])
        lr = max(self.scheduler.get_last_lr())
        bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}")
        record = {"split": "train", "epoch": epoch, "step": self.state["global_step"], "loss": mean_loss, "lr": lr}
        if self.has_moe:
            record["moe_aux_loss"] = acc.reduce(meter.moe_aux / meter.window_steps, reduction="mean").item()
            meter.moe_aux.zero_()
        self.log(record)
        meter.window.zero_()
        meter.window_steps = 0

    def end_epoch(self, epoch: int, stop_after_epoch: int | None = None) -> dict[str, Any]:
        """The epoch's record (training loss, time, evaluation when due), its line and log, then the
        checkpoint policy: ``best/`` on a better validation metric, ``last/`` every ``train.save_every``
        epochs and at the end. Returns the record."""
        t, acc, state, meter = self.cfg.train, self.accelerator, self.state, self.meter
        record: dict[str, Any] = {"split": "eval", "epoch": epoch, "step": state["global_step"],
                                  "train_loss": acc.reduce(meter.total / max(meter.steps, 1), reduction="mean").item(),
                                  "train_samples": int(meter.samples.item()),
                                  "epoch_time": meter.seconds, "data_time": meter.data_seconds,
                                  "examples_per_s": self.task.train_size / meter.seconds,
                                  "lr": max(self.scheduler.get_last_lr())}
        if self.has_moe:  # share of routing assignments per expert, per MoE layer, over all processes this epoch
            counts = [acc.reduce(c, reduction="sum") for c in _epoch_expert_counts(self.model, meter, reset=True)]
            record["expert_utilization"] = [[round(x, 4) for x in (c / c.sum().clamp(min=1)).tolist()]
                                            for c in counts]
        is_best = False
        if epoch == t.epochs or (t.eval_every and epoch % t.eval_every == 0):
            eval_start = time.time()
            for name, loader in self.eval_loaders.items():
                nets = [("", self.model)] + ([("ema_", self.ema.module)] if self.ema is not None else [])
                for prefix, net in nets:
                    record.update({f"{prefix}{name}_{k}": v for k, v in self.task.evaluate(net, loader, acc).items()})
            if "val" in self.eval_loaders:
                metric = record[("ema_" if self.ema is not None else "") + "val_" + self.task.select]
                best = state["best_metric"]
                if best is None or (metric < best if self.task.select_lower else metric > best):
                    state.update(best_metric=metric, best_epoch=epoch)
                    is_best = True
            record["eval_time"] = time.time() - eval_start
        # One line per epoch, evaluated or not, so a run without evaluations still shows its progress.
        acc.print(f"epoch {epoch}: " + ", ".join(
            f"{k} {v:.4f}" for k, v in record.items() if k.startswith(("train_loss", "val", "test", "ema")))
            + f" | {meter.seconds:.1f}s ({record['examples_per_s']:.0f} examples/s)"
            + (f" | expert use {record['expert_utilization']}" if self.has_moe else ""))
        self.log(record)
        if "eval_time" in record:
            self.last_evaluation = record
        state.update(epoch=epoch, epoch_step=0)
        if is_best:
            self.save("best")
        step_due = t.save_every_steps and state["global_step"] % t.save_every_steps == 0
        if epoch % t.save_every == 0 or epoch == t.epochs or epoch == stop_after_epoch or step_due:
            self.save("last")
        return record

    def _record(self) -> dict[str, Any]:
        """What the run has measured, for the model card: data, epochs, steps, wall time, the command,
        the metrics of the last evaluated epoch."""
        d = self.cfg.data
        return {"dataset": f"{d.dataset}" + (f" ({d.root})" if getattr(d, "root", "") else ""),
                "epochs": self.state["epoch"], "steps": self.state["global_step"], "wall_time": self.state["wall_time"],
                "command": shlex.join(["python", *sys.argv]),
                "evaluation": {k: v for k, v in self.last_evaluation.items() if k == "epoch" or (
                    k.startswith(("train_loss", "val_", "test_", "ema_")) and isinstance(v, (int, float)))}}

    def save(self, name: str) -> None:
        """Write ``checkpoints/<name>/`` atomically: into a temporary directory, then swapped in. Inside an
        epoch every process adds its ``process_<rank>.json`` (its global generators and sums). ``last/``
        is also kept as ``step_<global step>/`` (the ``train.keep_last`` newest)."""
        acc, state = self.accelerator, self.state
        final = self.run_dir / "checkpoints" / name
        tmp = final.with_name(f".{name}.tmp")
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        if state["epoch_step"]:
            process_state = {"rng": rng_state(acc.device), "meter": self.meter.state_dict()}
            if self.has_moe:
                process_state["meter"]["expert_counts"] = [c.tolist() for c in _epoch_expert_counts(self.model, self.meter)]
            ckpt.write_json(tmp / f"process_{acc.process_index}.json", process_state)
        state["wall_time"] = self.wall_time_before + time.time() - self.started
        if acc.is_main_process:
            ckpt.save_model(self.plain_model, tmp, self.cfg.model.name, {**self.task.meta, "training": self._record()},
                            self.ema.module if self.ema is not None else None)
            self.task.save_files(tmp)
            ckpt.save_optimizer(self.optimizer.optimizer, tmp)
            ckpt.write_json(tmp / "trainer_state.json", {
                **state, "scheduler": self.scheduler.state_dict(), "num_processes": acc.num_processes,
                "metrics_lines": self.metrics_lines,
                **({"grad_scaler": self.scaler.state_dict()} if self.scaler is not None else {})})
            save_config(self.cfg, tmp / "run_config.yaml")
        acc.wait_for_everyone()
        if acc.is_main_process:
            if name == "last" and self.cfg.train.keep_last:
                _keep_step_copy(tmp, self.run_dir / "checkpoints", state["global_step"], self.cfg.train.keep_last)
            ckpt.replace_dir(tmp, final)
        acc.wait_for_everyone()
        if name == "last":
            self.saved_step = state["global_step"]


def set_epoch(loader: Any, epoch: int) -> None:
    """Start ``epoch`` in a training loader: its order (the sampler's) and its dataset's per-image
    augmentation seeds. Accelerate's ``DataLoaderShard.set_epoch`` sets the dataset's epoch only when
    the sampler is not sharded (an ``elif``): with several processes it never did, and every image got
    the same augmentation in every epoch. Before Accelerate 1.7 it did not reach a sampler under its
    ``BatchSamplerShard`` either (several processes): repeated augmentation's order stayed epoch 0's. So
    both are set here, where vitlab owns them."""
    (loader if hasattr(loader, "set_epoch") else loader.batch_sampler).set_epoch(epoch)
    shard = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)  # BatchSamplerShard's own
    sampler = getattr(shard, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    dataset = getattr(loader, "dataset", None)
    if hasattr(dataset, "set_epoch"):
        dataset.set_epoch(epoch)


def _epoch_expert_counts(model: nn.Module, meter: _Meter, reset: bool = False) -> list[torch.Tensor]:
    """This process's routing counts per MoE layer over the epoch so far (before and after a resume)."""
    counts = expert_utilization(model, reset=reset)
    if meter.expert_counts is None:
        return counts
    return [c + torch.tensor(before, device=c.device) for c, before in zip(counts, meter.expert_counts)]


def _keep_step_copy(checkpoint: Path, checkpoints: Path, step: int, keep: int) -> None:
    """``checkpoints/step_<step>/`` as hard links to a written checkpoint's files (no second write;
    copies where the file system has no hard links); only the ``keep`` newest are kept."""
    copy = checkpoints / f"step_{step}"
    staging = copy.with_name(f".{copy.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        shutil.copytree(checkpoint, staging, copy_function=os.link)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(checkpoint, staging)
    ckpt.replace_dir(staging, copy)
    steps = sorted(int(p.name[5:]) for p in checkpoints.glob("step_*") if p.name[5:].isdigit())
    for old in steps[:-keep]:
        shutil.rmtree(checkpoints / f"step_{old}")


def _truncate_lines(path: Path, keep: int | None) -> int:
    """Keep the first ``keep`` lines of ``path`` (all if None; a missing file has none): what a resumed
    run logged after its checkpoint is logged again. Returns the lines kept."""
    if not path.exists():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    if keep is not None and keep < len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(lines[:keep]))
        os.replace(tmp, path)
        return keep
    return len(lines)


def train(cfg: Config, resume: str | Path | None = None, stop_after_epoch: int | None = None) -> dict[str, Any]:
    """Train ``cfg``: a new run in ``train.output_dir``, or (``train.resume: auto``) the run there
    continued from its last checkpoint; with ``resume`` (a run directory) continue that run.

    Model selection uses the validation split only: ``checkpoints/best/`` is written when the task
    has a ``'val'`` loader, chosen on its metric; otherwise there is no ``best/`` and the run's
    figure is the final epoch's test metric. On a signal of ``train.stop_signals`` every process
    finishes its optimizer step, ``last/`` is written and :class:`~vitlab.errors.Preempted` (exit status
    75) is raised. ``stop_after_epoch`` ends the run early after that epoch's checkpoint, as an
    interruption would (the schedule still spans ``train.epochs``). Returns a summary: the last
    evaluation, the best validation metric (if any), epochs, the wall time of the whole run (every
    command that continued it)."""
    start_time = time.time()
    run_dir, resume_from, note = _find_resume_point(cfg, resume)  # bad input fails here, before data is read
    loop = _Loop(cfg, run_dir, resume_from)
    t, acc, state = cfg.train, loop.accelerator, loop.state
    for line in (note, elastic_restart_advice(), _busy_machine_advice()):
        if line:
            acc.print(line)
    summary: dict[str, Any] = {}
    loop.model.train()
    with StopSignals(t.stop_signals, acc.num_processes) as stop:
        for epoch in range(state["epoch"] + 1, t.epochs + 1):
            stopped = not loop.train_epoch(epoch, stop)
            if not stopped:
                summary = loop.end_epoch(epoch, stop_after_epoch)
                stopped = epoch < t.epochs and epoch != stop_after_epoch and stop.agreed()  # a signal in evaluation
            if stopped:
                if loop.saved_step != state["global_step"]:
                    loop.save("last")
                acc.end_training()
                preempted = Preempted(
                    f"stopped by {stop.received or 'a signal to another process'} after step {state['global_step']} "
                    f"(epoch {state['epoch'] + 1}, step {state['epoch_step']} of {loop.steps_per_epoch}); "
                    f"{run_dir / 'checkpoints' / 'last'} holds it, nothing was lost: run the same command to continue "
                    f"(exit status {PREEMPTED_EXIT_CODE})")
                acc.print(preempted.message)
                raise preempted
            if epoch == stop_after_epoch:
                break
    acc.end_training()
    if acc.is_main_process and state["epoch"] == t.epochs:
        plot_curves(loop.metrics_file, run_dir / "curves.png")
    if not summary and state["epoch"] == t.epochs:
        acc.print(f"{run_dir} holds a finished run ({t.epochs} epochs): nothing to train")
        summary = _last_eval(loop.metrics_file)
    result = {**summary, "best_metric": state["best_metric"], "best_epoch": state["best_epoch"],
              "epochs_done": state["epoch"], "run_dir": str(run_dir),
              "wall_time": loop.wall_time_before + time.time() - start_time}  # the run's: its earlier commands' too
    if state["epoch"] == t.epochs:
        if acc.is_main_process:
            ckpt.write_json(run_dir / "summary.json", summary_of(result))
        acc.print(_result_line(result, loop.task.select, "val" in loop.eval_loaders, run_dir))
    return result


def _busy_machine_advice() -> str:
    """One line when torch will spin several threads while other threads run on the machine, '' otherwise.
    On 2 cores with one kept busy by another process the quick CPU config trained at 296 images/s with
    torch's 2 threads and at 996 with one (``benchmarks/bench_threads.py``). The running threads are
    read from ``/proc/loadavg`` (the 1-minute load average lags: it counts what just ended), the lowest
    of up to five samples 50 ms apart, so that a process passing by does not count."""
    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    if threads < 2 or "OMP_NUM_THREADS" in os.environ or not Path("/proc/loadavg").is_file():
        return ""
    busy = cores
    for sample in range(5):
        busy = min(busy, int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1)  # others running
        if busy < 1:
            return ""
        time.sleep(0.05)
    return (f"the machine is busy ({busy} other thread(s) running on {cores} cores) and torch runs {threads} threads, "
            f"which wait for each other when cores are taken: if training is slow, run it with "
            f"OMP_NUM_THREADS={max(1, cores - busy)} (one core busy on 2: 3.4x faster with one thread)")


def interrupted_message(run_dir: str | Path) -> str:
    """What an interrupted run (Ctrl-C, a crash) kept and lost, and how to continue it."""
    checkpoint = _newest_checkpoint(Path(run_dir))
    if checkpoint is None:
        return (f"interrupted: {run_dir} holds no checkpoint yet, so this run is lost; the same command starts it "
                f"again")
    state = ckpt.read_json(checkpoint / "trainer_state.json")
    where = f"epoch {state['epoch'] + 1}, step {state['epoch_step']}" if state["epoch_step"] else \
        f"the end of epoch {state['epoch']}"
    return (f"interrupted: kept {checkpoint} (step {state['global_step']}, {where}); the steps after it are lost "
            f"(a stop signal, SIGTERM, would have kept them); the same command continues from it")


def summary_of(result: dict[str, Any]) -> dict[str, Any]:
    """What a finished run reports (``<run>/summary.json``, ``train.py --json``): the last evaluation's
    validation and test metrics, the best validation metric, epochs, wall time, the run directory."""
    return {k: result[k] for k in result if k.startswith(("val_", "test_", "ema_")) or k in (
        "best_metric", "best_epoch", "epochs_done", "wall_time", "run_dir")}


_FRACTIONS = ("top1", "top5", "exact_match")  # metrics in [0, 1], said in percent


def _result_line(result: dict[str, Any], select: str, has_val: bool, run_dir: Path) -> str:
    """The last line of a finished run: its result in words, where the model is and what to do next."""
    def said(value: float | None) -> str:
        if value is None:
            return "not evaluated"
        name = {"top1": "top-1", "exact_match": "exact match"}.get(select, select)
        return f"{name} {100 * value:.2f}%" if select in _FRACTIONS else f"{name} {value:.4f}"

    prefix = "ema_" if "ema_test_" + select in result else ""
    test = said(result.get(f"{prefix}test_{select}"))
    done = f"finished {result['epochs_done']} epochs in {result['wall_time']:.0f} s: test {test} " \
           f"at the final epoch{' (EMA weights)' if prefix else ''}"
    if has_val and result.get("best_epoch") is not None:
        model = run_dir / "checkpoints" / "best"
        done += f", best validation {said(result['best_metric'])} at epoch {result['best_epoch']} ({model})"
    else:
        model = run_dir / "checkpoints" / "last"
    return f"{done} | model: {model} | next: vitlab eval --checkpoint {run_dir}"


def _read_records(metrics_file: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``."""
    return [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]


def _last_eval(metrics_file: Path) -> dict[str, Any]:
    evals = [r for r in _read_records(metrics_file) if r["split"] == "eval"]
    return evals[-1] if evals else {}


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

    records = _read_records(metrics_file)
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
