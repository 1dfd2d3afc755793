"""Adapting a pretrained ViT (issue 52, 2): from scratch, full fine-tuning, layer decay, a linear probe, frozen
blocks and LoRA, on a transfer task made of the real CIFAR-10 images.

The quick model (``configs/cifar10_cpu_quick.yaml``) is pretrained on the six animal classes (all their 30,000
training images), then adapted to the four vehicle classes from 100 training images a class (drawn at random,
seed 0: the file names follow the search words the images were found by, so the first 100 by name would be
100 pictures of few kinds), each arm with the quick recipe's settings (warmup 10% of the run) for ``--epochs`` epochs
at its own learning rate, chosen from ``--lrs`` on a validation split of 80 of the 400 images (seed 0; the final
epoch's validation top-1); then trained on all 400 with it, once a seed. The final epoch's test top-1 on the
vehicles' 4,000 test images is reported (nothing is chosen on it), with the parameters that train and the peak
resident memory of the run's process. The linear probe on cached features (``train.cache_features``) has no learning
rate: its run chooses its L2 strength on the same 80 validation images, and it is fitted with that strength on the
400 (an optimum: the same for every seed). ``--pretrain-epochs N`` pretrains N epochs instead of the recipe's 7:

    python benchmarks/bench_transfer.py --cifar10 ../shared/data/cifar10 --work /tmp/transfer --seeds 0,1,2 \\
        --json benchmarks/results/transfer_cpu.jsonl

Each arm runs ``train.py`` in a process of its own, alone on the machine.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ANIMALS = ["bird", "cat", "deer", "dog", "frog", "horse"]
VEHICLES = ["airplane", "automobile", "ship", "truck"]
ARMS = {
    "from scratch": [],
    "full fine-tuning": ["model.pretrained={pre}"],
    "layer decay 0.65": ["model.pretrained={pre}", "optim.layer_decay=0.65"],
    "linear probe (model.freeze=backbone)": ["model.pretrained={pre}", "model.freeze=backbone"],
    "frozen blocks (model.freeze=blocks:2)": ["model.pretrained={pre}", "model.freeze=blocks:2"],
    "LoRA r=4 (model.lora_r=4)": ["model.pretrained={pre}", "model.lora_r=4", "model.lora_alpha=8"],
    "linear probe on cached features (train.cache_features=true)": ["model.pretrained={pre}", "model.freeze=backbone",
                                                                     "train.cache_features=true"],
}
PROBE = "train.cache_features=true"  # an arm that fits its head by L-BFGS: its L2 strength is chosen, not its lr
# The child: train.py as a script, then its own peak resident memory.
CHILD = ("import resource, sys, runpy\nsys.argv = ['train.py', *sys.argv[1:]]\ntry:\n"
         "    runpy.run_path('train.py', run_name='__main__')\nfinally:\n"
         "    print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)\n")


def make_folders(cifar10: Path, work: Path, per_class: int) -> tuple[Path, Path]:
    """Symlinked ImageFolders: ``animals`` (6 classes, every image) and ``vehicles`` (4 classes, ``per_class``
    training images each, every test image)."""
    animals, vehicles = work / "animals", work / "vehicles"
    for split in ("train", "test"):
        for c in ANIMALS:
            link = animals / split / c
            if not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to((cifar10 / split / c).resolve())
        for c in VEHICLES:
            folder = vehicles / split / c
            if folder.exists():
                continue
            if split == "test":
                folder.parent.mkdir(parents=True, exist_ok=True)
                folder.symlink_to((cifar10 / split / c).resolve())
                continue
            folder.mkdir(parents=True)
            for f in random.Random(0).sample(sorted((cifar10 / split / c).iterdir()), per_class):
                (folder / f.name).symlink_to(f.resolve())
    return animals, vehicles


def run(args: list[str], log: Path) -> dict:
    """``train.py`` with ``args`` in a process of its own: its summary (``--json``) and peak RSS in MiB."""
    done = subprocess.run([sys.executable, "-c", CHILD, *args, "--json"], cwd=ROOT, capture_output=True, text=True)
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"train.py failed ({log}):\n{done.stderr[-2000:]}")
    lines = done.stdout.splitlines()
    summary = json.loads(next(line for line in reversed(lines) if line.startswith("{")))
    rss = int(next(line for line in lines if line.startswith("PEAK_RSS_KIB")).split()[1]) / 1024
    head = [line for line in lines if line.startswith(("model ", "LoRA "))]
    return {"summary": summary, "peak_rss_mib": round(rss), "first_line": " || ".join(head)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cifar10", required=True, help="CIFAR-10 as class folders (VITLAB_CIFAR10_DIR)")
    parser.add_argument("--work", default="/tmp/transfer")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--per-class", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--arms", default=",".join(str(i) for i in range(len(ARMS))), help="indices into the arms")
    parser.add_argument("--lrs", default="1e-3,3e-3,1e-2", help="the learning rates each arm chooses from")
    parser.add_argument("--pretrain-epochs", type=int, default=0, help="epochs of the pretraining (0: the quick "
                                                                       "recipe's own)")
    parser.add_argument("--json", help="append a JSON line a run to this file")
    args = parser.parse_args()
    work = Path(args.work)
    animals, vehicles = make_folders(Path(args.cifar10), work, args.per_class)
    pre = work / ("pretrained" if not args.pretrain_epochs else f"pretrained_{args.pretrain_epochs}")
    quick = ["--config", "configs/cifar10_cpu_quick.yaml", "data.dataset=imagefolder", "data.download=false",
             "train.log_with=none"]
    if not (pre / "checkpoints" / "last" / "config.json").is_file():
        epochs = [f"train.epochs={args.pretrain_epochs}"] if args.pretrain_epochs else []
        result = run([*quick, *epochs, f"data.root={animals}", f"train.output_dir={pre}"], work / "pretrain.log")
        print(f"pretrained on the 6 animal classes: test top-1 {100 * result['summary']['test_top1']:.2f}%",
              flush=True)
    arms = [list(ARMS)[int(i)] for i in args.arms.split(",")]
    common = [*quick, f"data.root={vehicles}", f"train.epochs={args.epochs}", "optim.warmup_epochs=3",
              "train.eval_every=0"]
    chosen: dict[str, tuple[float, dict[str, float]]] = {}
    for name in arms:  # each arm's learning rate, chosen on 80 validation images of the 400
        keys = [k.format(pre=pre) for k in ARMS[name]]
        scores = {}
        if PROBE in keys:  # the run chooses its L2 strength on the 80 validation images itself
            out = work / "val" / f"{list(ARMS).index(name)}_{pre.name}"
            run([*common, "data.val_size=80", "train.seed=0", f"train.output_dir={out}", *keys],
                work / f"val_{out.name}.log")
            last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
            scores, best = last["probe_val_top1_by_l2"], f"{last['probe_l2']:g}"
        for lr in [] if PROBE in keys else args.lrs.split(","):
            out = work / "val" / f"{list(ARMS).index(name)}_{lr}_{pre.name}"
            run([*common, "data.val_size=80", "train.seed=0", f"optim.lr={lr}", f"train.output_dir={out}", *keys],
                work / f"val_{out.name}.log")
            last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
            scores[lr] = last["val_top1"]
            best = max(scores, key=scores.get)
        chosen[name] = (float(best), scores)
        print(f"{name}: validation top-1 by {'L2 strength' if PROBE in keys else 'lr'} {scores}: {best}", flush=True)
    for seed in map(int, args.seeds.split(",")):
        for name in arms:
            keys = [k.format(pre=pre) for k in ARMS[name]]
            lr, scores = chosen[name]
            out = work / "runs" / f"{list(ARMS).index(name)}_{seed}_{pre.name}"
            chosen_key = f"train.probe_l2={lr}" if PROBE in keys else f"optim.lr={lr}"
            result = run([*common, chosen_key, f"train.seed={seed}", f"train.output_dir={out}", *keys],
                         work / f"{out.name}.log")
            record = {"arm": name, "seed": seed, "pretrained": pre.name,
                      **({"probe_l2": lr, "val_top1_by_l2": scores} if PROBE in keys else
                         {"lr": lr, "val_top1_by_lr": scores}),
                      "test_top1": result["summary"]["test_top1"],
                      "peak_rss_mib": result["peak_rss_mib"], "first_line": result["first_line"],
                      "wall_time": result["summary"].get("wall_time")}
            print(json.dumps(record), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
