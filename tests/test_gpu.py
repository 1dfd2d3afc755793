"""What only a GPU can show: the training loop's hot path never waits for the host. Skipped without CUDA
(CI has none); run on a GPU machine with the rest of the suite."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("loader, extra", [
    ("gpu", ["data.augment=randaugment", "train.compile=true"]),  # device-resident, RandAugment on the device
    ("torch", ["data.num_workers=2"]),  # DataLoader workers, pinned batches copied without blocking
])
def test_an_optimizer_step_never_synchronizes_with_the_host(tiny_imagefolder, tmp_path, loader, extra):
    # torch.cuda.set_sync_debug_mode("error") raises at any call that makes the host wait for the GPU
    # (.item(), a blocking copy, nonzero, ...): the batch fetch and the whole optimizer step (forward,
    # backward, mixup, clipping, fused AdamW, the schedule, the EMA, the loss sums) run under it.
    from conftest import tiny_overrides
    from vitlab.config import load_config
    from vitlab.training import Loop, set_epoch

    cfg = load_config(None, tiny_overrides(
        tiny_imagefolder, tmp_path / "run", f"data.loader={loader}", "train.mixed_precision=bf16",
        "data.mixup_alpha=0.8", "data.cutmix_alpha=1.0", "train.ema_decay=0.99", "optim.grad_clip=1.0",
        "train.log_every=1000", *extra))
    loop = Loop(cfg, tmp_path / "run", None)
    assert loop.accelerator.device.type == "cuda"
    loop.model.train()
    set_epoch(loop.train_loader, 1)
    batches = iter(loop.train_loader)
    loop.step([next(batches)])  # warm-up: compilation, cuBLAS handles, the optimizer's state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            loop.step([next(batches)])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert loop.state["global_step"] == 4 and int(loop.meter.samples) == 4 * 16
