"""The parts every model is built from: norms, MLPs (SwiGLU, mixture of experts), positional encodings,
stochastic depth, gradient checkpointing, and the encoder and decoder blocks. Imports only :mod:`vitlab.attention` and torch."""
from .block import Block, DecoderBlock, DecoderCache, LayerScale
from .drop import DropPath, drop_path_rates
from .ffn import MLPS, MlpName, create_mlp
from .mlp import ACTIVATIONS, Mlp, SwiGLU, create_dense_mlp, get_activation
from .moe import MoE, expert_utilization, moe_aux_loss
from .norm import NORMS, LayerNorm, NormName, RmsNorm, create_norm
from .recompute import GradCheckpointing, checkpointed
from .pos_embed import (POS_EMBEDS, PosEmbedName, resample_pos_embed, sincos_2d_position_encoding,
                        sinusoidal_position_encoding)

__all__ = ["Block", "DecoderBlock", "DecoderCache", "LayerScale", "DropPath", "drop_path_rates", "Mlp", "SwiGLU", "MoE",
           "create_mlp", "create_dense_mlp", "get_activation", "moe_aux_loss", "expert_utilization", "LayerNorm", "RmsNorm", "create_norm",
           "resample_pos_embed", "sincos_2d_position_encoding", "sinusoidal_position_encoding", "NormName", "MlpName",
           "PosEmbedName", "NORMS", "MLPS", "POS_EMBEDS", "ACTIVATIONS", "GradCheckpointing", "checkpointed"]
