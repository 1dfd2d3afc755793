"""Pictures of what the models attend to: attention rollout and block maps for ViTs (``rollout``)."""
from .rollout import HeadFusion, attention_rollout, block_attention_map, cls_attention_map

__all__ = ["attention_rollout", "cls_attention_map", "block_attention_map", "HeadFusion"]
