"""What the training loop needs from each task: image classification and sequence-to-sequence.
A task builds its model (:mod:`vitlab.models`) and data (:mod:`vitlab.data`), says how to compute the
loss and how to score; it never imports the engine (config, training, checkpoint) at run time."""
from .base import TaskSetup, build_model

__all__ = ["TaskSetup", "build_model"]
