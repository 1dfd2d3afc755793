"""The 5-minute CPU run: vitlab's quick config against a plain timm training loop, at equal wall time.

One invocation, one machine, one after the other:

1. ``python train.py --config configs/cifar10_cpu_quick.yaml`` on real CIFAR-10 (ImageFolder PNGs), timed
   from launch to exit (imports, decoding, training, evaluation, checkpoints);
2. a plain loop around ``timm.models.VisionTransformer`` (by default the shape the quick config had
   before it was tuned: 96 wide, 4 blocks, 3 heads, patch 4, MLP ratio 2; ``--timm-shape`` and
   ``--timm-lr`` give it another recipe, e.g. the quick config's own): decode once, batch-wise random
   crop + flip, AdamW with warmup + cosine (on the clock), label smoothing 0.1; it trains until vitlab's
   wall time (or ``--budget``) minus its measured evaluation time, then evaluates on the 10,000 test
   images once.

Both rows report test top-1 (the final model, no selection), training images/s and where the time went:
setup (imports, decoding), data (waiting for batches), model (forward, backward, step), evaluation.

    python benchmarks/bench_cifar_cpu.py --data ../shared/data/cifar10
    python benchmarks/bench_cifar_cpu.py --data ../shared/data/cifar10 --timm-only --budget 239 \
        --timm-shape 64,3,2 --timm-lr 3e-3          # the timm loop alone, with the quick config's recipe
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START = time.time()  # the timm loop's clock starts with the process, imports included, as vitlab's does

import numpy as np  # noqa: E402
import timm  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from PIL import Image  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def decode(split_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    classes = sorted(p.name for p in split_dir.iterdir() if p.is_dir())
    files = [(f, i) for i, c in enumerate(classes) for f in sorted((split_dir / c).iterdir())]
    images = [np.asarray(Image.open(f).convert("RGB")) for f, _ in files]  # one thread: faster than a pool here
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous(), torch.tensor([i for _, i in files])


def crop_flip(x: torch.Tensor, g: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Random crop with zero padding and horizontal flip, per image, for a whole uint8 batch."""
    b, c, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy, dx = torch.randint(0, 2 * pad + 1, (2, b), generator=g)
    rows = (dy[:, None] + torch.arange(h))[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w))[:, None, None, :]
    x = padded[torch.arange(b)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]
    return torch.where((torch.rand(b, generator=g) < 0.5)[:, None, None, None], x.flip(-1), x)


def timm_loop(data: Path, budget: float, batch: int = 128, lr: float = 2e-3, seed: int = 0, embed_dim: int = 96,
              depth: int = 4, num_heads: int = 3) -> dict:
    """The plain loop; its clock is this process's (imports, decoding and evaluation count)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    (train_x, train_y), (test_x, test_y) = decode(data / "train"), decode(data / "test")
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1) * 255, torch.tensor(STD).view(1, 3, 1, 1) * 255
    model = timm.models.VisionTransformer(img_size=32, patch_size=4, num_classes=10, embed_dim=embed_dim,
                                          depth=depth, num_heads=num_heads, mlp_ratio=2.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)

    def evaluate(n: int) -> float:
        model.eval()
        with torch.no_grad():
            pred = torch.cat([model((test_x[i:i + 500].float() - mean) / std).argmax(-1) for i in range(0, n, 500)])
        model.train()
        return (pred == test_y[:n]).float().mean().item()

    probe = time.time()
    evaluate(1000)  # how long the final evaluation will take, to stop training in time for it
    eval_reserve = 1.2 * 10 * (time.time() - probe)
    setup = time.time() - START
    train_start, train_budget = time.time(), budget - setup - eval_reserve
    data_time = model_time = 0.0
    steps = seen = 0
    while time.time() - train_start < train_budget:
        order = torch.randperm(len(train_y), generator=g)
        for i in range(0, len(order) - batch + 1, batch):
            progress = (time.time() - train_start) / train_budget
            if progress >= 1:
                break
            t0 = time.time()
            idx = order[i:i + batch]
            x = (crop_flip(train_x[idx], g).float() - mean) / std
            t1 = time.time()
            scale = progress / 0.05 if progress < 0.05 else 0.5 * (1 + math.cos(math.pi * (progress - 0.05) / 0.95))
            for group in optimizer.param_groups:
                group["lr"] = lr * scale
            loss = F.cross_entropy(model(x), train_y[idx], label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            data_time, model_time = data_time + t1 - t0, model_time + time.time() - t1
            steps, seen = steps + 1, seen + len(idx)
    eval_start = time.time()
    top1 = evaluate(len(test_y))
    eval_time = time.time() - eval_start
    wall = time.time() - START
    return {"name": f"timm loop {embed_dim}w x {depth}, lr {lr:g}", "test_top1": top1, "wall_s": wall,
            "epochs": seen / len(train_y), "images_per_s": seen / (data_time + model_time), "setup_s": setup,
            "data_s": data_time, "model_s": model_time, "eval_s": eval_time}


def vitlab_run(data: Path, config: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / config), "data.dataset=imagefolder",
               f"data.root={data}", f"train.output_dir={run_dir}", *extra]
        start = time.time()
        subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
        wall = time.time() - start
        evals = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                 if r["split"] == "eval"]
    train_time = sum(r["epoch_time"] for r in evals)
    data_time = sum(r.get("data_time", 0.0) for r in evals)
    eval_time = sum(r.get("eval_time", 0.0) for r in evals)
    images = sum(r["examples_per_s"] * r["epoch_time"] for r in evals)
    return {"name": f"vitlab {Path(config).name}" + (f" {' '.join(extra)}" if extra else ""),
            "test_top1": evals[-1]["test_top1"], "wall_s": wall, "epochs": evals[-1]["epoch"],
            "images_per_s": images / train_time, "setup_s": wall - train_time - eval_time, "data_s": data_time,
            "model_s": train_time - data_time, "eval_s": eval_time}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="CIFAR-10 in ImageFolder layout (train/, test/)")
    parser.add_argument("--config", default="configs/cifar10_cpu_quick.yaml")
    parser.add_argument("--budget", type=float, default=0, help="the timm loop's wall time (0 = vitlab's)")
    parser.add_argument("--timm-only", action="store_true", help="run only the timm loop (needs --budget); print JSON")
    parser.add_argument("--timm-shape", default="96,4,3", help="the timm ViT's width,depth,heads (default 96,4,3)")
    parser.add_argument("--timm-lr", type=float, default=2e-3)
    parser.add_argument("--out", default="benchmarks/results/cifar_cpu.json")
    parser.add_argument("overrides", nargs="*", help="overrides of the vitlab config")
    args = parser.parse_args()
    data = Path(args.data).resolve()
    if args.timm_only and args.budget <= 0:
        parser.error("--timm-only needs --budget SECONDS (the wall time to give the timm loop)")
    if args.timm_only:  # a fresh process, so the timm loop pays its own imports like vitlab's train.py
        width, depth, heads = map(int, args.timm_shape.split(","))
        print(json.dumps(timm_loop(data, args.budget, lr=args.timm_lr, embed_dim=width, depth=depth, num_heads=heads)))
        return
    rows = [vitlab_run(data, args.config, args.overrides)]
    budget = args.budget or rows[0]["wall_s"]
    out = subprocess.run([sys.executable, __file__, "--data", str(data), "--budget", str(budget), "--timm-only",
                          "--timm-shape", args.timm_shape, "--timm-lr", str(args.timm_lr)],
                         check=True, capture_output=True, text=True).stdout
    rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"CIFAR-10 on {torch.get_num_threads()} CPU threads; the timm loop gets vitlab's wall time ({budget:.0f} s)")
    print(f"{'':45s} {'test top-1':>10s} {'wall s':>7s} {'epochs':>6s} {'img/s':>6s}   setup / data / model / eval (s)")
    for r in rows:
        print(f"{r['name'][:45]:45s} {100 * r['test_top1']:9.2f}% {r['wall_s']:7.1f} {r['epochs']:6.2f} "
              f"{r['images_per_s']:6.0f}   "
              f"{r['setup_s']:.0f} / {r['data_s']:.0f} / {r['model_s']:.0f} / {r['eval_s']:.0f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
