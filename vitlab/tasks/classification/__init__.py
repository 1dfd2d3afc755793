"""Image classification as a training task, a module a job:

- :mod:`.splits`: the splits from their listing (held-out test, training subset, validation images, class
  counts), checked before any image is decoded, and their decoding;
- :mod:`.data`: memory or streaming, training's transform, the device-resident loader or the DataLoader;
- :mod:`.shards`: WebDataset shards and streamed Hugging Face splits, listed once and read in order;
- :mod:`.losses`: cross-entropy and its variants (class weights, logit adjustment);
- :mod:`.metrics`: what an evaluation reports, from the one gathered forward pass;
- :mod:`.task`: the task itself, single-label or multi-label (decided once, from the training labels).

What evaluation shows a model and test-time augmentation are :mod:`vitlab.inference`'s, shared with ``vitlab
eval``, ``predict`` and ``embed``.
"""
from ...inference.tta import five_crops_tta, flip_tta, tta_logits
from ...inference.view import crops_view_size, eval_dataset, eval_view
from ...runtime import gather_uneven, listed_once
from .data import build_loaders, in_memory, resolve_loader, train_transform_of
from .losses import class_weights, classification_criterion, logit_adjustment
from .metrics import SCORES, evaluate_classifier, metrics_from_predictions, report_metrics
from .shards import index_stream, shard_streams, streamed_in_shards
from .splits import class_counts, index_splits, load_test_data, load_train_val_data, require_trained_classes, \
    training_class_counts
from .task import image_classification_task

__all__ = ["image_classification_task", "resolve_loader", "in_memory", "index_splits", "shard_streams",
           "load_train_val_data", "load_test_data", "eval_dataset", "eval_view", "evaluate_classifier",
           "metrics_from_predictions", "report_metrics", "gather_uneven", "training_class_counts", "class_counts",
           "require_trained_classes", "logit_adjustment", "class_weights", "flip_tta", "five_crops_tta", "tta_logits",
           "listed_once", "classification_criterion", "streamed_in_shards", "index_stream", "crops_view_size",
           "build_loaders", "train_transform_of", "SCORES"]
