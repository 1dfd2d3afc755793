"""Multi-label on CIFAR-10 mosaics (issue 50): vitlab's recipe against a plain timm loop given the same wall time.

For each seed, first ``train.py --config configs/cifar10_mosaic_cpu.yaml`` (timed start to finish, as a user
runs it); then, on the same files, the loop most timm users write: timm's ``VisionTransformer`` of the same
shape, timm's ``BinaryCrossEntropy`` and AdamW (``create_optimizer_v2``), a torch ``DataLoader`` decoding the
PNGs with PIL each epoch (random crop with 4 px of padding, flip, CIFAR-10's normalization), its cosine
learning rate spread over the vitlab run's wall time (timed from this script's own start of the arm), then one
evaluation of the test mosaics. Both test mAPs are computed here by scikit-learn's ``average_precision_score``
(macro) from the models' outputs, so the two arms are scored by the same independent code:

    python benchmarks/bench_multilabel.py --root data/cifar10_mosaic --seeds 0,1,2 --json benchmarks/results/multilabel_mosaic.jsonl

Run it alone on the machine: the arms are timed.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

ROOT = Path(__file__).resolve().parent.parent
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class MosaicCsv(Dataset):
    """``root/<split>.csv`` as a plain torch data set: (image tensor, multi-hot float targets)."""

    def __init__(self, root: Path, split: str, classes: list[str] | None, transform) -> None:
        rows = list(csv.DictReader((root / f"{split}.csv").open()))
        self.classes = classes or sorted({c for r in rows for c in r["labels"].split()})
        self.files = [root / r["image"] for r in rows]
        index = {c: i for i, c in enumerate(self.classes)}
        self.targets = torch.zeros(len(rows), len(self.classes))
        for i, r in enumerate(rows):
            self.targets[i, [index[c] for c in r["labels"].split()]] = 1.0
        self.transform = transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        return self.transform(Image.open(self.files[i]).convert("RGB")), self.targets[i]


def vitlab_arm(root: Path, seed: int, out: Path) -> dict:
    start = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/cifar10_mosaic_cpu.yaml"),
                    f"data.root={root}", f"train.seed={seed}", f"train.output_dir={out}", "train.log_with=none"],
                   check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    summary = json.loads((out / "summary.json").read_text())
    return {"arm": "vitlab", "seed": seed, "wall_s": wall, "test_map": summary["test_map"],
            "epochs": summary["epochs_done"]}


def timm_arm(root: Path, seed: int, budget: float, workers: int) -> dict:
    import timm
    from sklearn.metrics import average_precision_score
    from timm.loss import BinaryCrossEntropy
    from timm.models.vision_transformer import VisionTransformer
    from timm.optim import create_optimizer_v2

    start = time.perf_counter()
    torch.manual_seed(seed)
    normalize = transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)
    train_set = MosaicCsv(root, "train", None, transforms.Compose([
        transforms.RandomCrop(64, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]))
    test_set = MosaicCsv(root, "test", train_set.classes, transforms.Compose([transforms.ToTensor(), normalize]))
    loader = DataLoader(train_set, batch_size=128, shuffle=True, num_workers=workers, drop_last=True,
                        persistent_workers=workers > 0)
    model = VisionTransformer(img_size=64, patch_size=8, embed_dim=64, depth=3, num_heads=2, mlp_ratio=2.0,
                              num_classes=len(train_set.classes))
    optimizer = create_optimizer_v2(model, "adamw", lr=3e-3, weight_decay=0.05)
    criterion = BinaryCrossEntropy(smoothing=0.0)
    train_until = start + 0.95 * budget  # the rest of the budget for the test evaluation
    epochs = steps = 0
    while time.perf_counter() < train_until:
        for images, targets in loader:
            progress = (time.perf_counter() - start) / (train_until - start)
            if progress >= 1:
                break
            warm = 0.03
            lr = 3e-3 * progress / warm if progress < warm else \
                1e-5 + 0.5 * (3e-3 - 1e-5) * (1 + math.cos(math.pi * (progress - warm) / (1 - warm)))
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = criterion(model(images), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            steps += 1
        epochs += 1
    model.eval()
    scores = []
    with torch.no_grad():
        for images, _ in DataLoader(test_set, batch_size=256, num_workers=workers):
            scores.append(model(images).sigmoid())
    test_map = average_precision_score(test_set.targets.numpy(), torch.cat(scores).numpy(), average="macro")
    return {"arm": "timm", "seed": seed, "wall_s": time.perf_counter() - start, "test_map": float(test_map),
            "epochs": epochs, "steps": steps, "timm": timm.__version__}


def rescore_vitlab(root: Path, out: Path) -> float:
    """The vitlab run's final-epoch test mAP recomputed by scikit-learn from its predictions file."""
    from sklearn.metrics import average_precision_score

    predictions = out / "test_predictions.csv"
    subprocess.run([sys.executable, "-m", "vitlab.cli", "eval", "--checkpoint", str(out), "--predictions",
                    str(predictions)], check=True, stdout=subprocess.DEVNULL)
    rows = list(csv.DictReader(predictions.open()))
    classes = [k.removeprefix("prob_") for k in rows[0] if k.startswith("prob_")]
    truth = np.array([[c in r["labels"].split() for c in classes] for r in rows])
    scores = np.array([[float(r[f"prob_{c}"]) for c in classes] for r in rows])
    return float(average_precision_score(truth, scores, average="macro"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--workers", type=int, default=2, help="the timm loop's DataLoader workers")
    parser.add_argument("--runs", type=Path, default=Path("runs/bench_multilabel"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    for seed in map(int, args.seeds.split(",")):
        mine = vitlab_arm(args.root.resolve(), seed, args.runs / f"vitlab_{seed}")
        mine["test_map_sklearn"] = rescore_vitlab(args.root.resolve(), args.runs / f"vitlab_{seed}")
        theirs = timm_arm(args.root.resolve(), seed, mine["wall_s"], args.workers)
        for r in (mine, theirs):
            r.update(torch=torch.__version__, threads=torch.get_num_threads())
            print(json.dumps(r), flush=True)
            results.append(r)
    gains = [100 * (a["test_map_sklearn"] - b["test_map"]) for a, b in zip(results[::2], results[1::2])]
    print(f"vitlab - timm test mAP, points: {', '.join(f'{g:+.2f}' for g in gains)}; mean {np.mean(gains):+.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
