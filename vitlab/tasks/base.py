"""What the training loop needs from a task (:class:`TaskSetup`), what a task is given when it goes on from a
checkpoint (:class:`Resumed`) and when ``vitlab eval`` evaluates one of its runs (:class:`EvalRequest`). The loop
(``vitlab.training``) is the same for every task; a task (:mod:`.classification`, :mod:`.seq2seq`, :mod:`.lm`,
:mod:`.mae`, :mod:`.dino`) only says how to build, batch and score."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from accelerate import Accelerator
from torch import Tensor, nn

from ..errors import ConfigError
from ..models import create_model
from ..models.freeze import freeze_parameters

if TYPE_CHECKING:
    from ..schema import Config

__all__ = ["TaskSetup", "Resumed", "EvalRequest", "build_model", "resumed_statistics"]


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run goes on from, read by the training engine before the task is built.

    Attributes:
        directory: The checkpoint (``checkpoints/last``); where a task finds files of its own it saved there
            (``save_files``: a tokenizer).
        meta: Its ``config.json``: what inference needs, the normalization the run keeps among it.
        data_state: What the data fixed when the run started (``TaskSetup.data_state``, kept in
            ``trainer_state.json``): the held-out test split, the epoch plan's partitions of streamed shards.
    """

    directory: Path
    meta: dict[str, Any]
    data_state: dict[str, Any]


@dataclass(frozen=True)
class EvalRequest:
    """What ``vitlab eval`` asks of a run: the split, and the options its task takes (its registry entry's
    ``eval_options``; the others are refused before the model is read).

    Attributes:
        directory: The checkpoint evaluated; ``given``: as the user named it (a run, ``best/``, ``last/``).
        output: The metrics' JSON file, beside which a classifier's other files go (else the checkpoint).
        predictions: A classifier's CSV of every image's probabilities.
        adjust_logits: A classifier's logit adjustment ``tau`` (Menon et al. 2021).
        tta: A classifier's test-time augmentation (``none``, ``flip``, ``crops``).
        knn: The neighbours of an image model's k-NN vote (0: none).
    """

    directory: Path
    given: str
    split: str
    batch_size: int
    output: Path | None = None
    predictions: Path | None = None
    adjust_logits: float | None = None
    tta: str = "none"
    knn: int = 0


def resumed_statistics(d: Any, resumed: Resumed) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The image normalization a resumed run keeps: its checkpoint's ``mean`` and ``std`` (``config.json``).

    Raises:
        ConfigError: one line, if ``data.mean`` / ``data.std`` (``d``) are given otherwise.
    """
    meta = resumed.meta
    for key in ("mean", "std"):
        given = getattr(d, key)
        if given is not None and tuple(given) != tuple(meta[key]):
            raise ConfigError(f"data.{key}={list(given)} differs from the run's {list(meta[key])} (its checkpoint "
                              f"{resumed.directory}); resume with the run's statistics, or start a new run (another "
                              f"train.output_dir)")
    return tuple(meta["mean"]), tuple(meta["std"])


def build_model(cfg: Config, **derived: Any) -> nn.Module:
    """The model of ``cfg.model`` plus arguments the data decides (vocabulary sizes, special ids), with
    gradient checkpointing as ``model.grad_checkpointing`` says and frozen as ``model.freeze`` says; invalid
    arguments raise :class:`ConfigError` naming the preset and the overrides."""
    try:
        model = create_model(cfg.model.name, **derived, **cfg.model.args)
        model.set_grad_checkpointing(cfg.model.grad_checkpointing)
    except ValueError as e:
        raise ConfigError(f"model ({cfg.model.name} with {cfg.model.args or 'no overrides'}): {e}") from None
    freeze_parameters(model, cfg.model.freeze)
    if cfg.model.lora_r:  # the targets checked now, before any image is decoded; the adapters come after the weights
        from ..models.lora import check_lora_targets

        check_lora_targets(model, cfg.model.lora_targets)
    return model


@dataclass
class TaskSetup:
    """A task ready to train.

    Attributes:
        model: The model, not yet prepared.
        train_loader: A DataLoader of training batches.
        prepare_train_loader: Let Accelerate shard the train loader (False when the task's own
            batch sampler already gives each process its part; its batches then go to the device
            in ``loss``).
        eval_loaders: Named evaluation loaders: ``'val'`` (held-out training data; picks ``best/``)
            if the run has a validation split, and ``'test'`` (reported, never used to choose).
        prepare_eval_loaders: Let Accelerate shard them (False for loaders that shard themselves).
        final_eval_loaders: Loaders that stand in for ``eval_loaders``' of the same name at the run's last
            evaluation (its final epoch, or the one it stops early at), prepared alike: the whole test split,
            whose metric the run reports, where each epoch's evaluation decodes a part (``generate.eval_subset``).
        loss: ``loss(prepared_model, batch) -> scalar``: the **mean** of the per-example (per-token)
            losses of this process's batch.
        count: ``count(batch) -> int``: how many examples (tokens) ``loss`` is the mean of. The loop
            weighs each batch's mean by its share of the optimizer step's global count, so a step's
            loss is the mean over its whole global batch however it is split across processes and
            accumulation steps.
        evaluate: ``evaluate(model, prepared_loader, accelerator) -> {metric: value}``; every process
            gets the same numbers.
        select: The metric (a key of ``evaluate``'s result) that picks the best checkpoint on the
            ``'val'`` loader; without one no best checkpoint is kept.
        select_lower: Lower ``select`` is better (a loss); default: higher (an accuracy).
        meta: What inference needs besides the architecture, stored in the checkpoint's
            ``config.json`` (class names and normalization; the task and languages).
        train_size: Training examples (for a language model: tokens) per epoch, for the logs.
        save_files: ``save_files(checkpoint_directory)`` writes the task's own files (a tokenizer).
        data_state: What the data fixed when the run started and a resumed run must keep (the epoch
            plan's partitions of streamed shards), saved as ``data`` in ``trainer_state.json``.
        metrics: The names ``evaluate`` returns, where the task declares them (``train.best_metric`` is
            checked against them before training); empty: checked at the first evaluation.
        feature_loader: With ``train.cache_features``: the training images as evaluation shows them, each
            once (prepared with the evaluation loaders), whose features the head is fitted on.
        features: ``features(model, prepared_loader, accelerator) -> (features (N, E), labels (N,))``: the
            model's pooled pre-logits features of the loader's images, on every process.
        before_step: ``before_step(step)``: the optimizer step ``step`` (0-based, counted over the run) is about to
            run (a schedule the loss reads: DINO's teacher temperature), after a resume too.
        after_step: ``after_step(model, step)``: step ``step`` has updated the weights of ``model`` (the bare
            model): DINO's teacher follows its student.
        finish: ``finish(model, run_dir)``: the run is finished; on the main process, what it leaves beside its
            checkpoints (MAE's picture of reconstructions).
    """

    model: nn.Module
    train_loader: Any
    prepare_train_loader: bool
    eval_loaders: dict[str, Any]
    prepare_eval_loaders: bool
    loss: Callable[[nn.Module, Any], Tensor]
    count: Callable[[Any], int]
    evaluate: Callable[[nn.Module, Any, Accelerator], dict[str, float]]
    select: str
    meta: dict[str, Any]
    train_size: int
    save_files: Callable[[Path], None] = field(default=lambda directory: None)
    select_lower: bool = False
    data_state: dict[str, Any] = field(default_factory=dict)
    metrics: tuple[str, ...] = ()
    feature_loader: Any = None
    features: Callable[[nn.Module, Any, Accelerator], tuple[Tensor, Tensor]] | None = None
    final_eval_loaders: dict[str, Any] = field(default_factory=dict)
    before_step: Callable[[int], None] | None = None
    after_step: Callable[[nn.Module, int], None] | None = None
    finish: Callable[[nn.Module, Path], None] | None = None
