"""transformers' ViT weights under vitlab's names and back: the one table of their layer names (both releases' of
transformers), used by every converter of a transformers ViT, DeiT or ViTMAE (:mod:`.interop`, :mod:`.mae_interop`).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

__all__ = ["hf_blocks_to_vitlab", "vitlab_blocks_to_hf", "vit_weights_from_hf", "vit_weights_to_hf"]


# transformers' ViT and DeiT: their parameter names in a layer under the base model (``vit.``, ``deit.`` or
# none), and vitlab's for each; a layer's query, key and value are vitlab's one qkv projection. transformers 5
# renamed the modules (its checkpoints' names are converted when read); both are known.
_HF_NAMES = {  # (a layer's prefix, its query / key / value, the rest)
    4: ("encoder.layer.{i}.", [f"attention.attention.{p}" for p in ("query", "key", "value")],
        {"layernorm_before": "norm1", "attention.output.dense": "attn.proj", "layernorm_after": "norm2",
         "intermediate.dense": "mlp.fc1", "output.dense": "mlp.fc2"}),
    5: ("layers.{i}.", [f"attention.{p}_proj" for p in "qkv"],
        {"layernorm_before": "norm1", "attention.o_proj": "attn.proj", "layernorm_after": "norm2",
         "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}),
}


def _hf_names(base: nn.Module) -> tuple[str, list[str], dict[str, str]]:
    """The layer names of this transformers release's ViT (``base``: its encoder)."""
    return _HF_NAMES[5] if hasattr(base, "layers") else _HF_NAMES[4]


def _block_names(base: nn.Module, depth: int, theirs: str | None,
                 ours: str) -> Iterator[tuple[list[str], str, dict[str, str]]]:
    """For each of ``depth`` layers and each of weight and bias: transformers' query, key and value names, vitlab's
    ``qkv`` name, and the other parameters' names (theirs: ours), as :func:`hf_blocks_to_vitlab` reads them."""
    prefix, qkv, rest = _hf_names(base)
    prefix = theirs or prefix
    for i in range(depth):
        layer = prefix.format(i=i)
        for kind in ("weight", "bias"):
            yield ([f"{layer}{p}.{kind}" for p in qkv], f"{ours}.{i}.attn.qkv.{kind}",
                   {f"{layer}{name}.{kind}": f"{ours}.{i}.{mine}.{kind}" for name, mine in rest.items()})


def hf_blocks_to_vitlab(state: dict[str, Tensor], base: nn.Module, depth: int, theirs: str | None = None,
                        ours: str = "blocks") -> dict[str, Tensor]:
    """``depth`` transformers ViT layers taken out of ``state`` (a release's names, read from ``base``; under
    ``theirs``, e.g. ``'decoder_layers.{i}.'``, instead of its encoder's prefix) as vitlab :class:`Block` weights
    under ``ours``: query, key and value concatenated into one ``qkv`` (their biases where there are any)."""
    out = {}
    for their_qkv, our_qkv, others in _block_names(base, depth, theirs, ours):
        if their_qkv[0] in state:
            out[our_qkv] = torch.cat([state.pop(name) for name in their_qkv])
        out.update({mine: state.pop(name) for name, mine in others.items()})
    return out


def vitlab_blocks_to_hf(mine: dict[str, Tensor], base: nn.Module, depth: int, theirs: str | None = None,
                        ours: str = "blocks") -> dict[str, Tensor]:
    """The inverse of :func:`hf_blocks_to_vitlab`: vitlab's ``depth`` blocks under ``ours`` as transformers'
    layers (``base``'s release's names, under ``theirs`` or its encoder's prefix)."""
    out = {}
    for their_qkv, our_qkv, others in _block_names(base, depth, theirs, ours):
        if our_qkv in mine:
            out.update(zip(their_qkv, mine[our_qkv].chunk(3)))
        out.update({name: mine[own] for name, own in others.items()})
    return out


# A transformers ViT's embeddings and final norm, and vitlab's names for them.
_HF_EMBEDDINGS = {"embeddings.cls_token": "cls_token", "embeddings.position_embeddings": "pos_embed",
                  "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
                  "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
                  "layernorm.weight": "norm.weight", "layernorm.bias": "norm.bias"}


def vit_weights_from_hf(state: dict[str, Tensor], base: nn.Module, depth: int) -> dict[str, Tensor]:
    """A transformers ViT encoder's weights (``base``'s ``state``, taken out of it) as a vitlab ViT's: embeddings,
    layers, final norm."""
    return {**{mine: state.pop(theirs) for theirs, mine in _HF_EMBEDDINGS.items()},
            **hf_blocks_to_vitlab(state, base, depth)}


def vit_weights_to_hf(mine: dict[str, Tensor], base: nn.Module, depth: int) -> dict[str, Tensor]:
    """The inverse of :func:`vit_weights_from_hf`: a vitlab ViT's weights as the transformers encoder ``base``'s."""
    return {**{theirs: mine[own] for theirs, own in _HF_EMBEDDINGS.items()}, **vitlab_blocks_to_hf(mine, base, depth)}
