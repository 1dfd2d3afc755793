"""The one attention core of vitlab and its variants; imports only torch (and einops).

Everything in vitlab that attends (the ViT blocks, the text encoder and decoder) goes through
:class:`MultiHeadAttention`; score functions and kernels are its options:

- :mod:`.core`: masks, :func:`scaled_dot_product_attention` (fused or explicit), :func:`attend_scores`
  (scores -> softmax or argmax weights -> output);
- :mod:`.scores`: Luong's general and Bahdanau's additive scores;
- :mod:`.kernels`: linear attention (elu + 1) with its recurrent state, streaming (online) softmax;
- :mod:`.multihead`: :class:`MultiHeadAttention` and its decoding :class:`KVCache`.

Mask convention everywhere: boolean, **True = may attend** (key masks: True = real token).
"""
from .core import attend_scores, causal_mask, scaled_dot_product_attention
from .kernels import LinearAttentionState, elu_feature_map, linear_attention, streaming_attention
from .multihead import KERNELS, attend, attention_dropout, KERNELS_WITH_DROPOUT, SCORES, KernelName, KVCache, MultiHeadAttention, ScoreName
from .scores import AdditiveScore, GeneralScore, additive_attention, additive_scores, general_attention

__all__ = ["scaled_dot_product_attention", "attend", "attention_dropout", "attend_scores", "causal_mask", "MultiHeadAttention", "KVCache",
           "linear_attention", "LinearAttentionState", "elu_feature_map", "streaming_attention", "general_attention",
           "additive_attention", "additive_scores", "GeneralScore", "AdditiveScore", "ScoreName", "KernelName",
           "SCORES", "KERNELS", "KERNELS_WITH_DROPOUT"]
