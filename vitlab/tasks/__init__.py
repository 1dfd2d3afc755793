"""Every kind of run, one entry each in :mod:`.registry` (its data section, models, builder, config checks and
``vitlab eval``), which the config, the training loop and evaluation consult. What the loop needs from a task, what a
resumed task is given and what ``vitlab eval`` asks of one (:mod:`.base`); the tasks: image classification
(:mod:`.classification`, single- and multi-label, :mod:`.multilabel`), sequence-to-sequence (:mod:`.seq2seq`),
language modelling (:mod:`.lm`), and pretraining a ViT backbone without labels, masked autoencoding (:mod:`.mae`)
and self-distillation (:mod:`.dino`), with what they share (:mod:`.pretraining`: unlabelled images, views, the k-NN
monitor). The image data every image task and job reads (splits, loaders, shards) is :mod:`.image_data`. A task
builds its model (:mod:`vitlab.models`) and data (:mod:`vitlab.data`), says how to compute the loss and how to score;
it reads its config's schema (:mod:`vitlab.schema`) and never imports the engine (config loading, training,
checkpoints). Beside them, what the classification task and ``vitlab eval`` share: distillation from a teacher
(:mod:`.distill`), temperature scaling and the calibration error (:mod:`.calibration`), k-NN by the pooled features
(:mod:`.knn`) and the linear probe on cached features (:mod:`.linear_probe`)."""
from .base import EvalRequest, Resumed, TaskSetup, build_model

__all__ = ["TaskSetup", "Resumed", "EvalRequest", "build_model"]
