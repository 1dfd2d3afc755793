"""vitlab's ViT against timm's VisionTransformer, side by side in one process.

For each configuration, both models get identical weights (``vitlab.interop.to_timm``) and the same
synthetic batch already on the device; their timings alternate (vitlab, timm, vitlab, timm, ...)
so drifting clocks and background load hit both alike. Reported: median time per step over the
repeats, images/s, the ratio vitlab/timm of step times (< 1: vitlab is faster), peak memory (CUDA)
and, on CUDA, model FLOPs utilisation (MFU).

    python benchmarks/bench_model.py --device cpu
    python benchmarks/bench_model.py --device cuda --dtypes fp32,bf16 --modes eager,compile
    python benchmarks/bench_model.py --models small224 --batch-224 256 --dtypes bf16 --modes eager,compile,cudagraphs

A model is a preset key, or a vitlab model name with overrides after slashes:
``vit_cifar_small_patch4_32/patch_size=2/embed_dim=256``. Modes: ``eager``, ``compile``
(``torch.compile``), ``cudagraphs`` (``torch.compile(mode="reduce-overhead")``: the step's kernels
replayed as CUDA graphs).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import vitlab
from vitlab.interop import to_timm

PRESETS = {"cifar": "vit_cifar_small_patch4_32", "small224": "vit_small_patch16_224"}
COMPILE_MODES = {"compile": "default", "cudagraphs": "reduce-overhead"}


def parse_model(spec: str) -> tuple[str, dict[str, float | int | str]]:
    """A preset key, or ``name/key=value/...``: the model name and its overrides (numbers parsed)."""
    name, *pairs = PRESETS.get(spec, spec).split("/")
    overrides: dict[str, float | int | str] = {}
    for pair in pairs:
        key, value = pair.split("=", 1)
        overrides[key] = _number(value)
    return name, overrides


def _number(value: str) -> float | int | str:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def forward_flops(model: vitlab.VisionTransformer) -> float:
    """Matmul FLOPs of one image's forward pass (2 per multiply-add)."""
    n = model.pos_embed.shape[1]
    d = model.embed_dim
    patch = model.patch_embed.proj
    flops = 2 * (n - 1) * patch.in_channels * patch.kernel_size[0] * patch.kernel_size[1] * d
    for block in model.blocks:
        hidden = block.mlp.fc1.out_features
        flops += 2 * n * (4 * d * d + 2 * d * hidden)  # qkv + proj, MLP
        flops += 2 * 2 * n * n * d  # QK^T and attention @ V
    return flops + 2 * d * model.num_classes


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, train: bool, dtype: torch.dtype | None,
              device: torch.device) -> Callable[[], None]:
    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    if train:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda" or None)

        def step() -> None:
            with autocast():
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        @torch.no_grad()
        def step() -> None:
            with autocast():
                model(x)
    return step


def time_steps(step: Callable[[], None], n: int, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    for _ in range(n):
        step()
    sync(device)
    return (time.perf_counter() - start) / n


def peak_memory(step: Callable[[], None], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    step()
    sync(device)
    return torch.cuda.max_memory_allocated(device) / 2 ** 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="cifar,small224", help=f"comma list of {list(PRESETS)}")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--modes", default="eager", help="eager,compile")
    parser.add_argument("--batch-cifar", type=int, default=256)
    parser.add_argument("--batch-224", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak, for MFU")
    parser.add_argument("--phases", default="train,infer")
    parser.add_argument("--against", choices=("timm", "none"), default="timm", help="none: time vitlab alone")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows: list[dict[str, object]] = []
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else f'{torch.get_num_threads()} threads'}), "
          f"torch {torch.__version__}, median of {args.repeats} alternating repeats x {args.steps} steps")
    header = (f"{'model':26s} {'dtype':5s} {'mode':10s} {'phase':5s} {'batch':>5s} {'vitlab img/s':>12s} "
              f"{'timm img/s':>11s} {'ratio':>6s} {'vitlab MiB':>10s} {'timm MiB':>9s} {'MFU':>6s}")
    print(header)
    print("-" * len(header))
    for key in args.models.split(","):
        name, overrides = parse_model(key)
        label = key.split("/", 1)[-1]  # a preset's key, or the overrides
        for dtype_name in args.dtypes.split(","):
            dtype = {"fp32": None, "bf16": torch.bfloat16}[dtype_name]
            for mode in args.modes.split(","):
                for phase in args.phases.split(","):
                    torch.manual_seed(0)
                    ours = vitlab.create_model(name, **overrides).to(device)
                    batch = args.batch_cifar if max(ours.patch_embed.img_size) <= 64 else args.batch_224
                    theirs = to_timm(ours).to(device)
                    ours.train(phase == "train")
                    theirs.train(phase == "train")
                    img = ours.patch_embed.img_size
                    x = torch.randn(batch, 3, *img, device=device)
                    y = torch.randint(0, ours.num_classes, (batch,), device=device)
                    flops = forward_flops(ours) * batch * (3 if phase == "train" else 1)
                    models = {"vitlab": ours, "timm": theirs} if args.against == "timm" else {"vitlab": ours}
                    if mode in COMPILE_MODES:
                        models = {k: torch.compile(m, mode=COMPILE_MODES[mode]) for k, m in models.items()}
                    steps = {k: make_step(m, x, y, phase == "train", dtype, device) for k, m in models.items()}
                    for step in steps.values():
                        for _ in range(args.warmup):
                            step()
                    times: dict[str, list[float]] = {k: [] for k in steps}
                    for _ in range(args.repeats):
                        for k in steps:
                            times[k].append(time_steps(steps[k], args.steps, device))
                    med = {k: statistics.median(v) for k, v in times.items()}
                    med.setdefault("timm", float("nan"))
                    mem = {k: peak_memory(steps[k], device) for k in steps}
                    mem.setdefault("timm", None)
                    mfu = flops / med["vitlab"] / (args.peak_tflops * 1e12) if device.type == "cuda" else None
                    fmt_mem = lambda m: f"{m:10.0f}" if m is not None else f"{'n/a':>10s}"
                    print(f"{label[:26]:26s} {dtype_name:5s} {mode:10s} {phase:5s} {batch:5d} {batch / med['vitlab']:12.1f} "
                          f"{batch / med['timm']:11.1f} {med['vitlab'] / med['timm']:6.3f} {fmt_mem(mem['vitlab'])} "
                          f"{fmt_mem(mem['timm']):>9s} {f'{mfu:.1%}' if mfu is not None else 'n/a':>6s}", flush=True)
                    rows.append(dict(model=key, dtype=dtype_name, mode=mode, phase=phase, batch=batch,
                                     vitlab_images_per_s=batch / med["vitlab"], timm_images_per_s=batch / med["timm"],
                                     ratio=med["vitlab"] / med["timm"], vitlab_mib=mem["vitlab"], timm_mib=mem["timm"],
                                     mfu=mfu, tflops=flops / med["vitlab"] / 1e12))
                    del models, steps, ours, theirs
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
