"""Images read as shards, in order (``data.dataset=wds``, or a Hugging Face split with ``data.streaming=true``):
their listing, made once and shared by the processes, and the streams of the training, validation and test
images, each process and worker reading its part of every global batch."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...data.rules import streamed_in_shards
from ...data.shard_stream import ShardStream, spread
from ...data.shards import ShardIndex, index_shards
from ...data.transforms import CIFAR10_MEAN
from ...errors import ConfigError
from ...inference.view import eval_view
from ...runtime import listed_once
from .loaders import train_transform_of
from .splits import decode_size_of

if TYPE_CHECKING:
    from ...schema import DataConfig

__all__ = ["streamed_in_shards", "index_stream", "shard_streams"]


def index_stream(d: DataConfig, split: str, classes: list[str] | None) -> ShardIndex:
    """The listing of ``split`` read as shards: WebDataset tars (their index, or read through), or a streamed
    Hugging Face split; labels through ``classes`` (the training split's), where given."""
    if d.dataset == "wds":
        return index_shards(d.root, split, classes, d.exif_transpose)
    from ...data.hf import index_hf_stream

    return index_hf_stream(d.root, split, image_key=d.image_key, label_key=d.label_key, classes=classes,
                           exif_transpose=d.exif_transpose)


def shard_streams(d: DataConfig, seed: int, size: tuple[int, int], batch_size: int, num_processes: int = 1,
                  process_index: int = 0,
                  classes: list[str] | None = None, splits: tuple[str, ...] = ("train", "val", "test"),
                  partitions: int = 0, mean: tuple[float, ...] = CIFAR10_MEAN, train_view: Any = None,
                  ) -> tuple[dict[str, ShardStream], list[str]]:
    """``data.dataset=wds`` or a streamed ``hf``: the streams of the ``splits`` asked for, and the class names. The
    validation images (``data.val_size``) are the heads of the training shards (:func:`spread`), read
    in order for evaluation and passed over by training; ``data.train_subset`` / ``test_subset`` take
    the next ones likewise. Shards are listed (labels checked) before any image is decoded. ``batch_size``
    is this process's; ``partitions``: the training plan's (0: ``data.partitions``, else processes x workers).
    ``train_view``: the training samples' view instead of the data's training transform (a self-supervised task's:
    its images decoded first, then viewed)."""
    stored = decode_size_of(d, size, keep_in_memory=False)
    common = dict(seed=seed, num_processes=num_processes, process_index=process_index, num_workers=d.num_workers)
    streams: dict[str, ShardStream] = {}
    train = listed_once(lambda: index_stream(d, d.train_split, classes), num_processes)
    held = spread(d.val_size, train.counts)
    rest = [c - k for c, k in zip(train.counts, held)]
    used = spread(d.train_subset, rest) if d.train_subset else rest
    if d.val_size and sum(held) >= len(train):
        raise ConfigError(f"data.val_size={d.val_size} leaves no training images ({train.where} hold {len(train)})")
    crop_pct = d.crop_pct if d.train_crop != "pad" else None
    evaluation = eval_view(size, stored, crop_pct)
    lazy_eval = d.scaled_decode and crop_pct is not None  # the center crop decodes each file at the scale it needs
    if "train" in splits:
        view = train_view if train_view is not None else train_transform_of(d, size, stored, mean)
        streams["train"] = ShardStream(train, [(s, k, k + u) for s, (k, u) in enumerate(zip(held, used))],
                                       view, batch_size, True, stored,
                                       shuffle_buffer=d.shuffle_buffer, partitions=partitions or d.partitions,
                                       lazy=d.scaled_decode and d.train_crop == "rrc" and train_view is None, **common)
    if "val" in splits and d.val_size:
        streams["val"] = ShardStream(train, [(s, 0, k) for s, k in enumerate(held)], evaluation, batch_size, False,
                                     stored, lazy=lazy_eval, **common)
    if "test" in splits:
        test = listed_once(lambda: index_stream(d, d.test_split, train.classes), num_processes)
        take = spread(d.test_subset, test.counts) if d.test_subset else test.counts
        streams["test"] = ShardStream(test, [(s, 0, k) for s, k in enumerate(take)], evaluation, batch_size, False,
                                      stored, lazy=lazy_eval, **common)
    return streams, train.classes
