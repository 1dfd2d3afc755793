"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") through the ``peft`` library:
``W x + (alpha / r) B A x`` on the linear layers named by ``targets`` (by default the attention's ``qkv`` and
``proj``), ``A`` and ``B`` the only weights of the model that train besides its head.

peft injects its ``LoraLayer`` into the model in place (``inject_adapter_in_model``: the model stays a vitlab
or timm model, its names gaining ``.base_layer`` and ``.lora_A/B.default``), so training, checkpoints and
evaluation see the same model; a run saves the adapters and the head alone (``config.json``'s ``lora`` and
``base`` say how to rebuild the rest), and :func:`merge_lora` folds them into plain linear layers for export.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from ..errors import ConfigError

__all__ = ["DEFAULT_TARGETS", "check_lora_targets", "add_lora", "merge_lora", "merged_copy", "has_lora"]

DEFAULT_TARGETS = ["attn.qkv", "attn.proj"]


def _matches(name: str, target: str) -> bool:
    """peft's rule for a list of target names: the module's whole name, or its last dotted parts."""
    return name == target or name.endswith(f".{target}")


def check_lora_targets(model: nn.Module, targets: Sequence[str]) -> None:
    """Every one of ``targets`` names a linear layer of ``model``, or one line with the names it has."""
    linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    unmatched = [t for t in targets if not any(_matches(name, t) for name in linear)]
    if unmatched:
        ends = sorted({".".join(name.split(".")[-2:]) for name in linear})
        raise ConfigError(f"model.lora_targets={list(unmatched)} match no module of the model; its linear layers end "
                          f"in {', '.join(ends[:12])}")


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError("model.lora_r needs the peft library: pip install 'vitlab[lora]'") from None
    return peft


def add_lora(model: nn.Module, r: int, alpha: float, dropout: float = 0.0,
             targets: Sequence[str] = tuple(DEFAULT_TARGETS)) -> int:
    """Inject peft's LoRA layers of rank ``r`` (scale ``alpha / r``, ``dropout`` on their input) into the linear
    layers ``targets`` name, in place; everything else is frozen but the head (``get_classifier()``), which
    trains in full. Returns how many scalars train."""
    peft = _peft()
    check_lora_targets(model, targets)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets), bias="none")
    peft.inject_adapter_in_model(config, model)
    heads = model.get_classifier()
    for head in heads if isinstance(heads, tuple) else (heads,):
        head.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def has_lora(model: nn.Module) -> bool:
    return any(".lora_A." in name for name, _ in model.named_parameters())


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA layer's ``(alpha / r) B A`` into its base layer's weight and put the plain base layer
    back in its place (``merge_and_unload``): a model without peft's layers, its outputs unchanged. In place."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
    return model


def merged_copy(model: nn.Module) -> nn.Module:
    """``model`` itself without LoRA layers, else a copy with them merged (:func:`merge_lora`): what leaves vitlab
    (``save_pretrained`` and the Hub, timm and transformers models, exports) is a plain model any reader loads,
    and the model in hand keeps its adapters (peft's ``merge_and_unload`` on a copy)."""
    if not has_lora(model):
        return model
    import copy

    return merge_lora(copy.deepcopy(model))
