"""What a trained model makes of images, the same in every command: the one evaluation view (:mod:`.view`),
test-time augmentation (:mod:`.tta`), the forward passes gathered over processes or run in CPU chunks
(:mod:`.forward`) and the files of predictions and embeddings (:mod:`.files`). Training's evaluations,
``vitlab eval``, ``calibrate``, ``predict``, ``embed`` and k-NN all read images through it."""
from .forward import ChunkedForward, cpu_chunk, gathered, pooled_features
from .tta import five_crops_tta, flip_tta, tta_logits
from .view import crops_view_size, eval_dataset, eval_view, model_dataset

__all__ = ["eval_view", "eval_dataset", "model_dataset", "crops_view_size", "tta_logits", "flip_tta",
           "five_crops_tta", "gathered", "pooled_features", "ChunkedForward", "cpu_chunk"]
