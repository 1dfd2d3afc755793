"""LoRA through peft (issue 52, 2): the adapted layers are peft's (its forward against the formula W x + (alpha / r)
B A x written out here), only adapters and head train, a run saves them alone and resumes exactly, eval loads
them on their base, export merges them (merged outputs equal unmerged to 1e-5); bad input is one line before any
image is decoded."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors.torch import load_file

import vitlab
from conftest import reset_accelerate, tiny_overrides
from vitlab.config import load_config
from vitlab.errors import ConfigError

pytest.importorskip("peft", reason="the lora extra is not installed: pip install 'vitlab[lora]'")

from vitlab.models.lora import add_lora, merge_lora  # noqa: E402


def _vit() -> torch.nn.Module:
    return vitlab.create_model("vit_cifar_tiny_patch4_32", depth=2, embed_dim=32, num_heads=2, num_classes=4)


def test_the_adapted_layers_compute_w_x_plus_alpha_over_r_b_a_x_and_only_adapters_and_head_train():
    torch.manual_seed(0)
    model = _vit().eval()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    trainable = add_lora(model, r=4, alpha=8.0, dropout=0.0, targets=["attn.qkv", "attn.proj"])
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names == {f"blocks.{i}.attn.{m}.lora_{ab}.default.weight" for i in range(2) for m in ("qkv", "proj")
                     for ab in "AB"} | {"head.weight", "head.bias"}
    assert trainable == sum(p.numel() for n, p in model.named_parameters() if n in names)
    qkv = model.blocks[0].attn.qkv
    with torch.no_grad():
        qkv.lora_B.default.weight.normal_()  # peft starts B at zero: the model is its base until trained
        x = torch.randn(5, 32)
        a, b = qkv.lora_A.default.weight, qkv.lora_B.default.weight
        expected = x @ base["blocks.0.attn.qkv.weight"].T + base["blocks.0.attn.qkv.bias"] + (8.0 / 4) * x @ a.T @ b.T
        assert torch.allclose(qkv(x), expected, atol=1e-5)
        images = torch.randn(3, 3, 32, 32)
        adapted = model(images)
        merged = merge_lora(model)
    assert not any("lora" in n for n in merged.state_dict()) and type(merged.blocks[0].attn.qkv) is torch.nn.Linear
    assert torch.allclose(merged(images), adapted, atol=1e-5)


@pytest.mark.slow
def test_a_lora_run_saves_its_adapters_alone_resumes_exactly_and_eval_and_export_use_them(
        tiny_imagefolder, tmp_path, monkeypatch, capsys, on_cpu):
    from conftest import train_until_signal
    from vitlab.cli import main
    from vitlab.training import train

    source = tmp_path / "source"
    train(load_config(None, tiny_overrides(tiny_imagefolder, source, "model.depth=2", "train.epochs=1")))
    reset_accelerate()
    keys = ("model.depth=2", f"model.pretrained={source}", "model.lora_r=4", "train.epochs=2", "train.ema_decay=0.9")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(load_config(None, tiny_overrides(tiny_imagefolder, whole, *keys)))
    reset_accelerate()
    out = capsys.readouterr().out
    assert "LoRA r=4 on attn.qkv, attn.proj" in out and "adapters and head saved alone" in out
    saved = load_file(str(whole / "checkpoints/last/model.safetensors"))
    assert set(saved) == {f"blocks.{i}.attn.{m}.lora_{ab}.default.weight" for i in range(2) for m in ("qkv", "proj")
                          for ab in "AB"} | {"head.weight", "head.bias"}
    assert set(load_file(str(whole / "checkpoints/last/ema.safetensors"))) == set(saved)
    train_until_signal(monkeypatch, load_config(None, tiny_overrides(tiny_imagefolder, parts, *keys)), 9)
    reset_accelerate()
    train(load_config(None, tiny_overrides(tiny_imagefolder, parts, *keys)))
    reset_accelerate()
    resumed = load_file(str(parts / "checkpoints/last/model.safetensors"))
    assert all(torch.equal(saved[k], resumed[k]) for k in saved)
    # eval loads the adapters on their base (the source run) and gives the run's own final numbers
    main(["eval", "--checkpoint", str(whole / "checkpoints/last"), "--output", str(tmp_path / "m.json"), "--no-ema"])
    reset_accelerate()
    import json

    final = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()][-1]
    assert json.loads((tmp_path / "m.json").read_text())["top1"] == pytest.approx(final["test_top1"], abs=1e-6)
    # export merges them: the exported program runs plain linear layers and gives the adapted model's outputs
    out = tmp_path / "merged.pt2"
    main(["export", "--checkpoint", str(whole / "checkpoints/last"), "--format", "torch-export", "--output", str(out)])
    program = torch.export.load(str(out)).module()
    assert not any("lora" in k for k in program.state_dict())
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(program(images), vitlab.load_model(whole / "checkpoints/last")(images), atol=1e-5)


def test_bad_lora_settings_are_one_line_before_any_image_is_decoded(tiny_imagefolder, tmp_path, monkeypatch):
    import importlib.util

    from vitlab.training import train

    with monkeypatch.context() as m:  # peft not installed
        find = importlib.util.find_spec
        m.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find(name, *a))
        with pytest.raises(ConfigError, match=r"^model.lora_r=4 needs the peft library: pip install 'vitlab\[lora\]'$"):
            load_config(None, ["model.lora_r=4", "model.pretrained=timm:x"])

    with pytest.raises(ConfigError, match=r"model.lora_r=4 adapts pretrained weights: set model.pretrained"):
        load_config(None, ["model.lora_r=4"])
    with pytest.raises(ConfigError, match=r"model.freeze='backbone' .* with model.lora_r=4"):
        load_config(None, ["model.lora_r=4", "model.pretrained=timm:x", "model.freeze=backbone"])
    with pytest.raises(ConfigError, match=r"model.lora_targets=\['attn.qkvv'\] match no module of the model; its "
                                          r"linear layers end in .*attn.qkv"):
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "r", f"model.pretrained={tmp_path}",
                                               "model.lora_r=4", "model.lora_targets=[attn.qkvv]")))
    reset_accelerate()


def test_a_lora_model_saves_and_converts_as_a_merged_copy_that_every_reader_loads(tiny_imagefolder, tmp_path, on_cpu):
    # save_pretrained, to_timm and to_transformers fold the adapters into a copy (peft's merge_and_unload): the files
    # and models give the adapted model's outputs, and the model in hand keeps its adapters
    from vitlab.interop import to_timm
    from vitlab.training import train

    source, run = tmp_path / "source", tmp_path / "lora"
    train(load_config(None, tiny_overrides(tiny_imagefolder, source, "model.depth=2", "train.epochs=1")))
    reset_accelerate()
    train(load_config(None, tiny_overrides(tiny_imagefolder, run, "model.depth=2", f"model.pretrained={source}",
                                           "model.lora_r=4", "train.epochs=1", "optim.lr=3e-2")))
    reset_accelerate()
    model = vitlab.load_model(run)
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        adapted = model(images)
        assert not torch.allclose(adapted, vitlab.load_model(source)(images), atol=1e-3)  # the adapters changed it
        model.save_pretrained(tmp_path / "saved")
        saved = vitlab.load_model(tmp_path / "saved")
        assert not any("lora" in k for k in saved.state_dict())
        torch.testing.assert_close(saved(images), adapted, atol=1e-5, rtol=0)
        assert saved.pretrained_cfg["label_names"] == model.pretrained_cfg["label_names"]
        torch.testing.assert_close(to_timm(model).eval()(images), adapted, atol=1e-5, rtol=0)
        if importlib.util.find_spec("transformers") is not None:
            from vitlab.interop import to_transformers

            hf = to_transformers(model).eval()
            torch.testing.assert_close(hf(pixel_values=images).logits, adapted, atol=1e-5, rtol=0)
        assert any(".lora_A." in n for n, _ in model.named_parameters())  # the model given keeps its adapters
        torch.testing.assert_close(model(images), adapted, atol=0, rtol=0)
