"""A search space: a YAML of config keys, each a range or a list of choices, checked against the config before a
trial starts.

    optim.lr: {low: 1.0e-4, high: 3.0e-3, log: true}   # a float key: a float range (log: sampled on a log scale)
    model.depth: {low: 2, high: 6}                      # an int key: an int range (step: 1 unless given)
    data.mixup_alpha: [0.0, 0.2, 0.8]                   # any key: one of these values

A key the config does not have, a range of the wrong type for its key, and a value the config's rules refuse are
one line each: every range's ends and every choice are loaded into the base config once, before the first trial.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from ..config import load_config
from ..errors import ConfigError
from ..models.registry import model_argument

__all__ = ["Dimension", "read_space", "suggest", "overrides_of", "base_values"]


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One key's range (``low``, ``high``, ``log``, ``step``; ``kind`` 'int' or 'float') or its ``choices``; ``base``:
    the value the base config gives the key, its model preset's where it sets none (``has_base`` False where that is
    not known: a timm model's own defaults)."""

    key: str
    kind: str                       # 'int', 'float' or 'choice'
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] = ()
    base: Any = None
    has_base: bool = False

    def values_to_check(self) -> list[Any]:
        return list(self.choices) if self.kind == "choice" else [self.low, self.high]


def _default(cfg: Any, key: str) -> Any:
    """The value ``key`` (``section.name``) holds in ``cfg``; AttributeError if it is no field (a model's
    constructor arguments are ``cfg.model.args``)."""
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _dimension(key: str, spec: Any, default: Any) -> Dimension:
    where = f"space: {key}"
    if isinstance(spec, list):
        if not spec:
            raise ConfigError(f"{where}: an empty list of choices; give at least one value")
        return Dimension(key, "choice", choices=tuple(spec))
    if not isinstance(spec, dict) or set(spec) - {"low", "high", "log", "step"} or not {"low", "high"} <= set(spec):
        raise ConfigError(f"{where}: {spec!r} is neither a list of choices nor {{low: ..., high: ..., log: false, "
                          f"step: ...}}")
    if isinstance(default, bool) or not isinstance(default, (int, float)):
        raise ConfigError(f"{where}: a range, but the key holds {type(default).__name__} values; give a list of "
                          f"choices, e.g. [{default!r}]")
    kind = "int" if isinstance(default, int) else "float"
    low, high, log, step = spec["low"], spec["high"], bool(spec.get("log", False)), spec.get("step")
    numbers = (low, high) + ((step,) if step is not None else ())
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in numbers):
        raise ConfigError(f"{where}: low, high and step must be numbers, got {spec!r}")
    if kind == "int" and any(not float(v).is_integer() for v in numbers):
        raise ConfigError(f"{where} holds integers: give integer low/high/step, got {spec!r}")
    if not low < high:
        raise ConfigError(f"{where}: low={low} must be below high={high}")
    if log and low <= 0:
        raise ConfigError(f"{where}: a log range needs low > 0, got low={low}")
    if log and step is not None:
        raise ConfigError(f"{where}: give log or step, not both (Optuna samples a log range without steps)")
    if step is not None and step <= 0:
        raise ConfigError(f"{where}: step={step} must be > 0")
    cast = int if kind == "int" else float
    return Dimension(key, kind, cast(low), cast(high), log, None if step is None else cast(step))


def read_space(path: str | Path, base: str | Path, overrides: list[str]) -> list[Dimension]:
    """The dimensions of the space in ``path``, each checked against the config ``base`` with ``overrides``: the key
    exists, the range fits its type, and each end or choice passes the config's rules. Raises ``ConfigError``
    (one line) otherwise, before any trial."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--space {path}: no such file; write a YAML of config keys, e.g. "
                          f"'optim.lr: {{low: 1.0e-4, high: 3.0e-3, log: true}}'")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"--space {path}: expected a mapping of config keys to ranges or lists of choices")
    cfg = load_config(base, overrides)
    dimensions = []
    for key, spec in raw.items():
        has_base, own = True, None
        try:
            default = own = _default(cfg, key)
        except AttributeError:
            if key.startswith("model.") and key.count(".") == 1:  # a constructor argument of the preset
                has_base, own = model_argument(cfg.model.name, key[6:], **cfg.model.args)
                default = cfg.model.args.get(key[6:], spec.get("low") if isinstance(spec, dict) else None)
            else:
                load_config(base, [*overrides, f"{key}={_literal(spec)}"])  # names the keys close to it
                raise ConfigError(f"space: {key} is not a config key") from None
        dimension = _dimension(key, spec, default)
        for value in dimension.values_to_check():
            try:
                load_config(base, [*overrides, f"{key}={_literal(value)}"])
            except ConfigError as e:
                raise ConfigError(f"space: {key}={value!r} is refused by the config: {e}") from None
        dimensions.append(dataclasses.replace(dimension, base=own, has_base=has_base))
    return dimensions


def base_values(dimensions: list[Dimension]) -> dict[str, Any]:
    """The base config's own value of each dimension's key, each in its range (on its step) or among its choices:
    the trial ``vitlab tune --base-first`` asks first. Raises ``ConfigError`` (one line) for one that is not, or whose
    value is not known (a timm model's own default)."""
    values = {}
    for d in dimensions:
        where = f"--base-first: the base config's {d.key}={d.base!r}"
        if not d.has_base:
            raise ConfigError(f"--base-first: the base config's {d.key} is the model's own default, which vitlab "
                              f"does not know (a timm model's): set it in the config, or drop --base-first")
        if d.kind == "choice" and d.base not in d.choices:
            raise ConfigError(f"{where} is not among the space's choices {list(d.choices)}: add it, or drop "
                              f"--base-first")
        if d.kind != "choice":
            steps = (d.base - d.low) / d.step if d.step else 0.0
            if not d.low <= d.base <= d.high or abs(steps - round(steps)) > 1e-9:
                raise ConfigError(f"{where} lies outside the space's range [{d.low:g}, {d.high:g}]"
                                  f"{f' (step {d.step:g})' if d.step else ''}: widen it, or drop --base-first")
        values[d.key] = d.base
    return values


def _literal(value: Any) -> str:
    """``value`` as an override's right-hand side (YAML, as config overrides are parsed)."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def suggest(trial: Any, dimensions: list[Dimension]) -> dict[str, Any]:
    """A trial's values, one a dimension, drawn by the study's sampler: ``{key: value}``."""
    values = {}
    for d in dimensions:
        if d.kind == "choice":
            values[d.key] = trial.suggest_categorical(d.key, list(d.choices))
        elif d.kind == "int":
            values[d.key] = trial.suggest_int(d.key, int(d.low), int(d.high), step=int(d.step or 1), log=d.log)
        else:
            values[d.key] = trial.suggest_float(d.key, d.low, d.high, step=d.step, log=d.log)
    return values


def overrides_of(values: dict[str, Any]) -> list[str]:
    """``{key: value}`` as config overrides ``key=value``."""
    return [f"{key}={_literal(value)}" for key, value in values.items()]
