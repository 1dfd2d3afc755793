"""A run's configuration read: a YAML file (or a dict of the same form) and ``section.key=value`` overrides onto
the typed sections (:mod:`vitlab.schema`), every value coerced to its key's type, unknown keys named with close
matches; then every rule checked (:mod:`.rules`, then the task's own: :mod:`vitlab.tasks.registry`, which also says
each task's data section, models and sections). And written back: as YAML, as a dict, as flat keys."""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from ..errors import ConfigError, close_matches
from ..models import list_models, preset_class
from ..models.timm_classifier import TIMM_PREFIX, TimmClassifier, timm_problem
from ..schema import Config, DataConfig, DINOConfig, DistillConfig, GenerateConfig, MAEConfig, ModelConfig, \
    MonitorConfig, OptimConfig, TrainConfig
from ..tasks.registry import TASKS, get_task
from .rules import check_values

__all__ = ["load_config", "apply_overrides", "config_to_dict", "config_to_flat", "save_config"]


_SECTIONS = ("model", "data", "optim", "train", "generate", "distill", "mae", "dino", "monitor")
_SECTION_TYPES = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "train": TrainConfig,
                  "generate": GenerateConfig, "distill": DistillConfig, "mae": MAEConfig, "dino": DINOConfig,
                  "monitor": MonitorConfig}
# Set by the data and tokenizer, or by the task's own section (mae.mask_ratio), not by the model section.
_DERIVED_MODEL_ARGS = {"src_vocab_size", "tgt_vocab_size", "pad_id", "bos_id", "eos_id", "vocab_size", "block_size",
                       "mask_ratio", "norm_pix_loss"}


def _owned_sections() -> set[str]:
    """The sections of one kind of run alone (its registry entry's): written and read for it, refused in any
    other; asked of the registry each time, so that a task registered later counts."""
    return {name for task in TASKS.values() for name in task.sections}


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a type annotation; accept ints for floats and lists for tuples."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if isinstance(value, bool) and ("no" if not value else "yes") in allowed:
            value = "no" if not value else "yes"  # YAML 1.1 reads an unquoted no / yes as a boolean
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not allowed; expected one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r} has the wrong type; expected {_type_name(annotation)}")
    if origin is tuple:
        args = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}={value!r} has the wrong type; expected a list of {len(args)} numbers")
        return tuple(_coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} has the wrong type; expected a list")
        (arg,) = typing.get_args(annotation)
        return [_coerce(f"{key}[{i}]", v, arg) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} has the wrong type; expected a mapping")
        return value
    if annotation is type(None):
        if value is not None:
            raise ConfigError(f"{key}={value!r}: expected null")
        return None
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if annotation is int and isinstance(value, bool) or not isinstance(value, annotation):
        raise ConfigError(f"{key}={value!r} has the wrong type; expected {_type_name(annotation)}, "
                          f"got {type(value).__name__}")
    return value


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


_MODEL_OPTIONS = ["name", "pretrained", "pretrained_file", "grad_checkpointing", "freeze", "lora_r", "lora_alpha",
                  "lora_dropout", "lora_targets"]


def _task_presets(task: str) -> list[str]:
    return [n for n in list_models() if preset_class(n).__name__ in get_task(task).models]


def _build_model_section(raw: dict[str, Any], task: str) -> ModelConfig:
    raw = dict(raw)
    default = get_task(task).default_model
    name = _coerce("model.name", raw.pop("name", default), str)
    if name.startswith(TIMM_PREFIX):
        return _timm_model_section(name, raw, task)
    presets = _task_presets(task)
    if name not in presets:
        raise ConfigError(f"model.name={name!r} is not a {task} preset{close_matches(name, presets)} "
                          f"(available: {', '.join(presets)})")
    hints = {k: v for k, v in typing.get_type_hints(preset_class(name).__init__).items()
             if k != "return" and k not in _DERIVED_MODEL_ARGS}
    option_types = typing.get_type_hints(ModelConfig)
    options = {key: _coerce(f"model.{key}", raw.pop(key), option_types[key])
               for key in _MODEL_OPTIONS[1:] if key in raw}
    args = dict(raw.pop("args", {}) or {})
    args.update(raw)
    for key, value in args.items():
        if key not in hints:
            raise ConfigError(f"unknown key model.{key}{close_matches(key, list(hints) + _MODEL_OPTIONS)} "
                              f"(model keys: {', '.join(_MODEL_OPTIONS)}, {', '.join(hints)})")
        args[key] = _coerce(f"model.{key}", value, hints[key])
    return ModelConfig(name=name, args=args, **options)


def _timm_model_section(name: str, raw: dict[str, Any], task: str) -> ModelConfig:
    """``model.name: timm:<name>``: timm's classifier; its arguments are timm's, checked by timm when the
    model is built (before any data is read), those vitlab sets itself (classes, input size) here."""
    if not get_task(task).timm:
        raise ConfigError(f"model.name={name!r}: timm models are image classifiers, and this is a {task} config")
    problem = timm_problem(name.removeprefix(TIMM_PREFIX))
    if problem:
        raise ConfigError(f"model.name={name!r}: {problem}")
    option_types = typing.get_type_hints(ModelConfig)
    options = {key: _coerce(f"model.{key}", raw.pop(key), option_types[key])
               for key in _MODEL_OPTIONS[1:] if key in raw}
    args = dict(raw.pop("args", {}) or {})
    args.update(raw)
    hints = typing.get_type_hints(TimmClassifier.__init__)
    for key in ("num_classes", "img_size", "in_chans"):
        if key in args:
            args[key] = _coerce(f"model.{key}", args[key], hints[key])
    return ModelConfig(name=name, args=args, **options)


def _build_section(name: str, raw: Any, task: str) -> Any:
    cls = get_task(task).data if name == "data" else _SECTION_TYPES[name]
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"section {name!r} must be a mapping of keys to values, got {raw!r}")
    if cls is ModelConfig:
        return _build_model_section(raw, task)
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in raw.items():
        if key not in hints:
            raise ConfigError(f"unknown key {name}.{key}{close_matches(key, hints)} (allowed: {', '.join(hints)})")
        values[key] = _coerce(f"{name}.{key}", value, hints[key])
    return cls(**values)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key.sub=value (e.g. train.epochs=5)")
    key, text = item.split("=", 1)
    path = key.strip().split(".")
    if len(path) != 2 or not all(path):
        raise ConfigError(f"override key {key!r} must be section.key (e.g. optim.lr=1e-3)")
    return path, yaml.safe_load(text) if text.strip() else ""


def apply_overrides(raw: dict[str, Any], overrides: typing.Sequence[str]) -> dict[str, Any]:
    """``overrides`` (``section.key=value``, the value YAML; ``task=NAME``) written into a config's YAML mapping
    ``raw`` in place, as the command line gives them; returns ``raw``."""
    for item in overrides:
        if item.startswith("task="):
            raw["task"] = item.split("=", 1)[1]
            continue
        (section, key), value = _parse_override(item)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raw[section] = {}
        raw[section][key] = value
    return raw


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = (),
                base: dict[str, Any] | None = None, recorded: bool = False) -> Config:
    """Read a YAML config (or ``base``, a dict of the same form), apply overrides, validate.

    An ``optim.lr`` given beside ``optim.lr_base`` is the learning rate, as timm's ``--lr`` beside its
    ``--lr-base``: ``optim.lr_base`` becomes 0. ``recorded``: ``path`` is a config a run wrote
    (``run_config.yaml``), taken as it ran: there (every key written) ``optim.lr_base`` keeps its meaning, and
    only an ``optim.lr`` among ``overrides`` wins over it.

    Raises:
        ConfigError: on a missing file, unknown key, wrong type or invalid value.
    """
    raw: dict[str, Any] = {}
    if base is not None:
        raw = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            folder = path.parent if path.parent.is_dir() else Path("configs")
            shipped = sorted(str(p) for p in folder.glob("*.yaml")) if folder.is_dir() else []
            raise ConfigError(f"config file {str(path)!r} does not exist"
                              + (f"; the configs in {folder}: {', '.join(shipped)}" if shipped else ""))
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}".splitlines()[0]) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(path)!r} must be a mapping of sections, got {type(raw).__name__}")
    lr_given = not recorded and isinstance(raw.get("optim"), dict) and "lr" in raw["optim"]
    apply_overrides(raw, overrides)
    for section in raw:
        if section not in (*_SECTIONS, "task"):
            raise ConfigError(f"unknown section {section!r}{close_matches(section, _SECTIONS)} "
                              f"(sections: task, {', '.join(_SECTIONS)})")
    task = get_task(raw.get("task", Config.task)).name
    for section in raw:
        if section in _owned_sections() and section not in get_task(task).sections:
            owners = " or ".join(t.name for t in TASKS.values() if section in t.sections)
            raise ConfigError(f"section {section!r} is read by task: {owners} runs alone, and this is a task: {task} "
                              f"config; remove it, or set task: {owners.split(' or ')[0]}")
    cfg = Config(task=task, **{name: _build_section(name, raw.get(name), task) for name in _SECTIONS})
    if lr_given or "optim.lr" in {item.split("=", 1)[0].strip() for item in overrides}:
        cfg.optim.lr_base = 0.0
    check_values(cfg)
    if get_task(task).check is not None:
        get_task(task).check(cfg)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain YAML-able data; the model section in its YAML form (name + arguments)."""
    out: dict[str, Any] = {"task": cfg.task}
    out.update({name: dataclasses.asdict(getattr(cfg, name)) for name in _SECTIONS
                if name not in _owned_sections() or name in get_task(cfg.task).sections})
    m = cfg.model
    out["model"] = {"name": m.name, **{k: getattr(m, k) for k in _MODEL_OPTIONS[1:] if getattr(m, k)}, **m.args}
    if cfg.optim.lr_base:  # optim.lr would win over it when the file is read again
        del out["optim"]["lr"]
    for section in out.values():
        if not isinstance(section, dict):
            continue
        for key, value in section.items():
            if isinstance(value, tuple):
                section[key] = list(value)
    return out


def config_to_flat(cfg: Config) -> dict[str, Any]:
    """The config as ``{"section.key": value}``, values that are not numbers, strings or booleans as strings:
    what trackers log as hyperparameters and what a resume compares."""
    flat: dict[str, Any] = {}
    for section, values in config_to_dict(cfg).items():
        for key, value in (values.items() if isinstance(values, dict) else [("", values)]):
            name = f"{section}.{key}" if key else section
            flat[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
