"""transformers' masked autoencoder (``ViTMAEForPreTraining``; ``ViTMAEModel``, its encoder) and vitlab's
:class:`~vitlab.models.MaskedAutoencoder`, both ways: the public :func:`vitlab.interop.from_transformers` and
:func:`~vitlab.interop.to_transformers` call these for an MAE. The encoder's layers are named as transformers' ViT's
(:func:`~vitlab.models.hf_names.vit_weights_from_hf`), the decoder's as its layers under ``decoder.decoder_layers``.
"""
from __future__ import annotations

from torch import nn

from .hf_names import hf_blocks_to_vitlab, vit_weights_from_hf, vit_weights_to_hf, vitlab_blocks_to_hf
from .mae import MaskedAutoencoder
from .vit import VisionTransformer

__all__ = ["mae_from_transformers", "mae_to_transformers", "MAE_KINDS"]

MAE_KINDS = ("ViTMAEForPreTraining", "ViTMAEModel")
_DECODER_LAYERS = "decoder_layers.{i}."
_DECODER = {"decoder_embed.weight": "decoder_embed.weight", "decoder_embed.bias": "decoder_embed.bias",
            "mask_token": "mask_token", "decoder_pos_embed": "decoder_pos_embed",
            "decoder_norm.weight": "decoder_norm.weight", "decoder_norm.bias": "decoder_norm.bias",
            "decoder_pred.weight": "decoder_pred.weight", "decoder_pred.bias": "decoder_pred.bias"}


def _encoder_args(c: object) -> dict:
    """A ``ViTMAEConfig``'s encoder as :class:`MaskedAutoencoder` / :class:`VisionTransformer` arguments."""
    if c.hidden_act != "gelu":
        raise ValueError(f"this ViTMAE uses hidden_act={c.hidden_act!r}; vitlab's ViT runs GELU")
    return dict(img_size=c.image_size, patch_size=c.patch_size, in_chans=c.num_channels, embed_dim=c.hidden_size,
                depth=c.num_hidden_layers, num_heads=c.num_attention_heads,
                mlp_ratio=c.intermediate_size / c.hidden_size, qkv_bias=c.qkv_bias, norm_eps=c.layer_norm_eps)


def mae_from_transformers(model: nn.Module) -> MaskedAutoencoder | VisionTransformer:
    """transformers' ``ViTMAEForPreTraining`` as a :class:`MaskedAutoencoder` (encoder, decoder, mask ratio, pixel
    loss, layer-norm eps: the same loss and predictions for the same ``noise``), or its ``ViTMAEModel`` as the
    encoder, a :class:`VisionTransformer` without a head that sees every patch (no masking).

    Raises:
        ValueError: for another model, or a config vitlab cannot reproduce (an activation other than GELU).
    """
    kind = type(model).__name__
    if kind not in MAE_KINDS:
        raise ValueError(f"expected one of transformers' {', '.join(MAE_KINDS)}, got {kind}")
    c = model.config
    base = model.vit if kind == "ViTMAEForPreTraining" else model
    state = base.state_dict()
    if kind == "ViTMAEModel":
        vit = VisionTransformer(num_classes=0, **_encoder_args(c))
        vit.load_state_dict(vit_weights_from_hf(state, base, c.num_hidden_layers), strict=True)
        return vit.train(model.training)
    mae = MaskedAutoencoder(**_encoder_args(c), decoder_embed_dim=c.decoder_hidden_size,
                            decoder_depth=c.decoder_num_hidden_layers,
                            decoder_num_heads=c.decoder_num_attention_heads,
                            decoder_mlp_ratio=c.decoder_intermediate_size / c.decoder_hidden_size,
                            mask_ratio=c.mask_ratio, norm_pix_loss=c.norm_pix_loss)
    ours = {f"encoder.{k}": v for k, v in vit_weights_from_hf(state, base, c.num_hidden_layers).items()}
    decoder = model.decoder.state_dict()
    ours.update({mine: decoder.pop(theirs) for theirs, mine in _DECODER.items()})
    ours.update(hf_blocks_to_vitlab(decoder, base, c.decoder_num_hidden_layers, _DECODER_LAYERS, "decoder_blocks"))
    if state or decoder:
        raise ValueError(f"weights of this {kind} vitlab's MAE has no place for: {sorted([*state, *decoder])[:4]}")
    mae.load_state_dict(ours, strict=True)
    return mae.train(model.training)


def mae_to_transformers(model: MaskedAutoencoder) -> nn.Module:
    """A transformers ``ViTMAEForPreTraining`` with ``model``'s architecture, weights, mask ratio and pixel loss.

    Raises:
        ValueError: for an MAE transformers' cannot express (a non-square image or patch).
    """
    import transformers

    cfg, pe = model.config, model.encoder.patch_embed
    if pe.img_size[0] != pe.img_size[1]:
        raise ValueError(f"transformers' ViTMAE takes square images; this MAE's are {pe.img_size}")
    mine = model.state_dict()
    hf = transformers.ViTMAEForPreTraining(transformers.ViTMAEConfig(
        image_size=pe.img_size[0], patch_size=cfg["patch_size"], num_channels=cfg["in_chans"],
        hidden_size=cfg["embed_dim"], num_hidden_layers=cfg["depth"], num_attention_heads=cfg["num_heads"],
        intermediate_size=model.encoder.blocks[0].mlp.fc1.out_features, qkv_bias=cfg["qkv_bias"],
        layer_norm_eps=cfg["norm_eps"], hidden_act="gelu", decoder_hidden_size=cfg["decoder_embed_dim"],
        decoder_num_hidden_layers=cfg["decoder_depth"], decoder_num_attention_heads=cfg["decoder_num_heads"],
        decoder_intermediate_size=(model.decoder_blocks[0].mlp.fc1.out_features if model.decoder_blocks else
                                   int(cfg["decoder_embed_dim"] * cfg["decoder_mlp_ratio"])),
        mask_ratio=cfg["mask_ratio"], norm_pix_loss=cfg["norm_pix_loss"]))
    encoder = {k.removeprefix("encoder."): v for k, v in mine.items() if k.startswith("encoder.")}
    hf.vit.load_state_dict(vit_weights_to_hf(encoder, hf.vit, cfg["depth"]), strict=True)
    decoder = {theirs: mine[own] for theirs, own in _DECODER.items()}
    decoder.update(vitlab_blocks_to_hf(mine, hf.vit, cfg["decoder_depth"], _DECODER_LAYERS, "decoder_blocks"))
    hf.decoder.load_state_dict(decoder, strict=True)
    return hf.train(model.training)
