"""What only a GPU can show: the training loop's hot path never waits for the host. Skipped without CUDA
(CI has none); run on a GPU machine with the rest of the suite."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def steps_under_sync_debug(cfg, run_dir):
    """A warm-up step (compilation, cuBLAS handles, the optimizer's state), then 3 optimizer steps under
    ``torch.cuda.set_sync_debug_mode("error")``, which raises at any call that makes the host wait for the GPU."""
    from vitlab.training import Loop, set_epoch

    loop = Loop(cfg, run_dir, None)
    assert loop.accelerator.device.type == "cuda"
    loop.model.train()
    set_epoch(loop.train_loader, 1)
    batches = iter(loop.train_loader)
    loop.step([next(batches)])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            loop.step([next(batches)])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert loop.state["global_step"] == 4
    return loop


@pytest.mark.parametrize("loader, extra", [
    ("gpu", ["data.augment=randaugment", "train.compile=true"]),  # device-resident, RandAugment on the device
    ("gpu", ["data.train_crop=rrc", "data.decode_size=40"]),  # random resized crops of the batch on the device
    ("torch", ["data.num_workers=2"]),  # DataLoader workers, pinned batches copied without blocking
])
def test_an_optimizer_step_never_synchronizes_with_the_host(tiny_imagefolder, tmp_path, loader, extra):
    # torch.cuda.set_sync_debug_mode("error") raises at any call that makes the host wait for the GPU
    # (.item(), a blocking copy, nonzero, ...): the batch fetch and the whole optimizer step (forward,
    # backward, mixup, clipping, fused AdamW, the schedule, the EMA, the loss sums) run under it.
    from conftest import tiny_overrides
    from vitlab.config import load_config

    cfg = load_config(None, tiny_overrides(
        tiny_imagefolder, tmp_path / "run", f"data.loader={loader}", "train.mixed_precision=bf16",
        "data.mixup_alpha=0.8", "data.cutmix_alpha=1.0", "train.ema_decay=0.99", "optim.grad_clip=1.0",
        "train.log_every=1000", *extra))
    loop = steps_under_sync_debug(cfg, tmp_path / "run")
    assert int(loop.meter.samples) == 4 * 16


def test_dinos_views_made_on_the_gpu_are_the_cpus_and_never_wait_for_the_host():
    # The batch's crops, flips, jitter, grey, blur and solarization at DINO's 224/96 px, from parameters already on
    # the GPU (the loader's pinned batch); the CPU's the reference
    from vitlab.schema import DINOConfig
    from vitlab.tasks.dino import dino_views

    view = dino_views((224, 224), 96, DINOConfig(local_crops=2), device=True)
    images = torch.randint(0, 256, (32, 3, 256, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    params = torch.stack([view(image, torch.Generator().manual_seed(i))[1] for i, image in enumerate(images)])
    expected = view.apply(images, params)
    on_gpu = images.cuda(), params.cuda()
    view.apply(*on_gpu)  # warm-up: the weight tables, cuDNN's choice of kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        views = view.apply(*on_gpu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for got, want in zip(views, expected):
        assert got.is_cuda and got.shape == want.shape
        # levels of 255; a pixel whose crop lands a hair either side of solarization's 128 is mirrored on one device
        # and not the other (a level apart there): on the H200, 3 of 4.8 million
        off = (got.cpu() - want).abs()
        assert (off > 0.05).float().mean() < 1e-5 and off.max() < 1.1


@pytest.mark.parametrize("task", ["mae", "dino"])
def test_a_pretraining_step_with_views_on_the_gpu_never_synchronizes_with_the_host(task, tiny_imagefolder, tmp_path):
    from vitlab.config import load_config

    head = {"mae": ["model.decoder_embed_dim=16", "model.decoder_depth=1", "model.decoder_num_heads=2",
                    "data.train_crop=rrc"],
            "dino": ["model.out_dim=64", "model.hidden_dim=32", "model.bottleneck_dim=16", "dino.local_crops=2"]}[task]
    cfg = load_config(None, [f"task={task}", f"model.name={task}_vit_cifar_tiny_patch4_32", "model.depth=1",
                             "model.embed_dim=32", "model.num_heads=2", *head, "data.dataset=imagefolder",
                             f"data.root={tiny_imagefolder}", "data.decode_size=32", "data.views=device",
                             "data.num_workers=2", "train.batch_size=16", "train.epochs=1",
                             "train.mixed_precision=bf16", "train.log_every=1000",
                             f"train.output_dir={tmp_path / 'run'}"])
    steps_under_sync_debug(cfg, tmp_path / "run")


@pytest.mark.parametrize("score", ["vim", "mahalanobis"])
def test_a_calibrated_classifier_on_the_gpu_exports_with_its_preprocessing_and_its_score(tiny_imagefolder, tmp_path,
                                                                                         score):
    # export_model of a model on the GPU (the Python API; vitlab export loads it on the CPU): the normalization and the
    # fitted statistics where the weights are (test_open_set checks it on the meta device); the file's scores are those
    # vitlab.unknown_scores gives on the CPU (to 1e-2, as test_open_set's export)
    ort = pytest.importorskip("onnxruntime")
    import vitlab
    from conftest import train_tiny
    from vitlab import load_model
    from vitlab.export import export_model
    from vitlab.unknown import calibrate_unknown

    run = train_tiny(tiny_imagefolder, tmp_path / "run", "train.epochs=1", "data.val_size=24", "data.loader=torch")
    calibrate_unknown(run, score)
    model = load_model(run)
    size = model.pretrained_cfg["input_size"][1:]
    images = torch.randint(0, 256, (5, *size, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    expected = vitlab.unknown_scores(model, images.permute(0, 3, 1, 2))["scores"]
    export_model(model.cuda(), tmp_path / "m.onnx", with_preprocess=True)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    _, scores = session.run(None, {"images": images.numpy()})
    assert torch.allclose(torch.from_numpy(scores), expected, rtol=1e-4, atol=1e-2), (scores, expected)
