"""Self-supervised pretraining (``task: mae``, ``task: dino``): the models against their references (transformers'
ViTMAE, the MAE and DINO repositories' formulas written out here, timm's dynamic image size), the training runs
(images in any folders, the k-NN monitor, the reconstruction picture), every promise a classification run keeps
(exact resume after a signal and after a kill, 2 processes = 1, shards, bf16, gradient checkpointing,
save_pretrained), the bad input one line each, and starting a classifier from the backbone."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from conftest import launch_env, max_weight_diff, reset_accelerate, run_two, same_run_records, signal_at_step, \
    tiny_overrides
from vitlab import checkpoint as ckpt
from vitlab.config import load_config
from vitlab.errors import CheckpointError, ConfigError, DataError, Preempted
from vitlab.models import MaskedAutoencoder, VisionTransformer, create_model
from vitlab.models.dino import DINOHead, cosine_momentum, dino_loss, teacher_temperature, update_center
from vitlab.training import train

ROOT = Path(__file__).resolve().parents[1]
transformers = pytest.importorskip("transformers")


# ---- the references, written out ---------------------------------------------------------------------------------

def mae_repo_sincos(embed_dim: int, grid_size: int) -> np.ndarray:
    """facebookresearch/mae, util/pos_embed.py: ``get_2d_sincos_pos_embed(embed_dim, grid_size, cls_token=True)``."""
    def from_grid(dim: int, pos: np.ndarray) -> np.ndarray:
        omega = np.arange(dim // 2, dtype=np.float64) / (dim / 2.0)
        omega = 1.0 / 10000 ** omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    grid_h = np.arange(grid_size, dtype=np.float32)
    grid_w = np.arange(grid_size, dtype=np.float32)
    grid = np.stack(np.meshgrid(grid_w, grid_h), axis=0).reshape([2, 1, grid_size, grid_size])
    emb = np.concatenate([from_grid(embed_dim // 2, grid[0]), from_grid(embed_dim // 2, grid[1])], axis=1)
    return np.concatenate([np.zeros([1, embed_dim]), emb], axis=0)


class RepoDINOHead(nn.Module):
    """facebookresearch/dino, vision_transformer.py: ``DINOHead`` (no batch norm, 3 layers)."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int, bottleneck_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim),
                                 nn.GELU(), nn.Linear(hidden_dim, bottleneck_dim))
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)

    def forward(self, x):
        x = self.mlp(x)
        x = nn.functional.normalize(x, dim=-1, p=2)
        return self.last_layer(x)


class RepoDINOLoss(nn.Module):
    """facebookresearch/dino, main_dino.py: ``DINOLoss`` (one process: its all-reduce is the identity)."""

    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs, nepochs,
                 student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.student_temp, self.center_momentum, self.ncrops = student_temp, center_momentum, ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.teacher_temp_schedule = np.concatenate((
            np.linspace(warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs),
            np.ones(nepochs - warmup_teacher_temp_epochs) * teacher_temp))

    def forward(self, student_output, teacher_output, epoch):
        student_out = student_output / self.student_temp
        student_out = student_out.chunk(self.ncrops)
        temp = self.teacher_temp_schedule[epoch]
        teacher_out = F.softmax((teacher_output - self.center) / temp, dim=-1)
        teacher_out = teacher_out.detach().chunk(2)
        total_loss, n_loss_terms = 0, 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:
                    continue
                loss = torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1)
                total_loss += loss.mean()
                n_loss_terms += 1
        total_loss /= n_loss_terms
        self.update_center(teacher_output)
        return total_loss

    @torch.no_grad()
    def update_center(self, teacher_output):
        batch_center = torch.sum(teacher_output, dim=0, keepdim=True) / len(teacher_output)
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


def repo_cosine_scheduler(base_value, final_value, epochs, niter_per_ep):
    """facebookresearch/dino, utils.py: ``cosine_scheduler`` without warmup (the teacher's momentum)."""
    iters = np.arange(epochs * niter_per_ep)
    return final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * iters / len(iters)))


# ---- the models --------------------------------------------------------------------------------------------------

def _hf_mae_config(**extra):
    return transformers.ViTMAEConfig(image_size=32, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, decoder_hidden_size=16,
                                     decoder_num_hidden_layers=2, decoder_num_attention_heads=2,
                                     decoder_intermediate_size=40, **extra)


@pytest.mark.parametrize("norm_pix_loss,qkv_bias", [(True, True), (False, False)])
def test_mae_gives_transformers_vitmae_loss_predictions_and_mask_for_the_same_noise_both_ways(norm_pix_loss, qkv_bias):
    from vitlab.interop import from_transformers, to_transformers

    torch.manual_seed(0)
    hf = transformers.ViTMAEForPreTraining(_hf_mae_config(norm_pix_loss=norm_pix_loss, qkv_bias=qkv_bias,
                                                          mask_ratio=0.6)).eval()
    with torch.no_grad():  # transformers 5 leaves a model built from a config with zero position tables
        for p in hf.parameters():
            p.normal_(0, 0.2)
    ours = from_transformers(hf)
    assert isinstance(ours, MaskedAutoencoder) and ours.mask_ratio == 0.6 and ours.norm_pix_loss == norm_pix_loss
    images, noise = torch.randn(3, 3, 32, 32), torch.rand(3, 64)
    with torch.no_grad():
        theirs, mine = hf(pixel_values=images, noise=noise), ours(images, noise=noise)
        back = to_transformers(ours).eval()(pixel_values=images, noise=noise)
    assert mine.mask.sum(1).tolist() == [64 - int(64 * 0.4)] * 3 and torch.equal(mine.mask, theirs.mask)
    assert torch.equal(mine.ids_restore, theirs.ids_restore)
    assert (mine.loss - theirs.loss).abs().item() < 1e-5 and (mine.pred - theirs.logits).abs().max().item() < 1e-5
    assert (back.loss - theirs.loss).abs().item() < 1e-5 and (back.logits - theirs.logits).abs().max().item() < 1e-5


def test_vitmae_model_is_the_encoder_on_every_patch():
    # transformers' ViTMAEModel masks too; with mask_ratio 0 and increasing noise it keeps every patch in order.
    from vitlab.interop import from_transformers

    torch.manual_seed(0)
    hf = transformers.ViTMAEModel(_hf_mae_config(mask_ratio=0.0)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    vit = from_transformers(hf)
    assert isinstance(vit, VisionTransformer) and vit.num_classes == 0
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        theirs = hf(pixel_values=images, noise=torch.arange(64.0).expand(2, -1)).last_hidden_state
        assert (vit.forward_features(images) - theirs).abs().max().item() < 1e-5


def test_mae_position_tables_are_the_mae_repositorys_fixed_sincos():
    from transformers.models.vit_mae.modeling_vit_mae import build_2d_sinusoidal_position_embedding

    mae = MaskedAutoencoder(img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2, decoder_embed_dim=16,
                            decoder_depth=1, decoder_num_heads=2)
    for table, width in ((mae.encoder.pos_embed, 32), (mae.decoder_pos_embed, 16)):
        assert not table.requires_grad
        reference = torch.from_numpy(mae_repo_sincos(width, 8)).float()
        assert (table[0] - reference).abs().max().item() < 1e-6
    # transformers builds the canonical layout and turns its halves (its note: the original's swapped h and w)
    hf = build_2d_sinusoidal_position_embedding(height=8, width=8, embed_dim=32, cls_token=True)
    assert (torch.cat([hf[:, 16:], hf[:, :16]], -1) - mae.encoder.pos_embed[0]).abs().max().item() < 1e-6


def test_dynamic_image_size_gives_timms_features_at_another_size():
    import timm

    from vitlab.interop import to_timm

    torch.manual_seed(0)
    ours = VisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=0,
                             dynamic_img_size=True).eval()
    theirs = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=0, dynamic_img_size=True).eval()
    theirs.load_state_dict(to_timm(ours).state_dict())
    for side in (32, 16, 12):
        images = torch.randn(2, 3, side, side)
        with torch.no_grad():
            assert (ours.forward_features(images) - theirs.forward_features(images)).abs().max().item() < 1e-5, side
    with pytest.raises(ValueError, match="any multiple of the patch size"):
        ours(torch.randn(1, 3, 14, 14))


@pytest.mark.filterwarnings("ignore:.*weight_norm.* is deprecated:FutureWarning")  # the repository's own call
def test_dino_head_loss_center_and_schedules_are_the_dino_repositorys():
    torch.manual_seed(0)
    ours, theirs = DINOHead(24, 50, hidden_dim=40, bottleneck_dim=16), RepoDINOHead(24, 50, 40, 16)
    state = {k: v for k, v in ours.state_dict().items()}
    theirs.mlp.load_state_dict({k.removeprefix("mlp."): v for k, v in state.items() if k.startswith("mlp.")})
    theirs.last_layer.weight_v.data.copy_(state["last_layer.parametrizations.weight.original1"])
    features = torch.randn(6, 24)
    assert (ours(features) - theirs(features)).abs().max().item() < 1e-6
    assert not ours.last_layer.parametrizations.weight.original0.requires_grad  # norm_last_layer
    # the loss of 2 large and 3 small views of 4 images, the center after it, epoch by epoch through the warmup
    reference = RepoDINOLoss(50, ncrops=5, warmup_teacher_temp=0.04, teacher_temp=0.07, warmup_teacher_temp_epochs=3,
                             nepochs=5)
    center = torch.zeros(1, 50)
    for epoch in range(5):
        student, teacher = torch.randn(5 * 4, 50) * 3, torch.randn(2 * 4, 50) * 3
        temp = teacher_temperature(epoch, 3, 0.04, 0.07)
        assert temp == pytest.approx(reference.teacher_temp_schedule[epoch], abs=1e-12)
        mine = dino_loss(student, teacher, center, 2, 0.1, temp)
        update_center(center, teacher, 0.9)
        assert (mine - reference(student, teacher, epoch)).abs().item() < 1e-6
        assert (center - reference.center).abs().max().item() < 1e-6
    momentum = repo_cosine_scheduler(0.996, 1, 3, 7)
    assert max(abs(cosine_momentum(i, 21, 0.996) - momentum[i]) for i in range(21)) < 1e-12


@pytest.mark.parametrize("kind", ["mae", "dino"])
def test_gradient_checkpointing_gives_the_same_gradients(kind):
    torch.manual_seed(0)
    model = _tiny_model(kind)
    images = torch.randn(4, 3, 32, 32)

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad()
        torch.manual_seed(1)
        loss = model(images).loss if kind == "mae" else model([images, images.flip(-1), images[..., 8:24, 8:24]]).sum()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.set_grad_checkpointing(True)
    assert model.encoder.grad_checkpointing if kind == "mae" else model.student_backbone.grad_checkpointing
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys() and len(plain) > 10
    assert max((plain[k] - checkpointed[k]).abs().max().item() for k in plain) < 1e-6


def _tiny_model(kind: str) -> nn.Module:
    if kind == "mae":
        return create_model("mae_vit_cifar_tiny_patch4_32", embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=16,
                            decoder_depth=1, decoder_num_heads=2)
    return create_model("dino_vit_cifar_tiny_patch4_32", embed_dim=32, depth=2, num_heads=2, out_dim=64,
                        hidden_dim=32, bottleneck_dim=16, drop_path_rate=0.0)


@pytest.mark.parametrize("kind", ["mae", "dino"])
def test_save_pretrained_and_load_model_give_the_same_model(kind, tmp_path):
    import vitlab

    torch.manual_seed(0)
    model = _tiny_model(kind).eval()
    model.save_pretrained(tmp_path / "saved")
    for loaded in (type(model).from_pretrained(tmp_path / "saved"), vitlab.load_model(tmp_path / "saved")):
        assert type(loaded) is type(model)
        images = torch.randn(2, 3, 32, 32)
        with torch.no_grad():
            if kind == "mae":
                noise = torch.rand(2, 64)
                assert torch.equal(loaded(images, noise=noise).pred, model(images, noise=noise).pred)
            else:
                assert torch.equal(loaded([images]), model([images]))
                assert torch.equal(loaded.teacher_forward([images]), model.teacher_forward([images]))


def test_the_teacher_runs_without_drop_path_in_training_mode():
    torch.manual_seed(0)
    model = create_model("dino_vit_cifar_tiny_patch4_32", embed_dim=32, depth=2, num_heads=2, out_dim=64,
                         hidden_dim=32, bottleneck_dim=16, drop_path_rate=0.5).train()
    images = torch.randn(3, 3, 32, 32)
    assert model.student_backbone.training and not model.teacher_backbone.training
    assert torch.equal(model.teacher_forward([images]), model.teacher_forward([images]))
    assert not torch.equal(model([images]), model([images]))  # the student's drop path draws anew


def test_dino_views_are_two_large_and_n_small_of_whole_patches_drawn_from_the_samples_generator():
    from torchvision.transforms import v2

    from vitlab.schema import DINOConfig
    from vitlab.data.images import seeded_transform
    from vitlab.tasks.dino import dino_views, local_view_size

    s = DINOConfig(local_crops=3)
    assert local_view_size((32, 32), 4, s) == 12 and local_view_size((224, 224), 16, s) == 96  # DINO's 96 of 224
    image = torch.randint(0, 256, (3, 40, 40), dtype=torch.uint8)
    views = dino_views((32, 32), 12, s)(image)
    assert [tuple(v.shape) for v in views] == [(3, 32, 32)] * 2 + [(3, 12, 12)] * 3
    assert all(v.dtype == torch.uint8 for v in views)
    blurs = lambda view: [t for t in view.transforms if isinstance(t, v2.RandomApply)
                          and isinstance(t.transforms[0], v2.GaussianBlur)]
    made = dino_views((32, 32), 12, s)
    assert [len(blurs(t)) for t in (*made.large, made.small)] == [1, 1, 1]
    unblurred = dino_views((32, 32), 12, DINOConfig(blur=False))
    assert [len(blurs(t)) for t in (*unblurred.large, unblurred.small)] == [0, 0, 0]
    # the same sample, epoch and seed: the same views, wherever and whenever they are drawn
    draw = lambda epoch: seeded_transform(made, image, 0, epoch, 7)
    assert all(torch.equal(a, b) for a, b in zip(draw(1), draw(1))) and not all(
        torch.equal(a, b) for a, b in zip(draw(1), draw(2)))


def test_dinos_views_made_on_the_device_are_distributed_as_the_loaders_and_fixed_by_the_image_and_epoch():
    # The loader's views: torchvision on uint8, rounding after each step; the device's: each image's uniforms drawn
    # from its own generator, the parameters and views made a batch at a time in float (vitlab.data.batch_views).
    # Over 10 epochs of 48 images, each view's mean, spread and left-right difference are distributed alike
    # (two-sample KS); the same image, epoch and seed give the same views, another epoch others
    from scipy.stats import ks_2samp

    from vitlab.data.images import seeded_sample
    from vitlab.schema import DINOConfig
    from vitlab.tasks.dino import dino_views

    s = DINOConfig(local_crops=3)  # blurred
    loader, device = dino_views((32, 32), 12, s), dino_views((32, 32), 12, s, device=True)
    grid = torch.linspace(0, 255, 40)
    images = (grid[None, None, :, None] * 0.5 + grid[None, None, None, :] * 0.5 + torch.randint(
        -40, 41, (48, 3, 40, 40), generator=torch.Generator().manual_seed(0))).clamp(0, 255).to(torch.uint8)

    def device_views(epoch: int) -> list[torch.Tensor]:
        drawn = [seeded_sample(device, image, 0, epoch, i) for i, image in enumerate(images)]
        assert all(torch.equal(image, d[0]) for image, d in zip(images, drawn))
        return device.apply(images, torch.stack([d[1] for d in drawn]))

    def loader_views(epoch: int) -> list[torch.Tensor]:
        per_image = [seeded_sample(loader, image, 0, epoch, i) for i, image in enumerate(images)]
        return [torch.stack([v[k] for v in per_image]).float() for k in range(5)]

    ours = [device_views(epoch) for epoch in range(10)]
    theirs = [loader_views(epoch) for epoch in range(10)]
    assert [tuple(v.shape) for v in ours[0]] == [(48, 3, 32, 32)] * 2 + [(48, 3, 12, 12)] * 3
    statistics = (lambda v: v.mean((1, 2, 3)), lambda v: v.std((1, 2, 3)),
                  lambda v: v[..., :v.shape[-1] // 2].mean((1, 2, 3)) - v[..., v.shape[-1] // 2:].mean((1, 2, 3)))
    for k in range(5):
        for statistic in statistics:
            a, b = (torch.cat([statistic(epoch[k]) for epoch in views]).numpy() for views in (ours, theirs))
            assert ks_2samp(a, b).pvalue > 1e-3, k
    again = device_views(3)
    assert all(torch.equal(a, b) for a, b in zip(again, ours[3]))
    assert all((a - b).abs().mean() > 10 for a, b in zip(again, ours[4]))


# ---- training runs -----------------------------------------------------------------------------------------------

# The views made on the device, of images kept in memory at 32 px: MAE's crops and flips, DINO's multi-crop
DEVICE_VIEWS = {"mae": ("data.train_crop=rrc", "data.scale=[0.2,1.0]", "data.decode_size=32", "data.views=device"),
                "dino": ("data.decode_size=32", "data.views=device")}


def ssl_overrides(kind: str, data: Path, output_dir: Path, *extra: str, monitor: Path | None = None) -> list[str]:
    """A self-supervised run of a few seconds: a 1-block backbone on the images under ``data``."""
    head = ("model.decoder_embed_dim=16", "model.decoder_depth=1", "model.decoder_num_heads=2") if kind == "mae" else (
        "model.out_dim=64", "model.hidden_dim=32", "model.bottleneck_dim=16", "dino.local_crops=2")
    return [f"task={kind}", f"model.name={kind}_vit_cifar_tiny_patch4_32", "model.depth=1", "model.embed_dim=32",
            "model.num_heads=2", *head, "data.dataset=imagefolder", f"data.root={data}", "data.num_workers=0",
            "train.batch_size=16", "train.epochs=2", "optim.warmup_epochs=1", "optim.lr=3e-3", "train.log_every=2",
            "train.curves=false", f"train.output_dir={output_dir}",
            *((f"monitor.root={monitor}", "monitor.k=5") if monitor else ()),
            *extra]


@pytest.fixture(scope="module")
def loose_images(tiny_imagefolder, tmp_path_factory) -> Path:
    """The tiny set's 96 training images without classes: in nested folders, one with a space, some at the top."""
    import shutil

    root = tmp_path_factory.mktemp("loose")
    for i, image in enumerate(sorted((tiny_imagefolder / "train").rglob("*.png"))):
        folder = root / ("" if i % 3 == 0 else "holiday photos" if i % 3 == 1 else "a/b/c")
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(image, folder / f"img {i}.png")
    return root


@pytest.fixture(scope="module")
def ssl_shards(tiny_imagefolder, tmp_path_factory) -> Path:
    """The tiny set's training images in WebDataset shards of 20 (their labels unread by pretraining)."""
    from vitlab.cli import main

    shards = tmp_path_factory.mktemp("ssl_shards") / "shards"
    main(["shards", str(tiny_imagefolder), str(shards), "--shard-size", "20"])
    reset_accelerate()
    return shards


@pytest.fixture(scope="module")
def uneven_images(loose_images, tmp_path_factory) -> Path:
    """The loose images, two in three of them resized to other sizes (48 x 40, 24 x 36): files of three sizes."""
    import shutil

    from PIL import Image

    root = Path(shutil.copytree(loose_images, tmp_path_factory.mktemp("uneven") / "images"))
    for i, path in enumerate(sorted(root.rglob("*.png"))):
        if i % 3:
            Image.open(path).resize((48, 40) if i % 3 == 1 else (24, 36), Image.BICUBIC).save(path)
    return root


@pytest.fixture(scope="module")
def mae_run(loose_images, tiny_imagefolder, tmp_path_factory) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("mae") / "run"
    summary = train(load_config(None, ssl_overrides("mae", loose_images, run_dir, "train.epochs=3",
                                                    monitor=tiny_imagefolder)))
    reset_accelerate()
    return run_dir, summary


def test_mae_trains_on_images_in_any_folders_with_a_k_nn_monitor_and_a_reconstruction_picture(mae_run, capsys):
    from PIL import Image

    run_dir, summary = mae_run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["epoch"] for r in evals] == [1, 2, 3]
    assert evals[-1]["train_loss"] < evals[0]["train_loss"]  # the masked pixels are learnt
    # the monitor's vote of 5 of the 96 labelled images for the 36 test images: colours a random network tells apart
    assert summary["test_knn_top1"] == evals[-1]["test_knn_top1"] and summary["test_knn_top1"] >= 0.9
    picture = Image.open(run_dir / "reconstructions.png")
    assert picture.size[0] > 3 * 32 and picture.size[1] > 32
    saved = json.loads((run_dir / "checkpoints/last/config.json").read_text())
    assert saved["architecture"] == "MaskedAutoencoder" and saved["task"] == "mae" and "classes" not in saved
    assert "mae" in (run_dir / "config.yaml").read_text() and "dino:" not in (run_dir / "config.yaml").read_text()


def test_vitlab_eval_of_an_mae_run_is_its_k_nn_and_without_knn_says_how(mae_run, tmp_path, capsys):
    from vitlab.cli import main

    run_dir, summary = mae_run
    with pytest.raises(SystemExit) as exited:
        main(["eval", "--checkpoint", str(run_dir)])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a backbone without a head" in err[0] and "--knn K" in err[0] and \
        f"model.pretrained={run_dir}" in err[0]
    main(["eval", "--checkpoint", str(run_dir), "--knn", "5", "--output", str(tmp_path / "k.json")])
    result = json.loads((tmp_path / "k.json").read_text())
    assert result["knn_top1"] == summary["test_knn_top1"] and result["knn_train_images"] == 96
    with pytest.raises(SystemExit):
        main(["eval", "--checkpoint", str(run_dir), "--knn", "5", "monitor.root="])
    assert "names no labelled images" in capsys.readouterr().err


def test_unknown_scores_of_an_mae_run_are_one_line_and_write_nothing(mae_run, tiny_imagefolder, tmp_path, capsys):
    # The scores of 'none of my classes' are a classifier's: an MAE run has no classes to be none of
    from vitlab.cli import main

    run_dir = mae_run[0]
    before = {f: f.stat().st_mtime_ns for f in run_dir.rglob("*") if f.is_file()}
    for argv in (["calibrate", "--checkpoint", str(run_dir), "--unknown"],
                 ["eval", "--checkpoint", str(run_dir), "--unknown-images", str(tiny_imagefolder / "test")]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exited.value.code == 2 and len(err) == 1, err
        assert "classifier" in err[0] and "mae" in err[0], err[0]
    assert {f: f.stat().st_mtime_ns for f in run_dir.rglob("*") if f.is_file()} == before


def test_a_classifier_fine_tunes_probes_and_adapts_from_the_mae_encoder(mae_run, tiny_imagefolder, tmp_path):
    from vitlab.models.pretrained import load_pretrained

    run_dir, _ = mae_run
    encoder = {k.removeprefix("encoder."): v for k, v in load_file(str(run_dir / "checkpoints/last/model.safetensors"))
               .items() if k.startswith("encoder.")}
    classifier = create_model("vit_cifar_tiny_patch4_32", num_classes=3, depth=1, embed_dim=32, num_heads=2)
    cfg = load_pretrained(classifier, str(run_dir))
    assert list(cfg["mean"]) == json.loads((run_dir / "checkpoints/last/config.json").read_text())["mean"]
    own = classifier.state_dict()
    assert set(own) - set(encoder) == {"head.weight", "head.bias"}
    assert all(torch.equal(own[k], v) for k, v in encoder.items())
    # the wrong width: one line naming the encoder's arguments
    with pytest.raises(CheckpointError, match="model.embed_dim=32 model.depth=1 model.num_heads=2"):
        load_pretrained(create_model("vit_cifar_tiny_patch4_32", num_classes=3), str(run_dir))
    base = ("model.depth=1", "model.embed_dim=32", "model.num_heads=2", f"model.pretrained={run_dir}",
            "train.epochs=1")
    for name, extra in (("finetune", ("optim.layer_decay=0.75",)),
                        ("probe", ("model.freeze=backbone", "train.cache_features=true", "data.val_size=12")),
                        ("lora", ("model.lora_r=4", "model.lora_targets=[qkv]"))):
        summary = train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / name, *base, *extra)))
        reset_accelerate()
        assert 0 <= summary["test_top1"] <= 1, name


def test_a_classifier_starts_from_a_transformers_vitmae_directory(tmp_path):
    from vitlab.interop import from_transformers
    from vitlab.models.pretrained import load_pretrained

    torch.manual_seed(0)
    hf = transformers.ViTMAEForPreTraining(_hf_mae_config(layer_norm_eps=1e-6))
    hf.save_pretrained(tmp_path / "mae")
    classifier = create_model("vit_cifar_tiny_patch4_32", num_classes=3, depth=2, embed_dim=32, num_heads=2)
    cfg = load_pretrained(classifier, f"transformers:{tmp_path / 'mae'}")
    assert cfg["mean"] == (0.485, 0.456, 0.406)  # no image processor saved: MAE's ImageNet statistics
    encoder = from_transformers(hf).encoder.state_dict()
    assert all(torch.equal(classifier.state_dict()[k], v) for k, v in encoder.items())


def _continued_to_the_uninterrupted_weights(cfg, stopped: Path, whole: Path, from_step: int) -> dict[str, torch.Tensor]:
    """Continues the run ``stopped`` (its config ``cfg``, its last checkpoint at optimizer step ``from_step``) as the
    same command would, and checks that it ends with the uninterrupted run's weights (``whole``), bit for bit."""
    assert ckpt.read_json(stopped / "checkpoints/last/trainer_state.json")["global_step"] == from_step
    train(cfg)
    reset_accelerate()
    a, b = (load_file(str(run / "checkpoints/last/model.safetensors")) for run in (whole, stopped))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return a


@pytest.mark.slow
@pytest.mark.parametrize("kind,loader", [("mae", "memory"), ("dino", "streamed"), ("mae", "device"),
                                         ("dino", "device"), ("dino", "device-shards")])
def test_a_signal_inside_an_epoch_and_the_same_command_end_bit_identical(kind, loader, loose_images, ssl_shards,
                                                                          tmp_path, monkeypatch, on_cpu):
    # The masks, crops, flips, colour jitter and drop path drawn from the run's seed and the sample; the teacher and
    # the center in the checkpoint; streamed: each image decoded by 2 DataLoader workers when read; device: the
    # crops and flips drawn by 2 workers, made a batch at a time; device-shards: the same, of images streamed from
    # shards.
    extra = ("model.drop_path_rate=0.1", *{"streamed": ("data.in_memory=false", "data.num_workers=2"),
                                           "device": DEVICE_VIEWS[kind] + ("data.num_workers=2",),
                                           "device-shards": ("data.views=device", "data.dataset=wds",
                                                             f"data.root={ssl_shards}", "data.num_workers=2")
                                           }.get(loader, ()))
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(load_config(None, ssl_overrides(kind, loose_images, whole, *extra)))
    reset_accelerate()
    cfg = load_config(None, ssl_overrides(kind, loose_images, parts, *extra))
    with monkeypatch.context() as m:
        signal_at_step(m, 4)  # epoch 1 has 6 steps
        with pytest.raises(Preempted):
            train(cfg)
    reset_accelerate()
    a = _continued_to_the_uninterrupted_weights(cfg, parts, whole, from_step=4)
    if kind == "dino":
        assert "center" in a and a["center"].abs().sum() > 0
        assert not torch.equal(a["teacher_head.mlp.0.weight"], a["student_head.mlp.0.weight"])
    assert same_run_records(whole, parts)


@pytest.mark.parametrize("kind", ["mae", "dino"])
def test_views_on_the_device_of_a_streamed_folder_are_those_of_the_folder_held_in_memory(kind, uneven_images,
                                                                                        tmp_path, on_cpu):
    # Files of three sizes, no data.decode_size: held in memory, decoded once at the model's input size; streamed,
    # decoded at that size by 2 DataLoader workers as read, the views made of the batch on the device. The same
    # pixels, views and steps: the same weights, bit for bit.
    runs = {}
    for where, extra in (("memory", ("data.in_memory=true",)), ("streamed", ("data.in_memory=false",
                                                                            "data.num_workers=2"))):
        views = ("data.train_crop=rrc", "data.views=device") if kind == "mae" else ("data.views=device",)
        train(load_config(None, ssl_overrides(kind, uneven_images, tmp_path / where, "train.epochs=1", *views,
                                              *extra)))
        reset_accelerate()
        runs[where] = load_file(str(tmp_path / where / "checkpoints/last/model.safetensors"))
    assert all(torch.equal(runs["memory"][k], runs["streamed"][k]) for k in runs["memory"])
    # so the run held in memory is continued streamed (data.in_memory changes no pixel here), not refused
    views = ("data.train_crop=rrc", "data.views=device") if kind == "mae" else ("data.views=device",)
    summary = train(load_config(None, ssl_overrides(kind, uneven_images, tmp_path / "memory", "train.epochs=1", *views,
                                                    "data.in_memory=false", "data.num_workers=2")))
    reset_accelerate()
    assert summary["epochs_done"] == 1


def test_a_dino_run_killed_between_checkpoints_continues_from_the_last_one_bit_identical(loose_images, tmp_path,
                                                                                        monkeypatch, on_cpu):
    # What kill -9 leaves: the step checkpoint before it, nothing after; the same command redoes the lost steps.
    from vitlab import training

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    train(load_config(None, ssl_overrides("dino", loose_images, whole)))
    reset_accelerate()
    cfg = load_config(None, ssl_overrides("dino", loose_images, killed, "train.save_every_steps=4"))
    step = training.Loop.step

    def dies_at_step_6(self, group):
        if self.state["global_step"] == 5:
            raise KeyboardInterrupt  # nothing in the loop handles it: no checkpoint is written
        step(self, group)

    with monkeypatch.context() as m:
        m.setattr(training.Loop, "step", dies_at_step_6)
        with pytest.raises(KeyboardInterrupt):
            train(cfg)
    reset_accelerate()
    _continued_to_the_uninterrupted_weights(cfg, killed, whole, from_step=4)


@pytest.mark.multiprocess
def test_two_processes_pretrain_the_weights_one_process_does(loose_images, ssl_shards, tmp_path, on_cpu):
    # Each image's views and mask are drawn from the sample, the center's mean is over both processes' halves; MAE's
    # and DINO's views made on the device too, DINO's of images streamed from shards too (one launch for the runs).
    runs = {"mae": ("mae",), "dino": ("dino",), "mae_device": ("mae", *DEVICE_VIEWS["mae"]),
            "dino_device": ("dino", *DEVICE_VIEWS["dino"]),
            "dino_device_shards": ("dino", "data.views=device", "data.dataset=wds", f"data.root={ssl_shards}",
                                   "data.partitions=2")}  # the epoch's plan, fixed: the same global batches on 1
    argv = []
    for name, (kind, *extra) in runs.items():
        argv += [*(["--then"] if argv else []), *ssl_overrides(kind, loose_images, tmp_path / "two" / name,
                                                               "train.epochs=1", "model.drop_path_rate=0", *extra)]
    launched = run_two([str(ROOT / "tests/helpers/dist_train.py"), *argv], launch_env(2, exact=True))
    assert launched.returncode == 0, launched.stderr[-3000:]
    for name, (kind, *extra) in runs.items():
        train(load_config(None, ssl_overrides(kind, loose_images, tmp_path / "one" / name, "train.epochs=1",
                                              "model.drop_path_rate=0", *extra)))
        reset_accelerate()
        one, two = (load_file(str(tmp_path / run / name / "checkpoints/last/model.safetensors"))
                    for run in ("one", "two"))
        assert max_weight_diff(one, two) < 1e-5, name


@pytest.mark.parametrize("kind", ["mae", "dino"])
def test_shards_bf16_and_gradient_checkpointing_train(kind, loose_images, tiny_imagefolder, tmp_path):
    from vitlab.cli import main

    shards = tmp_path / "shards"
    main(["shards", str(tiny_imagefolder), str(shards), "--shard-size", "20"])
    reset_accelerate()
    summary = train(load_config(None, ssl_overrides(
        kind, shards, tmp_path / "run", "data.dataset=wds", "data.loader=torch", "train.epochs=1",
        "train.mixed_precision=bf16", "model.grad_checkpointing=true")))
    assert math.isfinite(summary["train_loss"]) and summary["epochs_done"] == 1


# ---- bad input, one line before any image is decoded -------------------------------------------------------------

@pytest.mark.parametrize("change,message", [
    (("mae.mask_ratio=1.0",), "mae.mask_ratio=1.0"),
    (("mae.mask_ratio=0.99",), "mask_ratio=0.99 leaves none of an image's 64 patches visible to the encoder; at most "
                               "0.9843"),
    (("model.decoder_embed_dim=64",), "decoder_embed_dim=64 is wider than the encoder's embed_dim=32"),
    (("data.mixup_alpha=0.2",), "there are no labels to mix"),
    (("data.val_size=10",), "monitor.val_size"),
    (("train.best_metric=val_knn_top1",), "set monitor.root"),
    (("distill.type=soft",), "distill.type"),
])
def test_what_pretraining_cannot_take_is_one_line(change, message, loose_images, tmp_path):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as raised:
        train(load_config(None, ssl_overrides("mae", loose_images, tmp_path / "run", *change)))
    assert "\n" not in str(raised.value) and not (tmp_path / "run").exists()


def test_sections_of_another_task_and_a_local_crop_of_part_patches_are_one_line(loose_images, tmp_path):
    with pytest.raises(ConfigError, match="section 'mae' is read by task: mae runs alone"):
        load_config(None, ["mae.mask_ratio=0.5"])
    with pytest.raises(ConfigError, match="dino.local_size=14 is not a multiple of the model's patch size 4"):
        train(load_config(None, ssl_overrides("dino", loose_images, tmp_path / "run", "dino.local_size=14")))


def test_a_folder_without_images_is_one_line(tmp_path):
    (tmp_path / "empty" / "cats").mkdir(parents=True)
    (tmp_path / "empty" / "cats" / "notes.txt").write_text("no images here")
    with pytest.raises(DataError, match="no images .* self-supervised pretraining needs a folder of images"):
        train(load_config(None, ssl_overrides("mae", tmp_path / "empty", tmp_path / "run")))


def test_an_mae_run_resumed_as_dino_is_one_line(mae_run, loose_images, capsys):
    from vitlab.cli import train_main

    run_dir, _ = mae_run
    with pytest.raises(SystemExit) as exited:
        train_main(["--resume", str(run_dir), "task=dino", "model.name=dino_vit_cifar_tiny_patch4_32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and "task 'mae' -> 'dino'" in err[0]


def test_a_csv_of_images_without_labels_pretrains(loose_images, tmp_path, capsys, on_cpu):
    table = tmp_path / "table"
    table.mkdir()
    files = sorted(loose_images.rglob("*.png"))
    (table / "train.csv").write_text("image\n" + "".join(f"{f}\n" for f in files))  # no labels column
    train(load_config(None, ssl_overrides("mae", table, tmp_path / "run", "data.dataset=csv", "train.epochs=1")))
    reset_accelerate()
    assert "96 images, without labels" in capsys.readouterr().out


def test_the_monitors_data_errors_name_monitor_keys(loose_images, tiny_imagefolder, tmp_path):
    import csv

    labelled = tmp_path / "labelled"
    labelled.mkdir()
    for split in ("train", "test"):
        with open(labelled / f"{split}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["image", "labels"])
            w.writerows((p, json.dumps(["class_0", "class_1"] if i % 2 else [p.parent.name]))
                        for i, p in enumerate(sorted((tiny_imagefolder / "train").rglob("*.png"))))
    with pytest.raises(DataError) as raised:
        train(load_config(None, ssl_overrides("mae", loose_images, tmp_path / "run", "monitor.dataset=csv",
                                              monitor=labelled)))
    said = str(raised.value)
    assert said.endswith("the k-NN monitor votes one class an image: give monitor.root images of one class each")
    assert "data.multi_label" not in said and "\n" not in said
    with pytest.raises(DataError, match=r"monitor\.root") as raised:
        train(load_config(None, ssl_overrides("mae", loose_images, tmp_path / "run", monitor=tmp_path / "nowhere")))
    assert "data.root" not in str(raised.value)


@pytest.mark.parametrize("task, extra, said", [
    ("classification", (), r"^data\.views='device' is invalid; expected loader with task: classification"),
    ("mae", ("data.train_crop=pad",), r"^data\.train_crop='pad' is invalid; expected rrc with data\.views=device"),
    ("mae", ("data.train_crop=rrc", "data.augment=randaugment"), r"^data\.augment='randaugment' is invalid")])
def test_views_on_the_device_are_refused_in_one_line_where_they_do_not_apply(task, extra, said):
    with pytest.raises(ConfigError, match=said):
        load_config(None, [f"task={task}", "data.views=device", "train.output_dir=unused", *extra])


@pytest.mark.slow
def test_a_runs_config_json_keeps_the_crop_pct_its_monitor_evaluated_with(loose_images, tmp_path, on_cpu):
    # eval --knn, embed and fine-tuning read crop_pct from config.json: the view the k-NN monitor scored (a DINO run
    # with cropped images kept none before, so they saw the images resized whole)
    for kind in ("mae", "dino"):
        run = tmp_path / kind
        train(load_config(None, ssl_overrides(kind, loose_images, run, "train.epochs=1", "data.train_crop=rrc",
                                              "data.crop_pct=0.9", "data.decode_size=32")))
        reset_accelerate()
        assert ckpt.read_json(run / "checkpoints/last/config.json")["crop_pct"] == 0.9, kind
    train(load_config(None, ssl_overrides("dino", loose_images, tmp_path / "pad", "train.epochs=1")))
    reset_accelerate()
    assert "crop_pct" not in ckpt.read_json(tmp_path / "pad/checkpoints/last/config.json")  # resized whole
