"""Converters between vitlab and the references: timm's ViT, transformers' ViT, DeiT and ViTMAE (the masked
autoencoder's in :mod:`.mae_interop`), ``torch.nn.MultiheadAttention`` and ``torch.nn.Transformer``.

Conversions copy weights exactly; outputs agree to float32 rounding (tested to 1e-5).
"""
from __future__ import annotations


import torch
from torch import nn

from ..attention import MultiHeadAttention
from ..layers.pos_embed import resample_pos_embed
from .lora import merged_copy
from .hf_names import vit_weights_from_hf, vit_weights_to_hf
from .mae_interop import mae_from_transformers, mae_to_transformers
from .transformer import Transformer
from .vit import VisionTransformer

__all__ = ["from_timm", "to_timm", "mha_from_torch", "transformer_from_torch"]


_TIMM_ACTS = {"GELU": "gelu", "SiLU": "silu", "ReLU": "relu"}


def _norm_name(norm: nn.Module) -> str | None:
    """vitlab's name for a timm ViT norm it can reproduce (eps 1e-6), else None."""
    from timm.layers import RmsNorm

    if isinstance(norm, nn.LayerNorm) and norm.eps == 1e-6 and norm.bias is not None:
        return "layernorm"
    if isinstance(norm, (RmsNorm, nn.RMSNorm)) and norm.eps == 1e-6 and norm.weight is not None:
        return "rmsnorm"
    return None


def _is_distilled(model: nn.Module) -> bool:
    from timm.models.deit import VisionTransformerDistilled

    return isinstance(model, VisionTransformerDistilled)


def _timm_vit_args(model: nn.Module) -> dict:
    """vitlab ``VisionTransformer`` arguments equivalent to a timm ViT; raise on what vitlab lacks."""
    from timm.layers import Mlp, SwiGLU
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    if not isinstance(model, TimmViT):
        raise ValueError(f"expected a timm.models.vision_transformer.VisionTransformer, got {type(model).__name__}")
    unsupported = {
        "no positional embedding": model.pos_embed is None,
        "dynamic_img_size": model.dynamic_img_size,
        "pre_norm": not isinstance(model.norm_pre, nn.Identity),
        "attention pooling": model.attn_pool is not None,
        f"global_pool={model.global_pool!r}": model.global_pool not in ("token", "avg"),
        "patch-embed norm": not isinstance(model.patch_embed.norm, nn.Identity),
        "final_norm=False": isinstance(model.norm, nn.Identity) and isinstance(model.fc_norm, nn.Identity),
    }
    mlp_layer, act = "mlp", None
    if len(model.blocks):
        block = model.blocks[0]
        mlp = block.mlp
        mlp_layer = "swiglu" if type(mlp) is SwiGLU else "mlp" if type(mlp) is Mlp else type(mlp).__name__
        act_name = type(mlp.act).__name__
        act = _TIMM_ACTS.get(act_name)
        qk_norm = not isinstance(block.attn.q_norm, nn.Identity)
        unsupported.update({
            "qk_norm other than the blocks' norm": qk_norm and (
                _norm_name(block.attn.q_norm) != _norm_name(block.norm1)),
            "attention/MLP scale norms": not (isinstance(block.attn.norm, nn.Identity)
                                              and isinstance(mlp.norm, nn.Identity)),
            f"MLP {mlp_layer}": mlp_layer not in ("mlp", "swiglu"),
            f"MLP activation {act_name}": act is None or (act == "gelu" and mlp.act.approximate != "none"),
            "no attention proj bias": block.attn.proj.bias is None,
            "norm other than LayerNorm or RmsNorm with eps=1e-6": _norm_name(block.norm1) is None,
        })
    found = [name for name, present in unsupported.items() if present]
    if found:
        raise ValueError(f"this timm ViT uses features vitlab's VisionTransformer does not have: {', '.join(found)}")
    embed_dim = model.embed_dim
    blocks = list(model.blocks)
    hidden = (blocks[0].mlp.fc2.in_features if blocks else 4 * embed_dim)
    return dict(
        img_size=tuple(model.patch_embed.img_size),
        patch_size=tuple(model.patch_embed.patch_size),
        in_chans=model.patch_embed.proj.in_channels,
        num_classes=model.num_classes,
        embed_dim=embed_dim,
        depth=len(blocks),
        num_heads=blocks[0].attn.num_heads if blocks else 1,
        mlp_ratio=hidden / embed_dim,
        qkv_bias=blocks[0].attn.qkv.bias is not None if blocks else True,
        global_pool=model.global_pool,
        fc_norm=not isinstance(model.fc_norm, nn.Identity),
        class_token=model.cls_token is not None,
        norm_layer=_norm_name(blocks[0].norm1) if blocks else "layernorm",
        mlp_layer=mlp_layer,
        act_layer=act,
        # LayerScale's starting value: the weights loaded next hold its learned gamma, so any value stands
        # where timm keeps none (older timm's LayerScale has no init_values).
        init_values=(float(getattr(blocks[0].ls1, "init_values", 1e-5))
                     if blocks and not isinstance(blocks[0].ls1, nn.Identity) else None),
        qk_norm=bool(blocks) and not isinstance(blocks[0].attn.q_norm, nn.Identity),
        reg_tokens=model.reg_token.shape[1] if model.reg_token is not None else 0,
        no_embed_class=model.no_embed_class,
        distilled=_is_distilled(model),
    )


def from_timm(model: nn.Module) -> VisionTransformer:
    """A vitlab ``VisionTransformer`` with the architecture and weights of a timm ViT.

    Covers timm ViTs with LayerNorm or ``timm.layers.RmsNorm``, ``Mlp`` or ``timm.layers.SwiGLU``
    (GELU, SiLU or ReLU), with or without a class token, LayerScale, qk-norm, register tokens and
    ``no_embed_class`` (DeiT III, the ``reg4`` models), and DeiT's distillation token
    (``VisionTransformerDistilled``). Dropout rates are not carried over (they
    do not change eval outputs); pass them to ``VisionTransformer`` yourself if you fine-tune.
    """
    vit = VisionTransformer(**_timm_vit_args(model))
    vit.load_state_dict(model.state_dict(), strict=True)
    vit.distilled_training = getattr(model, "distilled_training", False)
    return vit.train(model.training)


def to_timm(model: VisionTransformer) -> nn.Module:
    """A ``timm.models.vision_transformer.VisionTransformer`` with ``model``'s architecture and weights.

    timm has no mixture of experts, no general/additive scores, no linear, streaming or argmax
    kernel and no sin-cos positions in its ViT: such models raise ``ValueError``.
    """
    from functools import partial

    from timm.layers import Mlp, RmsNorm, SwiGLU
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    model = merged_copy(model)  # LoRA adapters folded in, on a copy
    cfg = model.config
    missing = [f"{k}={cfg[k]!r}" for k, ok in (("mlp_layer", ("mlp", "swiglu")), ("score", ("dot",)),
                                                ("kernel", ("softmax",)), ("pos_embed", ("learn",)))
               if cfg[k] not in ok]
    if missing:
        raise ValueError(f"timm's VisionTransformer has no {', '.join(missing)}; only vitlab runs this model")
    act = cfg["act_layer"] or ("silu" if cfg["mlp_layer"] == "swiglu" else "gelu")
    use_fc_norm = not isinstance(model.fc_norm, nn.Identity)
    from timm.models.deit import VisionTransformerDistilled

    timm_model = (VisionTransformerDistilled if cfg.get("distilled") else TimmViT)(
        img_size=model.patch_embed.img_size, patch_size=model.patch_embed.patch_size, in_chans=cfg["in_chans"],
        num_classes=cfg["num_classes"], global_pool=cfg["global_pool"], embed_dim=cfg["embed_dim"],
        depth=cfg["depth"], num_heads=cfg["num_heads"], mlp_ratio=cfg["mlp_ratio"], qkv_bias=cfg["qkv_bias"],
        fc_norm=use_fc_norm, drop_rate=cfg["drop_rate"], pos_drop_rate=cfg["pos_drop_rate"],
        proj_drop_rate=cfg["proj_drop_rate"], attn_drop_rate=cfg["attn_drop_rate"],
        drop_path_rate=cfg["drop_path_rate"], class_token=cfg["class_token"],
        norm_layer=partial(RmsNorm, eps=1e-6) if cfg["norm_layer"] == "rmsnorm" else None,
        mlp_layer=SwiGLU if cfg["mlp_layer"] == "swiglu" else Mlp,
        act_layer={"gelu": nn.GELU, "silu": nn.SiLU, "relu": nn.ReLU}[act],
        init_values=cfg.get("init_values"), qk_norm=cfg.get("qk_norm", False), reg_tokens=cfg.get("reg_tokens", 0),
        no_embed_class=cfg.get("no_embed_class", False),
    )
    timm_model.load_state_dict(model.state_dict(), strict=True)
    if model.distilled:
        timm_model.set_distilled_training(model.distilled_training)
    return timm_model.train(model.training)


def mha_from_torch(module: nn.MultiheadAttention) -> MultiHeadAttention:
    """A vitlab ``MultiHeadAttention`` with the weights of a ``torch.nn.MultiheadAttention``.

    The result is batch first, ``(B, L, E)``, whatever ``module.batch_first`` says, and uses
    vitlab's mask convention (True = may attend): PyTorch's boolean ``attn_mask`` and
    ``key_padding_mask`` translate as ``mask=~attn_mask`` and ``key_mask=~key_padding_mask``.
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise ValueError(f"expected torch.nn.MultiheadAttention, got {type(module).__name__}")
    if not module._qkv_same_embed_dim:
        raise ValueError("kdim/vdim different from embed_dim are not supported (vitlab projects from embed_dim)")
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError("add_bias_kv and add_zero_attn are not supported by vitlab's MultiHeadAttention")
    has_bias = module.in_proj_bias is not None
    mha = MultiHeadAttention(module.embed_dim, module.num_heads, qkv_bias=has_bias, attn_drop=module.dropout,
                             proj_bias=module.out_proj.bias is not None)
    with torch.no_grad():
        mha.qkv.weight.copy_(module.in_proj_weight)
        mha.proj.weight.copy_(module.out_proj.weight)
        if has_bias:
            mha.qkv.bias.copy_(module.in_proj_bias)
        if module.out_proj.bias is not None:
            mha.proj.bias.copy_(module.out_proj.bias)
    return mha.to(module.in_proj_weight.device, module.in_proj_weight.dtype).train(module.training)


def transformer_from_torch(module: nn.Transformer) -> Transformer:
    """A vitlab :class:`~vitlab.text.Transformer` with the weights of a ``torch.nn.Transformer``.

    The result is batch first whatever ``module.batch_first`` says; its key masks are True = real
    token, so PyTorch's ``src_key_padding_mask=pad`` becomes ``src_key_mask=~pad``, and the decoder
    is always causal (PyTorch's ``tgt_mask=generate_square_subsequent_mask(T)``).
    """
    import torch.nn.functional as F

    if not isinstance(module, nn.Transformer):
        raise ValueError(f"expected torch.nn.Transformer, got {type(module).__name__}")
    enc, dec = list(module.encoder.layers), list(module.decoder.layers)
    first = (enc or dec)[0]
    act = first.activation
    if act is F.relu or isinstance(act, nn.ReLU):
        activation = "relu"
    elif act is F.gelu or (isinstance(act, nn.GELU) and act.approximate == "none"):
        activation = "gelu"
    else:
        raise ValueError(f"activation {act} is not supported; vitlab has 'relu' and 'gelu'")
    if module.encoder.norm is None or module.decoder.norm is None:
        raise ValueError("a torch Transformer without final encoder/decoder norms is not supported")
    if any(l.linear1.bias is None for l in enc + dec):
        raise ValueError("a torch Transformer without biases (bias=False) is not supported")
    ours = Transformer(d_model=module.d_model, num_heads=module.nhead, num_encoder_layers=len(enc),
                       num_decoder_layers=len(dec), dim_feedforward=first.linear1.out_features,
                       dropout=first.dropout.p, activation=activation, norm_first=first.norm_first,
                       norm_eps=first.norm1.eps)

    def copy_linear(dst: nn.Linear, src: nn.Linear) -> None:
        dst.load_state_dict(src.state_dict())

    for mine, theirs in zip(ours.encoder_layers, enc):
        mine.attn.load_state_dict(mha_from_torch(theirs.self_attn).state_dict())
        copy_linear(mine.mlp.fc1, theirs.linear1)
        copy_linear(mine.mlp.fc2, theirs.linear2)
        mine.norm1.load_state_dict(theirs.norm1.state_dict())
        mine.norm2.load_state_dict(theirs.norm2.state_dict())
    for mine, theirs in zip(ours.decoder_layers, dec):
        mine.self_attn.load_state_dict(mha_from_torch(theirs.self_attn).state_dict())
        mine.cross_attn.load_state_dict(mha_from_torch(theirs.multihead_attn).state_dict())
        copy_linear(mine.mlp.fc1, theirs.linear1)
        copy_linear(mine.mlp.fc2, theirs.linear2)
        for i in (1, 2, 3):
            getattr(mine, f"norm{i}").load_state_dict(getattr(theirs, f"norm{i}").state_dict())
    ours.encoder_norm.load_state_dict(module.encoder.norm.state_dict())
    ours.decoder_norm.load_state_dict(module.decoder.norm.state_dict())
    return ours.to(first.linear1.weight.device).train(module.training)


_HF_KINDS = ("ViTForImageClassification", "ViTModel", "DeiTForImageClassificationWithTeacher",
             "DeiTForImageClassification", "DeiTModel")


def _hf_base(model: nn.Module) -> tuple[nn.Module, nn.Module | None, nn.Module | None]:
    """The encoder of a transformers ViT / DeiT and its classifier heads (cls, distillation), if any."""
    kind = type(model).__name__
    if kind not in _HF_KINDS:
        raise ValueError(f"expected one of transformers' {', '.join(_HF_KINDS)}, got {kind}")
    base = getattr(model, "vit", None) or getattr(model, "deit", None) or model
    head = getattr(model, "classifier", None) or getattr(model, "cls_classifier", None)
    return base, head, getattr(model, "distillation_classifier", None)


def from_transformers(model: nn.Module, img_size: int | tuple[int, int] | None = None) -> nn.Module:
    """A vitlab ``VisionTransformer`` with the architecture, weights and label names of a transformers
    ``ViTForImageClassification``, ``ViTModel`` (no head: ``forward`` returns the normed CLS token) or DeiT
    model (``DeiTForImageClassificationWithTeacher``: its distillation token and head, their logits averaged
    in eval as transformers' are; ``DeiTForImageClassification``, what ``AutoModelForImageClassification``
    builds for DeiT, and ``DeiTModel``: the distillation token without its head, which a ViT holds as a register
    token with a position of its own, the CLS token read alone): patch and image size (square or not), width,
    depth, heads, MLP width, layer-norm eps, the query/key/value bias or none.
    ``img_size``: built for this size instead, its positions resampled as transformers'
    ``interpolate_pos_encoding`` resamples them (plain bicubic; ``set_input_size`` resamples as timm does).

    A masked autoencoder (``ViTMAEForPreTraining``) comes back as a :class:`~vitlab.models.MaskedAutoencoder`, its
    ``ViTMAEModel`` as the encoder (:func:`~vitlab.models.mae_interop.mae_from_transformers`).

    Raises:
        ValueError: for another model, or a config vitlab's ViT cannot reproduce (an activation other than
            GELU, a ViTModel's pooler).
    """
    if type(model).__name__.startswith("ViTMAE"):
        return mae_from_transformers(model)
    base, head, head_dist = _hf_base(model)
    c = model.config
    if c.hidden_act != "gelu":
        raise ValueError(f"this {type(model).__name__} uses hidden_act={c.hidden_act!r}; vitlab's ViT runs GELU")
    if getattr(base, "pooler", None) is not None and head is None:
        raise ValueError(f"this {type(model).__name__} has a pooler (dense + tanh on the CLS token), which vitlab's "
                         f"ViT does not; build it with add_pooling_layer=False, or read a model with a classifier")
    distilled = head_dist is not None
    # a DeiT without its distillation head: the token still joins the sequence, as a register after the CLS token
    dist_as_register = not distilled and type(model).__name__.startswith("DeiT")
    num_classes = head.out_features if head is not None else 0
    given = lambda v: tuple(v) if isinstance(v, (list, tuple)) else v  # an int, or a pair (height, width)
    pair = lambda v: given(v) if isinstance(v, (list, tuple)) else (v, v)
    image_size, patch_size = pair(c.image_size), pair(c.patch_size)
    vit = VisionTransformer(img_size=img_size or given(c.image_size), patch_size=given(c.patch_size),
                            in_chans=c.num_channels,
                            num_classes=num_classes, embed_dim=c.hidden_size, depth=c.num_hidden_layers,
                            num_heads=c.num_attention_heads, mlp_ratio=c.intermediate_size / c.hidden_size,
                            qkv_bias=c.qkv_bias, distilled=distilled, reg_tokens=int(dist_as_register),
                            norm_eps=c.layer_norm_eps)
    state = {k: v for k, v in base.state_dict().items() if not k.startswith("pooler.")}
    ours = vit_weights_from_hf(state, base, c.num_hidden_layers)
    if distilled or dist_as_register:
        ours["dist_token" if distilled else "reg_token"] = state.pop("embeddings.distillation_token")
    state.pop("embeddings.mask_token", None)  # masked image modelling's token: not used to classify
    if state:
        raise ValueError(f"weights of this {type(model).__name__} vitlab's ViT has no place for: {sorted(state)[:4]}")
    for name, module in (("head", head), ("head_dist", head_dist)):
        if module is not None:
            ours.update({f"{name}.{k}": v for k, v in module.state_dict().items()})
    grid = (image_size[0] // patch_size[0], image_size[1] // patch_size[1])
    ours["pos_embed"] = resample_pos_embed(ours["pos_embed"], vit.patch_embed.grid_size, grid,
                                           vit.num_prefix_tokens, antialias=False)
    vit.load_state_dict(ours, strict=True)
    if head is not None and c.id2label and len(c.id2label) == num_classes:
        names = [c.id2label[i] for i in range(num_classes)]
        vit.pretrained_cfg = {**getattr(vit, "pretrained_cfg", {}), "label_names": names}
    return vit.train(model.training)


def to_transformers(model: nn.Module) -> nn.Module:
    """A transformers ``ViTForImageClassification`` (``DeiTForImageClassificationWithTeacher`` for a distilled
    ViT) with ``model``'s architecture, weights and label names (``pretrained_cfg["label_names"]``), to
    ``save_pretrained`` where transformers users will read it.

    A :class:`~vitlab.models.MaskedAutoencoder` becomes a ``ViTMAEForPreTraining``
    (:func:`~vitlab.models.mae_interop.mae_to_transformers`).

    Raises:
        ValueError: for a ViT transformers' cannot express (average pooling, no class token, registers,
            LayerScale, qk-norm, RMSNorm, SwiGLU or experts, other scores or kernels, fixed positions).
    """
    import transformers

    if type(model).__name__ == "MaskedAutoencoder":
        return mae_to_transformers(model)

    model = merged_copy(model)  # LoRA adapters folded in, on a copy
    cfg = model.config
    unsupported = [f"{k}={cfg.get(k)!r}" for k, ok in (
        ("global_pool", ("token",)), ("class_token", (True,)), ("reg_tokens", (0,)), ("init_values", (None,)),
        ("qk_norm", (False,)), ("norm_layer", ("layernorm",)), ("mlp_layer", ("mlp",)), ("score", ("dot",)),
        ("kernel", ("softmax",)), ("pos_embed", ("learn",)), ("no_embed_class", (False,)),
        ("act_layer", (None, "gelu"))) if cfg.get(k) not in ok]
    if model.patch_embed.img_size[0] != model.patch_embed.img_size[1] or model.patch_embed.patch_size[0] != \
            model.patch_embed.patch_size[1]:
        unsupported.append(f"img_size={model.patch_embed.img_size} / patch_size={model.patch_embed.patch_size} "
                           f"(not square)")
    if unsupported or not isinstance(model.fc_norm, nn.Identity):
        raise ValueError(f"transformers' ViT has no {', '.join(unsupported) or 'fc_norm'}; only vitlab runs this model")
    names = (getattr(model, "pretrained_cfg", None) or {}).get("label_names") or [
        f"LABEL_{i}" for i in range(model.num_classes)]
    sizes = dict(image_size=model.patch_embed.img_size[0], patch_size=model.patch_embed.patch_size[0],
                 num_channels=cfg["in_chans"], hidden_size=cfg["embed_dim"], num_hidden_layers=cfg["depth"],
                 num_attention_heads=cfg["num_heads"], intermediate_size=model.blocks[0].mlp.fc1.out_features,
                 qkv_bias=cfg["qkv_bias"], layer_norm_eps=cfg.get("norm_eps", 1e-6), hidden_act="gelu",
                 id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)})
    if model.distilled:
        hf = transformers.DeiTForImageClassificationWithTeacher(transformers.DeiTConfig(**sizes))
    else:
        hf = transformers.ViTForImageClassification(transformers.ViTConfig(**sizes))
    base, head, head_dist = _hf_base(hf)
    mine = model.state_dict()
    state = vit_weights_to_hf(mine, base, cfg["depth"])
    if model.distilled:
        state["embeddings.distillation_token"] = mine["dist_token"]
    missing, unexpected = base.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "embeddings.mask_token"]:
        raise ValueError(f"transformers' ViT does not take these weights: missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]}")
    head.load_state_dict({k.removeprefix("head."): v for k, v in mine.items() if k.startswith("head.")})
    if head_dist is not None:
        head_dist.load_state_dict({k.removeprefix("head_dist."): v for k, v in mine.items()
                                   if k.startswith("head_dist.")})
    return hf.train(model.training)
