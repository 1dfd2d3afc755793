"""The models, each a stack of :mod:`vitlab.layers` parts, and the preset registry.

- :class:`VisionTransformer` (:mod:`.vit`): images to class logits;
- :class:`Transformer`, :class:`Seq2SeqTransformer` (:mod:`.transformer`): the 2017 encoder-decoder;
- :class:`GPT` (:mod:`.gpt`): the decoder-only language model;
- :class:`RNNSeq2Seq` (:mod:`.rnn`): the GRU encoder-decoder with Bahdanau attention;
- :class:`TimmClassifier` (:mod:`.timm_classifier`): any timm image classifier (``timm:<name>``);
- :class:`MaskedAutoencoder` (:mod:`.mae`), :class:`DINO` (:mod:`.dino`): a ViT backbone pretrained without labels;
- :mod:`.decoding`: greedy and beam search over any model's ``step`` function;
- :mod:`.registry`: named presets, ``create_model`` / ``list_models``;
- :mod:`.hub`: ``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` (every model class has them).
"""
from .decoding import beam_search, greedy_search, sample_next
from .dino import DINO
from .mae import MaskedAutoencoder
from .gpt import GPT
from .rnn import RNNSeq2Seq
from .hub import HubMixin
from .timm_classifier import TimmClassifier
from .registry import create_model, list_models, model_args, model_class, preset_class
from .transformer import Seq2SeqTransformer, Transformer
from .vit import PatchEmbed, VisionTransformer, checkpoint_filter_fn

__all__ = ["VisionTransformer", "PatchEmbed", "checkpoint_filter_fn", "Transformer", "Seq2SeqTransformer",
           "GPT", "RNNSeq2Seq", "greedy_search", "beam_search", "sample_next", "create_model", "list_models", "model_args",
           "model_class", "preset_class", "HubMixin", "TimmClassifier", "MaskedAutoencoder", "DINO"]
