"""Pictures of what the models attend to: attention rollout and block maps for ViTs (``rollout``), and the
figures (``plots``): heat maps over images, every block x head, translation alignments, a classifier's
most confident mistakes, confusion matrix and reliability diagram."""
from .plots import (attention_heatmaps, plot_alignment, plot_attention, plot_attention_grid, plot_confusion_matrix,
                    plot_mistakes, plot_reconstructions, plot_reliability, save_figure)
from .rollout import HeadFusion, attention_rollout, block_attention_map, cls_attention_map

__all__ = ["attention_rollout", "cls_attention_map", "block_attention_map", "HeadFusion", "attention_heatmaps",
           "plot_attention", "plot_attention_grid", "plot_alignment", "plot_mistakes", "plot_confusion_matrix",
           "plot_reliability", "plot_reconstructions", "save_figure"]
