"""Data: where images come from (:mod:`.sources`: CIFAR-10, ImageFolder :mod:`.folder`, Hugging Face
:mod:`.hf`, each listed as a :mod:`.split` before :mod:`.decode` decodes it; WebDataset shards
:mod:`.shards`, written by :mod:`.convert`), how a sample becomes the model's input (:mod:`.transforms`),
how samples are batched (in memory or streamed by a sampler, :mod:`.images`; shards streamed in equal
parts to every process and worker, :mod:`.shard_stream`), and text (:mod:`.text`: synthetic pairs,
parallel text, BPE, token batching). Knows no model."""
from .decode import pil_to_tensor, read_image
from .images import ImageData
from .transforms import CIFAR10_MEAN, CIFAR10_STD, create_transform
from .sources import index_split, load_split

__all__ = ["CIFAR10_MEAN", "CIFAR10_STD", "ImageData", "create_transform", "index_split", "load_split",
           "pil_to_tensor", "read_image"]
