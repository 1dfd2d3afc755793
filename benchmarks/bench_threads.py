"""Torch's threads on a busy machine: the quick CPU config's training speed with 1 and 2 threads, on an
idle machine and while another process keeps one core busy.

Each measurement is one ``train.py`` run of the quick config (``configs/cifar10_cpu_quick.yaml``) on the
first ``--images`` training images of a CIFAR-10 ImageFolder, one epoch, in a process of its own with
``OMP_NUM_THREADS`` set; the figure is the epoch's training images/s from its ``metrics.jsonl`` (decoding
and start-up left out). "busy" runs a pure-Python loop on one core beside it, as another user's job
would. The settings alternate, ``--repeats`` times; the medians are printed and written as JSON.

    python benchmarks/bench_threads.py --data ../shared/data/cifar10
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(data: str, images: int, threads: int, busy: bool, out_dir: Path) -> float:
    """Training images/s of one epoch of the quick config with ``threads`` torch threads."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/cifar10_cpu_quick.yaml"),
                        "data.dataset=imagefolder", f"data.root={data}", f"data.train_subset={images}",
                        "data.test_subset=100", "train.epochs=1", "train.log_with=none", f"train.output_dir={out_dir}"],
                       check=True, env=env, capture_output=True, text=True)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if r["split"] == "eval")["examples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a CIFAR-10 ImageFolder (train/<class>/*.png)")
    parser.add_argument("--images", type=int, default=10240, help="training images (80 steps of 128)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/threads_cpu.json"))
    args = parser.parse_args()
    settings = [(threads, busy) for busy in (False, True) for threads in (2, 1)]
    rates: dict[str, list[float]] = {f"{t} thread(s), {'busy' if b else 'idle'}": [] for t, b in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for threads, busy in settings:
                key = f"{threads} thread(s), {'busy' if busy else 'idle'}"
                rate = one_run(args.data, args.images, threads, busy, Path(tmp) / f"{repeat}_{threads}_{busy}")
                rates[key].append(rate)
                print(f"{key}: {rate:.0f} images/s", flush=True)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    for key, value in medians.items():
        print(f"median {key}: {value:.0f} images/s")
    Path(args.output).write_text(json.dumps({"images_per_s": rates, "median": medians, "cpus": os.cpu_count(),
                                             "command": " ".join(["python", *sys.argv])}, indent=2) + "\n")


if __name__ == "__main__":
    main()
