"""What ``vitlab inspect`` writes: ``issues.csv`` (a row an issue, each kind worst first), a picture grid an issue
kind, the summary it prints, and the clean list (``--write-clean``) that ``data.dataset=csv`` reads."""
from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from torch import Tensor

from ..files import replaced
from .pixels import PIXEL_KINDS


__all__ = ["COLUMNS", "KINDS", "write_issues", "draw_grid", "write_clean", "summary_lines"]

COLUMNS = ("split", "image", "issue", "score", "given_label", "suggested_label", "duplicate_of")
# The kinds, in the order issues.csv lists them; what a row's score (0 to 1, higher = surer) is, for each.
KINDS = {
    "label": "1 - cleanlab's label quality of the given label",
    "leak": "the thumbnails' correlation with its near-duplicate in another split",
    "near_duplicate": "the thumbnails' correlation with its near-duplicate in the same split",
    "outlier": "1 - cleanlab's outlier score",
    "unreadable": "1: the image could not be read",
    **PIXEL_KINDS,
}
NAMES = {"label": "label issue", "leak": "leak", "near_duplicate": "near-duplicate", "outlier": "outlier",
         "unreadable": "unreadable", **{kind: kind.replace("_", "-") for kind in PIXEL_KINDS}}
_COUNTED = ("label", "leak", "near_duplicate", "outlier")  # nouns (a plural), in the summary even when 0


def write_issues(path: Path, rows: list[dict[str, Any]]) -> None:
    """``rows`` (dicts of :data:`COLUMNS`) to ``path``, by kind in :data:`KINDS`' order, each kind's surest first;
    written under a temporary name and renamed into place."""
    rows = sorted(rows, key=lambda r: (list(KINDS).index(r["issue"]), -r["score"]))
    with replaced(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows({**r, "score": f"{r['score']:.4f}"} for r in rows)


def draw_grid(path: Path, items: list[tuple[list[Tensor], str]], title: str, columns: int = 4) -> None:
    """A grid of ``items`` (one or two images side by side, uint8 ``(3, H, W)``, and a title) to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = max(len(images) for images, _ in items)
    rows = -(-len(items) // columns)
    fig, axes = plt.subplots(rows, columns * width, figsize=(1.6 * columns * width, 1.9 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for n, (images, caption) in enumerate(items):
        r, c = divmod(n, columns)
        for k, image in enumerate(images):
            ax = axes[r, c * width + k]
            ax.imshow(image.permute(1, 2, 0).numpy(), interpolation="nearest")
        axes[r, c * width].set_title(caption, fontsize=7, loc="left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_clean(path: Path, files: list[Path], labels: list[str]) -> None:
    """The clean list: ``files`` (paths relative to ``path``'s folder, which is the ``data.root`` that reads it)
    with their ``labels``, a CSV that ``data.dataset=csv`` reads as the split named by ``path``'s stem."""
    path.parent.mkdir(parents=True, exist_ok=True)
    root = path.parent.absolute()  # paths as the listing gave them: through a linked folder, not to its target
    with replaced(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["image", "labels"])
        writer.writerows([Path(os.path.relpath(Path(p).absolute(), root)).as_posix(), label]
                         for p, label in zip(files, labels))


def summary_lines(counts: dict[str, dict[str, int]], balance: dict[str, dict[str, Any]], how: str, output: Path,
                  grids: list[str], agreed: dict[str, float], multi_label: bool, trusted: float) -> list[str]:
    """The few lines printed at the end: each split's issues by kind, its class balance, how often the out-of-sample
    probabilities agree with its labels (and, below ``trusted``, that its label findings are not to be trusted), where
    the files are."""
    lines = []
    what = "micro-F1 of the label sets" if multi_label else "top-1"
    for split, kinds in counts.items():
        b = balance[split]
        per = sorted(b["classes"].items(), key=lambda kv: kv[1])
        ratio = per[-1][1] / max(per[0][1], 1)
        lines.append(f"{split}: {b['images']:,} images; " + ", ".join(
            f"{n:,} {NAMES[kind]}{'s' if n != 1 and kind in _COUNTED else ''}"
            for kind, n in kinds.items() if n or kind in (*_COUNTED, "unreadable"))
            + f"; classes from {per[0][1]:,} ({per[0][0]}) to {per[-1][1]:,} "
            f"({per[-1][0]}) images, {ratio:.1f}x")
    lines.append(f"label issues and outliers from {how}; near-duplicates and leaks: thumbnails compared pixel by "
                 f"pixel; low-information, dark, light, blurry and odd-size images: CleanVision (the first three left "
                 f"out of the other searches)")
    lines.append(f"those probabilities agree with the given labels ({what}, out of sample): " +
                 ", ".join(f"{split} {100 * a:.1f}%" for split, a in agreed.items()))
    weak = [split for split, a in agreed.items() if a < trusted]
    if weak:
        lines.append(f"below {100 * trusted:.0f}% ({', '.join(weak)}) the label issues cannot be told from the model's "
                     f"own mistakes and are not to be trusted: inspect with a stronger model (a fine-tuned or "
                     f"longer-trained checkpoint), or check the labels by hand")
    lines.append(f"wrote {output / 'issues.csv'}" + (f" and {', '.join(grids)}" if grids else "") +
                 "; nothing in the data set was changed")
    return lines
