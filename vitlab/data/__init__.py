"""Data: images (:mod:`.images`: CIFAR-10 / ImageFolder decoded once, transforms, the device-resident
loader) and text (:mod:`.text`: synthetic pairs, parallel text, BPE, token batching). Knows no model."""
from .images import CIFAR10_MEAN, CIFAR10_STD, ImageData, create_transform, load_split, read_image

__all__ = ["CIFAR10_MEAN", "CIFAR10_STD", "ImageData", "create_transform", "load_split", "read_image"]
