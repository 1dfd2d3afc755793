"""Where a run continues from: the run directory and checkpoint a command resumes, vetted before any data
is read (a changed config is one line, except the keys that do not change the result), the trainer state
to restore, and what an interrupted run kept."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import checkpoint as ckpt
from ..config import Config, config_to_flat, load_config
from ..errors import CheckpointError, ConfigError
from ..tasks.image_data import streamed_at_own_size

__all__ = ["RESULT_NEUTRAL_KEYS", "SAMPLE_KEYS", "result_neutral", "newest_checkpoint", "resolve_resume",
           "refuse_other_samples", "refuse_other_budget", "refuse_fixed_keys", "FIXED_KEYS", "find_resume_point",
           "resume_state", "interrupted_message"]


# Keys that change how a run is watched, stored or stopped, never its numbers: train.resume=auto
# continues a run across a change of them and says which changed. data.in_memory too, where it does not
# change the pixels (:func:`result_neutral`).
RESULT_NEUTRAL_KEYS = frozenset({"train.resume", "train.log_with", "train.stop_signals", "train.log_every",
                                 "train.save_every", "train.save_every_steps", "train.keep_last", "data.num_workers",
                                 "data.in_memory", "train.curves"})


def result_neutral(key: str, cfg: Config) -> bool:
    """Whether a change of ``key`` leaves ``cfg``'s numbers as they were: one of :data:`RESULT_NEUTRAL_KEYS`,
    but not ``data.in_memory`` where streamed images are cropped at their own sizes and held ones are stored at one
    size first (:func:`~vitlab.tasks.image_data.streamed_at_own_size`)."""
    if key == "data.in_memory" and hasattr(cfg.data, "train_crop") and streamed_at_own_size(cfg.data):
        return False
    return key in RESULT_NEUTRAL_KEYS


def newest_checkpoint(run_dir: Path) -> Path | None:
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
    checkpoint = newest_checkpoint(path)
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


def refuse_other_samples(cfg: Config, checkpoint: Path) -> None:
    """Refuse, in one line, ``--resume CHECKPOINT key=value`` that changes a key deciding the samples of an
    epoch (:data:`SAMPLE_KEYS`) from a checkpoint written inside one: that epoch would continue on other
    samples than it began with. At an epoch's end any change starts the next epoch cleanly."""
    state = ckpt.read_json(checkpoint / "trainer_state.json")
    if not state.get("epoch_step") or not (checkpoint / "run_config.yaml").is_file():
        return
    saved, wanted = config_to_flat(load_config(checkpoint / "run_config.yaml", recorded=True)), config_to_flat(cfg)
    changed = [f"{k} {saved.get(k)} -> {wanted.get(k)}" for k in SAMPLE_KEYS if saved.get(k) != wanted.get(k)]
    if changed:
        epoch = state["epoch"] + 1
        raise ConfigError(f"--resume {checkpoint}: {', '.join(changed)} inside epoch {epoch} (the checkpoint is at its "
                          f"step {state['epoch_step']}) would continue that epoch on other samples than it began with; "
                          f"finish epoch {epoch} as it was (--resume {checkpoint} train.epochs={epoch}), then change it")


# Keys a continued run keeps: its task (a masked autoencoder's checkpoint is no DINO's); the optimizer's state is of
# its kind (AdamW's moments are not SGD's momentum, nor
# Adafactor's factored statistics), and best/, a plateau schedule and early stopping compare every epoch with the
# best value of one validation metric. The optimizer's other settings (optim.lr, weight_decay, betas, eps,
# momentum) may change: the state is kept and they apply from the next step (checkpoint.load_optimizer).
FIXED_KEYS = ("task", "optim.opt", "train.best_metric", "train.greater_is_better")


# Model arguments that shape no weight: a continued run may change them (the others are its architecture).
SHAPELESS_MODEL_ARGS = frozenset({"drop_path_rate", "drop_rate", "attn_drop_rate", "proj_drop_rate", "pos_drop_rate"})


def refuse_fixed_keys(cfg: Config, checkpoint: Path, run_dir: Path) -> None:
    """Refuse, in one line, ``--resume RUN key=value`` that changes a key of :data:`FIXED_KEYS`, or the model's
    architecture (``model.name``, an argument that shapes weights: ``model.img_size``, ``model.depth``, ...), before
    any data is read."""
    if not (checkpoint / "run_config.yaml").is_file():
        return
    recorded = load_config(checkpoint / "run_config.yaml", recorded=True)
    saved, wanted = config_to_flat(recorded), config_to_flat(cfg)
    changed = [f"{k} {saved.get(k)!r} -> {wanted.get(k)!r}" for k in FIXED_KEYS if saved.get(k) != wanted.get(k)]
    if changed:
        raise ConfigError(_fixed_keys_refusal(changed, run_dir))
    before, after = {"name": recorded.model.name, **recorded.model.args}, {"name": cfg.model.name, **cfg.model.args}
    shaped = [f"model.{k} {before.get(k)!r} -> {after.get(k)!r}" for k in sorted(before.keys() | after.keys())
              if k not in SHAPELESS_MODEL_ARGS and before.get(k) != after.get(k)]
    if shaped:
        raise ConfigError(f"--resume {run_dir}: {', '.join(shaped)}: the checkpoint holds the weights of the model the "
                          f"run began with; keep its model.* keys, or start a new run from its weights: "
                          f"model.pretrained={run_dir}")


def refuse_other_budget(cfg: Config, checkpoint: Path, run_dir: Path) -> None:
    """Refuse, in one line, ``--resume RUN train.budget_minutes=B`` with another budget than the run began with (or
    none): a budget chose the run's length as it began (:mod:`~vitlab.training.budget`), and is not chosen again."""
    if not cfg.train.budget_minutes or not (checkpoint / "run_config.yaml").is_file():
        return
    began = load_config(checkpoint / "run_config.yaml", recorded=True).train.budget_minutes
    chosen = ckpt.read_json(checkpoint / "trainer_state.json").get("budget_epochs")
    if began != cfg.train.budget_minutes or chosen is None:
        length = (f"its budget of {began:g} minutes chose {chosen} epochs" if chosen is not None
                  else "it began without one")
        raise ConfigError(f"--resume {run_dir}: train.budget_minutes {began:g} -> {cfg.train.budget_minutes:g}: a "
                          f"budget chooses a run's length as the run begins, and {length}; keep train.budget_minutes="
                          f"{began:g}, or set its length yourself with train.budget_minutes=0 train.epochs=N")


def refuse_task_change(checkpoint: Path, overrides: list[str], run_dir: str | Path) -> None:
    """Refuse ``--resume RUN task=OTHER`` in the line :func:`refuse_fixed_keys` gives, before the run's own config is
    read as another task's (whose sections it has not)."""
    wanted = [item.split("=", 1)[1].strip() for item in overrides if item.startswith("task=")]
    saved = load_config(checkpoint / "run_config.yaml", recorded=True).task
    if wanted and wanted[-1] != saved:
        raise ConfigError(_fixed_keys_refusal([f"task {saved!r} -> {wanted[-1]!r}"], run_dir))


def _fixed_keys_refusal(changed: list[str], run_dir: str | Path) -> str:
    return (f"--resume {run_dir}: {', '.join(changed)}: a run continues with the task, the optimizer and the "
            f"validation metric it began with (the optimizer's state is of its kind; best/ and early stopping compare "
            f"with the best value of one metric); keep them, or start a new run from its weights: "
            f"model.pretrained={run_dir}")


def find_resume_point(cfg: Config, resume: str | Path | None) -> tuple[Path, Path | None, str]:
    """The run directory, the checkpoint to continue from (None: a new run) and a line to print about
    it (or ''), decided before any data is read.

    ``resume`` (a run directory, or a checkpoint in one) continues that run with ``cfg`` as it is now
    (more epochs, say). Otherwise ``train.output_dir`` decides. With ``train.resume: auto`` a directory
    holding a run (a checkpoint, or the ``config.yaml`` a run writes first) must hold ``cfg``'s run: the
    keys that differ are one line, except the result-neutral ones (:func:`result_neutral`), which are continued across and
    named; the run continues from its newest checkpoint, or starts anew if it died before its first.
    With ``train.resume: no`` any run there is refused.
    """
    if resume is not None:
        run_dir, checkpoint = resolve_resume(resume)
        cfg.train.output_dir = str(run_dir)
        refuse_fixed_keys(cfg, checkpoint, run_dir)
        refuse_other_samples(cfg, checkpoint)
        refuse_other_budget(cfg, checkpoint, run_dir)
        return run_dir, checkpoint, ""
    run_dir = Path(cfg.train.output_dir)
    checkpoint = newest_checkpoint(run_dir)
    saved_file = checkpoint / "run_config.yaml" if checkpoint is not None else run_dir / "config.yaml"
    if cfg.train.resume == "no":
        if checkpoint is not None or saved_file.is_file() or (run_dir / "metrics.jsonl").exists():
            raise ConfigError(f"train.output_dir={str(run_dir)!r} already holds a run and train.resume=no; continue "
                              f"it with train.resume=auto (or --resume {run_dir}), or choose another train.output_dir")
        return run_dir, None, ""
    if not saved_file.is_file():
        return run_dir, None, ""
    saved, wanted = config_to_flat(load_config(saved_file, recorded=True)), config_to_flat(cfg)
    changed = [k for k in sorted(saved.keys() | wanted.keys()) if saved.get(k) != wanted.get(k)]
    differ = [f"{k}: {saved.get(k)!r} there, {wanted.get(k)!r} now" for k in changed if not result_neutral(k, cfg)]
    if differ:
        raise ConfigError(f"train.output_dir={str(run_dir)!r} holds a run with another config ({'; '.join(differ)}); "
                          f"run its own config to continue it, change it on purpose with --resume {run_dir} "
                          f"key=value, or choose another train.output_dir")
    neutral = [f"{k} {saved.get(k)} -> {wanted.get(k)}" for k in changed if k != "train.resume"]
    note = f"continuing with keys that do not change the result changed: {', '.join(neutral)}" if neutral else ""
    return run_dir, checkpoint, note if checkpoint is not None else ""


def resume_state(resume_from: Path, run_dir: Path) -> dict[str, Any]:
    """The trainer state of ``last/``, with the best metric of ``best/`` when it exists: ``best/`` may
    have been written after ``last/`` (with ``train.save_every > 1``) and must not be overwritten by
    a worse epoch after the resume."""
    state = ckpt.read_json(resume_from / "trainer_state.json")
    best_file = run_dir / "checkpoints" / "best" / "trainer_state.json"
    if best_file.is_file():
        best = ckpt.read_json(best_file)
        state.update(best_metric=best["best_metric"], best_epoch=best["best_epoch"])
    return state


def interrupted_message(run_dir: str | Path) -> str:
    """What an interrupted run (Ctrl-C, a crash) kept and lost, and how to continue it."""
    checkpoint = newest_checkpoint(Path(run_dir))
    if checkpoint is None:
        return (f"interrupted: {run_dir} holds no checkpoint yet, so this run is lost; the same command starts it "
                f"again")
    state = ckpt.read_json(checkpoint / "trainer_state.json")
    where = f"epoch {state['epoch'] + 1}, step {state['epoch_step']}" if state["epoch_step"] else \
        f"the end of epoch {state['epoch']}"
    return (f"interrupted: kept {checkpoint} (step {state['global_step']}, {where}); the steps after it are lost "
            f"(a stop signal, SIGTERM, would have kept them); the same command continues from it")
