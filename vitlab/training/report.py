"""What a run says and leaves for people: the advice on a busy machine, the last line and ``summary.json``
of a finished run, its records (``metrics.jsonl``) and its curves (``curves.png``)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from ..files import replaced

__all__ = ["busy_machine_advice", "summary_of", "result_line", "read_records", "last_eval", "truncate_lines",
           "plot_curves"]


def busy_machine_advice() -> str:
    """One line when torch will spin several threads while other threads run on the machine, '' otherwise: torch's
    threads wait for each other when another process takes a core (benchmarks/RESULTS.md, "Torch's threads on a
    busy machine"). The running threads are
    read from ``/proc/loadavg`` (the 1-minute load average lags: it counts what just ended), the lowest
    of up to five samples 50 ms apart, so that a process passing by does not count."""
    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    if threads < 2 or "OMP_NUM_THREADS" in os.environ or not Path("/proc/loadavg").is_file():
        return ""
    busy = cores
    for sample in range(5):
        busy = min(busy, int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1)  # others running
        if busy < 1:
            return ""
        time.sleep(0.05)
    return (f"the machine is busy ({busy} other thread(s) running on {cores} cores) and torch runs {threads} threads, "
            f"which wait for each other when cores are taken: if training is slow, run it with "
            f"OMP_NUM_THREADS={max(1, cores - busy)} (one core busy on 2: 3.4x faster with one thread)")


def summary_of(result: dict[str, Any]) -> dict[str, Any]:
    """What a finished run reports (``<run>/summary.json``, ``train.py --json``): the last evaluation's
    validation and test metrics, the best validation metric, epochs, wall time, the run directory."""
    return {k: result[k] for k in result if k.startswith(("val_", "test_", "ema_")) or k in (
        "best_metric", "best_epoch", "epochs_done", "stopped_early", "wall_time", "run_dir")}


_FRACTIONS = ("top1", "top5", "knn_top1", "exact_match", "balanced_top1", "macro_f1", "map", "micro_map", "micro_f1",
              "example_f1")  # metrics in [0, 1], said in percent


def result_line(result: dict[str, Any], select: str, has_val: bool, run_dir: Path) -> str:
    """The last line of a finished run: its result in words, where the model is and what to do next."""
    def said(value: float | None) -> str:
        if value is None:
            return "not evaluated"
        name = {"top1": "top-1", "exact_match": "exact match", "balanced_top1": "balanced top-1",
                "macro_f1": "macro F1", "map": "mAP", "micro_map": "micro mAP", "micro_f1": "micro F1",
                "example_f1": "example-based F1", "knn_top1": "k-NN top-1"}.get(select, select)
        return f"{name} {100 * value:.2f}%" if select in _FRACTIONS else f"{name} {value:.4f}"

    prefix = "ema_" if "ema_test_" + select in result else ""
    test = said(result.get(f"{prefix}test_{select}"))
    done = f"finished {result['epochs_done']} epochs in {result['wall_time']:.0f} s: test {test} " \
           f"at the final epoch{' (EMA weights)' if prefix else ''}"
    if has_val and result.get("best_epoch") is not None:
        model = run_dir / "checkpoints" / "best"
        done += f", best validation {said(result['best_metric'])} at epoch {result['best_epoch']} ({model})"
    else:
        model = run_dir / "checkpoints" / "last"
    if select == "knn_top1":  # a self-supervised backbone: no head to evaluate
        return f"{done} | model: {model} | next: train.py --config CONFIG task=classification " \
               f"model.pretrained={run_dir} (fine-tune), or vitlab eval --checkpoint {run_dir} --knn 20"
    return f"{done} | model: {model} | next: vitlab eval --checkpoint {run_dir}"


def read_records(metrics_file: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``."""
    return [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]


def last_eval(metrics_file: Path) -> dict[str, Any]:
    evals = [r for r in read_records(metrics_file) if r["split"] == "eval"]
    return evals[-1] if evals else {}


def truncate_lines(path: Path, keep: int | None) -> int:
    """Keep the first ``keep`` lines of ``path`` (all if None; a missing file has none): what a resumed
    run logged after its checkpoint is logged again. Returns the lines kept."""
    if not path.exists():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    if keep is not None and keep < len(lines):
        with replaced(path) as tmp:
            tmp.write_text("".join(lines[:keep]))
        return keep
    return len(lines)


def plot_curves(metrics_file: Path, path: Path) -> None:
    """Training curves from ``metrics.jsonl``: loss, accuracy and learning rate against epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_records(metrics_file)
    evals = [r for r in records if r["split"] == "eval"]
    trains = [r for r in records if r["split"] == "train"]
    steps_per_epoch = max(1, evals[0]["step"]) if evals else 1
    # Fixed margins, not tight_layout: measuring the labels drew the figure once more, and every finished run draws
    # its curves (benchmarks/RESULTS.md, "The run's curves"), for the same picture.
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), gridspec_kw=dict(left=0.06, right=0.985, bottom=0.13, top=0.92,
                                                                     wspace=0.22))
    axes[0].plot([r["step"] / steps_per_epoch for r in trains], [r["loss"] for r in trains], label="train")
    for key in sorted({k for r in evals for k in r if k.endswith("_loss")}):
        axes[0].plot([r["epoch"] for r in evals if key in r], [r[key] for r in evals if key in r], "o-", label=key)
    metric_keys = {k for r in evals for k in r if k.startswith(("val_", "test_", "ema_")) and not k.endswith("_loss")}
    for key in sorted(metric_keys):
        axes[1].plot([r["epoch"] for r in evals if key in r], [r[key] for r in evals if key in r], "o-", label=key)
    axes[2].plot([r["step"] / steps_per_epoch for r in trains], [r["lr"] for r in trains])
    for ax, title in zip(axes, ("loss", "evaluation metrics", "learning rate")):
        ax.set_title(title, y=1.0)  # placed, not measured against the ticks: the same place, a draw less
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0].legend()
    if metric_keys:
        axes[1].legend()
    else:  # a run without evaluation (a self-supervised one without monitor.root): say so, not an empty key
        axes[1].text(0.5, 0.5, "not evaluated", ha="center", va="center", transform=axes[1].transAxes)
    fig.savefig(path, dpi=100)
    plt.close(fig)
