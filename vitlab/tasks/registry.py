"""Every kind of run vitlab trains, one entry each: the config section it reads its data from, the models it takes
and the one it defaults to, the sections it alone reads, the function that builds it, its own config checks, and
what ``vitlab eval`` does with its runs. The config (:mod:`vitlab.config`), the training loop (:mod:`vitlab.training`)
and evaluation (:mod:`vitlab.evaluation`) consult it; they name no task themselves. A new task is a module of its
own and one entry here, as a model is in timm's registry.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from accelerate import Accelerator
from torch import nn

from ..errors import ConfigError
from ..schema import Config, DataConfig, LMDataConfig, ModelConfig, TextDataConfig
from . import dino, lm, mae, pretraining, seq2seq
from .base import EvalRequest, Resumed, TaskSetup
from .classification import evaluation as classification_evaluation
from .classification.task import check_classification, classification_validation, image_classification_task

__all__ = ["Task", "TASKS", "get_task", "EVAL_OPTIONS"]

# What each of ``vitlab eval``'s options is for, said when a run's task does not take it.
EVAL_OPTIONS = {"knn": "an image model", "tta": "an image classifier", "adjust_logits": "an image classifier",
                "predictions": "an image classifier"}


@dataclass(frozen=True)
class Task:
    """One kind of run.

    Attributes:
        name: Its ``task:`` in a config.
        data: The schema of its ``data`` section.
        models: The classes of the model presets it trains (``timm:<name>`` classifiers too, where ``timm``).
        default_model: Its ``model.name`` when a config gives none.
        build: ``build(cfg, accelerator, micro_batch, run_dir, resumed) -> TaskSetup``: the task ready to train,
            ``micro_batch`` the global batch of one step, ``resumed`` the checkpoint it goes on from (or None).
        evaluate: ``evaluate(request, cfg, model) -> metrics``: ``vitlab eval`` of one of its runs.
        sections: The config sections it alone reads (written and read for it, refused in any other task's config).
        check: ``check(cfg)``: its rules beside each section's (:mod:`vitlab.config.rules`); one line each.
        validation: ``validation(cfg)``: '' when ``cfg`` holds out a validation split, else what to set for one
            (said when a key reads it: ``train.best_metric``, early stopping, ...); None: it always holds one out.
        eval_options: The options of ``vitlab eval`` it takes, of :data:`EVAL_OPTIONS`.
        calibrates: ``vitlab calibrate`` fits its temperature or thresholds.
        timm: It trains timm's classifiers (``model.name: timm:<name>``) too.
        device_views: It makes its views a batch at a time where the model is (``data.views: device``).
    """

    name: str
    data: type
    models: tuple[str, ...]
    default_model: str
    build: Callable[[Config, Accelerator, int, Path, Resumed | None], TaskSetup]
    evaluate: Callable[[EvalRequest, Config, nn.Module], dict[str, Any]]
    sections: tuple[str, ...] = ()
    check: Callable[[Config], None] | None = None
    validation: Callable[[Config], str] | None = None
    eval_options: tuple[str, ...] = ()
    calibrates: bool = False
    timm: bool = False
    device_views: bool = False


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("classification", DataConfig, ("VisionTransformer",), ModelConfig.name, image_classification_task,
         classification_evaluation.evaluate_run, check=check_classification, validation=classification_validation,
         eval_options=("knn", "tta", "adjust_logits", "predictions"), calibrates=True, timm=True),
    Task("seq2seq", TextDataConfig, ("Seq2SeqTransformer", "RNNSeq2Seq"), "transformer_tiny", seq2seq.seq2seq_task,
         seq2seq.evaluate_run),
    Task("lm", LMDataConfig, ("GPT",), "gpt_char_tiny", lm.lm_task, lm.evaluate_run),
    Task("mae", DataConfig, ("MaskedAutoencoder",), "mae_vit_cifar_tiny_patch4_32", mae.mae_task,
         pretraining.evaluate_run, sections=("mae", "monitor"), check=mae.check_mae,
         validation=pretraining.monitor_validation, eval_options=("knn",), device_views=True),
    Task("dino", DataConfig, ("DINO",), "dino_vit_cifar_tiny_patch4_32", dino.dino_task, pretraining.evaluate_run,
         sections=("dino", "monitor"), check=dino.check_dino, validation=pretraining.monitor_validation,
         eval_options=("knn",), device_views=True),
)}


def get_task(name: str) -> Task:
    """The task ``name``.

    Raises:
        ConfigError: one line naming the tasks there are, if there is none of that name.
    """
    if not isinstance(name, str) or name not in TASKS:
        raise ConfigError(f"task={name!r} is not allowed; expected one of {', '.join(map(repr, TASKS))}")
    return TASKS[name]
