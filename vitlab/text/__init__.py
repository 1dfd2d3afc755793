"""The text encoder-decoder Transformer (Vaswani et al., 2017): a public alias of its home in
:mod:`vitlab.models` (one definition)."""
from ..layers import DecoderBlock, DecoderCache
from ..models.transformer import Seq2SeqTransformer, Transformer

__all__ = ["Transformer", "Seq2SeqTransformer", "DecoderBlock", "DecoderCache"]
