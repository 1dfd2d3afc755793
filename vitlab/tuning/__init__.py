"""Hyperparameter search (``vitlab tune``): an Optuna study over a config's keys, each trial an ordinary run chosen
on a validation metric (:func:`tune`; the space: :mod:`vitlab.tuning.space`)."""
from .space import Dimension, read_space
from .study import tune

__all__ = ["tune", "read_space", "Dimension"]
