"""The training loop, read top to bottom: :class:`Loop`'s set-up (model, optimizer, schedule, EMA and loaders
prepared by Accelerate, the state of a resumed run restored), its step, epoch, epoch's end and checkpoint."""
from __future__ import annotations

import contextlib
import copy
import json
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterable

import torch
from accelerate import DataLoaderConfiguration
from accelerate.utils import set_seed
from timm.utils import ModelEmaV3
from torch import nn

from .. import checkpoint as ckpt
from ..config import Config, save_config
from ..data.workers import shutdown_workers
from ..errors import ConfigError
from ..layers import expert_utilization, moe_aux_loss
from ..models.hub import trained_names
from ..preemption import StopSignals, ignore_in_workers
from ..progress import Progress
from ..runtime import bare_model, create_accelerator
from ..seeding import rng_state, seed_process, set_rng_state
from . import budget
from .meter import Meter, checked_mean, epoch_expert_counts
from .optim import create_optimizer, create_scheduler
from .report import truncate_lines
from .resume import resume_state
from .setup import add_lora, choose_best_metric, read_resumed, run_header, setup_task
from .trackers import resolve_trackers, start_trackers

__all__ = ["Loop", "set_epoch"]


class Loop:
    """A run set up to train: model, optimizer, schedule, EMA and loaders prepared by Accelerate, its
    state restored from ``resume_from``. Its parts: :meth:`step` (one optimizer step),
    :meth:`train_epoch`, :meth:`end_epoch` (evaluation, logs, checkpoint policy), :meth:`save`."""

    def __init__(self, cfg: Config, run_dir: Path, resume_from: Path | None, started: float | None = None) -> None:
        t = cfg.train
        self.cfg, self.run_dir = cfg, run_dir
        self.given_epochs = t.epochs  # train.epochs as given: a budget's bound (train.budget_minutes), saved as such
        if t.budget_minutes and resume_from is not None:  # the length the run's budget chose as it began
            t.epochs = ckpt.read_json(resume_from / "trainer_state.json")["budget_epochs"]
        trackers = resolve_trackers(t.log_with)
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
        self.resumed = read_resumed(resume_from) if resume_from is not None else None
        self.task = task = setup_task(cfg, acc, micro_batch, run_dir, self.resumed)
        if cfg.model.lora_r:
            add_lora(cfg, task, acc)
        choose_best_metric(t, task)
        for loader in (task.train_loader, *task.eval_loaders.values(), *task.final_eval_loaders.values()):
            ignore_in_workers(loader, t.stop_signals)  # before Accelerate copies them
        optimizer = create_optimizer(task.model, cfg.optim, t.batch_size, acc.device)
        self.model, self.optimizer = acc.prepare(task.model, optimizer)
        if t.compile:  # after prepare: DDP's buckets are compiled with the model (checkpoints strip the wrapper)
            self.model = torch.compile(self.model)
        self.eval_loaders, self.final_eval_loaders = (
            {k: acc.prepare(v) for k, v in loaders.items()} if task.prepare_eval_loaders else loaders
            for loaders in (task.eval_loaders, task.final_eval_loaders))
        self.train_loader = acc.prepare(task.train_loader) if task.prepare_train_loader else task.train_loader
        # Gradient accumulation is done here, not by Accelerate: each optimizer step takes exactly
        # grad_accum_steps micro-batches, a partial group at the end of an epoch is dropped (as
        # drop_last drops a partial batch), so no gradient carries into the next epoch.
        self.accum = t.grad_accum_steps
        self.steps_per_epoch = len(self.train_loader) // self.accum
        if self.steps_per_epoch == 0:
            raise ConfigError(f"one epoch has {len(self.train_loader)} micro-batches, fewer than "
                              f"train.grad_accum_steps={self.accum}; lower train.batch_size or train.grad_accum_steps")
        self.scheduler = create_scheduler(self.optimizer.optimizer, cfg.optim, self.steps_per_epoch, t.epochs,
                                          lower_is_better=task.select_lower)
        self.ema = ModelEmaV3(self.plain_model, decay=t.ema_decay) if t.ema_decay > 0 else None
        self.scaler = acc.scaler  # fp16 only
        self.has_moe = bool(expert_utilization(self.model))
        # epoch: epochs done; epoch_step: optimizer steps done in the next one (a checkpoint inside it).
        self.state: dict[str, Any] = {"epoch": 0, "epoch_step": 0, "global_step": 0, "best_metric": None,
                                      "best_epoch": None, **({"data": task.data_state} if task.data_state else {})}
        self.process_state: dict[str, Any] | None = None  # this process's RNG and sums, inside an epoch
        self.meter = Meter.start(acc.device)
        self.started = time.time()
        self.last_evaluation: dict[str, Any] = {}  # the record of the last evaluated epoch
        self.probe_record: dict[str, Any] = {}  # train.cache_features: the fitted head's L2 strength
        keep_lines = self._load(resume_from) if resume_from is not None else 0
        if t.budget_minutes and resume_from is None:
            self._fit_budget(time.time() if started is None else started)
        self.wall_time_before = self.state.get("wall_time", 0.0)  # of the run's earlier commands
        self.saved_step = self.state["global_step"] if resume_from is not None else None  # last/'s step
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_file = run_dir / "metrics.jsonl"
        self.metrics_lines = truncate_lines(self.metrics_file, keep_lines) if acc.is_main_process else 0
        if acc.is_main_process:
            save_config(self.config_as_given, run_dir / "config.yaml")
        if trackers:
            start_trackers(acc, trackers, run_dir, cfg, self.state, resumed=resume_from is not None)
        acc.print(run_header(cfg, acc, task, self.model, self.steps_per_epoch, self.ema is not None,
                             "val" in self.eval_loaders, run_dir, self.state, resume_from is not None))

    def _fit_budget(self, started: float) -> None:
        """``train.budget_minutes``: the epochs that fit it (:func:`~.budget.fit_epochs`, which times steps and restores
        what they changed), then the schedule over them; kept in the checkpoints' state for a resumed run."""
        t = self.cfg.train
        t.epochs = self.state["budget_epochs"] = budget.fit_epochs(self, t.budget_minutes, started)
        self.scheduler = create_scheduler(self.optimizer.optimizer, self.cfg.optim, self.steps_per_epoch, t.epochs,
                                          lower_is_better=self.task.select_lower)

    @property
    def config_as_given(self) -> Config:
        """The run's config as its command gave it: with a budget, ``train.epochs`` is its bound, not the number of
        epochs the budget chose (kept in the checkpoints' state), so the same command continues the run."""
        if self.cfg.train.epochs == self.given_epochs:
            return self.cfg
        given = copy.deepcopy(self.cfg)
        given.train.epochs = self.given_epochs
        return given

    def close(self) -> None:
        """End the loaders' DataLoader workers (:func:`~vitlab.data.workers.shutdown_workers`), however the run
        ended: left to the garbage collector, those of an epoch cut short took 5 s each to go."""
        for loader in (self.train_loader, *self.eval_loaders.values()):
            shutdown_workers(loader)

    @property
    def plain_model(self) -> nn.Module:
        """The model without DDP's and ``torch.compile``'s wrappers (the same parameters)."""
        return bare_model(self.model, self.accelerator)

    def _load(self, resume_from: Path) -> int | None:
        """Restore weights, EMA, optimizer, schedule, scaler and position; returns how many lines of
        ``metrics.jsonl`` the checkpoint had seen (None: all, for a checkpoint that did not count)."""
        acc = self.accelerator
        saved = resume_state(resume_from, self.run_dir)
        only = trained_names(self.plain_model) if self.cfg.model.lora_r else None  # adapters and head alone
        ckpt.load_weights(self.plain_model, resume_from / "model.safetensors", only)
        if self.ema is not None:
            ckpt.load_weights(self.ema.module, resume_from / "ema.safetensors", only)
        ckpt.load_optimizer(self.optimizer.optimizer, resume_from)
        self.scheduler.load_state_dict(saved.pop("scheduler"))
        grad_scaler = saved.pop("grad_scaler", None)
        if self.scaler is not None and grad_scaler is not None:
            self.scaler.load_state_dict(grad_scaler)
        num_processes, lines = saved.pop("num_processes", acc.num_processes), saved.pop("metrics_lines", None)
        self.last_evaluation = self.resumed.meta.get("training", {}).get("evaluation", {})
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
        if self.task.before_step is not None:
            self.task.before_step(self.state["global_step"])
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
        if self.task.after_step is not None:
            self.task.after_step(self.plain_model, self.state["global_step"])
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
        self.meter = Meter.start(acc.device, resumed["meter"] if resumed else None)
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
            checked_mean(acc, meter.window / meter.window_steps, epoch, state["global_step"])
        meter.seconds = time.time() - started
        return True

    def _log_window(self, epoch: int, bar: Progress) -> None:
        """A training log line: the mean loss since the last one (checked finite), the learning rate."""
        acc, meter = self.accelerator, self.meter
        mean_loss = checked_mean(acc, meter.window / meter.window_steps, epoch, self.state["global_step"])
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
                                  **({"lr": max(self.scheduler.get_last_lr())} if not self.cfg.train.cache_features
                                     else {}),
                                  **self.probe_record}
        if self.has_moe:  # share of routing assignments per expert, per MoE layer, over all processes this epoch
            counts = [acc.reduce(c, reduction="sum") for c in epoch_expert_counts(self.model, meter, reset=True)]
            record["expert_utilization"] = [[round(x, 4) for x in (c / c.sum().clamp(min=1)).tolist()]
                                            for c in counts]
        is_best = False
        if epoch == t.epochs or (t.eval_every and epoch % t.eval_every == 0):
            eval_start = time.time()
            # val first: whether this evaluation is the run's last (it may stop early) depends on it
            for name in sorted(self.eval_loaders, key=lambda n: n != "val"):
                last = epoch == t.epochs or self._stops_early(epoch)
                loader = self.final_eval_loaders.get(name) if last else None
                nets = [("", self.model)] + ([("ema_", self.ema.module)] if self.ema is not None else [])
                for prefix, net in nets:
                    record.update({f"{prefix}{name}_{k}": v for k, v in
                                   self.task.evaluate(net, loader or self.eval_loaders[name], acc).items()})
                if name == "val":
                    is_best = self._note_validation(record, epoch)
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
        if "eval_time" in record and self._stops_early(epoch):
            state["stopped_early"] = epoch  # kept in the checkpoint: the run is finished
        if is_best:
            self.save("best")
        step_due = t.save_every_steps and state["global_step"] % t.save_every_steps == 0
        if epoch % t.save_every == 0 or epoch == t.epochs or epoch == stop_after_epoch or step_due \
                or state.get("stopped_early"):
            self.save("last")
        return record

    def _note_validation(self, record: dict[str, Any], epoch: int) -> bool:
        """Keep the epoch's validation metric (``train.best_metric``) if it is the best yet, and hand it to a
        plateau schedule; whether it is the best."""
        t, state = self.cfg.train, self.state
        key = ("ema_" if self.ema is not None else "") + "val_" + self.task.select
        if key not in record:
            raise ConfigError(f"train.best_metric={t.best_metric}: the run's validation metrics are "
                              f"{', '.join(k for k in record if k.startswith('val_'))}")
        metric, best = record[key], state["best_metric"]
        self.scheduler.evaluated(metric)  # optim.schedule=plateau
        if best is None or (metric < best if self.task.select_lower else metric > best):
            state.update(best_metric=metric, best_epoch=epoch)
            return True
        return False

    def _stops_early(self, epoch: int) -> bool:
        """Whether the run stops after ``epoch`` (evaluated): ``train.early_stop_patience`` epochs without a better
        validation metric, before the last epoch."""
        patience, best_epoch = self.cfg.train.early_stop_patience, self.state["best_epoch"]
        return bool(patience) and best_epoch is not None and epoch < self.cfg.train.epochs \
            and epoch - best_epoch >= patience

    def _record(self) -> dict[str, Any]:
        """What the run has measured, for the model card: data, epochs, steps, wall time, the command,
        the metrics of the last evaluated epoch."""
        d = self.cfg.data
        return {"dataset": f"{d.dataset}" + (f" ({d.root})" if getattr(d, "root", "") else ""),
                "epochs": self.state["epoch"], "steps": self.state["global_step"], "wall_time": self.state["wall_time"],
                "command": shlex.join(["python", *sys.argv]),
                "mixed_precision": self.cfg.train.mixed_precision,  # eval's and predict's precision for the model
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
                process_state["meter"]["expert_counts"] = [c.tolist() for c in epoch_expert_counts(self.model, self.meter)]
            ckpt.write_json(tmp / f"process_{acc.process_index}.json", process_state)
        state["wall_time"] = self.wall_time_before + time.time() - self.started
        if acc.is_main_process:
            ckpt.write_model_files(self.plain_model, tmp, {**self.task.meta, "training": self._record()},
                                   self.cfg.model.name, self.ema.module if self.ema is not None else None)
            self.task.save_files(tmp)
            ckpt.save_optimizer(self.optimizer.optimizer, tmp)
            ckpt.write_json(tmp / "trainer_state.json", {
                **state, "scheduler": self.scheduler.state_dict(), "num_processes": acc.num_processes,
                "metrics_lines": self.metrics_lines,
                **({"grad_scaler": self.scaler.state_dict()} if self.scaler is not None else {})})
            save_config(self.config_as_given, tmp / "run_config.yaml")
        acc.wait_for_everyone()
        if acc.is_main_process:
            if name == "last" and self.cfg.train.keep_last:
                ckpt.keep_step_copy(tmp, self.run_dir / "checkpoints", state["global_step"], self.cfg.train.keep_last)
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
