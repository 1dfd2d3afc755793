"""Image classification as a training task, a module a job:

- :mod:`.task`: the task itself, single-label or multi-label (decided once, from the training labels), and its
  config check;
- :mod:`.losses`: cross-entropy and its variants (class weights, logit adjustment);
- :mod:`.metrics`: what an evaluation reports, from the one gathered forward pass;
- :mod:`.evaluation`: ``vitlab eval`` of a classifier run.

Its images (splits, loaders, shards) are every image task's, :mod:`vitlab.tasks.image_data`; what evaluation shows a
model and test-time augmentation are :mod:`vitlab.inference`'s, shared with ``vitlab predict`` and ``embed``.
"""
from .losses import class_weights, classification_criterion, logit_adjustment
from .metrics import SCORES, evaluate_classifier, metrics_from_predictions, report_metrics
from .task import check_classification, image_classification_task

__all__ = ["image_classification_task", "check_classification", "evaluate_classifier", "metrics_from_predictions",
           "report_metrics", "logit_adjustment", "class_weights", "classification_criterion", "SCORES"]
