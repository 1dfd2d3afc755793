"""The image data of every image task and job: what image classification trains on, what MAE and DINO pretrain
on and their k-NN monitors vote with, what ``vitlab eval``, ``predict``, ``embed`` and ``inspect`` read.

- :mod:`.splits`: the splits from their listing (held-out test, training subset, validation images, class
  counts), checked before any image is decoded, and their decoding;
- :mod:`.loaders`: memory or streaming, training's transform, the device-resident loader or the DataLoader;
- :mod:`.shards`: WebDataset shards and streamed Hugging Face splits, listed once and read in order.

What evaluation shows a model is :mod:`vitlab.inference`'s.
"""
from .loaders import build_loaders, device_eval_data, in_memory, resolve_loader, train_transform_of
from .shards import index_stream, shard_streams, streamed_in_shards
from .splits import class_counts, decode_size_of, index_splits, load_test_data, load_train_val_data, \
    require_trained_classes, streamed_at_own_size, training_class_counts

__all__ = ["index_splits", "load_train_val_data", "load_test_data", "class_counts", "training_class_counts",
           "require_trained_classes", "decode_size_of", "streamed_at_own_size", "build_loaders", "device_eval_data",
           "in_memory", "resolve_loader", "train_transform_of", "shard_streams", "index_stream", "streamed_in_shards"]
