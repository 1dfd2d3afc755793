"""Uploaded images, as ``vitlab predict`` reads files: each one's bytes listed as a split
(:class:`~vitlab.data.split.SplitIndex`) and shown to the model by :func:`~vitlab.inference.view.model_dataset`,
eval's one view (upright by its EXIF orientation if the run read its files so; a JPEG decoded only as large as the
model needs, so a 100-megapixel photo takes the memory of its reduced decode; the center crop or resize; uint8)."""
from __future__ import annotations

import contextlib
import io
import threading
from typing import Iterator

import torch
from PIL import Image
from torch import Tensor, nn

from ..data.decode import check_pixels, decode_image, open_image
from ..data.split import SplitIndex
from ..data.transforms import decode_upright
from ..errors import DataError
from ..inference.view import model_dataset

__all__ = ["UploadedImages", "model_images", "PixelBudget"]


class UploadedImages:
    """Images given as bytes, read by position (what :class:`~vitlab.data.folder.FolderFiles` is for files)."""

    def __init__(self, blobs: list[bytes], names: list[str], exif_transpose: bool = True) -> None:
        self.blobs, self.names, self.exif_transpose = blobs, names, exif_transpose

    def key(self, i: int) -> str:
        return self.names[i]

    def open(self, i: int) -> Image.Image:
        return open_image(io.BytesIO(self.blobs[i]), exif_transpose=self.exif_transpose)

    def encoded(self, i: int) -> bytes:
        return self.blobs[i]

    def read(self, i: int) -> Tensor:
        return decode_image(self.blobs[i], repr(self.names[i]), exif_transpose=self.exif_transpose)


def model_images(model: nn.Module, blobs: list[bytes], names: list[str]) -> Tensor:
    """uint8 ``(B, 3, H, W)``: each image of ``blobs`` as eval shows it to ``model`` (see the module).

    Raises:
        DataError: one line naming the image (its ``names`` entry), for bytes that are not an image it can decode.
    """
    reader = UploadedImages(blobs, names, decode_upright(model))
    index = SplitIndex(torch.zeros(len(blobs), dtype=torch.long), ["?"], reader.open, "the upload",
                       encoded=reader.encoded, read=reader.read, key=reader.key, upright=reader.exif_transpose)
    shown = model_dataset(model, index)
    images = []
    for i in range(len(blobs)):
        try:
            images.append(shown[i][0])
        except DataError as e:
            reason = str(e).rsplit("': ", 1)[-1]
            raise DataError(f"{names[i]} is not an image that can be read ({reason})") from None
    return torch.stack(images)


class PixelBudget:
    """At most ``limit`` pixels (width x height, from the images' headers) being decoded at once across the
    requests in flight: a request holds its images' pixels while they are decoded, and one that would go over waits
    (in its worker thread) until enough are given back; one asking for more than ``limit`` waits until it is alone.
    So concurrent requests of large images take the memory of one at a time, not of all of them."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held, self.changed = limit, 0, threading.Condition()

    @contextlib.contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        pixels = min(pixels, self.limit)
        with self.changed:
            self.changed.wait_for(lambda: self.held + pixels <= self.limit)
            self.held += pixels
        try:
            yield
        finally:
            with self.changed:
                self.held -= pixels
                self.changed.notify_all()


def checked_pixels(blobs: list[bytes], names: list[str], limit: int) -> int:
    """The pixels of all ``blobs`` from their headers (:func:`~vitlab.data.decode.check_pixels`).

    Raises:
        TooManyPixels: one line naming the first image over ``limit``.
    """
    return sum(check_pixels(b, n, limit) for b, n in zip(blobs, names))
