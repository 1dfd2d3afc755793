"""transformers checkpoints (issue 52, 3): ViTForImageClassification, ViTModel and
DeiTForImageClassificationWithTeacher read into vitlab's ViT and written back, their outputs equal to
transformers' own forward to 1e-5 in eval mode, at the checkpoint's size and at another; model.pretrained=
transformers:<directory> starts a run from one. Offline: transformers builds the models from a config."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed: "
                                                          "pip install 'vitlab[transformers]'")

from vitlab.errors import CheckpointError  # noqa: E402
from vitlab.interop import from_transformers, to_transformers  # noqa: E402

SIZES = dict(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
             intermediate_size=96, layer_norm_eps=1e-12)
LABELS = {i: name for i, name in enumerate(["ant", "bee", "cat", "dog", "eel"])}


def _hf(kind: str, **config_args) -> torch.nn.Module:
    torch.manual_seed(0)
    labels = dict(id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    if kind.startswith("deit"):
        config = transformers.DeiTConfig(**{**SIZES, **config_args}, **labels)
        if kind == "deit-model":  # no head: the normed CLS token, the distillation token in the sequence
            return transformers.DeiTModel(config, add_pooling_layer=False).eval()
        if kind == "deit-no-teacher":  # what AutoModelForImageClassification builds for DeiT: the CLS head alone
            return transformers.DeiTForImageClassification(config).eval()
        return transformers.DeiTForImageClassificationWithTeacher(config).eval()
    config = transformers.ViTConfig(**{**SIZES, **config_args}, **labels)
    if kind == "vit-model":
        return transformers.ViTModel(config, add_pooling_layer=False).eval()
    return transformers.ViTForImageClassification(config).eval()


def _theirs(hf: torch.nn.Module, x: torch.Tensor, **kwargs) -> torch.Tensor:
    out = hf(pixel_values=x, **kwargs)
    return out.last_hidden_state[:, 0] if hasattr(out, "last_hidden_state") else out.logits


@pytest.mark.parametrize("kind", ["vit", "vit-model", "deit", "deit-no-teacher", "deit-model"])
def test_a_transformers_vit_read_into_vitlab_gives_its_outputs_at_its_size_and_at_another(kind):
    hf = _hf(kind)
    vit = from_transformers(hf).eval()
    assert vit.config["norm_eps"] == 1e-12 and vit.config["patch_size"] == 8 and vit.config["img_size"] == 32
    assert vit.num_reg_tokens == int(kind in ("deit-no-teacher", "deit-model"))  # the distillation token, headless
    if kind not in ("vit-model", "deit-model"):
        assert vit.pretrained_cfg["label_names"] == list(LABELS.values()) and vit.num_classes == 5
        assert vit.distilled == (kind == "deit")
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(vit(x), _theirs(hf, x), atol=1e-5)
        # Built for 48 px: the positions resampled as transformers' interpolate_pos_encoding resamples them
        bigger = from_transformers(hf, img_size=48).eval()
        big = torch.randn(2, 3, 48, 48)
        assert torch.allclose(bigger(big), _theirs(hf, big, interpolate_pos_encoding=True), atol=1e-5)


@pytest.mark.parametrize("kind", ["vit", "deit"])
def test_to_transformers_writes_a_checkpoint_transformers_reads_with_the_same_outputs(kind, tmp_path):
    vit = from_transformers(_hf(kind)).eval()
    hf = to_transformers(vit)
    hf.save_pretrained(tmp_path / "saved")
    again = transformers.AutoModelForImageClassification.from_pretrained(tmp_path / "saved").eval()
    assert type(again).__name__ == ("DeiTForImageClassificationWithTeacher" if kind == "deit"
                                    else "ViTForImageClassification")
    assert again.config.id2label == LABELS and again.config.layer_norm_eps == 1e-12
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(again(pixel_values=x).logits, vit(x), atol=1e-5)


def test_a_run_starts_from_a_transformers_checkpoint_and_other_architectures_are_one_line(tmp_path):
    import vitlab
    from vitlab.models.pretrained import load_pretrained

    hf = _hf("vit")
    hf.save_pretrained(tmp_path / "vit")
    model = vitlab.create_model("vit_cifar_tiny_patch4_32", img_size=32, patch_size=8, embed_dim=48, depth=2,
                                num_heads=3, mlp_ratio=2.0, num_classes=3, norm_eps=1e-12)
    info = load_pretrained(model, f"transformers:{tmp_path / 'vit'}")
    assert info["mean"] == (0.5, 0.5, 0.5) and info["source"] == f"transformers:{tmp_path / 'vit'}"
    theirs = hf.vit(pixel_values=torch.randn(1, 3, 32, 32)).last_hidden_state  # every weight but the head's
    model.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model.forward_features(x), hf.vit(pixel_values=x).last_hidden_state, atol=1e-5)
    assert theirs.shape[-1] == 48
    torch.manual_seed(0)
    transformers.ResNetForImageClassification(transformers.ResNetConfig(hidden_sizes=[8, 16], depths=[1, 1],
                                                                        embedding_size=8)).save_pretrained(tmp_path / "rn")
    with pytest.raises(CheckpointError, match=r"transformers:.*rn is a resnet checkpoint; vitlab reads ViT, DeiT and ViTMAE "
                                              r"\(ViTForImageClassification, ViTModel"):
        load_pretrained(model, f"transformers:{tmp_path / 'rn'}")


@pytest.mark.parametrize("config_args", [dict(qkv_bias=False), dict(image_size=(32, 48)), dict(image_size=[48, 32],
                                                                                                patch_size=[8, 8])])
@pytest.mark.parametrize("kind", ["vit", "deit-no-teacher"])
def test_configs_without_qkv_bias_or_with_an_image_size_pair_read_with_their_outputs(config_args, kind):
    hf = _hf(kind, **config_args)
    vit = from_transformers(hf).eval()
    size = config_args.get("image_size", 32)
    h, w = (size, size) if isinstance(size, int) else size
    assert vit.config["img_size"] == (h, w) or vit.config["img_size"] == h == w
    assert (vit.blocks[0].attn.qkv.bias is None) == (config_args.get("qkv_bias") is False)
    x = torch.randn(2, 3, h, w)
    with torch.no_grad():
        torch.testing.assert_close(vit(x), _theirs(hf, x), atol=1e-5, rtol=0)


def test_a_run_starts_from_a_deit_without_its_teacher_head_given_the_register_it_needs(tmp_path):
    import vitlab
    from vitlab.models.pretrained import load_pretrained

    hf = _hf("deit-no-teacher")
    hf.save_pretrained(tmp_path / "deit")
    build = lambda **kw: vitlab.create_model("vit_cifar_tiny_patch4_32", img_size=32, patch_size=8, embed_dim=48,
                                             depth=2, num_heads=3, mlp_ratio=2.0, num_classes=5, norm_eps=1e-12, **kw)
    with pytest.raises(CheckpointError, match=r"holds 1 register token\(s\) \(a DeiT's distillation token without its "
                                              r"head is read as one\) and the model 0: set model.reg_tokens=1"):
        load_pretrained(build(), f"transformers:{tmp_path / 'deit'}")
    model = build(reg_tokens=1)
    load_pretrained(model, f"transformers:{tmp_path / 'deit'}")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), hf(pixel_values=x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["vit", "deit-no-teacher"])
def test_a_run_from_a_transformers_directory_takes_its_architecture_from_the_checkpoints_config(kind, tmp_path,
                                                                                                   tiny_imagefolder):
    """model.pretrained=transformers:DIR without model.* arguments: the width, depth, heads, MLP ratio, patch size,
    layer-norm eps (and a DeiT's register) come from DIR's config, as from_pretrained builds them; a key given with
    another value is one line naming both."""
    import vitlab
    from conftest import reset_accelerate
    from vitlab.config import load_config
    from vitlab.errors import ConfigError
    from vitlab.training import train

    hf = _hf(kind, qkv_bias=False)
    hf.save_pretrained(tmp_path / "hf")
    base = ["model.name=vit_cifar_tiny_patch4_32", f"model.pretrained=transformers:{tmp_path / 'hf'}",
            "data.dataset=imagefolder", f"data.root={tiny_imagefolder}", "data.num_workers=0", "data.loader=torch",
            "train.batch_size=16", "train.epochs=1", "optim.warmup_epochs=0", "model.num_classes=3"]
    with pytest.raises(ConfigError, match=r"fixes the architecture, and this config gives model.depth=4 \(the "
                                          r"checkpoint's: 2\), model.num_heads=2 \(the checkpoint's: 3\): leave"):
        train(load_config(None, [*base, "model.depth=4", "model.num_heads=2", "model.embed_dim=48",
                                 f"train.output_dir={tmp_path / 'no'}"]))
    reset_accelerate()
    # an lr of 1e-12: Adam moves each weight by about that (the test reads the weights the run started from)
    train(load_config(None, [*base, "optim.lr=1e-12", "optim.min_lr=0", "optim.weight_decay=0",
                             f"train.output_dir={tmp_path / 'run'}"]))
    reset_accelerate()
    model = vitlab.load_model(tmp_path / "run")
    c = model.config
    assert (c["embed_dim"], c["depth"], c["num_heads"], c["mlp_ratio"], c["patch_size"], c["norm_eps"]) == \
        (48, 2, 3, 2.0, 8, 1e-12)
    assert c["qkv_bias"] is False and model.num_reg_tokens == int(kind == "deit-no-teacher")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():  # every weight but the head's is the checkpoint's
        theirs = (hf.vit if kind == "vit" else hf.deit)(pixel_values=x).last_hidden_state
        torch.testing.assert_close(model.eval().forward_features(x), theirs, atol=1e-4, rtol=0)  # fresh: O(1)


def test_a_run_from_a_transformers_directory_continues_with_the_config_it_began_with(tmp_path, tiny_imagefolder):
    """The architecture read from the checkpoint's config is part of the run's config before the run is looked for:
    the same config continues it (train.resume=auto, --resume RUN key=value), rather than reading as another one."""
    from conftest import reset_accelerate
    from vitlab.config import load_config
    from vitlab.training import train

    _hf("vit").save_pretrained(tmp_path / "hf")
    base = ["model.name=vit_cifar_tiny_patch4_32", f"model.pretrained=transformers:{tmp_path / 'hf'}",
            "data.dataset=imagefolder", f"data.root={tiny_imagefolder}", "data.num_workers=0", "data.loader=torch",
            "train.batch_size=16", "optim.warmup_epochs=0", "model.num_classes=3", f"train.output_dir={tmp_path / 'r'}"]
    train(load_config(None, [*base, "train.epochs=1"]))
    reset_accelerate()
    train(load_config(None, [*base, "train.epochs=1", "train.resume=auto"]))  # the same config: the same run
    reset_accelerate()
    summary = train(load_config(None, [*base, "train.epochs=2"]), resume=tmp_path / "r")  # one more epoch
    reset_accelerate()
    assert summary["epochs_done"] == 2
