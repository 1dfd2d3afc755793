"""The curve of docs/performance.md: CIFAR-10 test top-1 against wall time of the time-to-accuracy run on
one H100 (benchmarks/gpu_session.sh; its metrics.jsonl kept in benchmarks/results/gpu_h100/).

The wall time of an evaluated epoch is the process's start-to-finish time less what the loop measured
(epoch and evaluation times), all of it put before the first epoch (an upper bound at every point), plus
the loop's time up to that epoch.

    python benchmarks/plot_time_to_accuracy.py
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--metrics", default=str(HERE / "results/gpu_h100/final.metrics.jsonl"))
    parser.add_argument("--total", type=float, default=583.2, help="the run's start-to-finish seconds")
    parser.add_argument("--out", default=str(HERE.parent / "docs/cifar10_time_to_accuracy.png"))
    args = parser.parse_args()
    evals = [r for r in map(json.loads, Path(args.metrics).read_text().splitlines()) if r["split"] == "eval"]
    loop = sum(r["epoch_time"] + r.get("eval_time", 0.0) for r in evals)
    clock, points = args.total - loop, []
    for r in evals:
        clock += r["epoch_time"]
        if "test_top1" in r:
            points.append((clock / 60, 100 * r["test_top1"]))
        clock += r.get("eval_time", 0.0)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(*zip(*points), "o-", ms=3, label=f"vit_cifar_small_patch4_32 (512 wide, 8 blocks), {evals[-1]['epoch']} epochs")
    for y, text in ((94, "goal 94%"), (90, "milestone 90%")):
        ax.axhline(y, color="grey", lw=0.8, ls="--")
        ax.text(0.2, y + 0.3, text, color="grey", fontsize=8)
    ax.axvline(args.total / 60, color="black", lw=0.8)
    ax.annotate(f"final epoch: {points[-1][1]:.2f}% at {args.total / 60:.1f} min", (args.total / 60, points[-1][1]),
                xytext=(-190, -40), textcoords="offset points", fontsize=8, arrowprops=dict(arrowstyle="->", lw=0.6))
    ax.set(xlabel="wall time, start to finish (minutes)", ylabel="CIFAR-10 test top-1 (%)", ylim=(50, 96), xlim=(0, 10.2),
           title="One H100, from scratch: test top-1 during a 10-minute run")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}: {len(points)} evaluations, the last {points[-1][1]:.2f}% at {points[-1][0]:.2f} min")


if __name__ == "__main__":
    main()
