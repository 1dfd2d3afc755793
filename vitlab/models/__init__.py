"""The models, each a stack of :mod:`vitlab.layers` parts, and the preset registry.

- :class:`VisionTransformer` (:mod:`.vit`): images to class logits;
- :class:`Transformer`, :class:`Seq2SeqTransformer` (:mod:`.transformer`): the 2017 encoder-decoder;
- :mod:`.decoding`: greedy and beam search over any model's ``step`` function;
- :mod:`.registry`: named presets, ``create_model`` / ``list_models``.
"""
from .decoding import beam_search, greedy_search
from .registry import create_model, list_models, model_args, preset_class
from .transformer import Seq2SeqTransformer, Transformer
from .vit import PatchEmbed, VisionTransformer, checkpoint_filter_fn

__all__ = ["VisionTransformer", "PatchEmbed", "checkpoint_filter_fn", "Transformer", "Seq2SeqTransformer",
           "greedy_search", "beam_search", "create_model", "list_models", "model_args", "preset_class"]
