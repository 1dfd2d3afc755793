"""Starting a ViT from pretrained weights (fine-tuning), the way timm does it.

:func:`load_pretrained` fills a :class:`VisionTransformer` built for the new task (its preset, image
size and number of classes) from one of:

- ``timm:<name>``: timm's pretrained weights for ``<name>`` (``timm.create_model(name, pretrained=True)``,
  downloaded by timm, or read offline from ``file`` as timm reads a local file),
  converted with :func:`vitlab.interop.from_timm`;
- a ``.safetensors``, ``.pth`` or ``.bin`` file of a timm or vitlab ViT (timm's ``load_state_dict``
  reads both, and timm's checkpoint dicts);
- a vitlab run, checkpoint or ``save_pretrained`` directory; of a self-supervised run (``task: mae``, ``task:
  dino``), its backbone (the MAE encoder, DINO's teacher), the decoder or projection head dropped.

The positional embedding is resampled to the model's patch grid (:func:`checkpoint_filter_fn`), a head
of another size is reset (:meth:`VisionTransformer.reset_classifier`), and everything else must fit
exactly. The returned ``pretrained_cfg`` says how the weights expect images to be normalised.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from ..errors import CheckpointError, ConfigError
from .hub import CONFIG_NAME, load_model_dir, read_json, resolve_checkpoint
from .interop import from_timm, from_transformers
from .dino import DINO
from .mae import MaskedAutoencoder
from .timm_classifier import TIMM_PREFIX, TimmClassifier
from .vit import checkpoint_filter_fn

__all__ = ["load_pretrained", "timm_model", "timm_filter", "pretrained_architecture", "take_pretrained_architecture"]

# The arguments that shape a ViT's weights: what a classifier must share with the backbone it starts from.
_BACKBONE_KEYS = ("patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias", "class_token", "reg_tokens",
                  "mlp_layer", "norm_layer", "qk_norm", "init_values")
_HEAD = ("head.weight", "head.bias", "head_dist.weight", "head_dist.bias")  # head_dist: a distilled model's


def timm_model(name: str, file: str, key: str = "model.pretrained_file") -> nn.Module:
    """timm's ``name`` with its pretrained weights: fetched by timm, or read from ``file`` (offline; a
    head of the file's number of classes, as a fine-tuned model or a vitlab ``timm:<name>`` run has). Its
    ``pretrained_cfg`` is timm's for the name, with the mean and std of the ``config.json`` beside a
    checkpoint's ``model.safetensors`` / ``ema.safetensors`` (a vitlab run's own statistics).

    A file is loaded here the way timm's ``load_pretrained`` loads a local file (its ``load_state_dict``,
    then the model module's ``checkpoint_filter_fn``) rather than through
    ``pretrained_cfg_overlay=dict(file=...)``: timm 1.0.29 hands such a file to its JAX ``.npz`` loader
    when the registry entry has ``custom_load`` (the augreg ViTs), and fails.
    """
    import timm
    from timm.models import load_state_dict

    if not file:
        return timm.create_model(name, pretrained=True)
    path = Path(file).expanduser()
    if not path.is_file():
        raise CheckpointError(f"{key}={file!r} does not exist")
    model = timm.create_model(name, pretrained=False)  # the pretrained_cfg of name's tag all the same
    try:
        state = load_state_dict(str(path))
    except Exception as e:  # noqa: BLE001 (a corrupt file raises whatever its reader raises)
        raise CheckpointError(f"cannot read {key}={file!r}: {type(e).__name__}: {e}") from None
    state = timm_filter(state, model)
    heads = model.pretrained_cfg.get("classifier") or ()
    for head in (heads,) if isinstance(heads, str) else heads:  # a head of the file's classes (a fine-tuned model's)
        weight = state.get(f"{head}.weight")
        if weight is not None and weight.shape[0] != model.num_classes:
            model.reset_classifier(weight.shape[0])
            break
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise CheckpointError(f"{key}={file!r} does not hold timm's {name!r}: {' '.join(lines[1:2] or lines)[:300]}"
                              ) from None
    beside = path.parent / CONFIG_NAME  # the weights of a timm:<name> run vitlab trained: its run's statistics
    meta = read_json(beside) if path.name in ("model.safetensors", "ema.safetensors") and beside.is_file() else {}
    if meta.get("mean") is not None and meta.get("std") is not None:
        model.pretrained_cfg = {**model.pretrained_cfg, "mean": tuple(meta["mean"]), "std": tuple(meta["std"])}
    return model


def timm_filter(state: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """``state`` adapted to timm's ``model`` by timm itself: the ``checkpoint_filter_fn`` of the model's module,
    where it has one (a ViT's: ``pos_embed`` resampled to the model's patch grid, ``patch_embed`` to its patch
    size), as timm's ``load_pretrained`` does."""
    filter_fn = getattr(sys.modules[type(model).__module__], "checkpoint_filter_fn", None)
    return filter_fn(state, model) if filter_fn is not None else state


def _head_keys(model: nn.Module) -> tuple[str, ...]:
    """The weights of ``model``'s classifier heads: reset, not loaded, when the classes differ."""
    if not isinstance(model, TimmClassifier):
        return _HEAD
    heads = model.model.pretrained_cfg.get("classifier") or ()
    return tuple(f"{h}.{p}" for h in ((heads,) if isinstance(heads, str) else heads) for p in ("weight", "bias"))


def _from_timm(name: str, file: str, convert: bool = True) -> tuple[dict[str, Tensor], dict[str, Any]]:
    try:
        reference = timm_model(name, file)
    except RuntimeError as e:
        if "Unknown model" in str(e):
            raise CheckpointError(f"model.pretrained=timm:{name}: timm has no model {name!r}") from None
        raise
    except OSError as e:  # no network, no cache: huggingface_hub's errors are OSErrors
        raise CheckpointError(f"could not fetch timm's weights for {name!r} ({type(e).__name__}); without network, "
                              f"download them elsewhere and set model.pretrained_file=<the .safetensors file>") from None
    cfg = reference.pretrained_cfg
    try:
        state = from_timm(reference).state_dict() if convert else reference.state_dict()
    except ValueError as e:
        raise CheckpointError(f"model.pretrained=timm:{name}: {e}") from None
    return state, {"mean": tuple(cfg["mean"]), "std": tuple(cfg["std"])}


def _from_file(path: Path, model_name: str | None) -> tuple[dict[str, Tensor], dict[str, Any]]:
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    from timm.models import get_pretrained_cfg, load_state_dict

    try:
        state = load_state_dict(str(path))
    except Exception as e:  # noqa: BLE001 (a corrupt file raises whatever its reader raises)
        raise CheckpointError(f"could not read weights from {str(path)!r}: {e}") from None
    # A bare file says nothing about normalisation: timm's default config of the same name if timm has
    # one (vitlab's ImageNet presets have timm's names), else ImageNet's statistics.
    cfg = get_pretrained_cfg(model_name.removeprefix(TIMM_PREFIX)) if model_name else None
    mean, std = (cfg.mean, cfg.std) if cfg is not None else (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
    return state, {"mean": tuple(mean), "std": tuple(std)}


_TRANSFORMERS_KINDS = "ViTForImageClassification, ViTModel, DeiTForImageClassificationWithTeacher, " \
                      "ViTMAEForPreTraining"


def _transformers_config(source: str) -> Any:
    """A transformers checkpoint's config (a Hub id or a ``save_pretrained`` directory), of a kind vitlab reads.

    Raises:
        CheckpointError: one line, without transformers, for a config that cannot be read, or another kind."""
    try:
        import transformers
    except ImportError:
        raise CheckpointError(f"model.pretrained=transformers:{source} needs the transformers library: "
                              f"pip install 'vitlab[transformers]'") from None
    try:
        config = transformers.AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"model.pretrained=transformers:{source}: {str(e).splitlines()[0]}") from None
    if config.model_type not in ("vit", "deit", "vit_mae"):
        raise CheckpointError(f"model.pretrained=transformers:{source} is a {config.model_type} checkpoint; vitlab "
                              f"reads ViT, DeiT and ViTMAE ({_TRANSFORMERS_KINDS})")
    return config


def pretrained_architecture(source: str) -> dict[str, Any]:
    """The ViT arguments ``model.pretrained`` fixes, read from its config as ``from_pretrained`` reads it: for
    ``transformers:<id or directory>`` its patch size, width, depth, heads, MLP ratio, query/key/value bias,
    layer-norm eps, a distilled DeiT's distillation token and head, and for a DeiT without its teacher head the
    distillation token as a register
    (:func:`~vitlab.models.interop.from_transformers` builds the same); nothing for other sources (their
    architecture is the preset's). The input size stays the run's (the positions are resampled).

    Raises:
        CheckpointError: one line, for a config that cannot be read or of another kind.
    """
    if not source.startswith("transformers:"):
        return {}
    c = _transformers_config(source.removeprefix("transformers:"))
    arch = (c.architectures or [""])[0]
    patch = tuple(c.patch_size) if isinstance(c.patch_size, (list, tuple)) else c.patch_size
    args = dict(patch_size=patch, embed_dim=c.hidden_size, depth=c.num_hidden_layers,
                num_heads=c.num_attention_heads, mlp_ratio=c.intermediate_size / c.hidden_size,
                qkv_bias=bool(c.qkv_bias), norm_eps=c.layer_norm_eps)
    if arch == "DeiTForImageClassificationWithTeacher":
        args["distilled"] = True  # its distillation token and head
    elif c.model_type == "deit":
        args["reg_tokens"] = 1  # the distillation token without its head: a register with a position of its own
    return args


def take_pretrained_architecture(model: Any) -> None:
    """Complete a config's model section ``model`` (its ``name``, ``pretrained``, ``args``) with the architecture its
    ``pretrained`` weights fix (:func:`pretrained_architecture`), as ``from_pretrained`` builds a model from its
    checkpoint: a run's config holds it before the run is looked for, so the same config continues the run. A key
    given with another value is one line naming both.

    Raises:
        ConfigError: one line, for a key that contradicts the checkpoint's config.
    """
    if not model.pretrained or model.name.startswith(TIMM_PREFIX):
        return
    fixed, given = pretrained_architecture(model.pretrained), model.args
    conflicts = [f"model.{k}={given[k]} (the checkpoint's: {v})" for k, v in fixed.items() if k in given and
                 (tuple(given[k]) if isinstance(given[k], list) else given[k]) != v]
    if conflicts:
        raise ConfigError(f"model.pretrained={model.pretrained} fixes the architecture, and this config gives "
                          f"{', '.join(conflicts)}: leave those keys out (the checkpoint's config is read) or start "
                          f"from another checkpoint")
    model.args = {**fixed, **given}


def _from_transformers(source: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A transformers ViT or DeiT checkpoint (a Hub id or a ``save_pretrained`` directory) as vitlab weights
    (:func:`~vitlab.models.interop.from_transformers`) and its normalization (its image processor's, else
    ViT's 0.5)."""
    import transformers

    config = _transformers_config(source)
    default = {"vit": "ViTModel", "deit": "DeiTModel", "vit_mae": "ViTMAEModel"}[config.model_type]
    arch = (config.architectures or [default])[0]
    cls = getattr(transformers, arch, None)
    if cls is None or arch not in _TRANSFORMERS_KINDS + ", DeiTForImageClassification, DeiTModel, ViTMAEModel":
        raise CheckpointError(f"model.pretrained=transformers:{source} holds a {arch}; vitlab reads "
                              f"{_TRANSFORMERS_KINDS}")
    extra = {"add_pooling_layer": False} if arch in ("ViTModel", "DeiTModel") else {}
    vit = from_transformers(cls.from_pretrained(source, **extra))
    if isinstance(vit, MaskedAutoencoder):  # the encoder, the decoder dropped
        vit = vit.backbone()
    try:
        processor = transformers.AutoImageProcessor.from_pretrained(source)
        mean, std = tuple(processor.image_mean), tuple(processor.image_std)
    except (OSError, ValueError, AttributeError):  # no image processor saved: the model's own normalization
        mean, std = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)) if config.model_type == "vit_mae" else \
            ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))  # MAE's ImageNet statistics; ViT's 0.5
    return vit.state_dict(), {"mean": mean, "std": std}


# Self-supervised models (task: mae, task: dino): what fine-tuning starts from is their backbone, the rest dropped.
_PRETRAINING_MODELS = {cls.__name__: cls for cls in (MaskedAutoencoder, DINO)}


def _from_vitlab(path: Path, cls: type[nn.Module]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A vitlab run's weights; of a self-supervised run (MAE, DINO) its backbone's (the encoder; DINO's teacher),
    with the backbone's arguments (``"backbone"``) for a message where they do not fit."""
    directory = resolve_checkpoint(path)
    meta = read_json(directory / CONFIG_NAME)
    pretraining = meta.get("architecture") in _PRETRAINING_MODELS
    source = load_model_dir(_PRETRAINING_MODELS.get(meta.get("architecture"), cls), directory, meta)
    cfg = source.pretrained_cfg
    if pretraining:
        source = source.backbone()
        cfg = {**cfg, "backbone": {k: v for k, v in source.config.items() if k not in ("num_classes", "img_size")}}
    if "mean" not in cfg:
        raise CheckpointError(f"{str(directory)!r} does not say how its images were normalised (no mean/std in "
                              f"{CONFIG_NAME}); load its weights file instead: {directory / 'model.safetensors'}")
    return source.state_dict(), {k: cfg[k] for k in ("mean", "std", "backbone") if k in cfg}


def load_pretrained(model: nn.Module, source: str, file: str = "", model_name: str | None = None) -> dict[str, Any]:
    """Load pretrained weights into ``model`` in place; returns ``{"mean", "std", "source"}``.

    Args:
        model: The ViT (or :class:`TimmClassifier`) to fill, already built for the new task.
        source: ``timm:<name>``, ``transformers:<Hub id or directory>`` (a ViT or DeiT checkpoint), a weights
            file, or a vitlab run / checkpoint / ``save_pretrained`` directory.
        file: With ``timm:<name>``, a local copy of timm's weights for that name (offline).
        model_name: The preset ``model`` was built from (for a bare file's normalisation).

    Raises:
        CheckpointError: if the weights cannot be had, or do not fit ``model`` (other than its head).
    """
    vit = not isinstance(model, TimmClassifier)  # a timm model loads timm's weights as they are
    if source.startswith("timm:"):
        state, cfg = _from_timm(source.removeprefix("timm:"), file, convert=vit)
    elif source.startswith("transformers:"):
        state, cfg = _from_transformers(source.removeprefix("transformers:"))
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            state, cfg = _from_vitlab(path, type(model))
        elif path.is_file():
            state, cfg = _from_file(path, model_name)
        else:
            raise CheckpointError(f"model.pretrained={source!r} is neither timm:<name>, a weights file nor a "
                                  f"vitlab run or save_pretrained directory")
    registers = state["reg_token"].shape[1] if "reg_token" in state else 0
    if vit and registers != getattr(model, "num_reg_tokens", 0):  # before the positions are resampled by count
        deit = " (a DeiT's distillation token without its head is read as one)" if source.startswith("transformers:") \
            else ""
        raise CheckpointError(f"model.pretrained={source!r} holds {registers} register token(s){deit} and the model "
                              f"{getattr(model, 'num_reg_tokens', 0)}: set model.reg_tokens={registers}")
    # pos_embed resampled to the model's patch grid: by vitlab's filter, or a timm model's by timm's own
    state = checkpoint_filter_fn(state, model) if vit else timm_filter(state, model.model)
    own, head = model.state_dict(), _head_keys(model)
    reset_head = any(k in own and (k not in state or state[k].shape != own[k].shape) for k in head)
    state = {k: v for k, v in state.items() if not (k in head and (reset_head or k not in own))}
    mismatched = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in state.items()
                  if k in own and v.shape != own[k].shape]
    missing = [k for k in own if k not in state and not (reset_head and k in head)]
    unexpected = [k for k in state if k not in own]
    if mismatched or missing or unexpected:
        found = "; ".join(f"{what} {names[:4]}" for what, names in
                          (("shapes differ:", mismatched), ("missing", missing), ("unexpected", unexpected)) if names)
        fix = "choose the model.name of the pretrained architecture"
        if "backbone" in cfg:  # a self-supervised run: the classifier's arguments are its encoder's
            fix = "give the classifier the backbone's arguments: " + " ".join(
                f"model.{k}={v}" for k, v in cfg["backbone"].items() if k in _BACKBONE_KEYS)
        raise CheckpointError(f"model.pretrained={source!r} does not fit {model_name or 'the model'} ({found}); {fix}")
    model.load_state_dict(state, strict=False)
    if reset_head:
        model.reset_classifier(model.num_classes)
    return {**{k: v for k, v in cfg.items() if k != "backbone"}, "source": source}
