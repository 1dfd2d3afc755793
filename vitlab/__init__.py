"""vitlab: Vision Transformers on one shared attention core.

Public API: ``VisionTransformer``, ``create_model``, ``list_models``, ``load_model``,
``create_transform``; submodules ``attention`` (the attention core), ``layers``, ``vit``,
``interop`` (timm / torch.nn converters), ``config``, ``data``, ``training``, ``checkpoint``.
"""
from .checkpoint import load_model
from .data import create_transform
from .registry import create_model, list_models
from .vit import VisionTransformer

__version__ = "0.1.0"
__all__ = ["VisionTransformer", "create_model", "list_models", "load_model", "create_transform", "__version__"]
