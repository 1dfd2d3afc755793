"""``vitlab inspect``: wrong labels, near-duplicates (within a split, and between splits: leaks), outliers and the
class balance of a data set, from a checkpoint's features and out-of-sample class probabilities. It reads the data
set and writes only under ``output``; the user's files are never changed."""
from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from ..data.table import label_cell
from ..data.transforms import decode_upright
from ..errors import ConfigError
from ..outputs import check_new_file, check_output_folder
from ..runtime import processes
from .duplicates import DUPLICATE_THRESHOLD, duplicate_pairs
from .findings import require_cleanlab, split_issues
from .pixels import NO_INFORMATION, PIXEL_KINDS, require_cleanvision
from .probabilities import TRUSTED_AGREEMENT, agreement, cross_fitted, fold_of, knn_out_of_sample
from .report import KINDS, draw_grid, summary_lines, write_clean, write_issues
from .splits import Split, describe, list_splits, split_features

__all__ = ["inspect_data"]


def _check(model: nn.Module, splits: list[Split], classes: list[str], multi_label: bool, folds: int,
           other_classes: bool, output: Path, write_clean_to: Path | None, data_root: Path | None) -> None:
    """Everything that can be refused from the listings alone, one line each, before any image is decoded: among it
    an output inside the data set (its root, a folder of its images) and a clean list over an existing file."""
    read = ([data_root] if data_root is not None else []) + sorted({f.parent for s in splits for f in s.files or []})
    check_output_folder(output, "--output", read)
    known = (getattr(model, "pretrained_cfg", None) or {}).get("label_names")
    if known and sorted(known) != sorted(classes) and not other_classes:
        extra = sorted(set(classes) - set(known))[:3] or sorted(set(known) - set(classes))[:3]
        raise ConfigError(f"the checkpoint's {len(known)} classes are not the data's {len(classes)} "
                          f"({', '.join(extra)} in one and not the other): is it the run of this data set? To use "
                          f"the features of a model "
                          f"trained on other classes (a pretrained backbone), pass --other-classes")
    for split in splits:
        present = split.labels.any(0) if multi_label else torch.bincount(split.labels, minlength=len(classes)) > 0
        if int(present.sum()) < 2:
            only = [classes[k] for k in present.nonzero().flatten().tolist()]
            raise ConfigError(f"split {split.name!r} holds one class ({', '.join(only) or 'none'}): a label can only "
                              f"be judged against other classes; inspect a split with two or more")
        if folds and len(split) < folds:
            raise ConfigError(f"--folds {folds}: split {split.name!r} has {len(split)} images, fewer than the folds; "
                              f"give --folds {max(2, len(split))} or fewer, or --knn")
    if write_clean_to is not None:
        if write_clean_to.suffix != ".csv":
            raise ConfigError(f"--write-clean {write_clean_to}: give a .csv file (data.dataset=csv reads "
                              f"<data.root>/<split>.csv)")
        if splits[0].files is None:
            raise ConfigError("--write-clean lists image files; this data set's images are not files (a Hugging Face "
                              "data set, shards): inspect its files, or filter it by issues.csv")
        check_new_file(write_clean_to, "--write-clean", read)
        for other in splits[1:]:
            beside = write_clean_to.with_name(f"{Path(other.name).name}.csv")
            if beside != write_clean_to:
                check_new_file(beside, f"--write-clean {write_clean_to}: the {other.name} split's list beside it,",
                               read)


def _probabilities(features: Tensor, labels: Tensor, num_classes: int, knn: int, folds: int, seed: int) -> Tensor:
    return cross_fitted(features, labels, num_classes, fold_of(labels, folds, seed)) if folds else \
        knn_out_of_sample(features, labels, num_classes, knn)


class Searched(NamedTuple):
    """A split's images that the label, outlier and duplicate searches read: their positions in the split, features
    ``(n, E)`` and thumbnails ``(n, 3, 32, 32)``."""

    positions: np.ndarray
    features: Tensor
    thumbs: Tensor


def _row(split: Split, i: int, kind: str, score: float, classes: list[str], suggested: str = "",
         duplicate_of: str = "") -> dict[str, Any]:
    """The row of issues.csv (:data:`~vitlab.inspection.report.COLUMNS`) of image ``i`` of ``split``."""
    return {"split": split.name, "image": split.names[i], "issue": kind, "score": score,
            "given_label": label_cell(split.labels[i], classes), "suggested_label": suggested,
            "duplicate_of": duplicate_of}


def _label_rows(split: Split, rows: np.ndarray, issues: Any, probs: Tensor, classes: list[str],
                multi_label: bool) -> list[dict[str, Any]]:
    found = []
    for r in np.flatnonzero(issues["is_label_issue"].to_numpy()).tolist():
        suggested = label_cell(probs[r] >= 0.5, classes) if multi_label else classes[int(issues["predicted_label"][r])]
        found.append(_row(split, int(rows[r]), "label", 1 - float(issues["label_score"][r]), classes, suggested))
    for r in np.flatnonzero(issues["is_outlier_issue"].to_numpy()).tolist():
        found.append(_row(split, int(rows[r]), "outlier", 1 - float(issues["outlier_score"][r]), classes))
    return found


def _pair_rows(kind: str, a: Split, b: Split, pairs: list[tuple[int, int, float]], rows_a: np.ndarray,
               rows_b: np.ndarray, classes: list[str]) -> list[dict[str, Any]]:
    return [_row(a, int(rows_a[i]), kind, s, classes, duplicate_of=f"{b.name}:{b.names[int(rows_b[j])]}")
            for i, j, s in pairs]


def _inspect_split(model: nn.Module, split: Split, features_dir: Path, classes: list[str], multi_label: bool,
                   voting: tuple[int, int, int], duplicate_threshold: float,
                   reading: tuple[int, int, str]
                   ) -> tuple[Searched, list[dict[str, Any]], float]:
    """One split's findings: what its pixels alone say (CleanVision), then, on the images that are readable and carry
    information, wrong labels and outliers (cleanlab on the out-of-sample probabilities of ``voting``: k-NN ``k``,
    or ``folds`` heads dealt by ``seed``) and near-duplicates within it. Returns the images searched (their
    positions, features and thumbnails: what leaks are looked for among), the rows, and how often the probabilities
    agree with the labels."""
    knn, folds, seed = voting
    features, thumbs, pixels = split_features(model, split, features_dir, *reading)
    readable = ~np.isnan(np.asarray(features)).any(1)
    blank = np.zeros(len(split), bool)
    for kind in NO_INFORMATION:
        blank |= pixels[kind][0]
    searched = np.flatnonzero(readable & ~blank)
    x, small = torch.from_numpy(np.asarray(features)[searched]), torch.from_numpy(np.asarray(thumbs)[searched])
    labels = split.labels[torch.from_numpy(searched)]
    probs = _probabilities(x, labels, len(classes), knn, folds, seed)
    rows = _label_rows(split, searched, split_issues(labels, probs, x.numpy(), multi_label), probs, classes,
                       multi_label)
    alone = [("unreadable", i, 1.0) for i in np.flatnonzero(~readable).tolist()]
    alone += [(kind, i, float(score[i])) for kind, (flag, score) in pixels.items()
              for i in np.flatnonzero(flag & readable).tolist()]
    rows += [_row(split, i, kind, score, classes) for kind, i, score in alone]
    pairs = duplicate_pairs(x, small, threshold=duplicate_threshold)
    rows += _pair_rows("near_duplicate", split, split, pairs, searched, searched, classes)
    return Searched(searched, x, small), rows, agreement(probs, labels)


def inspect_data(model: nn.Module, data: list[str], output: str | Path, *, splits: list[str] | None = None,
                 knn: int = 0, folds: int = 0, seed: int = 0, duplicate_threshold: float = DUPLICATE_THRESHOLD,
                 write_clean_to: str | Path | None = None, other_classes: bool = False, batch_size: int = 64,
                 num_workers: int = 2, precision: str = "run", grid: int = 16) -> dict[str, Any]:
    """Inspect the splits ``splits`` (default: ``data.train_split`` and ``data.test_split``) of the data set the
    ``data.*`` keys ``data`` name, with the pooled features of ``model`` (any vitlab checkpoint: a classifier, a
    self-supervised or a pretrained backbone). Label issues and outliers: cleanlab on out-of-sample probabilities,
    from the ``knn`` nearest other images of the split (the default, 20), or from ``folds`` cross-fitted linear
    heads; near-duplicates within each split and between splits by
    :func:`~vitlab.inspection.duplicates.duplicate_pairs` at ``duplicate_threshold``. Writes
    ``output/issues.csv``, a picture grid a kind found (its ``grid`` surest), the features (reused by the next
    inspection), and with ``write_clean_to`` the first split's images without those flagged (label issues, outliers,
    unreadable images, each near-duplicate set's extra copies, copies of another split's images) as a CSV that
    ``data.dataset=csv`` reads, the other splits whole beside it.

    Returns:
        ``{"counts": {split: {kind: n}}, "balance": {split: {...}}, "issues": rows, "agreement": {split: a}}``:
        ``a`` how often the out-of-sample probabilities agree with the given labels
        (:func:`~vitlab.inspection.probabilities.agreement`); below
        :data:`~vitlab.inspection.probabilities.TRUSTED_AGREEMENT` the summary says the label findings are not to
        be trusted.

    Raises:
        ConfigError: one line, before any image is decoded (see :func:`_check`); without cleanlab installed.
    """
    require_cleanlab()
    require_cleanvision()
    if processes()[1] > 1:
        raise ConfigError("vitlab inspect runs in one process (it writes one report): start it without torchrun or "
                          "accelerate launch")
    if knn and folds:
        raise ConfigError("give --knn K or --folds K, not both: the out-of-sample probabilities come from one of them")
    if folds == 1 or folds < 0:
        raise ConfigError(f"--folds {folds}: give 2 or more folds (each image's probabilities come from a head "
                          f"fitted on the others)")
    if knn < 0:
        raise ConfigError(f"--knn {knn}: give how many nearest images vote, 1 or more")
    if not 0 < duplicate_threshold <= 1:
        raise ConfigError(f"--duplicate-threshold {duplicate_threshold}: a correlation in (0, 1]")
    output = Path(output)
    clean = Path(write_clean_to) if write_clean_to is not None else None
    listed, classes, multi_label = list_splits(data, splits or _default_splits(data), decode_upright(model))
    _check(model, listed, classes, multi_label, folds, other_classes, output, clean, _data_root(data))
    knn = knn or (0 if folds else 20)
    rows, counts, kept, found, agreed = [], {}, {}, {}, {}
    for split in listed:
        kept[split.name], found[split.name], agreed[split.name] = _inspect_split(
            model, split, output / "features", classes, multi_label, (knn, folds, seed), duplicate_threshold,
            (batch_size, num_workers, precision))
    for later, split in enumerate(listed):
        for earlier in listed[:later]:
            a, b = kept[split.name], kept[earlier.name]
            pairs = duplicate_pairs(a.features, a.thumbs, b.features, b.thumbs, threshold=duplicate_threshold)
            found[split.name] += _pair_rows("leak", split, earlier, pairs, a.positions, b.positions, classes)
    for split in listed:
        counts[split.name] = {kind: sum(1 for r in found[split.name] if r["issue"] == kind) for kind in KINDS}
        rows += found[split.name]
    output.mkdir(parents=True, exist_ok=True)
    write_issues(output / "issues.csv", rows)
    grids = _draw_grids(output, listed, rows, grid)
    beside = _write_clean_list(clean, listed, rows, classes) if clean is not None else []
    balance = {split.name: describe(split, classes) for split in listed}
    how = f"cross-fitted linear heads ({folds} folds)" if folds else f"the votes of the {knn} nearest other images"
    for line in summary_lines(counts, balance, how, output, grids, agreed, multi_label, TRUSTED_AGREEMENT):
        print(line)
    if clean is not None:
        print(f"wrote {clean}: the {listed[0].name} images without those flagged" +
              (f", and {', '.join(beside)} (whole)" if beside else "") + f"; train on it with data.dataset=csv "
              f"data.root={clean.parent} data.train_split={clean.stem}")
    return {"counts": counts, "balance": balance, "issues": rows, "agreement": agreed}


def _default_splits(data: list[str]) -> list[str]:
    from ..config import load_config

    d = load_config(None, data).data
    return list(dict.fromkeys([d.train_split, d.test_split]))


def _data_root(data: list[str]) -> Path | None:
    """The data set's folder (``data.root``) where it is one on this machine (not a Hugging Face hub name)."""
    from ..config import load_config

    root = Path(load_config(None, data).data.root).expanduser()
    return root if root.exists() else None


def _read(split: Split, name: str) -> Tensor:
    """An image of ``split`` by its name, as stored (uint8 ``(3, H, W)``), for a grid."""
    i = split.names.index(name)
    index = split.index
    if split.files is None and hasattr(index, "urls"):  # shards: read the sample at its position
        shard_name, position = name.rsplit(":", 1)
        shard = [Path(u).name for u in index.urls].index(shard_name)
        sample = next(iter(index.read(shard, int(position), int(position) + 1)))
        return index.decode(sample, None)
    return index.decode(i, None)


def _draw_grids(output: Path, listed: list[Split], rows: list[dict[str, Any]], grid: int) -> list[str]:
    """A picture grid for each kind found (its ``grid`` surest rows), written as ``<kind>.png``."""
    by_name = {s.name: s for s in listed}
    written = []
    for kind in ("label", "leak", "near_duplicate", "outlier", *PIXEL_KINDS):
        picked = sorted((r for r in rows if r["issue"] == kind), key=lambda r: -r["score"])[:grid]
        if not picked or grid <= 0:
            continue
        items = []
        for r in picked:
            images = [_read(by_name[r["split"]], r["image"])]
            if r["duplicate_of"]:
                other, name = r["duplicate_of"].split(":", 1)
                images.append(_read(by_name[other], name))
            pair = f"{r['split']} | {r['duplicate_of'].split(':')[0]}\nr = {r['score']:.3f}"
            caption = {"label": f"given {r['given_label']}\nsuggested {r['suggested_label']}"}.get(
                kind, pair if r["duplicate_of"] else f"given {r['given_label']}\nscore {r['score']:.3f}")
            items.append((images, caption))
        path = output / f"{kind}.png"
        draw_grid(path, items, f"{kind.replace('_', ' ')}: the {len(picked)} surest ({KINDS[kind]})")
        written.append(path.name)
    return written


def _write_clean_list(path: Path, listed: list[Split], rows: list[dict[str, Any]], classes: list[str]) -> list[str]:
    """The first split's images without those flagged (label issues, outliers, unreadable, the later image of each
    near-duplicate pair within it, each of its images that has a copy in another split) into ``path``; beside it, each
    other split whole as ``<split>.csv`` (its test score stays comparable; :func:`_check` refused existing files).
    The other splits' files written."""
    split = listed[0]
    kept_kinds = {"leak", *(k for k in PIXEL_KINDS if k not in NO_INFORMATION)}  # blurry, odd sizes: kept
    drop = {r["image"] for r in rows if r["split"] == split.name and r["issue"] not in kept_kinds}
    drop |= {r["duplicate_of"].split(":", 1)[1] for r in rows
             if r["issue"] == "leak" and r["duplicate_of"].split(":", 1)[0] == split.name}
    keep = [i for i, name in enumerate(split.names) if name not in drop]
    write_clean(path, [split.files[i] for i in keep], [label_cell(split.labels[i], classes) for i in keep])
    written = []
    for other in listed[1:]:
        beside = path.with_name(f"{Path(other.name).name}.csv")
        if beside != path and other.files is not None:
            write_clean(beside, other.files, [label_cell(label, classes) for label in other.labels])
            written.append(beside.name)
    return written
