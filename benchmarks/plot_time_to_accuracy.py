"""The curve of docs/performance.md: CIFAR-10 test top-1 against wall time of the time-to-accuracy runs on
one H100 (benchmarks/gpu_session.sh; their metrics.jsonl kept in benchmarks/results/): by default
``configs/vit_cifar10_fast.yaml`` as shipped, run in session 1 (583.2 s start to finish) and session 5
(599.4 s, another H100 whose bare training step was 10% slower).

The wall time of an evaluated epoch is the process's start-to-finish time less what the loop measured
(epoch and evaluation times), all of it put before the first epoch (an upper bound at every point), plus
the loop's time up to that epoch.

    python benchmarks/plot_time_to_accuracy.py
    python benchmarks/plot_time_to_accuracy.py --run "label" metrics.jsonl SECONDS [--run ...] --out FILE
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


RUNS = [("session 1 (2026-11-24)", str(HERE / "results/gpu_h100/final.metrics.jsonl"), "583.2"),
        ("session 5 (2026-11-27)", str(HERE / "results/gpu_h100_s5/final.metrics.jsonl"), "599.4")]


def curve(metrics: str, total: float) -> list[tuple[float, float]]:
    """(minutes since the process started, test top-1 %) at each evaluated epoch of one run."""
    evals = [r for r in map(json.loads, Path(metrics).read_text().splitlines()) if r["split"] == "eval"]
    loop = sum(r["epoch_time"] + r.get("eval_time", 0.0) for r in evals)
    clock, points = total - loop, []
    for r in evals:
        clock += r["epoch_time"]
        if "test_top1" in r:
            points.append((clock / 60, 100 * r["test_top1"]))
        clock += r.get("eval_time", 0.0)
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", nargs=3, action="append", metavar=("LABEL", "METRICS", "SECONDS"),
                        help="a run: its label, metrics.jsonl and start-to-finish seconds (repeatable)")
    parser.add_argument("--out", default=str(HERE.parent / "docs/cifar10_time_to_accuracy.png"))
    args = parser.parse_args()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for label, metrics, total in args.run or RUNS:
        points = curve(metrics, float(total))
        ax.plot(*zip(*points), "o-", ms=3, label=f"{label}: {points[-1][1]:.2f}% at {float(total) / 60:.1f} min")
        print(f"{label}: {len(points)} evaluations, the last {points[-1][1]:.2f}% at {points[-1][0]:.2f} min")
    for y, text in ((94, "goal 94%"), (90, "milestone 90%")):
        ax.axhline(y, color="grey", lw=0.8, ls="--")
        ax.text(0.2, y + 0.3, text, color="grey", fontsize=8)
    ax.set(xlabel="wall time, start to finish (minutes)", ylabel="CIFAR-10 test top-1 (%)", ylim=(50, 96), xlim=(0, 10.2),
           title="vit_cifar10_fast.yaml on one H100, from scratch (231 epochs)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
