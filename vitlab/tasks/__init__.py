"""What the training loop needs from each task (:mod:`.base`): image classification (:mod:`.classification`,
single- and multi-label, :mod:`.multilabel`), sequence-to-sequence (:mod:`.seq2seq`), language modelling
(:mod:`.lm`), and pretraining a ViT backbone without labels, masked autoencoding (:mod:`.mae`) and
self-distillation (:mod:`.dino`), with what they share (:mod:`.pretraining`: unlabelled images, views, the k-NN
monitor). A task builds its model (:mod:`vitlab.models`) and data (:mod:`vitlab.data`), says how to compute
the loss and how to score; it never imports the engine (config, training, checkpoint) at run time. Beside them,
what the classification task and ``vitlab eval`` share: distillation from a teacher (:mod:`.distill`),
temperature scaling and the calibration error (:mod:`.calibration`), k-NN by the pooled features
(:mod:`.knn`) and the linear probe on cached features (:mod:`.linear_probe`)."""
from .base import TaskSetup, build_model

__all__ = ["TaskSetup", "build_model"]
