"""The training loop on Hugging Face Accelerate: config -> task -> loop -> checkpoints.

One straight line for every task (image classification, sequence-to-sequence, language modelling, MAE and DINO
pretraining) on one CPU, one GPU or several processes (``accelerate launch``). ``train.batch_size`` is global:
Accelerate splits each batch across processes (``split_batches=True``), and gradient accumulation splits
it further in time. This file is :func:`train`, the run from its config to its last line; :mod:`.loop` is the
loop, read top to bottom: :class:`~.loop.Loop`'s step, epoch, epoch's end and checkpoint. Its other jobs have
files of their own:

- :mod:`.setup`: the task of the config (its entry in :mod:`vitlab.tasks.registry`, given what it resumes from),
  LoRA, the metric ``best/`` is chosen on, the run's first line;
- :mod:`.meter`: what an epoch sums as it goes;
- :mod:`.optim`: the optimizer's parameter groups and the learning-rate schedule;
- :mod:`.resume`: finding and vetting the checkpoint a run continues from (or refusing it in one line);
- :mod:`.trackers`: TensorBoard, W&B, MLflow and Aim through Accelerate;
- :mod:`.report`: what a run says and leaves: its last line, ``summary.json``, ``curves.png``;
- :mod:`.probe`: ``train.cache_features``, the linear probe fitted in place of the epochs' steps.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from .. import checkpoint as ckpt
from ..config import Config
from ..errors import PREEMPTED_EXIT_CODE, Preempted
from ..models.pretrained import take_pretrained_architecture
from ..preemption import StopSignals, elastic_restart_advice
from ..runtime import cpu_requested, create_accelerator
from .loop import Loop, set_epoch
from .optim import create_optimizer, create_scheduler, param_groups
from .probe import fit_head, probe_config, probe_header
from .report import busy_machine_advice, last_eval, plot_curves, result_line, summary_of
from .resume import find_resume_point, interrupted_message, resolve_resume

__all__ = ["train", "summary_of", "interrupted_message", "resolve_resume", "set_epoch", "create_accelerator",
           "cpu_requested", "param_groups", "create_optimizer", "create_scheduler", "plot_curves", "Loop"]


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
    command that continued it). A finished run with ``train.calibrate`` then gets its temperature (or a
    multi-label run its thresholds), fitted on its validation split as ``vitlab calibrate`` fits them."""
    start_time = time.time()
    if cfg.train.cache_features:
        cfg = probe_config(cfg)
    take_pretrained_architecture(cfg.model)  # part of the run's config, before the run is looked for
    run_dir, resume_from, note = find_resume_point(cfg, resume)  # bad input fails here, before data is read
    loop = Loop(cfg, run_dir, resume_from, started=start_time)
    t, acc, state = cfg.train, loop.accelerator, loop.state
    for line in (note, elastic_restart_advice(), busy_machine_advice(),
                 probe_header(loop.task.train_size) if t.cache_features else ""):
        if line:
            acc.print(line)
    summary: dict[str, Any] = {}
    loop.model.train()
    last_epoch = state.get("stopped_early") or t.epochs  # a run stopped early is finished
    with StopSignals(t.stop_signals, acc.num_processes) as stop, contextlib.closing(loop):  # closing: its workers
        for epoch in range(state["epoch"] + 1, last_epoch + 1):
            if t.cache_features:  # the head fitted once on the backbone's features, in place of the steps
                fit_head(loop)
                stopped = False
            else:
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
            if state.get("stopped_early"):
                acc.print(f"stopped early after epoch {epoch}: {'ema_' if loop.ema is not None else ''}val_"
                          f"{loop.task.select} has not improved for {epoch - state['best_epoch']} epochs, its best at "
                          f"epoch {state['best_epoch']} (train.early_stop_patience={t.early_stop_patience})")
                break
            if epoch == stop_after_epoch:
                break
    acc.end_training()
    finished = state["epoch"] == t.epochs or bool(state.get("stopped_early"))
    if acc.is_main_process and finished:
        if t.curves:
            plot_curves(loop.metrics_file, run_dir / "curves.png")
        if loop.task.finish is not None:
            loop.task.finish(loop.plain_model, run_dir)
    if not summary and finished:
        acc.print(f"{run_dir} holds a finished run ({state['epoch']} epochs"
                  f"{', stopped early' if state.get('stopped_early') else ''}): nothing to train")
        summary = last_eval(loop.metrics_file)
    result = {**summary, "best_metric": state["best_metric"], "best_epoch": state["best_epoch"],
              "epochs_done": state["epoch"], "run_dir": str(run_dir),
              **({"stopped_early": state["stopped_early"]} if state.get("stopped_early") else {}),
              "wall_time": loop.wall_time_before + time.time() - start_time}  # the run's: its earlier commands' too
    if finished:
        if acc.is_main_process:
            ckpt.write_json(run_dir / "summary.json", summary_of(result))
        acc.print(result_line(result, loop.task.select, "val" in loop.eval_loaders, run_dir))
        if t.calibrate:  # the finished run's model, fitted on its validation split as vitlab calibrate does
            from ..evaluation import calibrate_checkpoint

            calibrate_checkpoint(run_dir, objective=t.calibrate_objective)
    return result
