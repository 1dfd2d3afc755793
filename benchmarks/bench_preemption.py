"""What surviving a cluster costs: the seconds and megabytes of one step checkpoint, and the time from
SIGTERM to the process's exit.

Both through ``train.py``'s own loop, on a generated 10-class ImageFolder of 32-px images that the
model's loader resizes to its input (``vit_small_patch16_224`` by default: 22M parameters, AdamW):

- **step checkpoint**: a run with ``train.save_every_steps=1`` in this process; each write of
  ``checkpoints/last/`` (weights, optimizer, trainer state, this process's RNG state, the atomic swap)
  is timed; the size is that directory's;
- **SIGTERM to exit**: ``train.py`` in a fresh process, SIGTERM once its first training step is
  logged, the wall time until it has exited (status 75): the rest of the step it is in, the checkpoint,
  the exit.

    python benchmarks/bench_preemption.py                         # vit_small_patch16_224, batch 16, CPU
    python benchmarks/bench_preemption.py --model vit_cifar_small_patch4_32 --batch 128
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_data(root: Path) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(10):
        for split, n in (("train", 64), ("test", 8)):
            (root / split / f"c{c}").mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(root / split / f"c{c}" / f"{i}.png")
    return root


def overrides(model: str, batch: int, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [f"model.name={model}", "model.num_classes=10", "data.dataset=imagefolder", f"data.root={data}",
            "data.num_workers=0", "data.loader=torch", f"train.batch_size={batch}", "train.epochs=1",
            "train.log_every=1", "train.eval_every=0", f"train.output_dir={run_dir}", *extra]


def step_checkpoints(args: argparse.Namespace, data: Path, work: Path) -> dict:
    from vitlab import training
    from vitlab.config import load_config

    seconds: list[float] = []
    save = training._Loop.save

    def timed(self, name):
        start = time.perf_counter()
        save(self, name)
        if self.state["epoch_step"]:  # the step checkpoints, not the epoch's
            seconds.append(time.perf_counter() - start)

    training._Loop.save = timed
    run_dir = work / "steps"
    cfg = load_config(None, overrides(args.model, args.batch, data, run_dir, "train.save_every_steps=1",
                                      f"data.train_subset={args.batch * (args.steps + 1)}"))
    training.train(cfg)
    last = run_dir / "checkpoints" / "last"
    files = {p.name: round(p.stat().st_size / 1e6, 1) for p in sorted(last.iterdir())}
    return {"median_s": round(statistics.median(seconds), 3), "all_s": [round(s, 3) for s in seconds],
            "mb": round(sum(files.values()), 1), "files_mb": files}


def sigterm_to_exit(args: argparse.Namespace, data: Path, work: Path, trial: int) -> dict:
    run_dir = work / f"sigterm{trial}"
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/cifar10_cpu_quick.yaml"),
           *overrides(args.model, args.batch, data, run_dir)]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        if process.poll() is not None:
            raise RuntimeError(f"train.py ended ({process.returncode}) before its first step")
        time.sleep(0.01)
    start = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate()
    elapsed = time.perf_counter() - start
    state = json.loads((run_dir / "checkpoints/last/trainer_state.json").read_text())
    return {"seconds": round(elapsed, 2), "exit": process.returncode, "stopped_after_step": state["global_step"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="vit_small_patch16_224")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="step checkpoints to time")
    parser.add_argument("--trials", type=int, default=3, help="SIGTERM runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = make_data(work / "data")
        result = {"model": args.model, "batch": args.batch, "step_checkpoint": step_checkpoints(args, data, work)}
        trials = [sigterm_to_exit(args, data, work, i) for i in range(args.trials)]
        result["sigterm_to_exit"] = {"median_s": statistics.median(t["seconds"] for t in trials), "trials": trials}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
