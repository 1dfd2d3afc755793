"""The text models (the encoder-decoder Transformer, the RNN with attention, the decoder-only LM): public
aliases of their home in :mod:`vitlab.models` (one definition each)."""
from ..layers import DecoderBlock, DecoderCache
from ..models.gpt import GPT
from ..models.rnn import RNNSeq2Seq
from ..models.transformer import Seq2SeqTransformer, Transformer

__all__ = ["Transformer", "Seq2SeqTransformer", "RNNSeq2Seq", "GPT", "DecoderBlock", "DecoderCache"]
