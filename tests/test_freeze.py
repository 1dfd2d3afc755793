"""model.freeze (issue 52, 2): which parameters train under each choice, by name; frozen ones get no gradient
and no optimizer state; a fine-tuned run keeps its frozen weights exactly; bad choices are one line before any
image is decoded."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import vitlab
from conftest import reset_accelerate, tiny_overrides
from vitlab.config import load_config
from vitlab.errors import ConfigError
from vitlab.models.freeze import freeze_parameters
from vitlab.training import create_optimizer, train

EMBEDDINGS = {"cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias"}


def _block(i: int) -> set[str]:
    return {f"blocks.{i}.{part}.{kind}" for part in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2")
            for kind in ("weight", "bias")}


def _vit(depth: int = 3) -> torch.nn.Module:
    return vitlab.create_model("vit_cifar_tiny_patch4_32", depth=depth, embed_dim=32, num_heads=2, num_classes=5)


@pytest.mark.parametrize("spec, trains", [
    ("none", EMBEDDINGS | _block(0) | _block(1) | _block(2) | {"norm.weight", "norm.bias", "head.weight", "head.bias"}),
    ("backbone", {"head.weight", "head.bias"}),
    ("blocks:2", _block(2) | {"norm.weight", "norm.bias", "head.weight", "head.bias"}),
    ("attn_only", {f"blocks.{i}.{p}.{k}" for i in range(3) for p in ("attn.qkv", "attn.proj")
                   for k in ("weight", "bias")} | {"pos_embed", "head.weight", "head.bias"})])
def test_each_choice_trains_exactly_its_parameters_and_the_frozen_get_no_gradient_nor_optimizer_state(spec, trains):
    model = _vit()
    count = freeze_parameters(model, spec)
    named = dict(model.named_parameters())
    assert {n for n, p in named.items() if p.requires_grad} == trains
    assert count == sum(named[n].numel() for n in trains)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert all((p.grad is not None) == (n in trains) for n, p in named.items())
    optimizer = create_optimizer(model, load_config(None, []).optim, 128, torch.device("cpu"))
    optimizer.step()
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert held == {id(named[n]) for n in trains} and set(map(id, optimizer.state)) <= held


def test_a_fine_tuned_run_keeps_its_frozen_weights_and_its_checkpoint_only_the_trained_ones_state(
        tiny_imagefolder, tmp_path, on_cpu):
    source = tmp_path / "source"
    train(load_config(None, tiny_overrides(tiny_imagefolder, source, "model.depth=2", "train.epochs=1")))
    reset_accelerate()
    start = load_file(str(source / "checkpoints/last/model.safetensors"))
    for spec, frozen in (("blocks:1", EMBEDDINGS | _block(0)), ("attn_only", EMBEDDINGS - {"pos_embed"} | {
            f"blocks.{i}.{m}.{k}" for i in range(2) for m in ("mlp.fc1", "mlp.fc2", "norm1", "norm2")
            for k in ("weight", "bias")} | {"norm.weight", "norm.bias"})):
        run = tmp_path / spec.replace(":", "")
        train(load_config(None, tiny_overrides(tiny_imagefolder, run, "model.depth=2", "train.epochs=1",
                                               f"model.pretrained={source}", f"model.freeze={spec}")))
        reset_accelerate()
        end = load_file(str(run / "checkpoints/last/model.safetensors"))
        assert {k for k in start if torch.equal(start[k], end[k])} == frozen
        groups = json.loads((run / "checkpoints/last/optimizer.json").read_text())["param_groups"]
        held = sum(len(g["params"]) for g in groups)
        state = load_file(str(run / "checkpoints/last/optimizer.safetensors"))
        assert held == len(start) - len(frozen) == len({k.split(".")[0] for k in state})


def test_bad_freezing_is_one_line_before_any_image_is_decoded(tiny_imagefolder, tmp_path):
    with pytest.raises(ConfigError, match=r"model.freeze='blocks:x' is not one of none, backbone, blocks:N"):
        load_config(None, ["model.freeze=blocks:x"])
    with pytest.raises(ConfigError, match=r"model.freeze='head' is not one of"):
        load_config(None, ["model.freeze=head"])
    with pytest.raises(ConfigError, match=r"model.freeze='backbone' is invalid; expected none for a text model"):
        load_config(base={"task": "lm", "model": {"name": "gpt_char_tiny", "freeze": "backbone"},
                          "data": {"root": str(tmp_path)}})
    with pytest.raises(ConfigError, match=r"model.freeze=blocks:3: the model has 2 blocks; freeze at most 2"):
        freeze_parameters(_vit(depth=2), "blocks:3")
    resnet = vitlab.create_model("timm:resnet10t", num_classes=3)
    with pytest.raises(ConfigError, match=r"model.freeze=blocks:1 needs a model with a stack of blocks .* "
                                          r"TimmClassifier has none: use backbone or attn_only"):
        freeze_parameters(resnet, "blocks:1")
    assert freeze_parameters(resnet, "backbone") == sum(p.numel() for p in resnet.get_classifier().parameters())
    with pytest.raises(ConfigError, match=r"the model has 1 blocks") as bad:  # in train(), before decoding
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "r", "model.freeze=blocks:2")))
    reset_accelerate()
    assert "decoding" not in str(bad.value)


def _deit_attn_only(model: torch.nn.Module) -> set[str]:
    """DeiT's main.py under --attn-only (facebookresearch/deit), written out: what it leaves trainable."""
    for name, p in model.named_parameters():
        p.requires_grad = ".attn." in name
    model.head.weight.requires_grad = model.head.bias.requires_grad = True
    model.pos_embed.requires_grad = True
    for p in model.patch_embed.parameters():
        p.requires_grad = False
    return {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kwargs", [dict(), dict(reg_tokens=2), dict(qk_norm=True)])
def test_attn_only_trains_what_deits_attn_only_trains(kwargs):
    model = vitlab.create_model("vit_cifar_tiny_patch4_32", depth=2, embed_dim=32, num_heads=2, num_classes=5, **kwargs)
    freeze_parameters(model, "attn_only")
    ours = {n for n, p in model.named_parameters() if p.requires_grad}
    assert ours == _deit_attn_only(model) and "pos_embed" in ours and not any("norm1" in n for n in ours)


@pytest.mark.parametrize("kwargs", [dict(reg_tokens=4), dict(distilled=True), dict(class_token=False,
                                                                                     global_pool="avg")])
def test_the_tokens_without_weight_decay_are_timms(kwargs):
    # timm's VisionTransformer.no_weight_decay() as timm 1.0.31 writes it (1.0.16, the floor, lacked reg_token)
    timms = {"pos_embed", "cls_token", "reg_token", "dist_token"}
    model = vitlab.create_model("vit_cifar_tiny_patch4_32", depth=1, embed_dim=32, num_heads=2, **kwargs)
    names = {n for n, _ in model.named_parameters()}
    assert model.no_weight_decay() == timms & names
