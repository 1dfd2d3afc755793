"""Norms, MLPs, mixture of experts and positions as options of the one block, against references."""
from __future__ import annotations

import pytest
import torch
from timm.layers import RmsNorm, SwiGLU
from timm.layers.pos_embed_sincos import build_sincos2d_pos_embed
from timm.models.vision_transformer import VisionTransformer as TimmViT

import vitlab
from vitlab.checkpoint import load_model, write_model_files
from vitlab.config import load_config
from vitlab.errors import ConfigError
from vitlab.interop import from_timm, to_timm
from vitlab.layers import Mlp, MoE, create_norm, expert_utilization, moe_aux_loss, sincos_2d_position_encoding
from vitlab.layers import SwiGLU as OurSwiGLU
from vitlab.models import Seq2SeqTransformer

TINY = dict(img_size=32, patch_size=4, num_classes=10, embed_dim=48, depth=2, num_heads=3)


def test_rmsnorm_is_x_over_root_mean_square_times_weight():
    norm = create_norm("rmsnorm", 16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 7, 16)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)


def test_swiglu_matches_timm():
    torch.manual_seed(0)
    ours = OurSwiGLU(16, 40)
    theirs = SwiGLU(16, 40)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


@pytest.mark.parametrize("timm_kwargs", [
    dict(norm_layer=RmsNorm),
    dict(mlp_layer=SwiGLU),                                # timm passes the block's GELU to the gate
    dict(mlp_layer=SwiGLU, act_layer=torch.nn.SiLU, norm_layer=RmsNorm),
    dict(class_token=False, global_pool="avg"),
    dict(init_values=0.1),                                 # LayerScale (DeiT III, CaiT)
    dict(qk_norm=True),
    dict(qk_norm=True, norm_layer=RmsNorm),
    dict(reg_tokens=4),                                    # registers (Darcet et al. 2024)
    dict(reg_tokens=4, no_embed_class=True, global_pool="avg"),  # vit_*_reg4_gap
    dict(no_embed_class=True, init_values=1e-5),           # DeiT III
], ids=["rmsnorm", "swiglu-gelu", "swiglu-silu-rmsnorm", "no-cls-avg", "layerscale", "qk-norm", "qk-rmsnorm",
        "reg4", "reg4-no-embed-class-avg", "deit3"])
def test_timm_variants_convert_both_ways_with_equal_outputs(timm_kwargs):
    torch.manual_seed(0)
    theirs = TimmViT(**TINY, **timm_kwargs).eval()
    x = torch.randn(4, 3, 32, 32)
    ours = from_timm(theirs)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-5)
    back = to_timm(ours)
    assert type(back.blocks[0].norm1) is type(theirs.blocks[0].norm1)
    assert type(back.blocks[0].mlp) is type(theirs.blocks[0].mlp)
    torch.testing.assert_close(back(x), theirs(x), rtol=0, atol=1e-5)
    theirs.train(), ours.train()  # no dropout: training mode gives the same numbers
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kwargs", [{}, dict(init_values=1e-5)], ids=["deit", "layerscale"])
def test_the_distillation_token_and_head_equal_timms_distilled_deit_both_ways(kwargs):
    # timm's VisionTransformerDistilled: a second token (dist_token) read by a second head (head_dist);
    # the two heads' logits averaged, or both returned in distilled training. (timm's distilled model
    # sizes pos_embed for its prefix tokens always, so no_embed_class does not run there.)
    from timm.models.deit import VisionTransformerDistilled

    torch.manual_seed(0)
    theirs = VisionTransformerDistilled(**TINY, **kwargs).eval()
    x = torch.randn(4, 3, 32, 32)
    ours = from_timm(theirs)
    assert ours.distilled and ours.num_prefix_tokens == 2 and "dist_token" in ours.no_weight_decay()
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.forward_head(ours.forward_features(x), pre_logits=True),
                               theirs.forward_head(theirs.forward_features(x), pre_logits=True), rtol=0, atol=1e-5)
    for model in (ours, theirs):
        model.train()
        model.set_distilled_training(True)
    (a, a_dist), (b, b_dist) = ours(x), theirs(x)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    torch.testing.assert_close(a_dist, b_dist, rtol=0, atol=1e-5)
    assert not torch.allclose(a, a_dist)  # two heads
    back = to_timm(ours)
    assert type(back) is VisionTransformerDistilled
    assert all(torch.equal(back.state_dict()[k], v) for k, v in theirs.state_dict().items())
    ours.set_distilled_training(False)
    torch.testing.assert_close(ours(x), (a + a_dist) / 2, rtol=0, atol=1e-6)  # fine-tuned as a plain ViT


@pytest.mark.parametrize("name", ["deit3_small_patch16_224", "vit_base_patch16_reg4_gap_256"])
def test_timms_layerscale_and_register_models_convert_exactly_and_round_trip(name, tmp_path):
    # The named models at random init (timm.create_model(name, pretrained=False), 2 of their blocks to keep
    # it quick): vitlab's copy gives timm's outputs, converts back to equal state dicts, and saves and
    # loads as itself.
    import timm

    torch.manual_seed(0)
    theirs = timm.create_model(name, pretrained=False, depth=2).eval()
    x = torch.randn(2, 3, *theirs.patch_embed.img_size)
    ours = from_timm(theirs)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-5)
    back = to_timm(ours).state_dict()
    assert back.keys() == theirs.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in theirs.state_dict().items())
    ours.save_pretrained(tmp_path / "model")
    torch.testing.assert_close(load_model(tmp_path / "model").eval()(x), theirs(x), rtol=0, atol=1e-5)


def test_layerscale_starts_at_init_values_and_registers_take_no_position_of_their_own_with_no_embed_class():
    model = vitlab.create_model("vit_cifar_tiny_patch4_32", init_values=1e-4, reg_tokens=2, no_embed_class=True)
    assert torch.equal(model.blocks[0].ls1.gamma, torch.full((model.embed_dim,), 1e-4))
    assert model.num_prefix_tokens == 3 and model.pos_embed.shape[1] == model.patch_embed.num_patches
    assert model.forward_features(torch.randn(1, 3, 32, 32)).shape[1] == 3 + model.patch_embed.num_patches
    assert "reg_token" in {n for n, _ in model.named_parameters()} and "reg_token" in model.no_weight_decay()


@pytest.mark.parametrize("kwargs", [dict(norm_layer="rmsnorm"), dict(mlp_layer="swiglu")])
def test_vitlab_variants_convert_to_timm_and_back(kwargs):
    torch.manual_seed(0)
    ours = vitlab.create_model("vit_cifar_tiny_patch4_32", **kwargs).eval()
    x = torch.randn(2, 3, 32, 32)
    theirs = to_timm(ours)
    torch.testing.assert_close(theirs(x), ours(x), rtol=0, atol=1e-5)
    torch.testing.assert_close(from_timm(theirs)(x), ours(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kwargs", [dict(mlp_layer="moe"), dict(kernel="linear"), dict(score="additive"),
                                    dict(pos_embed="sincos")])
def test_to_timm_refuses_what_timm_lacks(kwargs):
    with pytest.raises(ValueError, match="timm's VisionTransformer has no"):
        to_timm(vitlab.create_model("vit_cifar_tiny_patch4_32", **kwargs))


def test_moe_with_one_expert_and_k1_equals_its_mlp():
    torch.manual_seed(0)
    moe = MoE(16, 32, num_experts=1, top_k=1)
    mlp = Mlp(16, 32)
    mlp.load_state_dict(moe.experts[0].state_dict())
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(moe(x), mlp(x), rtol=0, atol=0)


def test_moe_is_the_gate_weighted_sum_of_the_top_k_experts():
    torch.manual_seed(0)
    moe = MoE(8, 16, num_experts=4, top_k=2).eval()
    x = torch.randn(10, 8)
    logits = x @ moe.router.weight.T
    top, idx = logits.topk(2, dim=-1)
    gates = top.softmax(-1)  # softmax over the chosen k only (Mixtral)
    expected = torch.stack([sum(gates[t, j] * moe.experts[idx[t, j]](x[t]) for j in range(2)) for t in range(10)])
    torch.testing.assert_close(moe(x), expected)


def test_moe_gradients_reach_every_expert_and_compute_grows_with_k():
    torch.manual_seed(0)
    for k in (1, 2):
        moe = MoE(16, 32, num_experts=4, top_k=k)
        calls = []
        for e in moe.experts:
            e.register_forward_hook(lambda m, inp, out: calls.append(inp[0].shape[0]))
        x = torch.randn(64, 16)
        moe(x).sum().backward(retain_graph=True)
        assert sum(calls) == 64 * k  # each token runs through exactly k experts
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for e in moe.experts for p in e.parameters())
        # The router learns from the task loss itself, for k = 1 (Switch's gate) as for k = 2 (Mixtral's).
        assert moe.router.weight.grad.abs().min() > 0


def test_moe_top1_is_the_switch_transformer_gate_times_the_chosen_expert():
    # Fedus et al. 2021, eq. 1-2: y = p_i(x) E_i(x) for i = argmax p, p = softmax over all experts' logits.
    torch.manual_seed(0)
    moe = MoE(8, 16, num_experts=4, top_k=1).eval()
    x = torch.randn(20, 8)
    probs = (x @ moe.router.weight.T).softmax(-1)
    chosen = probs.argmax(-1)
    expected = torch.stack([probs[t, chosen[t]] * moe.experts[chosen[t]](x[t]) for t in range(20)])
    torch.testing.assert_close(moe(x), expected)
    assert probs.max(-1).values.max() < 0.99  # the gates are real probabilities, not 1


def test_switch_load_balancing_loss_and_utilisation():
    torch.manual_seed(0)
    model = vitlab.create_model("vit_cifar_tiny_patch4_32", mlp_layer="moe", num_experts=4, moe_top_k=2,
                                moe_aux_loss_weight=0.5)
    model(torch.randn(2, 3, 32, 32))
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(moes) == 4
    for m in moes:  # recompute E * sum_e f_e P_e from the router alone
        assert m.aux_loss.item() >= 0.5 * 0.99  # >= weight x 1, equality only for uniform routing
    counts = expert_utilization(model)
    assert [c.sum().item() for c in counts] == [2 * 65 * 2] * 4  # tokens x k assignments per layer
    assert all(c.sum() == 0 for c in expert_utilization(model))  # reset
    torch.testing.assert_close(moe_aux_loss(model), sum(m.aux_loss for m in moes))


def test_switch_loss_formula():
    torch.manual_seed(0)
    moe = MoE(8, 16, num_experts=4, top_k=1, aux_loss_weight=1.0)
    x = torch.randn(50, 8)
    moe(x)
    probs = (x @ moe.router.weight.T).softmax(-1)
    f = torch.bincount(probs.argmax(-1), minlength=4) / 50
    torch.testing.assert_close(moe.aux_loss, 4 * (f * probs.mean(0)).sum())


def test_sincos_positions_equal_timms_and_are_recomputed_at_other_sizes():
    torch.testing.assert_close(sincos_2d_position_encoding((6, 5), 32), build_sincos2d_pos_embed([6, 5], 32))
    model = vitlab.create_model("vit_cifar_tiny_patch4_32", pos_embed="sincos")
    assert "pos_embed" not in model.state_dict() and "pos_embed" not in dict(model.named_parameters())
    assert torch.equal(model.pos_embed[0, 0], torch.zeros(96))  # the CLS token gets no position
    model.set_input_size(48)
    torch.testing.assert_close(model.pos_embed[0, 1:], build_sincos2d_pos_embed([12, 12], 96))
    assert model(torch.randn(1, 3, 48, 48)).shape == (1, 10)


@pytest.mark.parametrize("pos_embed", ["learn", "sincos", "none"])
def test_no_class_token_with_average_pooling_works_with_every_position(pos_embed):
    model = vitlab.create_model("vit_cifar_tiny_patch4_32", class_token=False, global_pool="avg",
                                pos_embed=pos_embed).eval()
    x = torch.randn(2, 3, 32, 32)
    feats = model.forward_features(x)
    assert feats.shape == (2, 64, 96)
    torch.testing.assert_close(model.forward_head(feats, pre_logits=True), model.fc_norm(feats.mean(1)))
    if pos_embed == "none":  # no position at all: permuting the patches permutes nothing in the pooled output
        perm = torch.randperm(64)
        tokens = model.patch_embed(x)[:, perm]
        out = model.fc_norm(model.norm(model.blocks(tokens)).mean(1))
        torch.testing.assert_close(out, model.forward_head(feats, pre_logits=True), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="global_pool='avg'"):
        vitlab.create_model("vit_cifar_tiny_patch4_32", class_token=False)


VARIANTS = [dict(norm_layer="rmsnorm"), dict(mlp_layer="swiglu"), dict(mlp_layer="moe", num_experts=3, moe_top_k=2),
            dict(score="general"), dict(score="additive"), dict(kernel="linear"), dict(kernel="streaming"),
            dict(kernel="argmax"), dict(pos_embed="sincos")]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v.values())))
def test_variants_are_saved_in_checkpoints_and_restored(variant, tmp_path):
    torch.manual_seed(0)
    model = vitlab.create_model("vit_cifar_tiny_patch4_32", **variant).eval()
    write_model_files(model, tmp_path, {"classes": list("abcdefghij"), "mean": [0.5] * 3, "std": [0.5] * 3},
                      "vit_cifar_tiny_patch4_32")
    loaded = load_model(tmp_path)
    assert all(loaded.config[k] == v for k, v in variant.items())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_yaml_keys_reach_the_model_and_bad_values_name_the_allowed_ones():
    cfg = load_config("configs/cifar10_cpu_quick.yaml", ["model.norm_layer=rmsnorm", "model.mlp_layer=moe",
                                                         "model.num_experts=4", "model.kernel=linear",
                                                         "model.pos_embed=sincos"])
    own = load_config("configs/cifar10_cpu_quick.yaml", []).model.args  # the config's embed_dim, depth, ...
    assert cfg.model.args == dict(own, norm_layer="rmsnorm", mlp_layer="moe", num_experts=4, kernel="linear",
                                  pos_embed="sincos")
    for override, allowed in [("model.kernel=flash", "'softmax', 'streaming', 'argmax', 'linear'"),
                              ("model.norm_layer=batchnorm", "'layernorm', 'rmsnorm'"),
                              ("model.mlp_layer=glu", "'mlp', 'swiglu', 'moe'"),
                              ("model.score=cosine", "'dot', 'general', 'additive'"),
                              ("model.pos_embed=rope", "'learn', 'sincos', 'none'")]:
        with pytest.raises(ConfigError, match=allowed):
            load_config("configs/cifar10_cpu_quick.yaml", [override])
    text = load_config("configs/seq2seq_reverse.yaml", ["model.pos_embed=learn", "model.kernel=linear"])
    assert text.model.args["pos_embed"] == "learn"


@pytest.mark.parametrize("variant", [dict(kernel="linear"), dict(kernel="streaming"), dict(score="additive"),
                                     dict(norm_layer="rmsnorm", mlp_layer="swiglu", pos_embed="learn"),
                                     dict(mlp_layer="moe", num_experts=2, moe_top_k=1)],
                         ids=["linear", "streaming", "additive", "rms-swiglu-learn", "moe"])
def test_text_models_take_the_same_variants_and_cached_decoding_is_exact(variant):
    torch.manual_seed(0)
    model = Seq2SeqTransformer(20, 20, d_model=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
                               dim_feedforward=64, dropout=0.0, **variant).eval()
    src = torch.randint(3, 20, (3, 9))
    src[2, 6:] = 0
    cached = model.generate(src, max_new_tokens=12, use_cache=True)
    full = model.generate(src, max_new_tokens=12, use_cache=False)
    assert torch.equal(cached, full)
    logits = model(src, torch.randint(3, 20, (3, 7)))
    assert logits.shape == (3, 7, 20) and torch.isfinite(logits).all()


@pytest.mark.parametrize("kwargs", [dict(distilled=True), dict(init_values=1e-5, reg_tokens=4, no_embed_class=True)],
                         ids=["distilled", "deit3-registers"])
def test_finetuning_from_a_layerscale_register_or_distilled_checkpoint_resets_its_heads_and_keeps_the_rest(
        kwargs, tmp_path):
    # model.pretrained from such a model on another label set: every weight but the heads (head, and a
    # distilled model's head_dist) comes over; the heads start anew for the new classes.
    from vitlab.models.pretrained import load_pretrained

    torch.manual_seed(0)
    source = vitlab.create_model("vit_cifar_tiny_patch4_32", num_classes=10, **kwargs)
    source.save_pretrained(tmp_path / "source")
    target = vitlab.create_model("vit_cifar_tiny_patch4_32", num_classes=3, **kwargs)
    load_pretrained(target, str(tmp_path / "source" / "model.safetensors"))  # a weights file, as timm reads one
    heads = [h for h in ("head", "head_dist") if hasattr(target, h)]
    assert all(getattr(target, h).out_features == 3 for h in heads)
    kept = {k: v for k, v in source.state_dict().items() if k.split(".")[0] not in heads}
    assert all(torch.equal(target.state_dict()[k], v) for k, v in kept.items())
