"""A golden set of outputs, to show that a change moved code without changing what it computes: one short run of
each kind on real CIFAR-10 images, on the CPU with one thread, and what vitlab's commands make of it. Record it
before the change and again after, at the same place, and compare:

    python benchmarks/golden_set.py record --data ../shared/data/cifar10 --out /tmp/golden && cp -r /tmp/golden /tmp/before
    ... the change ...
    python benchmarks/golden_set.py record --data ../shared/data/cifar10 --out /tmp/golden
    python benchmarks/golden_set.py compare /tmp/before /tmp/golden

The set: the quick config for one epoch on 1,000 images (100 held out for validation) and its ``metrics.jsonl``
and weights; ``vitlab eval --output`` and ``--predictions``, with ``--tta flip``, ``--tta crops`` and ``--knn 5``;
``vitlab calibrate``; ``vitlab predict`` into CSV and JSON lines; ``vitlab embed`` into ``.npy``; a multi-label
csv run (CIFAR-10 mosaics) with its eval; a LoRA run and a cached-feature probe from the quick run; a short run of
MAE, DINO, the character language model and the copy task, each with its eval (``--only-tasks``: those alone). ``compare``
says which files differ: JSON and JSON lines with their timings left out (they are the clock's, not the
computation's), every other file byte for byte (weights, CSV, ``.npy``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMINGS = {"epoch_time", "data_time", "examples_per_s", "eval_time", "wall_time", "time", "seconds", "started",
           "duration", "images_per_s"}


def _run(*args: str) -> None:
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, *args], check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)


def _cli(*args: str) -> None:
    _run("-c", "import sys; from vitlab.cli import main; main(sys.argv[1:])", *args)


def record(data: Path, out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    quick, cfg = out / "quick", str(ROOT / "configs/cifar10_cpu_quick.yaml")
    common = ["data.dataset=imagefolder", f"data.root={data}", "data.loader=torch", "data.num_workers=0",
              "train.epochs=1", "train.log_every=2"]
    _run("train.py", "--config", cfg, *common, "data.train_subset=1000", "data.test_subset=200", "data.val_size=100",
         f"train.output_dir={quick}", "train.ema_decay=0.9")
    _cli("eval", "--checkpoint", str(quick), "--output", str(out / "eval.json"), "--predictions", str(out / "eval.csv"))
    for name, extra in (("tta_flip", ["--tta", "flip"]), ("tta_crops", ["--tta", "crops"]), ("knn", ["--knn", "5"]),
                        ("no_ema", ["--no-ema"])):
        _cli("eval", "--checkpoint", str(quick), "--output", str(out / f"eval_{name}.json"), *extra)
    _cli("calibrate", "--checkpoint", str(quick))
    shutil.copy(quick / "checkpoints/best/config.json", out / "calibrated_config.json")
    images = str(data / "test" / "cat")
    for suffix in (".csv", ".jsonl"):
        _cli("predict", "--checkpoint", str(quick), "--output", str(out / f"predict{suffix}"), "--batch-size", "64",
             "--num-workers", "0", images)
    _cli("predict", "--checkpoint", str(quick), "--output", str(out / "predict_flip.csv"), "--tta", "flip",
         "--num-workers", "0", images)
    _cli("embed", "--checkpoint", str(quick), "--output", str(out / "embed.npy"), "--num-workers", "0", images)
    mosaics = out / "mosaics"
    _run(str(ROOT / "benchmarks/make_cifar10_mosaic.py"), "--data", str(data), "--out", str(mosaics), "--train", "300",
         "--test", "60")
    _run("train.py", "--config", str(ROOT / "configs/cifar10_mosaic_cpu.yaml"), f"data.root={mosaics}",
         "data.loader=torch", "data.num_workers=0", "train.epochs=1", "data.val_size=40",
         f"train.output_dir={out / 'multilabel'}")
    _cli("calibrate", "--checkpoint", str(out / "multilabel"))
    _cli("eval", "--checkpoint", str(out / "multilabel"), "--output", str(out / "multilabel_eval.json"),
         "--predictions", str(out / "multilabel_eval.csv"))
    _run("train.py", "--config", cfg, *common, "data.train_subset=500", "data.test_subset=200",
         f"model.pretrained={quick}", "model.lora_r=4", f"train.output_dir={out / 'lora'}")
    _run("train.py", "--config", cfg, *common, "data.train_subset=500", "data.test_subset=200", "data.val_size=50",
         f"model.pretrained={quick}", "model.freeze=backbone", "train.cache_features=true",
         f"train.output_dir={out / 'probe'}")
    shutil.rmtree(mosaics / "images")  # the inputs, not outputs
    record_tasks(data, out)


def record_tasks(data: Path, out: Path) -> None:
    """One short run of each task but classification (MAE, DINO with their k-NN monitor, the character language
    model on tiny Shakespeare beside ``data``, the copy task's sequence-to-sequence) and ``vitlab eval`` of each."""
    tasks = out / "tasks"
    shutil.rmtree(tasks, ignore_errors=True)  # a run left there would be taken as finished (train.resume=auto)
    ssl = ["data.dataset=imagefolder", f"data.root={data}", "data.train_subset=300", "train.epochs=1",
           "train.batch_size=64", f"monitor.root={data}", "monitor.train_subset=200", "monitor.test_subset=100",
           "monitor.val_size=50", "monitor.k=5"]
    text = data.parent / "tinyshakespeare" / "input.txt"
    runs = {"mae": ["--config", str(ROOT / "configs/mae_cifar10_cpu.yaml"), *ssl],
            "dino": ["--config", str(ROOT / "configs/dino_cifar10_cpu.yaml"), *ssl],
            "lm": ["--config", str(ROOT / "configs/lm_shakespeare_char_cpu.yaml"), f"data.root={text}",
                   "data.steps_per_epoch=20", "train.epochs=1", "train.log_every=5"],
            "seq2seq": ["--config", str(ROOT / "configs/seq2seq_copy.yaml"), "data.num_train=512", "data.num_test=64",
                        "train.epochs=1", "train.log_every=2"]}
    for kind, args in runs.items():
        _run("train.py", *args, f"train.output_dir={tasks / kind}")
        _cli("eval", "--checkpoint", str(tasks / kind), "--output", str(tasks / f"{kind}_eval.json"),
             *(["--knn", "5"] if kind in ("mae", "dino") else []))


def _strip(value: object) -> object:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _same(a: Path, b: Path) -> bool:
    if a.suffix == ".json":
        return _strip(json.loads(a.read_text())) == _strip(json.loads(b.read_text()))
    if a.suffix == ".jsonl":
        read = lambda p: [_strip(json.loads(line)) for line in p.read_text().splitlines()]
        return read(a) == read(b)
    return a.read_bytes() == b.read_bytes()


def compare(before: Path, after: Path) -> int:
    # pictures carry the renderer's bytes, TensorBoard's folders the clock's time in their names
    kept = lambda p, top: p.is_file() and p.suffix != ".png" and "tensorboard" not in p.relative_to(top).parts
    files = sorted(p.relative_to(before) for p in before.rglob("*") if kept(p, before))
    differ = [f for f in files if not (after / f).is_file() or not _same(before / f, after / f)]
    extra = sorted(p.relative_to(after) for p in after.rglob("*")
                   if kept(p, after) and not (before / p.relative_to(after)).exists())
    for f in differ:
        print(f"differs: {f}")
    for f in extra:
        print(f"only after: {f}")
    print(f"{len(files) - len(differ)} of {len(files)} files equal" + (f"; {len(extra)} new" if extra else ""))
    return 1 if differ or extra else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--data", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--only-tasks", action="store_true", help="only the runs of the tasks but classification")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.cmd == "record":
        (record_tasks if args.only_tasks else record)(args.data.resolve(), args.out.resolve())
    else:
        sys.exit(compare(args.before, args.after))


if __name__ == "__main__":
    main()
