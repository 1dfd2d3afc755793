"""vitlab: Vision Transformers on one shared attention core.

Public API: ``VisionTransformer``, ``create_model``, ``list_models``, ``load_model``,
``create_transform``, ``unknown_scores``. The packages, lowest first (a lower one never imports a higher one): the
foundation (``errors``, ``schema``: the config's typed sections, ``runtime``, ...), ``attention`` (the one core and its
variants), ``layers`` (norms, MLPs, MoE, positions, blocks), ``models`` (ViT, encoder-decoder, language model, RNN,
MAE, DINO; registry), ``data``, ``inference`` (the one evaluation view and forward pass), ``tasks`` (one entry a task
in ``tasks.registry``: classification, seq2seq, lm, mae, dino); then the engine:
``config``, ``training``, ``checkpoint``, ``evaluation``, ``prediction``, ``inspection``, ``serving``, ``export``,
``interop``, ``cli``.
"""
from .checkpoint import load_model
from .data import create_transform
from .models import VisionTransformer, create_model, list_models

__version__ = "0.1.0"
__all__ = ["VisionTransformer", "create_model", "list_models", "load_model", "create_transform", "unknown_scores",
           "__version__"]


def __getattr__(name: str):  # noqa: ANN202  (imported when first asked for: it brings the evaluation's machinery)
    if name == "unknown_scores":
        from .unknown import unknown_scores

        return unknown_scores
    raise AttributeError(f"module 'vitlab' has no attribute {name!r}")
