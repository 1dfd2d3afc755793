"""The text encoder-decoder Transformer (Vaswani et al., 2017) on vitlab's attention core."""
from .transformer import DecoderBlock, DecoderCache, Seq2SeqTransformer, Transformer

__all__ = ["Transformer", "Seq2SeqTransformer", "DecoderBlock", "DecoderCache"]
