"""Predictions over many images (``vitlab predict``): files, folders and globs, or a split of a data set named
by ``data.*`` keys as in training (a Hugging Face data set, a folder of class folders, a csv table, WebDataset
shards), read in batches by DataLoader workers with the checkpoint's own preprocessing, into a CSV, JSON-lines
or parquet file, a row an image (a data set's image named by its key: its path in the split's folder, its row
number, ``<shard>:<position>``).

The job holds one batch of images at a time, whatever the number of files; rows reach ``OUTPUT.partial`` as
each batch is done and the file is renamed to ``OUTPUT`` when all are, so a job stopped and started again
with the same inputs and output continues after the last row written (no row twice, none missing); the job that
writes them is recorded beside them, and another job is refused. An image that cannot be read is a row with its
error, not the end of the job; the count of such rows is printed at the end. Each image is read as ``vitlab
eval`` reads a split's (:mod:`vitlab.inference`: its decode size, EXIF rule, a JPEG decoded only as large as
needed, eval's crop or resize, the normalization), so its probabilities are those eval gives it. The files'
layouts are :mod:`vitlab.inference.files`'.
"""
from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from .data.folder import IMAGE_EXTENSIONS, FolderFiles
from .data.shards import ShardIndex
from .data.split import SplitIndex
from .data.transforms import ModelInput, decode_size, decode_upright
from .errors import ConfigError, DataError
from .inference.files import columns, csv_lines, job_file, job_record, open_partial, resume_rows, rows, \
    text_line, to_npy, to_parquet
from .inference.forward import ChunkedForward, cpu_chunk, feature_model, logits_and_features, pooled_features
from .inference.open_set import UnknownRule, stored_rule
from .inference.tta import tta_logits
from .inference.view import crops_view_size, eval_view, model_dataset
from .progress import Progress
from .runtime import autocast_dtype, default_device, listed_once, processes
from .tasks.image_data import streamed_in_shards

__all__ = ["list_images", "data_split", "image_dataset", "predict_images", "embed_images", "BatchPredictor",
           "default_device", "autocast_dtype", "FORMATS", "EMBED_FORMATS"]

FORMATS = (".csv", ".jsonl", ".parquet")
EMBED_FORMATS = (".parquet", ".jsonl", ".npy")


def list_images(inputs: list[str]) -> list[str]:
    """The image files ``inputs`` name, in order: a file as given, a folder's images (:data:`IMAGE_EXTENSIONS`,
    below it too, through linked folders as torchvision's ``ImageFolder`` goes) sorted, a glob's files sorted (``**`` reaches into folders).

    Raises:
        DataError: one line, for a path that does not exist, a folder without images, a glob that matches nothing.
    """
    files: list[str] = []
    for given in inputs:
        path = Path(given).expanduser()
        if path.is_dir():
            found = sorted(str(Path(root) / name) for root, _, names in os.walk(path, followlinks=True)
                           for name in names if Path(name).suffix.lower() in IMAGE_EXTENSIONS)
            if not found:
                raise DataError(f"the folder {given!r} holds no images ({', '.join(IMAGE_EXTENSIONS)}), in it or below it")
            files += found
        elif path.is_file():
            files.append(given)
        elif any(c in given for c in "*?["):
            found = sorted(p for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
            if not found:
                raise DataError(f"the pattern {given!r} matches no file")
            files += found
        else:
            raise DataError(f"{given!r}: no such file or folder")
    return files


def files_index(model: nn.Module, files: list[str]) -> SplitIndex:
    """``files`` listed as a split (no labels), read as the model's training read its files (EXIF rule)."""
    reader = FolderFiles([Path(f) for f in files], decode_upright(model))
    return SplitIndex(torch.zeros(len(files), dtype=torch.long), list(model.pretrained_cfg.get("label_names") or ["?"]),
                      reader.open, "the inputs", encoded=reader.encoded, read=reader.read, key=reader.key,
                      upright=reader.exif_transpose)


def data_split(model: nn.Module, keys: list[str], split: str = "",
               own_classes: bool = False) -> SplitIndex | ShardIndex:
    """The split ``split`` (default: ``data.test_split``) of the data set the ``data.*`` ``keys`` name, as
    training names one (``data.dataset=hf data.root=...``), listed (nothing decoded), its labels read through
    the model's classes where it has them (``own_classes``: its own classes, as of images of none of the model's;
    a Hugging Face split without labels is listed too); read upright as the model's training read its files.

    Shards (``data.dataset=wds``, or a streamed Hugging Face split) come as their listing (a
    :class:`~vitlab.data.shards.ShardIndex`), read in order.

    Raises:
        ConfigError, DataError: one line, for keys of no data section.
    """
    from .config import load_config
    from .data.sources import index_split

    bad = [k for k in keys if not k.startswith("data.")]
    if bad:
        raise ConfigError(f"{bad[0]!r}: predict and embed take data.* keys (the data set to read), as training does")
    d = load_config(None, [*keys, "data.download=false"] if not any(k.startswith("data.download=") for k in keys)
                    else keys).data
    cfg = model.pretrained_cfg
    classes = list(cfg["label_names"]) if cfg.get("label_names") and not own_classes else None
    if streamed_in_shards(d):
        from .tasks.image_data import index_stream

        d.exif_transpose = decode_upright(model)
        return index_stream(d, split or d.test_split, classes)
    multi = bool(cfg.get("multi_label"))
    return index_split(d.dataset, d.root, split or d.test_split, download=d.download, image_key=d.image_key,
                       label_key=d.label_key, classes=classes, exif_transpose=decode_upright(model), multi_label=multi,
                       labelled=False)


class _ShardView(IterableDataset):
    """Samples ``ids`` (ascending positions in a shard listing) as evaluation shows them (``transform`` of each
    image decoded at ``stored``), read in order; each DataLoader worker takes every ``workers``-th batch of them
    (the loader hands the workers' batches over in turn, so they come in order), reading its shards past the
    others' samples without decoding them. An unreadable image: zeros of ``shape`` and its error. Pickles."""

    def __init__(self, index: ShardIndex, ids: list[int], batch_size: int, transform: Any,
                 stored: tuple[int, int] | None, shape: tuple[int, ...]) -> None:
        self.index, self.ids, self.batch_size = index, ids, batch_size
        self.transform, self.stored, self.shape = transform, stored, shape

    def __iter__(self) -> Iterator[tuple[Tensor, str]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = [i for k, i in enumerate(self.ids) if k // self.batch_size % workers == worker]
        first = 0
        for shard, count in enumerate(self.index.counts):
            wanted = [i - first for i in mine if first <= i < first + count]
            first += count
            if not wanted:
                continue
            keep = set(wanted)
            for position, sample in enumerate(self.index.read(shard, wanted[0], wanted[-1] + 1), wanted[0]):
                if position in keep:
                    try:
                        yield self.transform(self.index.decode(sample, self.stored)), ""
                    except DataError as e:
                        yield torch.zeros(self.shape, dtype=torch.uint8), str(e)


class _Guarded(Dataset):
    """A dataset's images, with the error of one that cannot be read (then zeros of ``shape``) instead of
    raising it; a plain object, so it pickles for workers of any start method."""

    def __init__(self, images: Dataset, shape: tuple[int, ...]) -> None:
        self.images, self.shape = images, shape

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[Tensor, str]:
        try:
            return self.images[i][0], ""
        except DataError as e:
            return torch.zeros(self.shape, dtype=torch.uint8), str(e)


def embed_images(model: nn.Module, inputs: list[str], output: str | Path, batch_size: int = 64,
                 num_workers: int = 2, device: str | torch.device | None = None,
                 stop_after_batches: int | None = None, data: Sequence[str] | SplitIndex | ShardIndex = (),
                 split: str = "", precision: str = "run", max_pixels: int = 0) -> dict[str, int]:
    """The pooled pre-logits features (:func:`~vitlab.tasks.knn.pooled_features`: what a backbone is used for
    besides its head, search, clustering, deduplication) of every image ``inputs`` name, as
    :func:`predict_images` reads and batches them (eval's preprocessing, any number of processes, a stopped job
    continued), into ``output``: ``.parquet`` or ``.jsonl`` rows (``image``, ``embedding``; or ``error``), or a
    ``.npy`` float32 array ``(N, E)`` (NaN rows for unreadable images) with the paths in ``<name>.paths.txt``.
    ``data``, ``split``: a data set's split instead, as :func:`predict_images` reads one (or ``data``: a split
    already listed)."""
    return predict_images(model, inputs, output, batch_size, num_workers, device=device,
                          stop_after_batches=stop_after_batches, embed=True, data=data, split=split,
                          precision=precision, max_pixels=max_pixels)


def _check_request(model: nn.Module, out: Path | None, topk: int, embed: bool, inputs: list[str],
                   data: Sequence[str], max_pixels: int = 0) -> list[str]:
    """What a job asks for, checked before anything is read: the class names a prediction needs (returned), an
    output of a format that holds its rows, ``topk`` of 1 or more, images or a data set (not both)."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    if max_pixels < 0:
        raise ConfigError(f"--max-image-pixels {max_pixels}: give a number of pixels (width x height), or 0 for no "
                          f"limit")
    if not embed and topk < 1:
        raise ConfigError(f"--topk {topk}: give how many classes a row lists, 1 or more")
    names = cfg.get("label_names") or ([] if embed else None)
    if names is None:
        raise ConfigError("the checkpoint holds no class names (label_names); predict needs a classifier trained "
                          "or saved by vitlab")
    formats = EMBED_FORMATS if embed else FORMATS
    if embed and out is None:
        raise ConfigError(f"vitlab embed writes the features to a file: give --output FILE ({', '.join(formats)})")
    if out is not None and out.suffix not in formats:
        raise ConfigError(f"--output {out}: write {'embeddings' if embed else 'predictions'} as {', '.join(formats)} "
                          f"(by the file's suffix)")
    if out is not None and out.suffix == ".parquet":
        try:
            import pyarrow.json  # noqa: F401  (the rows become a parquet file at the end)
        except ImportError:
            raise ConfigError(f"--output {out}: parquet files are written with pyarrow: pip install pyarrow "
                              f"(or 'vitlab[hf]', which brings it)") from None
    if data and inputs:
        raise ConfigError(f"give image files, folders and globs ({inputs[0]!r}, ...) or a data set (data.* keys), "
                          f"not both")
    return list(names)


def _listing(model: nn.Module, inputs: list[str], data: Sequence[str] | SplitIndex | ShardIndex, split: str,
             world: int) -> tuple[SplitIndex | ShardIndex | None, list[str]]:
    """The data set's listing (None for files) and every image's name, in the job's order. A data set's split is
    listed by every process (its listing holds readers, which do not travel); files by process 0 alone."""
    index = data if isinstance(data, (SplitIndex, ShardIndex)) else data_split(model, list(data), split) if data \
        else None
    if isinstance(index, ShardIndex):  # a sample of shards is named by its shard and its position in it
        return index, [f"{Path(url).name}:{i}" for url, count in zip(index.urls, index.counts) for i in range(count)]
    if index is not None:
        return index, [index.key(i) for i in range(len(index))]
    return None, listed_once(lambda: list_images(inputs), world)


def image_dataset(model: nn.Module, index: SplitIndex | ShardIndex | None, files: list[str], ids: list[int],
                  batch_size: int, tta: str, max_pixels: int = 0) -> Any:
    """This process's images ``ids`` (positions in ``files``) as evaluation shows them (:mod:`vitlab.inference.view`;
    five-crop TTA's larger view), an unreadable one (or, with ``max_pixels``, one whose header gives more pixels) as
    zeros and its error."""
    cfg = model.pretrained_cfg
    size = tuple(cfg["input_size"][1:])
    view = crops_view_size(size, cfg.get("crop_pct")) if tta == "crops" else size
    if max_pixels and isinstance(index, ShardIndex):
        raise ConfigError(f"--max-image-pixels {max_pixels}: shards are read as they stream, without a header check; "
                          f"leave it out for data.dataset=wds")
    if isinstance(index, ShardIndex):
        stored = None if cfg.get("crop_pct") else (decode_size(model) or size)
        return _ShardView(index, ids, batch_size, eval_view(size, stored, cfg.get("crop_pct"), tta), stored, (3, *view))
    part = files_index(model, [files[i] for i in ids]) if index is None else \
        index.subset(torch.tensor(ids, dtype=torch.long), index.where)
    part.max_pixels = max_pixels or part.max_pixels
    return _Guarded(model_dataset(model, part, tta), (3, *view)) if ids else []


@torch.no_grad()  # not inference_mode: torch 2.4's all_gather_object failed under it
def predict_images(model: nn.Module, inputs: list[str], output: str | Path | None = None, batch_size: int = 64,
                   num_workers: int = 2, topk: int = 5, device: str | torch.device | None = None,
                   stop_after_batches: int | None = None, tta: str = "none", embed: bool = False,
                   data: Sequence[str] | SplitIndex | ShardIndex = (), split: str = "",
                   precision: str = "run", max_pixels: int = 0, unknown: str = "auto",
                   unknown_label: str = "unknown") -> dict[str, int]:
    """Predict every image ``inputs`` name (:func:`list_images`), or, with ``data`` (``data.*`` keys as in
    training), every image of that data set's ``split`` (:func:`data_split`), with ``model`` (from
    :func:`vitlab.load_model`), ``batch_size`` at a time, read by ``num_workers`` DataLoader workers, on ``device``
    (default: :func:`~vitlab.runtime.default_device`) at ``precision`` (:func:`~vitlab.runtime.autocast_dtype`: by
    default the checkpoint's training precision, as ``vitlab eval`` runs it, so the probabilities are eval's). Rows
    go to ``output`` (``.csv``, ``.jsonl``, ``.parquet``: :mod:`vitlab.inference.files`), or without one to stdout
    as ``path: class p, ...`` lines. A single-label model's row holds its ``topk`` classes, their indices and
    probabilities (softmax, at its calibrated temperature); a multi-label model's, the classes at or above its
    thresholds (``vitlab calibrate``; else 0.5) and every class's sigmoid. ``unknown='auto'``: with the threshold
    ``vitlab calibrate --unknown`` kept, a row also holds ``unknown_score`` and its ``label``, ``unknown_label`` below
    the threshold, else its top class ('on': a model without one refused; 'off': neither).

    Under ``torchrun`` or ``accelerate launch`` every process reads and predicts its part of each global batch
    (``batch_size`` a process, contiguous parts), and process 0 writes all the rows, in the inputs' order: the
    output does not depend on the number of processes, and a job may continue on another number.
    ``embed``: rows of the pooled pre-logits features instead (:func:`embed_images`). ``tta``: each image's
    probabilities are the mean of its views' (:func:`~vitlab.inference.tta.tta_logits`: ``'flip'``, ``'crops'``).
    ``max_pixels``: a file whose header gives more pixels is a row with the error (:func:`image_dataset`).
    ``stop_after_batches`` ends the job early, as an interruption would (for tests).

    Returns:
        ``{"images": ..., "unreadable": ..., "resumed": ...}``: images in the job, rows with an error, rows an
        earlier run had written.

    Raises:
        ConfigError, DataError: one line, before any image is read: an output of another format, a checkpoint
            without class names, inputs that name no image, a partial output of another job, another precision.
    """
    out = Path(output) if output is not None else None
    names = _check_request(model, out, topk, embed, inputs, data, max_pixels)
    model = feature_model(model) if embed else model  # a self-supervised run: its backbone's features
    cfg = model.pretrained_cfg
    rule, answers = (None, None) if embed else _unknown_rule(cfg, tta, unknown, unknown_label)
    lines = ".csv" if out is not None and out.suffix == ".csv" else ".jsonl"  # parquet, npy: JSON lines until the end
    rank, world, dist = processes()
    index, files = _listing(model, inputs, data, split, world)
    multi, k = bool(cfg.get("multi_label")), min(topk, len(names))
    layout = ["image", "error", "embedding"] if embed else columns(names, k, multi, rule is not None)
    header = ",".join(layout) + "\n"
    partial = out.with_name(out.name + ".partial") if out is not None else None
    device = default_device() if device is None else torch.device(device)
    dtype = autocast_dtype(model, precision, device)
    job = job_record(model, k, tta, dtype, embed, max_pixels, answers) if partial is not None and rank == 0 else {}
    done, unreadable = listed_once(lambda: resume_rows(partial, header, files, lines, job)
                                   if partial is not None and partial.is_file() else (0, 0), world)
    model = model.to(device).eval()
    chunk = _chunk(model, device, tta)
    todo = files[done:]
    mine = [i for i in range(len(todo)) if i // batch_size % world == rank]  # my part of every global batch
    loader = iter(DataLoader(image_dataset(model, index, files, [done + i for i in mine], batch_size, tta, max_pixels),
                             batch_size=batch_size, num_workers=num_workers, pin_memory=device.type == "cuda"))
    sink = open_partial(partial, job, header if lines == ".csv" else "", done) if rank == 0 else None
    predict = BatchPredictor(model, device=device, dtype=dtype, chunk=chunk, tta=tta, embed=embed, names=names, k=k,
                             unknown=rule)
    try:
        with Progress(total=len(files), initial=done, desc=f"predicting {len(files):,} images", unit="images",
                      interval=10.0, enabled=rank == 0) as progress:
            for b in range(-(-len(todo) // (batch_size * world))):  # the global batches
                if stop_after_batches is not None and b >= stop_after_batches:
                    return {"images": len(files), "unreadable": unreadable, "resumed": done}
                part = mine[b * batch_size:(b + 1) * batch_size]
                batch = predict(loader, [todo[i] for i in part]) if part else []
                batch = _all_rows(batch, dist, world)
                unreadable += sum(1 for r in batch if "error" in r)
                if rank == 0 and batch:
                    _write(sink, batch, lines, layout)
                progress.update(len(batch))
    finally:
        predict.close()
        if sink is not None:
            sink.close()
    if rank == 0:
        _finish(partial, out, len(files), done, unreadable)
    return {"images": len(files), "unreadable": unreadable, "resumed": done}


def _unknown_rule(cfg: dict[str, Any], tta: str, unknown: str, label: str) -> tuple[UnknownRule | None, Any]:
    """The rule rows answer ``unknown`` by (:func:`~vitlab.inference.open_set.stored_rule`) and what the job's
    record says of it: the rule and its label, 'off' for a model that has one, None for a model without."""
    rule = stored_rule(cfg, label, unknown)
    if rule is not None and tta != "none":
        raise ConfigError(f"--tta {tta}: the unknown threshold was fitted on the scores of the images as evaluation "
                          f"shows them, not of their views; give --tta none, or --unknown off")
    return rule, {**rule.record(None), "label": rule.label} if rule is not None else "off" if cfg.get("unknown") else None


def _chunk(model: nn.Module, device: torch.device, tta: str) -> int:
    """On a CPU, the forward pass in cache-sized chunks (TTA makes each image 2 (flip) or 5 (crops) inputs)."""
    if device.type != "cpu":
        return 0
    return max(1, cpu_chunk(model, (3, *model.pretrained_cfg["input_size"][1:])) // {"flip": 2, "crops": 5}.get(tta, 1))


def _all_rows(batch: list[dict[str, Any]], dist: Any, world: int) -> list[dict[str, Any]]:
    """Every process's rows of a global batch, in process order (the inputs' order)."""
    if dist is None:
        return batch
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, batch)
    return [r for got in gathered for r in got]


class BatchPredictor:
    """A batch's rows (:func:`~vitlab.inference.files.rows`): its images read from the loader, made the model's
    input, run (:class:`~vitlab.inference.forward.ChunkedForward`: in cache-sized chunks on a CPU) for their
    features (``embed``) or probabilities (softmax at the model's temperature, or sigmoids; ``tta``'s mean).

    Args:
        model: A trained classifier or backbone in eval mode, on ``device``.
        device: Where the forward pass runs.
        dtype: Its autocast precision (None: float32).
        chunk: Images a forward pass on a CPU (:func:`~vitlab.inference.forward.cpu_chunk`); 0: the batch whole.
        tta: Test-time augmentation (``'none'``, ``'flip'``, ``'crops'``).
        embed: Rows of pooled features instead of probabilities.
        names: The class names rows name (a multi-label model's thresholds: its own, 0.5 where it has none).
        k: Classes a single-label row lists.
        unknown: The open-set score and threshold by which a row answers ``unknown`` (None: never).
    """

    def __init__(self, model: nn.Module, *, device: torch.device, dtype: torch.dtype | None = None, chunk: int = 0,
                 tta: str = "none", embed: bool = False, names: list[str] | None = None, k: int = 1,
                 unknown: UnknownRule | None = None) -> None:
        names = list(names or [])
        cfg = model.pretrained_cfg
        self.model, self.device, self.tta, self.embed, self.names, self.k = model, device, tta, embed, names, k
        self.multi, self.size = bool(cfg.get("multi_label")), tuple(cfg["input_size"][1:])
        self.thresholds = torch.tensor(cfg.get("thresholds") or [0.5] * len(names)) if self.multi else None
        self.temperature, self.unknown = cfg.get("temperature", 1.0), unknown
        self.model_input = ModelInput(cfg["mean"], cfg["std"])
        self.forward = ChunkedForward(chunk, device, dtype)  # closed by close(), whatever happens

    def __call__(self, loader: Iterator[Any], names: list[str]) -> list[dict[str, Any]]:
        images, errors = next(loader)
        if self.embed:
            features = self.features(images)
            return [{"image": n, "error": e} if e else {"image": n, "embedding": f.tolist()}
                    for n, e, f in zip(names, errors, features)]
        probs, scores = self.predictions(images)
        answers = (scores, self.unknown.threshold, self.unknown.label) if scores is not None else None
        return rows(names, list(errors), probs, self.names, self.k, self.thresholds, answers)

    def features(self, images: Tensor) -> Tensor:
        """The pooled features, float32 ``(B, E)`` on the CPU, of uint8 images ``(B, 3, H, W)`` as eval shows them."""
        x = self.model_input(images.to(self.device, non_blocking=True))
        return self.forward(lambda c: pooled_features(self.model, c).float().cpu(), x)

    def probabilities(self, images: Tensor) -> Tensor:
        """The class probabilities, float32 ``(B, K)`` on the CPU (softmax at the temperature; sigmoids), of uint8
        images ``(B, 3, H, W)`` as eval shows them."""
        return self.predictions(images)[0]

    def predictions(self, images: Tensor) -> tuple[Tensor, Tensor | None]:
        """:meth:`probabilities` and, with an ``unknown`` rule, each image's open-set score ``(B,)`` (of its raw
        logits, or of its pooled features: a second forward pass), on the CPU."""
        x = self.model_input(images.to(self.device, non_blocking=True))
        features = None
        if self.unknown is not None and self.unknown.needs_features:  # both from one pass through the blocks
            both = self.forward(lambda c: torch.cat([t.float() for t in logits_and_features(self.model, c)], 1).cpu(),
                                x)
            logits, features = both[:, :len(self.names)], both[:, len(self.names):]
        else:
            logits = self.forward(lambda c: tta_logits(self.model, c, self.tta, self.multi, self.size).float().cpu(), x)
        probs = logits.sigmoid() if self.multi else (logits / self.temperature).softmax(-1)
        return probs, None if self.unknown is None else self.unknown.scores(logits, features)

    def close(self) -> None:
        self.forward.close()


def _write(sink: Any, batch: list[dict[str, Any]], lines: str, layout: list[str]) -> None:
    """A batch's rows to the partial file (flushed: a job stopped later keeps them), or as lines to stdout."""
    if sink is None:
        print("\n".join(text_line(r) for r in batch), flush=True)
        return
    sink.write("".join(json.dumps(r) + "\n" for r in batch) if lines == ".jsonl" else csv_lines(batch, layout))
    sink.flush()


def _finish(partial: Path | None, out: Path | None, images: int, done: int, unreadable: int) -> None:
    """The finished job's partial file in its final form and place (parquet, npy: converted), its job record gone,
    and its line: how many images, how many rows came from the run before, how many could not be read."""
    if partial is not None:
        if out.suffix == ".parquet":
            to_parquet(partial, out)
        elif out.suffix == ".npy":
            to_npy(partial, out)
        else:
            os.replace(partial, out)
        job_file(partial).unlink(missing_ok=True)
    if unreadable or partial is not None:
        print(f"{images:,} images" + (f" -> {out}" if out is not None else "")
              + (f" ({done:,} rows from the run before)" if done else "")
              + (f"; {unreadable} could not be read (their rows give the error)" if unreadable else ""),
              file=sys.stderr if out is None else sys.stdout)
