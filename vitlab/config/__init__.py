"""Run configuration: YAML files mapped onto typed dataclasses, with ``key.sub=value`` overrides.

Every key is checked before anything runs: unknown keys (with close matches), wrong types and
invalid values raise :class:`ConfigError`, whose message names the key, the value and what is
allowed. :mod:`vitlab.schema`: the sections and what each key means (re-exported here); :mod:`.loading`: reading,
coercing and writing them; :mod:`.rules`: the values each key may take, by section; each task's own rules are its
entry's in :mod:`vitlab.tasks.registry`.
"""
from ..errors import ConfigError
from ..schema import Config, DataConfig, DistillConfig, GenerateConfig, LMDataConfig, ModelConfig, OptimConfig, \
    TextDataConfig, TrainConfig
from .loading import config_to_dict, config_to_flat, load_config, save_config

__all__ = ["ConfigError", "Config", "ModelConfig", "DataConfig", "TextDataConfig", "LMDataConfig", "OptimConfig",
           "TrainConfig", "GenerateConfig", "DistillConfig", "load_config", "config_to_dict", "config_to_flat",
           "save_config"]
