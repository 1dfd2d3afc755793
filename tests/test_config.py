"""Config files, overrides and their validation."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vitlab.config import load_config, save_config
from vitlab.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load_and_build_their_model(path, tmp_path):
    import vitlab
    from vitlab.models.hub import image_input_size
    from vitlab.tasks import build_model

    cfg = load_config(path)
    if cfg.task == "classification":
        model = build_model(cfg)
        imagenet = cfg.data.dataset == "imagefolder" and "imagenet" in cfg.data.root
        size = (224, 224) if cfg.model.pretrained.startswith("timm:") or imagenet else (32, 32)  # timm's, ImageNet: 224
        size = tuple([cfg.model.args["img_size"]] * 2) if "img_size" in cfg.model.args else size  # the mosaics: 64
        assert model.num_classes == (1000 if imagenet else 10) and image_input_size(model)[1:] == size
        logits = model.eval()(torch.randn(2, 3, *size))
    elif cfg.task == "lm":
        model = build_model(cfg, vocab_size=64, block_size=cfg.data.block_size).eval()
        assert model.block_size == cfg.data.block_size
        logits = model(torch.tensor([[5, 6, 7]]))
    elif cfg.task == "mae":  # the decoder's pixels of each patch
        model = build_model(cfg).eval()
        logits = model(torch.randn(2, 3, 32, 32)).pred
        width = model.decoder_pred.out_features
    elif cfg.task == "dino":  # the student's outputs of a batch of views
        model = build_model(cfg).eval()
        logits = model([torch.randn(2, 3, 32, 32)])
        width = model.student_head.last_layer.out_features
    else:
        model = vitlab.create_model(cfg.model.name, src_vocab_size=64, tgt_vocab_size=64, **cfg.model.args).eval()
        logits = model(torch.tensor([[5, 6, 7]]), torch.tensor([[1, 9]]))
    if cfg.task not in ("mae", "dino"):
        width = model.num_classes if cfg.task == "classification" else 64
    assert torch.isfinite(logits).all() and logits.shape[-1] == width
    # What the run directory saves reloads to the same config.
    saved = tmp_path / "config.yaml"
    save_config(cfg, saved)
    assert load_config(saved) == cfg


def test_overrides_reach_their_keys_with_types():
    cfg = load_config(ROOT / "configs/vit_cifar10.yaml",
                      ["train.epochs=5", "optim.lr=1e-3", "model.depth=4", "data.hflip=false", "optim.betas=[0.9,0.95]"])
    assert cfg.train.epochs == 5 and cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)
    assert cfg.model.args["depth"] == 4 and cfg.data.hflip is False and cfg.optim.betas == (0.9, 0.95)


@pytest.mark.parametrize("override, message", [
    ("train.epoch=3", r"unknown key train\.epoch; did you mean epochs\?"),
    ("model.dpth=2", r"unknown key model\.dpth; did you mean depth\?"),
    ("optim.lr=fast", r"optim\.lr='fast' has the wrong type; expected float, got str"),
    ("train.epochs=2.5", r"train\.epochs=2\.5 has the wrong type; expected int"),
    ("train.mixed_precision=fp8", r"train\.mixed_precision='fp8' is not allowed; expected one of 'no', 'fp16', 'bf16'"),
    ("data.dataset=imgfolder", r"data\.dataset='imgfolder' is not allowed"),
    ("train.batch_size=0", r"train\.batch_size=0 is invalid; expected an integer >= 1"),
    ("train.eval_every=-1", r"train\.eval_every=-1 is invalid; expected an integer >= 0 \(0 = only after the last epoch\)"),
    ("optim.lr=-1", r"optim\.lr=-1\.0 is invalid; expected a number > 0"),
    ("model.name=vit_tiny", r"model\.name='vit_tiny' is not a classification preset; did you mean vit_tiny_patch16_224"),
    ("trian.epochs=3", r"unknown section 'trian'; did you mean train\?"),
    ("epochs=3", r"override key 'epochs' must be section\.key"),
    ("train.epochs", r"not of the form key\.sub=value"),
    ("data.max_image_pixels=-1", r"data\.max_image_pixels=-1 is invalid; expected a number of pixels"),
    ("data.dataset=wds data.root=/tmp data.max_image_pixels=1000", r"data\.max_image_pixels=1000 is invalid; expected 0 "
                                                                   r"with shards"),
])
def test_bad_keys_types_and_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "configs/vit_cifar10.yaml", override.split(" "))


def test_missing_config_file_is_named():
    with pytest.raises(ConfigError, match=r"config file 'nope\.yaml' does not exist"):
        load_config("nope.yaml")


@pytest.mark.slow
def test_train_py_rejects_bad_config_with_exit_2_and_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/vit_cifar10.yaml"),
                             "optim.lr=fast", f"train.output_dir={tmp_path / 'run'}"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: optim.lr='fast' has the wrong type; expected float, got str"
    assert not (tmp_path / "run").exists()


def test_invalid_model_combination_is_a_config_error(tiny_imagefolder, tmp_path):
    from conftest import tiny_overrides
    from vitlab.training import train

    cfg = load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "run", "model.num_heads=5"))
    with pytest.raises(ConfigError, match="embed_dim=32 is not divisible by num_heads=5"):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_an_unquoted_no_is_the_option_no_not_a_boolean():
    """YAML reads `no` as False; `train.mixed_precision=no` on the command line must still mean 'no'."""
    assert load_config(None, ["train.mixed_precision=no"]).train.mixed_precision == "no"
    with pytest.raises(ConfigError, match="train.mixed_precision=True is not allowed"):
        load_config(None, ["train.mixed_precision=yes"])


def test_mean_and_std_on_the_0_255_scale_are_refused_with_their_0_1_values():
    # timm's --mean / --std are on the 0-1 scale; ImageNet's statistics times 255 left inputs near -500.
    with pytest.raises(ConfigError, match=r"^data.mean=\[123.675, 116.28, 103.53\] is on the 0-255 scale; vitlab's "
                                          r"\(timm's\) are on the 0-1 scale: data.mean=\[0.485, 0.456, 0.406\]$"):
        load_config(None, ["data.mean=[123.675, 116.28, 103.53]", "data.std=[0.229, 0.224, 0.225]"])
    with pytest.raises(ConfigError, match=r"^data.std=\[58.395, 57.12, 57.375\] is on the 0-255 scale; .*"
                                          r"data.std=\[0.229, 0.224, 0.225\]$"):
        load_config(None, ["data.mean=[0.485, 0.456, 0.406]", "data.std=[58.395, 57.12, 57.375]"])
    with pytest.raises(ConfigError, match=r"^data.mean=\[-0.1, 0.5, 0.5\] is invalid"):
        load_config(None, ["data.mean=[-0.1, 0.5, 0.5]"])
    assert load_config(None, ["data.mean=[0.5, 0.5, 0.5]", "data.std=[1, 1, 1]"]).data.std == (1.0, 1.0, 1.0)


def test_an_explicit_lr_beside_lr_base_wins_as_timms_lr(tmp_path):
    # timm's train.py: --lr given is the learning rate; --lr-base scales only when --lr is not given.
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("optim:\n  lr_base: 5.0e-4\n  lr_base_size: 512\ntrain:\n  batch_size: 1024\n")
    assert load_config(recipe).optim.peak_lr(1024) == pytest.approx(1e-3)
    cfg = load_config(recipe, ["optim.lr=2e-4"])
    assert cfg.optim.peak_lr(1024) == 2e-4 and cfg.optim.lr_base == 0
    # what a run records says what it ran: written and read again, the same peak
    from vitlab.config import save_config

    for run in (load_config(recipe), cfg):
        save_config(run, tmp_path / "run_config.yaml")
        assert load_config(tmp_path / "run_config.yaml").optim.peak_lr(1024) == run.optim.peak_lr(1024)
    # a run_config.yaml written before (every key, lr beside lr_base): lr_base was its learning rate
    old = tmp_path / "old_run_config.yaml"
    old.write_text("optim:\n  lr: 0.001\n  lr_base: 5.0e-4\n  lr_base_size: 512\ntrain:\n  batch_size: 1024\n")
    assert load_config(old, recorded=True).optim.peak_lr(1024) == pytest.approx(1e-3 * 1)
    assert load_config(old, recorded=True).optim.lr_base == 5e-4
    with_lr = load_config(old, ["optim.lr=2e-4"], recorded=True).optim  # --resume RUN optim.lr=...: the override wins
    assert with_lr.peak_lr(1024) == 2e-4 and with_lr.lr_base == 0
