"""Fine-tuning from pretrained weights, offline: a timm ViT's weights saved to a file are what the run
starts from (all but the head), positions are resampled, images resized, normalization taken over."""
from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from timm.layers import resample_abs_pos_embed

from conftest import reset_accelerate, tiny_overrides
from vitlab import checkpoint as ckpt
from vitlab.config import load_config
from vitlab.errors import CheckpointError, ConfigError
from vitlab.training import create_optimizer, create_scheduler, train
import vitlab

TINY_LR = ["optim.lr=1e-7", "optim.min_lr=0", "optim.weight_decay=0", "train.epochs=1", "train.label_smoothing=0"]


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / "last" / "model.safetensors"))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in keys)


@pytest.fixture(scope="module")
def timm_file(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A small timm ViT of the tiny test run's shape, with 5 classes, saved as safetensors."""
    torch.manual_seed(7)
    reference = timm.models.VisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2,
                                              mlp_ratio=2.0, num_classes=5)
    path = tmp_path_factory.mktemp("timm") / "vit.safetensors"
    save_file(reference.state_dict(), str(path))
    return path, reference.state_dict()


def test_finetuning_from_a_timm_weights_file_starts_from_its_weights_with_a_new_head(tiny_imagefolder, timm_file,
                                                                                      tmp_path):
    path, reference = timm_file
    run_dir = tmp_path / "run"
    train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, f"model.pretrained={path}", *TINY_LR)))
    reset_accelerate()
    final = _final_weights(run_dir)
    body = [k for k in reference if not k.startswith("head.")]
    # Six steps at lr 1e-7 move a weight by at most ~6e-7: the run started from the file's weights.
    assert _max_diff(final, reference, body) < 1e-5
    fresh = vitlab.create_model("vit_cifar_tiny_patch4_32", depth=1, embed_dim=32, num_heads=2, num_classes=3)
    assert _max_diff(fresh.state_dict(), reference, body) > 0.01  # what "not loaded" would look like
    assert final["head.weight"].shape == (3, 32)  # reset to the data's 3 classes (the file has 5)
    meta = ckpt.read_json(run_dir / "checkpoints" / "last" / "config.json")
    # A bare file of a name timm does not know: ImageNet's statistics, not CIFAR-10's.
    assert meta["mean"] == pytest.approx(list(timm.data.IMAGENET_DEFAULT_MEAN))


@pytest.mark.parametrize("loader", ["torch", "gpu"])
def test_finetuning_through_timm_offline_resamples_positions_resizes_images_and_takes_timms_normalization(
        tiny_imagefolder, tmp_path, loader):
    """``timm:<name>`` with ``pretrained_file`` goes through timm.create_model(pretrained=True,
    pretrained_cfg_overlay=dict(file=...)) and vitlab.interop.from_timm, with no network."""
    torch.manual_seed(3)
    reference = timm.create_model("vit_tiny_patch16_224")  # random weights stand in for the downloaded ones
    path = tmp_path / "vit_tiny.safetensors"
    save_file(reference.state_dict(), str(path))
    run_dir = tmp_path / "run"
    overrides = [o for o in tiny_overrides(tiny_imagefolder, run_dir, *TINY_LR) if not o.startswith("model.")]
    train(load_config(None, overrides + [
        "model.name=vit_tiny_patch16_224", "model.img_size=64", "model.num_classes=3", "data.decode_size=32",
        "model.pretrained=timm:vit_tiny_patch16_224", f"model.pretrained_file={path}", f"data.loader={loader}"]))
    reset_accelerate()
    final, state = _final_weights(run_dir), reference.state_dict()
    body = [k for k in state if not k.startswith("head.") and k != "pos_embed"]
    assert _max_diff(final, state, body) < 1e-5
    # 14 x 14 positions resampled to the 4 x 4 grid of 64-pixel images, as timm resamples them.
    expected = resample_abs_pos_embed(state["pos_embed"], new_size=(4, 4), num_prefix_tokens=1)
    assert final["pos_embed"].shape == (1, 17, 192)
    assert (final["pos_embed"] - expected).abs().max().item() < 1e-5
    meta = ckpt.read_json(run_dir / "checkpoints" / "last" / "config.json")
    assert meta["mean"] == [0.5, 0.5, 0.5] and meta["std"] == [0.5, 0.5, 0.5]  # timm's config for this model
    assert meta["model_args"]["img_size"] == 64  # 32-pixel images were resized to the model's 64


def test_finetuning_from_a_vitlab_run_loads_every_weight(tiny_imagefolder, tmp_path):
    first = tmp_path / "first"
    train(load_config(None, tiny_overrides(tiny_imagefolder, first, "train.epochs=1")))
    reset_accelerate()
    second = tmp_path / "second"
    train(load_config(None, tiny_overrides(tiny_imagefolder, second, f"model.pretrained={first}", *TINY_LR)))
    reset_accelerate()
    start = _final_weights(first)
    assert _max_diff(_final_weights(second), start, list(start)) < 1e-5  # the head too: same 3 classes


def test_layer_decay_scales_each_depth_as_beit():
    """BEiT / timm: with n blocks, the stem is layer 0, block i layer i + 1, the head layer n + 1, and
    layer l learns at lr * decay ** (n + 1 - l)."""
    model = vitlab.create_model("vit_cifar_tiny_patch4_32", depth=3)
    optim = load_config(None, ["optim.lr=1e-3", "optim.layer_decay=0.5", "optim.warmup_epochs=0"]).optim
    optimizer = create_optimizer(model, optim, 128, torch.device("cpu"))
    create_scheduler(optimizer, optim, steps_per_epoch=10, epochs=2)  # the rate of the first step: the peak
    lr_of = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            lr_of[p] = group["lr"]
    named = dict(model.named_parameters())
    assert lr_of[named["head.weight"]] == pytest.approx(1e-3)
    for i in range(3):
        assert lr_of[named[f"blocks.{i}.attn.qkv.weight"]] == pytest.approx(1e-3 * 0.5 ** (3 - i))
    for stem in ("cls_token", "pos_embed", "patch_embed.proj.weight"):
        assert lr_of[named[stem]] == pytest.approx(1e-3 * 0.5 ** 4)
    assert len(lr_of) == len(named)


def test_bad_pretrained_sources_are_one_line_before_any_data_is_read(tiny_imagefolder, timm_file, tmp_path):
    path, _ = timm_file
    with pytest.raises(CheckpointError, match="is neither timm:<name>, a weights file nor a vitlab run"):
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "a", "model.pretrained=nowhere.bin")))
    with pytest.raises(CheckpointError, match=r"does not fit vit_cifar_tiny_patch4_32 \(shapes differ"):
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "b", f"model.pretrained={path}",
                                               "model.embed_dim=64")))
    with pytest.raises(CheckpointError, match="timm has no model 'no_such_vit'"):
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "c", "model.pretrained=timm:no_such_vit")))
    with pytest.raises(ConfigError, match="model.pretrained_file"):
        load_config(None, [f"model.pretrained_file={path}"])
    with pytest.raises(ConfigError, match="model.pretrained"):
        load_config(None, ["task=lm", "data.root=x.txt", f"model.pretrained={path}"])
    reset_accelerate()
