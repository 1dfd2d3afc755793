"""The files of predictions and embeddings, their layouts stated once:

- ``vitlab eval --predictions``: every image of a split, its true class (or label set), the prediction and every
  class's probability (:func:`write_eval_predictions`), a file any metric can be recomputed from;
- ``vitlab predict``: a row an image, its top ``k`` classes, their indices and probabilities (a multi-label model:
  the classes at or above its thresholds and every class's probability), or its error, as CSV, JSON lines or
  parquet (:func:`columns`, :func:`rows`, :func:`csv_lines`, :func:`to_parquet`);
- ``vitlab embed``: a row an image and its features, or an ``.npy`` array with the paths beside it (:func:`to_npy`).

A set of labels in a CSV cell is a JSON list (:func:`~vitlab.data.table.label_set_cell`), which reads back as
it was. Every file is written whole, or row by row into ``FILE.partial`` and renamed into place; the job that
writes a partial file is recorded beside it (:func:`job_record`), and only that job continues it
(:func:`resume_rows`)."""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..data.table import label_set_cell
from ..errors import ConfigError, DataError
from ..files import replaced
from ..models.calibrated import weights_digest
from ..models.hub import read_json, write_json

__all__ = ["write_eval_predictions", "columns", "rows", "csv_lines", "text_line", "to_parquet", "to_npy", "job_record",
           "job_file", "resume_rows", "open_partial"]


def write_eval_predictions(path: Path, key: Any, labels: Any, probs: Any, classes: list[str],
                       thresholds: Any = None) -> None:
    """``path`` (CSV, written whole, then renamed into place): ``image`` (``key(i)``), ``label``, ``prediction``
    and a ``prob_<class>`` column for every class, one row an image in the split's order. Multi-label
    (``labels`` ``(N, K)``): ``labels`` and ``predicted`` (the classes at or above ``thresholds``, else 0.5),
    each a JSON list of names, and each class's sigmoid."""
    if key is None or len(labels) != len(probs):
        raise ConfigError(f"--predictions: the split names {0 if key is None else len(labels)} images and "
                          f"{len(probs)} were evaluated")
    multi = labels.ndim == 2
    path.parent.mkdir(parents=True, exist_ok=True)
    with replaced(path) as tmp, tmp.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["image", *(("labels", "predicted") if multi else ("label", "prediction")),
                         *(f"prob_{c}" for c in classes)])
        if multi:
            chosen = probs >= (0.5 if thresholds is None else thresholds)
            named = lambda row: label_set_cell([c for c, on in zip(classes, row) if on])
            columns = zip(map(named, labels.bool().tolist()), map(named, chosen.tolist()), probs.tolist())
        else:
            columns = zip((classes[k] for k in labels.tolist()), (classes[k] for k in probs.argmax(1).tolist()),
                          probs.tolist())
        for i, (label, predicted, row) in enumerate(columns):
            writer.writerow([key(i), label, predicted, *(f"{p:.9g}" for p in row)])


def columns(names: list[str], k: int, multi_label: bool, unknown: bool = False) -> list[str]:
    if multi_label:
        return ["image", "error", "labels", *(f"prob_{c}" for c in names)]
    answer = ["label", "unknown_score"] if unknown else []
    return ["image", "error", *answer, *(f"{what}_{r}" for r in range(1, k + 1) for what in ("class", "index", "prob"))]


def rows(files: list[str], errors: list[str], probs: Tensor, names: list[str], k: int,
          thresholds: Tensor | None, unknown: tuple[Tensor, float, str] | None = None) -> list[dict[str, Any]]:
    """An output row of each image: its top ``k`` (single-label), or the classes at or above ``thresholds``
    and every class's probability (multi-label); an unreadable image's row holds its error only. The batch's
    top k and thresholds are taken at once (one per row cost more than the forward pass of a small image).
    ``unknown``: each image's open-set score, the threshold and the name of an image below it: a single-label row
    then also holds its ``label`` (that name below the threshold, else its top class) and ``unknown_score``."""
    if unknown is not None and thresholds is None:
        scores, threshold, label = unknown
        top = probs.argmax(1).tolist()
        answered = [(label if s < threshold else names[t], s) for s, t in zip(scores.tolist(), top)]
        return [r if "error" in r else {"image": r["image"], "label": a, "unknown_score": s, **r}
                for r, (a, s) in zip(rows(files, errors, probs, names, k, None), answered)]
    out: list[dict[str, Any]] = []
    if thresholds is not None:
        for path, error, p, above in zip(files, errors, probs.tolist(), (probs >= thresholds).tolist()):
            out.append({"image": path, "error": error} if error else
                        {"image": path, "labels": [n for n, a in zip(names, above) if a], "probs": dict(zip(names, p))})
        return out
    values, indices = probs.topk(k, dim=1)
    for path, error, top, index in zip(files, errors, values.tolist(), indices.tolist()):
        out.append({"image": path, "error": error} if error else
                    {"image": path, "classes": [names[i] for i in index], "indices": index, "probs": top})
    return out


def csv_lines(rows: list[dict[str, Any]], columns: list[str]) -> str:
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    for row in rows:
        flat: dict[str, Any] = {"image": row["image"], "error": row.get("error", "")}
        if "label" in row:
            flat.update({"label": row["label"], "unknown_score": f"{row['unknown_score']:.6g}"})
        if "labels" in row:
            flat["labels"] = label_set_cell(row["labels"])
            flat.update({f"prob_{c}": f"{v:.6g}" for c, v in row["probs"].items()})
        elif "classes" in row:
            for r, (c, i, v) in enumerate(zip(row["classes"], row["indices"], row["probs"]), 1):
                flat.update({f"class_{r}": c, f"index_{r}": i, f"prob_{r}": f"{v:.6g}"})
        writer.writerow([flat.get(c, "") for c in columns])
    return text.getvalue()


def text_line(row: dict[str, Any]) -> str:
    """``path: class p, class p, ...`` (the top k, or the classes at or above their thresholds)."""
    if "error" in row:
        return f"{row['image']}: error: {row['error']}"
    if "labels" in row:
        shown = [f"{c} {row['probs'][c]:.3f}" for c in row["labels"]]
        return f"{row['image']}: " + (", ".join(shown) if shown else "no class")
    top = ", ".join(f"{c} {v:.3f}" for c, v in zip(row["classes"], row["probs"]))
    if "label" in row and row["label"] != row["classes"][0]:  # below the unknown threshold
        return f"{row['image']}: {row['label']} (score {row['unknown_score']:.4g}); {top}"
    return f"{row['image']}: {top}"


def to_parquet(partial: Path, out: Path) -> None:
    """The finished job's JSON lines as one parquet file (written whole, then renamed into place)."""
    import pyarrow.json
    import pyarrow.parquet

    table = pyarrow.json.read_json(partial)
    with replaced(out) as tmp:
        pyarrow.parquet.write_table(table, tmp)
    partial.unlink()


def to_npy(partial: Path, out: Path) -> None:
    """The finished job's embeddings as one float32 array ``(N, E)`` in ``out`` (a row of NaN for an image that
    could not be read) and their paths, a line each in the same order, in ``out``'s ``.paths.txt``. Read a row at
    a time, twice (the shape, then the rows into the file), so the memory it takes is a row's, not the array's."""
    import numpy as np

    rows, width = 0, 0
    with open(partial) as f:
        for line in f:
            rows += 1
            if not width and '"embedding"' in line:
                width = len(json.loads(line)["embedding"])
    paths = out.with_suffix(".paths.txt")
    tmp = out.with_name(out.name + ".tmp")
    array = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(rows, width))
    with open(partial) as f, open(paths.with_name(paths.name + ".tmp"), "w") as names:
        for i, line in enumerate(f):
            row = json.loads(line)
            array[i] = row["embedding"] if "embedding" in row else np.nan
            names.write(row["image"] + "\n")
    array.flush()
    del array
    os.replace(paths.with_name(paths.name + ".tmp"), paths)
    os.replace(tmp, out)
    partial.unlink()


def job_record(model: nn.Module, k: int, tta: str, dtype: torch.dtype | None, embed: bool,
               max_pixels: int = 0, unknown: dict[str, Any] | str | None = None) -> dict[str, Any]:
    """What decides a job's rows besides its inputs: the weights (a digest of every tensor), the checkpoint's
    record (classes, preprocessing, temperature, thresholds: a digest of ``pretrained_cfg``), what a row holds
    (embeddings or predictions, top ``k``), the test-time augmentation, the precision, and a pixel limit where one
    is set (``max_pixels``: which images are rows of an error; absent when 0, as in the records written before it),
    and how rows answer ``unknown`` (``unknown``: the rule and its label, or 'off' for a model that has one)."""
    record = json.dumps(getattr(model, "pretrained_cfg", None) or {}, sort_keys=True, default=str)
    return {"rows": "embeddings" if embed else "predictions", "topk": None if embed else k, "tta": tta,
            "precision": str(dtype or torch.float32).removeprefix("torch."), "weights": weights_digest(model),
            "checkpoint record": hashlib.sha256(record.encode()).hexdigest(),
            **({"max_pixels": max_pixels} if max_pixels else {}), **({"unknown": unknown} if unknown else {})}


def job_file(partial: Path) -> Path:
    return partial.with_name(partial.name + ".job.json")


def csv_records(text: str) -> tuple[list[list[str]], int]:
    """The whole records of CSV ``text`` (as ``csv.writer`` writes them: a field holding a newline is quoted, a
    quote doubled) and the characters they take: a record ends at a newline outside quotes. Lines are not split
    at the other line breaks Python knows (U+2028, form feeds), which a file name may hold."""
    records, start, end = [], 0, 0
    for line in text.split("\n")[:-1]:
        end += len(line) + 1
        if text.count('"', start, end) % 2 == 0:  # the quotes balance: the record is whole
            records.append(next(csv.reader(io.StringIO(text[start:end], newline=""))))
            start = end
    return records, start


def resume_rows(partial: Path, header: str, files: list[str], suffix: str, job: dict[str, Any]) -> tuple[int, int]:
    """How many rows ``partial`` (an earlier run of the same job) holds whole, after cutting a row it was
    stopped in the middle of, and how many of them are errors; it must have been written by ``job``
    (:func:`_job`, recorded beside it) and hold ``header`` (CSV) and the rows of the first ``files``, in order.

    Raises:
        DataError: one line, if it was written by another job, for other inputs or another output format.
    """
    said = read_json(job_file(partial)) if job_file(partial).is_file() else None
    if said != job:
        differ = ["no record of the job that wrote it"] if said is None else \
            [f"{key} {said.get(key)} there, {value} now" if key not in ("weights", "checkpoint record") else
             f"another checkpoint ({key})" for key in sorted(job.keys() | said.keys())
             if said.get(key) != (value := job.get(key))]
        raise DataError(f"{partial} holds rows of another job ({'; '.join(differ)}); run the job it was started with "
                        f"to continue it, or remove it to start again")
    data = partial.read_bytes()
    text = data.decode()
    if suffix == ".csv":
        records, whole = csv_records(text)
        if not records or ",".join(records[0]) + "\n" != header:
            raise DataError(f"{partial} holds another job's rows (its header differs); remove it to start again")
        rows = [dict(zip(("image", "error"), r)) for r in records[1:]]
    else:  # JSON escapes every line break inside a row
        whole = text.rfind("\n") + 1
        rows = [json.loads(line) for line in text[:whole].split("\n")[:-1]]
    images = [row["image"] for row in rows]
    if images != files[:len(images)]:
        raise DataError(f"{partial} was written for other inputs (its row {len(images)} is not {files[len(images) - 1]!r}); "
                        f"give the inputs it was started with, or remove it to start again")
    kept = len(text[:whole].encode())  # a row stopped mid-write is written again
    if kept != len(data):
        with partial.open("r+b") as f:
            f.truncate(kept)
    return len(images), sum(1 for row in rows if row.get("error"))


def open_partial(partial: Path | None, job: dict[str, Any], header: str, done: int) -> Any:
    """The partial file the rows are appended to (None: to stdout), its job recorded beside it and its CSV header
    written when it starts."""
    if partial is None:
        return None
    partial.parent.mkdir(parents=True, exist_ok=True)
    if done == 0:  # the job that writes the rows, recorded before the first of them
        write_json(job_file(partial), job)
    sink = partial.open("a", newline="")
    if done == 0 and header:
        sink.write(header)
    return sink
