"""Any timm image classifier trained by vitlab (``model.name: timm:<name>``): the model is timm's own
(same weights under timm's names, equal outputs), its checkpoints load back in vitlab and in timm, and a
convnet vitlab trained teaches a distilled ViT from its run, its checkpoint's weights file, or the weights
file read as timm's."""
from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

import vitlab
from conftest import reset_accelerate, tiny_overrides
from vitlab.config import load_config
from vitlab.errors import ConfigError
from vitlab.evaluation import evaluate_checkpoint
from vitlab.models.pretrained import load_pretrained, timm_model
from vitlab.tasks.base import build_model
from vitlab.training import train


def test_a_timm_model_is_timms_own_under_timms_names(tmp_path):
    torch.manual_seed(0)
    reference = timm.create_model("test_byobnet", num_classes=10)
    model = vitlab.create_model("timm:test_byobnet", num_classes=10, img_size=32)
    assert list(model.state_dict()) == list(reference.state_dict())
    model.load_state_dict(reference.state_dict())
    x = torch.randn(4, 3, 32, 32)
    for mode in (True, False):
        model.train(mode), reference.train(mode)
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert model.num_classes == 10 and model.pretrained_cfg["input_size"] == (3, 32, 32)

    model.eval().save_pretrained(tmp_path / "saved")
    loaded = vitlab.load_model(tmp_path / "saved")
    assert type(loaded).__name__ == "TimmClassifier" and loaded.pretrained_cfg["input_size"] == (3, 32, 32)
    torch.testing.assert_close(loaded(x), reference.eval()(x), rtol=0, atol=0)
    # The weights file is timm's state dict: timm reads it as a local copy of the model's weights, head
    # size and all.
    as_timm = timm_model("test_byobnet", str(tmp_path / "saved/model.safetensors"))
    assert as_timm.num_classes == 10
    torch.testing.assert_close(as_timm.eval()(x), reference(x), rtol=0, atol=0)

    model.reset_classifier(3)
    assert model(x).shape == (4, 3) and model.config["num_classes"] == 3


def test_a_bad_timm_model_is_one_line_when_the_config_is_read(tiny_imagefolder, tmp_path):
    with pytest.raises(ConfigError, match=r"^model.name='timm:test_resnt': timm has no model 'test_resnt'; did you "
                                          r"mean timm:test_resnet"):
        load_config(None, tiny_overrides(tiny_imagefolder, tmp_path, "model.name=timm:test_resnt"))
    with pytest.raises(ConfigError, match=r"^model \(timm:test_resnet with .*\): timm's 'test_resnet' does not take "
                                          r"model.bogus; leave them out"):
        train(load_config(None, _timm_overrides(tiny_imagefolder, tmp_path, "model.bogus=1")))
    # A config written for a vitlab ViT with a timm convnet's name: every ViT key it set, in one line (timm named
    # only the first, embed_dim, in its own words).
    root = Path(__file__).resolve().parents[1]
    with pytest.raises(ConfigError, match=r"^model \(timm:test_resnet with .*\): timm's 'test_resnet' does not take "
                                          r"model.embed_dim, model.num_heads, model.depth \(arguments of vitlab's ViT, "
                                          r"which a config written for one sets\); leave them out of the config's "
                                          r"model section and overrides$"):
        build_model(load_config(root / "configs/cifar10_cpu_quick.yaml", ["model.name=timm:test_resnet"]))
    assert not (tmp_path / "checkpoints").exists()


def _timm_overrides(root, out, *extra):
    return [o for o in tiny_overrides(root, out, *extra) if not o.startswith(("model.depth", "model.embed_dim",
                                                                              "model.num_heads", "model.name"))] + \
        ["model.name=timm:test_resnet", "model.img_size=32"]


@pytest.fixture(scope="module")
def convnet_run(tiny_imagefolder, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("convnet") / "run"
    with pytest.MonkeyPatch.context() as m:
        m.setenv("ACCELERATE_USE_CPU", "true")
        summary = train(load_config(None, _timm_overrides(tiny_imagefolder, run_dir, "train.epochs=1")))
    reset_accelerate()
    assert summary["epochs_done"] == 1
    return run_dir, summary


def test_a_convnet_vitlab_trained_teaches_from_its_run_its_weights_file_or_as_timms(
        convnet_run, tiny_imagefolder, tmp_path, on_cpu):
    convnet_run, summary = convnet_run
    weights = convnet_run / "checkpoints/last/model.safetensors"
    reference = timm.create_model("test_resnet", num_classes=3)
    reference.load_state_dict(load_file(str(weights)))  # timm's names, nothing to convert
    model = vitlab.load_model(convnet_run / "checkpoints/last", use_ema=False)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model(x), reference.eval()(x), rtol=0, atol=0)

    # vitlab eval reads it back: the run's final test metrics.
    evaluated = evaluate_checkpoint(convnet_run)
    reset_accelerate()
    assert evaluated["top1"] == summary["test_top1"] and evaluated["loss"] == pytest.approx(
        summary["test_loss"], rel=1e-5)

    students = {}
    for name, teacher in {"run": [f"distill.teacher={convnet_run}"],
                          "file": [f"distill.teacher={weights}"],
                          "timm": ["distill.teacher=timm:test_resnet", f"distill.teacher_file={weights}"]}.items():
        out = tmp_path / name
        train(load_config(None, tiny_overrides(tiny_imagefolder, out, "model.distilled=true", "distill.type=hard",
                                               "train.epochs=1", *teacher)))
        reset_accelerate()
        students[name] = load_file(str(out / "checkpoints/last/model.safetensors"))
    for name in ("file", "timm"):  # the same teacher three ways: the same student, bit for bit
        assert all(torch.equal(students["run"][k], students[name][k]) for k in students["run"])
    # Its weights through timm:<name> keep its run's statistics (the config.json beside them), not timm's
    # ImageNet ones: no re-normalization under a run with the same statistics, one under ImageNet's.
    from vitlab.data.transforms import CIFAR10_MEAN, CIFAR10_STD
    from vitlab.tasks.distill import Renormalized, load_teacher

    assert not isinstance(load_teacher("timm:test_resnet", str(weights), 3, "cpu", CIFAR10_MEAN, CIFAR10_STD),
                          Renormalized)
    imagenet = timm.create_model("test_resnet").pretrained_cfg
    assert isinstance(load_teacher("timm:test_resnet", str(weights), 3, "cpu", imagenet["mean"], imagenet["std"]),
                      Renormalized)

    bare = tmp_path / "bare.safetensors"
    bare.write_bytes(weights.read_bytes())
    with pytest.raises(ConfigError, match=r"^distill.teacher=.*bare.safetensors' is a weights file without the "
                                          r"config.json beside it .* set distill.teacher=timm:<name> and "
                                          r"distill.teacher_file="):
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "x", "distill.type=hard",
                                               f"distill.teacher={bare}")))


def test_a_timm_model_fine_tunes_from_a_weights_file_with_another_head(tiny_imagefolder, tmp_path, on_cpu):
    torch.manual_seed(1)
    source = timm.create_model("test_resnet", num_classes=5)
    file = tmp_path / "five.safetensors"
    save_file(source.state_dict(), str(file))
    run = tmp_path / "run"
    cfg = load_config(None, _timm_overrides(tiny_imagefolder, run, f"model.pretrained={file}", "train.epochs=1"))
    model = build_model(cfg)

    got = load_pretrained(model, str(file), model_name=cfg.model.name)
    assert got["mean"] == timm.create_model("test_resnet").pretrained_cfg["mean"]  # timm's config of the name
    mine, theirs = model.state_dict(), source.state_dict()
    assert [k for k in theirs if not torch.equal(mine[k], theirs[k])] == ["fc.weight", "fc.bias"]
    assert mine["fc.weight"].shape == (3, theirs["fc.weight"].shape[1])  # a new head of the data's 3 classes


def test_gradient_checkpointing_of_a_timm_model_gives_its_gradients_or_one_line(monkeypatch):
    torch.manual_seed(0)
    model = vitlab.create_model("timm:test_resnet", num_classes=3, img_size=32)
    x = torch.randn(2, 3, 32, 32)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(plain, model.parameters()))

    def none(enable=True):
        raise NotImplementedError

    monkeypatch.setattr(model.model, "set_grad_checkpointing", none)
    with pytest.raises(ValueError, match=r"^timm's 'test_resnet' has no gradient checkpointing"):
        model.set_grad_checkpointing(True)
    model.set_grad_checkpointing(False)  # turning it off is always possible


@pytest.mark.parametrize("name", ["test_resnet", "test_vit", "test_convnext"])
def test_layer_decay_of_a_timm_model_gives_timms_own_groups(name):
    """optim.layer_decay on a timm:<name> model: each parameter's lr scale and weight decay are those timm's
    param_groups_layer_decay gives the timm model itself (its group_matcher, its no_weight_decay)."""
    from timm.optim import param_groups_layer_decay

    from vitlab.training import param_groups

    model = vitlab.create_model(f"timm:{name}", num_classes=3)
    inner = model.model
    skip = inner.no_weight_decay() if hasattr(inner, "no_weight_decay") else set()
    theirs = {id(p): (g["lr_scale"], g["weight_decay"])
              for g in param_groups_layer_decay(inner, 0.05, no_weight_decay_list=skip, layer_decay=0.65)
              for p in g["params"]}
    ours = {id(p): (g["lr_scale"], g["weight_decay"]) for g in param_groups(model, 0.05, layer_decay=0.65)
            for p in g["params"]}
    assert ours.keys() == theirs.keys() == {id(p) for p in model.parameters()}
    assert all(ours[k] == pytest.approx(theirs[k], rel=1e-12) for k in theirs)
    assert len({scale for scale, _ in theirs.values()}) >= 3  # layers by depth, not one group


def test_a_timm_vit_fine_tunes_at_another_image_size_with_timms_own_resampling(tmp_path):
    # timm:<name> at model.img_size=32 from the weights of its 160-px default: timm itself resamples pos_embed
    # (create_model(pretrained=True, img_size=32), its checkpoint_filter_fn); vitlab gives the same weights.
    torch.manual_seed(0)
    file = tmp_path / "test_vit.safetensors"
    save_file(timm.create_model("test_vit").state_dict(), str(file))
    reference = timm.create_model("test_vit", pretrained=True, img_size=32, num_classes=3,
                                  pretrained_cfg_overlay=dict(file=str(file)))
    for source, name in (("timm:test_vit", str(file)), (str(file), "")):  # timm's name and a bare file alike
        model = vitlab.create_model("timm:test_vit", num_classes=3, img_size=32)
        load_pretrained(model, source, name, model_name="timm:test_vit")
        mine, theirs = model.state_dict(), reference.state_dict()
        assert mine["pos_embed"].shape == (1, 1 + 2 * 2, 64)
        assert {k for k in theirs if not torch.equal(mine[k], theirs[k])} <= {"head.weight", "head.bias"}  # drawn anew
    with pytest.raises(Exception, match="pos_embed"):  # what timm's filter changes matters
        model.model.load_state_dict(load_file(str(file)), strict=False)
