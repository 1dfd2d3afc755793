"""The ViT against timm's VisionTransformer, presets, resampling and bad input."""
from __future__ import annotations

import re

import pytest
import timm
import torch
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer as TimmViT

import vitlab
from vitlab.interop import from_timm, to_timm
from vitlab.layers import DropPath, drop_path_rates
from vitlab.models import VisionTransformer, checkpoint_filter_fn

TOL = 1e-5

# (img_size, patch_size, in_chans, num_classes, embed_dim, depth, num_heads, mlp_ratio, qkv_bias, global_pool)
TIMM_CONFIGS = [
    (32, 4, 3, 10, 64, 2, 4, 2.0, True, "token"),
    (32, 8, 1, 5, 48, 3, 3, 4.0, False, "avg"),
    ((24, 40), 8, 3, 7, 32, 1, 2, 3.0, True, "token"),
    (48, 16, 4, 0, 96, 2, 6, 1.5, True, "avg"),
    (28, (7, 4), 2, 3, 40, 2, 5, 4.0, True, "token"),
]


def _timm_model(img, patch, chans, classes, dim, depth, heads, ratio, bias, pool, **kw):
    return TimmViT(img_size=img, patch_size=patch, in_chans=chans, num_classes=classes, embed_dim=dim,
                   depth=depth, num_heads=heads, mlp_ratio=ratio, qkv_bias=bias, global_pool=pool, **kw)


def _perturb_zero_inits(model: torch.nn.Module) -> None:
    """Biases, norms and the CLS token start at constants; randomize them so parity covers them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or "cls_token" in name:
                p.add_(torch.randn_like(p) * 0.05)


def _image(model_cfg) -> torch.Tensor:
    img, chans = model_cfg[0], model_cfg[2]
    h, w = (img, img) if isinstance(img, int) else img
    return torch.randn(2, chans, h, w)


@pytest.mark.parametrize("cfg", TIMM_CONFIGS, ids=str)
def test_from_timm_matches_timm_outputs(cfg):
    ref = _timm_model(*cfg).eval()
    _perturb_zero_inits(ref)
    ours = from_timm(ref)
    x = _image(cfg)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max() < TOL
        assert (ours.forward_features(x) - ref.forward_features(x)).abs().max() < TOL
        assert (ours.forward_head(ours.forward_features(x), pre_logits=True)
                - ref.forward_head(ref.forward_features(x), pre_logits=True)).abs().max() < TOL


@pytest.mark.parametrize("cfg", TIMM_CONFIGS, ids=str)
def test_to_timm_matches_vitlab_outputs(cfg):
    img, patch, chans, classes, dim, depth, heads, ratio, bias, pool = cfg
    ours = VisionTransformer(img_size=img, patch_size=patch, in_chans=chans, num_classes=classes, embed_dim=dim,
                             depth=depth, num_heads=heads, mlp_ratio=ratio, qkv_bias=bias, global_pool=pool).eval()
    _perturb_zero_inits(ours)
    ref = to_timm(ours)
    x = _image(cfg)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max() < TOL


def test_fc_norm_choice_round_trips_through_timm():
    ref = _timm_model(32, 4, 3, 10, 32, 1, 2, 2.0, True, "avg", fc_norm=False).eval()
    ours = from_timm(ref)
    assert isinstance(ours.fc_norm, torch.nn.Identity)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max() < TOL
        assert (to_timm(ours)(x) - ref(x)).abs().max() < TOL


def test_from_timm_names_the_unsupported_feature():
    with pytest.raises(ValueError, match="pre_norm"):
        from_timm(_timm_model(32, 4, 3, 10, 32, 1, 2, 2.0, True, "token", pre_norm=True))
    with pytest.raises(ValueError, match="dynamic_img_size"):
        from_timm(_timm_model(32, 4, 3, 10, 32, 1, 2, 2.0, True, "token", dynamic_img_size=True))


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224",
                                  "deit3_small_patch16_224", "deit3_base_patch16_224", "vit_base_patch16_reg4_gap_256",
                                  "vit_small_patch14_reg4_dinov2", "deit_tiny_distilled_patch16_224",
                                  "deit_small_distilled_patch16_224", "deit_base_distilled_patch16_224"])
def test_imagenet_presets_have_timms_shapes_and_parameter_counts(name):
    ours = vitlab.create_model(name)
    ref = timm.create_model(name, pretrained=False)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())


def test_vit_small_preset_matches_timm_outputs():
    ref = timm.create_model("vit_small_patch16_224", pretrained=False).eval()
    ours = from_timm(ref)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max() < TOL


def test_cifar_presets_have_65_tokens_and_vit_lite_shape():
    for name in vitlab.list_models("vit_*_32"):  # the classifiers (mae_* and dino_* are their pretraining)
        model = vitlab.create_model(name)
        assert model.pos_embed.shape[1] == 65, name
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    lite = vitlab.create_model("vit_lite_7_patch4_32")
    assert (len(lite.blocks), lite.embed_dim, lite.blocks[0].attn.num_heads) == (7, 256, 4)
    assert lite.blocks[0].mlp.fc1.out_features == 512
    assert sum(p.numel() for p in lite.parameters()) == 3_722_250


def test_create_model_applies_overrides():
    model = vitlab.create_model("vit_cifar_tiny_patch4_32", depth=2, num_classes=100, global_pool="avg")
    assert len(model.blocks) == 2 and model.head.out_features == 100 and model.global_pool == "avg"
    assert model.config["depth"] == 2


def test_unknown_preset_lists_close_matches():
    with pytest.raises(ValueError, match=r"unknown model 'vit_smal_patch16_224'; did you mean vit_small_patch16_224"):
        vitlab.create_model("vit_smal_patch16_224")


def test_unknown_model_argument_is_rejected_by_name():
    with pytest.raises(ValueError, match=r"unknown model argument\(s\) \['embed_dims'\]"):
        vitlab.create_model("vit_cifar_tiny_patch4_32", embed_dims=64)


def test_pretrained_weights_request_points_to_timm():
    with pytest.raises(ValueError, match="from_timm"):
        vitlab.create_model("vit_tiny_patch16_224", pretrained=True)


def test_gradients_reach_every_parameter():
    model = vitlab.create_model("vit_cifar_tiny_patch4_32", drop_path_rate=0.1)
    model(torch.randn(4, 3, 32, 32)).logsumexp(-1).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert missing == []


def test_get_attention_maps_returns_each_blocks_weights():
    model = vitlab.create_model("vit_cifar_tiny_patch4_32").eval()
    x = torch.randn(2, 3, 32, 32)
    maps = model.get_attention_maps(x)
    assert len(maps) == 4
    assert all(m.shape == (2, 3, 65, 65) for m in maps)
    assert all((m.sum(-1) - 1).abs().max() < 1e-5 for m in maps)
    # The maps are the weights the forward pass really used: recompute block 0's by hand.
    tokens = model._embed(x)
    attn = model.blocks[0].attn
    q, k, _ = attn.qkv(model.blocks[0].norm1(tokens)).chunk(3, -1)
    q, k = (t.view(2, 65, 3, 32).transpose(1, 2) for t in (q, k))
    expected = (q @ k.transpose(-2, -1) / 32 ** 0.5).softmax(-1)
    assert (maps[0] - expected).abs().max() < 1e-5


def test_no_weight_decay_names_embeddings():
    model = vitlab.create_model("vit_cifar_tiny_patch4_32")
    assert model.no_weight_decay() == {"pos_embed", "cls_token"}
    assert model.no_weight_decay() <= {n for n, _ in model.named_parameters()}


def test_set_input_size_resamples_pos_embed_like_timm():
    ref = _timm_model(32, 4, 3, 10, 32, 1, 2, 2.0, True, "token").eval()
    ours = from_timm(ref)
    ours.set_input_size(48)
    ref.set_input_size(img_size=(48, 48))
    assert ours.pos_embed.shape == (1, 1 + 144, 32)
    assert (ours.pos_embed - ref.pos_embed).abs().max() < 1e-6
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max() < TOL


def test_checkpoint_filter_fn_loads_weights_trained_at_another_size():
    small = vitlab.create_model("vit_cifar_tiny_patch4_32")
    big = vitlab.create_model("vit_cifar_tiny_patch4_32", img_size=64)
    big.load_state_dict(checkpoint_filter_fn(small.state_dict(), big))
    expected = resample_abs_pos_embed(small.pos_embed.detach(), new_size=[16, 16], num_prefix_tokens=1)
    assert torch.equal(big.pos_embed.detach(), expected)
    assert torch.equal(big.pos_embed[:, 0], small.pos_embed[:, 0])  # the CLS position is kept
    assert big(torch.randn(1, 3, 64, 64)).shape == (1, 10)


def test_img_size_not_divisible_by_patch_size_is_rejected():
    with pytest.raises(ValueError, match=r"img_size \(30, 30\) is not divisible by patch_size \(4, 4\)"):
        VisionTransformer(img_size=30, patch_size=4)


def test_embed_dim_not_divisible_by_heads_is_rejected():
    with pytest.raises(ValueError, match=r"embed_dim=100 is not divisible by num_heads=3"):
        VisionTransformer(img_size=32, patch_size=4, embed_dim=100, num_heads=3)


@pytest.mark.parametrize("shape", [(2, 3, 64, 64), (2, 1, 32, 32), (3, 32, 32)])
def test_image_batch_of_wrong_shape_is_rejected(shape):
    model = vitlab.create_model("vit_cifar_tiny_patch4_32")
    with pytest.raises(ValueError, match=re.escape(f"expected an image batch (batch, 3, 32, 32), got {shape}")):
        model(torch.randn(*shape))


def test_unknown_global_pool_is_rejected():
    with pytest.raises(ValueError, match="global_pool must be 'token' or 'avg', got 'max'"):
        VisionTransformer(img_size=32, patch_size=4, global_pool="max")


def test_drop_path_rates_match_timm():
    # The rates timm's own ViT gives its blocks (every timm version we admit has them there).
    import timm

    reference = timm.models.VisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=7, num_heads=2,
                                              drop_path_rate=0.1)
    timm_rates = [b.drop_path1.drop_prob if hasattr(b.drop_path1, "drop_prob") else 0.0 for b in reference.blocks]
    assert drop_path_rates(0.1, 7) == pytest.approx(timm_rates, abs=1e-12)


def test_drop_path_drops_whole_samples_and_keeps_the_expectation():
    layer = DropPath(0.25).train()
    x = torch.ones(4000, 3, 5)
    y = layer(x)
    kept = y[:, 0, 0] != 0
    assert torch.equal(y[kept], torch.full_like(y[kept], 1 / 0.75))  # scaled, whole sample
    assert torch.equal(y[~kept], torch.zeros_like(y[~kept]))
    assert abs(kept.float().mean().item() - 0.75) < 0.03
    assert torch.equal(layer.eval()(x), x)


@pytest.mark.parametrize("argument, overrides", [("mlp_ratio", {}), ("drop_path_rate", {}), ("depth", {"depth": 2}),
                                                 ("qkv_bias", {})])
def test_model_argument_is_what_the_built_model_was_given(argument, overrides):
    # an override, the preset's value or the class's default: the reference is the model create_model builds
    from vitlab.models.registry import model_argument

    model = vitlab.create_model("vit_cifar_tiny_patch4_32", **overrides)
    assert model_argument("vit_cifar_tiny_patch4_32", argument, **overrides) == (True, model.config[argument])
    assert model_argument("vit_cifar_tiny_patch4_32", "no_such_argument") == (False, None)
    assert model_argument("timm:resnet18", "drop_path_rate") == (False, None)  # timm's own default: not known here
