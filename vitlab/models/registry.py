"""Named model presets: ``create_model(name, **overrides)`` and ``list_models()``.

The ImageNet presets have timm's names and exactly timm's shapes and parameter counts. The CIFAR
presets run on 32x32 images cut into 4x4 patches (64 patch tokens + CLS = 65 tokens). The
``transformer_*`` presets are text encoder-decoders (:class:`vitlab.models.Seq2SeqTransformer`); they
need ``src_vocab_size`` and ``tgt_vocab_size``, as do the ``rnn_attention_*`` RNN encoder-decoders
(:class:`vitlab.models.RNNSeq2Seq`). The ``gpt_*`` presets are decoder-only language models
(:class:`vitlab.models.GPT`); they need ``vocab_size``. ``timm:<name>`` is timm's image classifier
``<name>`` (:class:`vitlab.models.TimmClassifier`), built without pretrained weights. ``mae_<preset>`` and
``dino_<preset>`` pretrain a ViT preset's backbone without labels (:class:`vitlab.models.MaskedAutoencoder`,
:class:`vitlab.models.DINO`). :func:`load_model`
builds a saved model from its ``config.json``'s architecture (one of the classes here).
"""
from __future__ import annotations

import difflib
import fnmatch
import inspect
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..errors import CheckpointError
from .dino import DINO
from .gpt import GPT
from .hub import load_model_dir, read_json, resolve_checkpoint, trained_names
from .mae import MaskedAutoencoder
from .rnn import RNNSeq2Seq
from .timm_classifier import TIMM_PREFIX, TimmClassifier
from .transformer import Seq2SeqTransformer
from .vit import VisionTransformer

__all__ = ["create_model", "list_models", "model_args", "model_argument", "preset_class", "model_class", "load_model"]

_PRESETS: dict[str, dict[str, Any]] = {
    # timm's ImageNet ViTs (224x224, 16x16 patches, 1000 classes).
    "vit_tiny_patch16_224": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "vit_small_patch16_224": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "vit_base_patch16_224": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
    # DeiT's distilled models (a distillation token and head), DeiT III (LayerScale, positions for the
    # patches only) and registers, as timm defines them.
    "deit_tiny_distilled_patch16_224": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3, distilled=True),
    "deit_small_distilled_patch16_224": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6, distilled=True),
    "deit_base_distilled_patch16_224": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12, distilled=True),
    "deit3_small_patch16_224": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6, no_embed_class=True,
                                    init_values=1e-6),
    "deit3_base_patch16_224": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12, no_embed_class=True,
                                   init_values=1e-6),
    "vit_base_patch16_reg4_gap_256": dict(img_size=256, patch_size=16, embed_dim=768, depth=12, num_heads=12,
                                          class_token=False, no_embed_class=True, global_pool="avg", reg_tokens=4),
    "vit_small_patch14_reg4_dinov2": dict(img_size=518, patch_size=14, embed_dim=384, depth=12, num_heads=6,
                                          init_values=1e-5, reg_tokens=4, no_embed_class=True, num_classes=0),
    # CIFAR-sized ViTs (32x32, 4x4 patches, 10 classes).
    "vit_cifar_tiny_patch4_32": dict(img_size=32, patch_size=4, num_classes=10, embed_dim=96, depth=4,
                                     num_heads=3, mlp_ratio=2.0),
    "vit_lite_7_patch4_32": dict(img_size=32, patch_size=4, num_classes=10, embed_dim=256, depth=7,
                                 num_heads=4, mlp_ratio=2.0),
    "vit_cifar_small_patch4_32": dict(img_size=32, patch_size=4, num_classes=10, embed_dim=384, depth=7,
                                      num_heads=6, mlp_ratio=2.0),
}

_TEXT_PRESETS: dict[str, dict[str, Any]] = {
    # The paper's base model (Vaswani et al. 2017, Table 3): 512 wide, 6 + 6 layers, post-norm.
    "transformer_base": dict(d_model=512, num_heads=8, num_encoder_layers=6, num_decoder_layers=6,
                             dim_feedforward=2048, dropout=0.1, norm_first=False),
    # Small model for Multi30k-sized data (~9M parameters with an 8k joint vocabulary).
    "transformer_small": dict(d_model=256, num_heads=4, num_encoder_layers=3, num_decoder_layers=3,
                              dim_feedforward=1024, dropout=0.1, norm_first=True),
    # For the synthetic tasks (copy, reverse, sort): trains in a minute on a CPU.
    "transformer_tiny": dict(d_model=64, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
                             dim_feedforward=256, dropout=0.0, norm_first=True),
}
_RNN_PRESETS: dict[str, dict[str, Any]] = {
    # Bahdanau et al.'s shape scaled to Multi30k: 256-d embeddings, 512-d decoder, bidirectional 2 x 256 encoder.
    "rnn_attention_small": dict(embed_dim=256, hidden_dim=512, dropout=0.3, score="additive"),
    # For the synthetic tasks.
    "rnn_attention_tiny": dict(embed_dim=64, hidden_dim=128, dropout=0.0, score="additive"),
}

_LM_PRESETS: dict[str, dict[str, Any]] = {
    # nanoGPT's shakespeare-char model: 6 layers, 6 heads, 384 wide, context 256, dropout 0.2 (10.7M + embeddings).
    "gpt_char_small": dict(block_size=256, embed_dim=384, depth=6, num_heads=6, dropout=0.2),
    # nanoGPT's documented CPU recipe: 4 layers, 4 heads, 128 wide, context 64, no dropout.
    "gpt_char_tiny": dict(block_size=64, embed_dim=128, depth=4, num_heads=4, dropout=0.0),
}
# Self-supervised pretraining (task: mae, task: dino) of a ViT preset's backbone: mae_<preset>, dino_<preset>.
# MAE's decoder is about half the encoder's width (ViT-B: 512 of 768, 8 blocks; smaller encoders fewer blocks).
_BACKBONE_ARGS = ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias",
                  "drop_path_rate", "norm_eps")
_MAE_DECODERS = {"vit_base_patch16_224": (512, 8, 16), "vit_small_patch16_224": (256, 4, 8),
                 "vit_tiny_patch16_224": (128, 4, 4), "vit_cifar_small_patch4_32": (192, 2, 6),
                 "vit_lite_7_patch4_32": (128, 2, 4), "vit_cifar_tiny_patch4_32": (48, 2, 2)}
_MAE_PRESETS: dict[str, dict[str, Any]] = {
    f"mae_{name}": {**{k: v for k, v in _PRESETS[name].items() if k in _BACKBONE_ARGS},
                    "decoder_embed_dim": width, "decoder_depth": depth, "decoder_num_heads": heads}
    for name, (width, depth, heads) in _MAE_DECODERS.items()}
# DINO's head: 65536 outputs for ImageNet; 4096 for the CIFAR-sized backbones (a smaller data set, fewer prototypes).
_DINO_PRESETS: dict[str, dict[str, Any]] = {
    f"dino_{name}": {**{k: v for k, v in _PRESETS[name].items() if k in _BACKBONE_ARGS},
                     "out_dim": 4096 if name.endswith("_32") else 65536,
                     **({"hidden_dim": 512, "bottleneck_dim": 128} if name.endswith("_32") else {})}
    for name in _MAE_DECODERS}
_PRESETS.update(_TEXT_PRESETS)
_PRESETS.update(_RNN_PRESETS)
_PRESETS.update(_LM_PRESETS)
_PRESETS.update(_MAE_PRESETS)
_PRESETS.update(_DINO_PRESETS)


def list_models(pattern: str = "*") -> list[str]:
    """Preset names matching a shell-style ``pattern`` (e.g. ``'*cifar*'``), sorted."""
    return sorted(n for n in _PRESETS if fnmatch.fnmatch(n, pattern))


def preset_class(name: str) -> type[nn.Module]:
    """The class preset ``name`` builds: ``VisionTransformer``, ``Seq2SeqTransformer``, ``RNNSeq2Seq``, ``GPT``,
    ``MaskedAutoencoder`` or ``DINO`` (``TimmClassifier`` for ``timm:<name>``)."""
    if name.startswith(TIMM_PREFIX):
        return TimmClassifier
    if name not in _PRESETS:
        close = difflib.get_close_matches(name, _PRESETS, n=3, cutoff=0.4)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(f"unknown model {name!r}; {hint}available: {', '.join(list_models())}")
    if name in _TEXT_PRESETS:
        return Seq2SeqTransformer
    if name in _MAE_PRESETS or name in _DINO_PRESETS:
        return MaskedAutoencoder if name in _MAE_PRESETS else DINO
    return RNNSeq2Seq if name in _RNN_PRESETS else GPT if name in _LM_PRESETS else VisionTransformer


_CLASSES: dict[str, type[nn.Module]] = {c.__name__: c for c in (VisionTransformer, Seq2SeqTransformer, RNNSeq2Seq, GPT,
                                                                 TimmClassifier, MaskedAutoencoder, DINO)}


def model_class(architecture: str) -> type[nn.Module]:
    """The model class named ``architecture`` (a ``config.json``'s ``"architecture"``)."""
    if architecture not in _CLASSES:
        raise ValueError(f"unknown architecture {architecture!r}; vitlab has {', '.join(_CLASSES)}")
    return _CLASSES[architecture]


def model_args(name: str, **overrides: Any) -> dict[str, Any]:
    """The constructor arguments of preset ``name`` with ``overrides`` applied (for ``timm:<name>``, timm's
    model ``<name>`` and the overrides, which timm checks when it builds the model)."""
    cls = preset_class(name)
    if cls is TimmClassifier:
        return {"name": name.removeprefix(TIMM_PREFIX), **overrides}
    allowed = tuple(inspect.signature(cls).parameters)
    unknown = [k for k in overrides if k not in allowed]
    if unknown:
        raise ValueError(f"unknown model argument(s) {unknown} for {name!r}; {cls.__name__} takes {', '.join(allowed)}")
    return {**_PRESETS[name], **overrides}


def model_argument(name: str, argument: str, **overrides: Any) -> tuple[bool, Any]:
    """What preset ``name`` built with ``overrides`` passes as ``argument`` (an override, the preset's value, else the
    class's default): ``(True, value)``, or ``(False, None)`` where vitlab does not know it (a timm model's own
    defaults, or an argument the class does not take)."""
    if argument in overrides:
        return True, overrides[argument]
    cls = preset_class(name)
    if cls is TimmClassifier:
        return False, None
    if argument in _PRESETS[name]:
        return True, _PRESETS[name][argument]
    parameter = inspect.signature(cls).parameters.get(argument)
    if parameter is None or parameter.default is parameter.empty:
        return False, None
    return True, parameter.default


def create_model(name: str, pretrained: bool = False, **overrides: Any) -> nn.Module:
    """Build preset ``name`` (see :func:`list_models`), with any ``VisionTransformer`` argument overridden.

    Example: ``create_model('vit_small_patch16_224', num_classes=10, drop_path_rate=0.1)``; any timm
    classifier: ``create_model('timm:resnet18', num_classes=10, img_size=32)``.
    vitlab ships no pretrained weights: for timm's, use
    ``vitlab.interop.from_timm(timm.create_model(name, pretrained=True))``.
    """
    if pretrained:
        raise ValueError(
            "vitlab ships no pretrained weights (pretrained=True); load timm's instead: "
            f"vitlab.interop.from_timm(timm.create_model({name!r}, pretrained=True))")
    args = model_args(name, **overrides)
    cls = preset_class(name)
    missing = [k for k, p in inspect.signature(cls).parameters.items()
               if p.default is p.empty and p.kind != p.VAR_KEYWORD and k not in args]
    if missing:
        raise ValueError(f"model {name!r} needs {', '.join(missing)} (e.g. create_model({name!r}, "
                         f"{', '.join(f'{k}=...' for k in missing)}))")
    return cls(**args)


def load_model(path: str | Path, use_ema: bool = True, map_location: str | torch.device = "cpu") -> nn.Module:
    """Load a trained model from a run directory (its best checkpoint), a checkpoint directory or a
    ``save_pretrained`` directory.

    The model comes back in eval mode with ``model.pretrained_cfg`` describing its input: for a ViT
    the input size, normalization and class names (``vitlab.create_transform(model)`` gives the
    preprocessing); for a text model the task and tokenizer file. For a model on the Hugging Face
    Hub use its class: ``vitlab.models.VisionTransformer.from_pretrained("user/repo")``.

    Args:
        path: Run directory, checkpoint directory or ``save_pretrained`` directory.
        use_ema: Load the EMA weights when the run kept them.
        map_location: Device for the weights.

    Raises:
        CheckpointError: if the checkpoint is missing, incomplete or corrupt.
    """
    directory = resolve_checkpoint(path)
    meta = read_json(directory / "config.json")
    try:
        cls = model_class(meta.get("architecture", ""))
    except (ValueError, AttributeError):
        raise CheckpointError(f"{str(directory / 'config.json')!r} does not describe a vitlab model") from None
    return load_model_dir(cls, directory, meta, use_ema=use_ema, map_location=map_location,
                          before_weights=_lora_base(meta) if meta.get("lora") else None)


def _lora_base(meta: dict) -> Callable[[nn.Module], set[str]]:
    """For a LoRA checkpoint (adapters and head alone): the base model's weights from its source, then peft's
    layers on it; the names the checkpoint holds."""
    from .lora import add_lora
    from .pretrained import load_pretrained

    def prepare(model: nn.Module) -> set[str]:
        base = meta["base"]
        load_pretrained(model, base["pretrained"], base.get("pretrained_file", ""), meta.get("preset"))
        add_lora(model, **meta["lora"])
        return trained_names(model)
    return prepare
