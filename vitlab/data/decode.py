"""How one image enters vitlab: any PIL image or image file -> uint8 RGB ``(3, H, W)``.

The one decode rule of every source (ImageFolder files, Hugging Face columns, ``vitlab predict``):
any mode becomes RGB, and images of more than 8 bits a channel are *scaled* to 8 bits, not clipped
(PIL's ``convert("RGB")`` clips a 16-bit ``I;16`` image at 255, so a 0..65535 ramp would come out
with 99.6% of its pixels white), and a photo is turned upright by its EXIF orientation tag, as
``PIL.ImageOps.exif_transpose`` and Hugging Face ``datasets`` turn it (``exif_transpose=False``: the
stored pixels, as timm's loader reads them). Knows no model and no other module of vitlab's data.
"""
from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch import Tensor
from torchvision.transforms.v2.functional import InterpolationMode, resized_crop

from ..errors import DataError

try:
    import simplejpeg  # libjpeg-turbo's decoder, straight into a NumPy array
except ImportError:  # a platform without its wheel: PIL decodes JPEGs too
    simplejpeg = None

__all__ = ["to_rgb", "pil_to_tensor", "open_image", "decode_image", "read_image", "decode_all", "decode_region",
           "jpeg_size", "jpeg_orientation", "Region", "EncodedImage", "dct_scale", "TooManyPixels", "check_pixels"]

_WIDE_INTEGER_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_ORIENTATION = 0x0112  # EXIF's Orientation tag


def _orientation(img: Image.Image) -> int:
    """The EXIF orientation of an opened image: 1 (upright, or no tag) to 8."""
    value = img.getexif().get(_ORIENTATION, 1)
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


_EXIF, _XMP = b"Exif\0\0", b"http://ns.adobe.com/xap/1.0/\x00"
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')  # PIL's pattern (Image.getexif)


def jpeg_orientation(data: bytes) -> int:
    """A JPEG's EXIF orientation, 1 (upright, no tag, or a value not 1-8) to 8, read from its bytes as PIL's
    ``getexif`` reads it (the Exif APP1 segment's first IFD, else an XMP segment's ``tiff:Orientation``)
    without opening it, a fifth of the time through PIL takes (benchmarks/RESULTS.md, "Decoding at the size the crop
    needs"). A file this reader does not expect (two Exif segments, a malformed one) is left to PIL."""
    value = _scan_orientation(data)
    if value is None:
        with Image.open(io.BytesIO(data)) as img:
            return _orientation(img)
    return value if 1 <= value <= 8 else 1


def _scan_orientation(data: bytes) -> int | None:
    """The orientation tag found by walking a JPEG's header segments up to its first scan (1 where there
    is none), or None where PIL must decide (see :func:`jpeg_orientation`)."""
    pos, exif, xmp = 2, None, None
    while True:
        if pos + 4 > len(data) or data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker in (0xDA, 0xD9):  # start of scan (or end of image): the header segments are over
            break
        if not 0xC0 <= marker <= 0xFE or 0xD0 <= marker <= 0xD8:  # fill bytes, markers without a length
            return None
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        segment = data[pos + 4:pos + 2 + length]
        if marker == 0xE1 and segment.startswith(_EXIF):
            if exif is not None or segment.startswith(_EXIF * 2):  # PIL joins or strips them
                return None
            exif = segment[len(_EXIF):]
        elif marker == 0xE1 and segment.startswith(_XMP):
            xmp = segment[len(_XMP):]  # the last one counts, as in PIL
        pos += 2 + length
    if exif is not None:
        value = _ifd0_orientation(exif)
        if value != 0:  # found, or None: left to PIL
            return value
    match = _XMP_ORIENTATION.search(xmp) if xmp is not None else None
    return int(match[2]) if match else 1


def _ifd0_orientation(tiff: bytes) -> int | None:
    """The orientation tag of a TIFF's first IFD (an Exif segment's payload): its value, 0 if it has none,
    None for anything but a well-formed IFD with one SHORT or LONG value."""
    if len(tiff) < 8 or tiff[:4] not in (b"II*\0", b"MM\0*"):
        return None
    order = "little" if tiff[0] == 0x49 else "big"
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return None
    count = int.from_bytes(tiff[ifd:ifd + 2], order)
    if ifd + 2 + 12 * count > len(tiff):
        return None
    found = 0
    for entry in range(ifd + 2, ifd + 2 + 12 * count, 12):
        if int.from_bytes(tiff[entry:entry + 2], order) != _ORIENTATION:
            continue
        kind, number = int.from_bytes(tiff[entry + 2:entry + 4], order), int.from_bytes(tiff[entry + 4:entry + 8], order)
        if found or number != 1 or kind not in (3, 4):  # twice, or not one SHORT (3) or LONG (4)
            return None
        found = int.from_bytes(tiff[entry + 8:entry + (10 if kind == 3 else 12)], order)
    return found


def _turn(x: Tensor, orientation: int) -> Tensor:
    """``(3, H, W)`` pixels stored with EXIF ``orientation``, upright: what ``ImageOps.exif_transpose``
    does to the image (2 mirror, 3 half turn, 4 flip, 5 transpose, 6 quarter turn clockwise, 7 transverse,
    8 quarter turn counter-clockwise). Lossless: only moves pixels (a transpose is a view, a flip one copy)."""
    if orientation in (5, 6, 7, 8):
        x = x.transpose(-1, -2)  # 5; then 6 = transpose + mirror, 7 = transpose + half turn, 8 = transpose + flip
    flips = {2: (-1,), 3: (-2, -1), 4: (-2,), 6: (-1,), 7: (-2, -1), 8: (-2,)}.get(orientation)
    return x.flip(flips) if flips else x


def _to_8_bits(img: Image.Image) -> Image.Image:
    """A greyscale image of more than 8 bits as mode ``L``: integer modes (16-bit ``I;16*``, and ``I``,
    which is how 16-bit PNG and TIFF files often open) map 0..65535 to 0..255 (``round(v / 257)``,
    as libvips and ImageMagick do; values outside are clipped), float ``F`` maps 0..1 to 0..255."""
    a = np.asarray(img)
    if img.mode == "F":
        scaled = np.clip(a.astype(np.float64), 0.0, 1.0) * 255.0
    else:
        scaled = np.clip(a.astype(np.float64), 0, 65535) / 257.0
    return Image.fromarray(np.rint(scaled).astype(np.uint8), mode="L")


def to_rgb(img: Image.Image, size: tuple[int, int] | None = None, exif_transpose: bool = False) -> Image.Image:
    """A PIL image of any mode (greyscale of 8, 16 or 32 bits, RGBA, palette, CMYK) as 8-bit RGB, turned
    upright by its EXIF orientation if ``exif_transpose``, then resized (PIL's bicubic) to ``size``
    ``(H, W)`` if given."""
    if exif_transpose and _orientation(img) != 1:
        img = ImageOps.exif_transpose(img)
    if img.mode in _WIDE_INTEGER_MODES or img.mode == "F":
        img = _to_8_bits(img)
    img = img.convert("RGB")
    if size is not None and img.size != (size[1], size[0]):
        img = img.resize((size[1], size[0]), Image.BICUBIC)
    return img


def pil_to_tensor(img: Image.Image, size: tuple[int, int] | None = None, exif_transpose: bool = False) -> Tensor:
    """A PIL image of any mode as uint8 RGB ``(3, H, W)`` (:func:`to_rgb`: upright if ``exif_transpose``),
    resized to ``size`` if given."""
    return torch.from_numpy(np.asarray(to_rgb(img, size, exif_transpose), dtype=np.uint8).copy()).permute(2, 0, 1)


def open_image(path: str | Path | io.BytesIO, size: tuple[int, int] | None = None,
               exif_transpose: bool = True) -> Image.Image:
    """Decode one image file (a path or a file object) to an 8-bit RGB PIL image (:func:`to_rgb`), upright
    by its EXIF orientation unless ``exif_transpose=False``, resized to ``size`` if given.

    Raises:
        DataError: naming the file, if it cannot be read or decoded.
    """
    try:
        with Image.open(path) as img:
            return to_rgb(img, size, exif_transpose)
    except UnidentifiedImageError:  # PIL's own words name a file object by its repr
        raise DataError(f"cannot read image {str(path)!r}: not an image file PIL can identify") from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"cannot read image {str(path)!r}: {e}") from None


def decode_image(data: bytes, where: str, size: tuple[int, int] | None = None, exif_transpose: bool = True) -> Tensor:
    """An encoded image (a file's bytes) as uint8 RGB ``(3, H, W)``, the pixels :func:`open_image` gives:
    upright by its EXIF orientation unless ``exif_transpose=False``, at ``size`` (PIL's bicubic) if given;
    at its own size decoded fastest, a JPEG by libjpeg-turbo through ``simplejpeg`` (PIL decodes into its
    own memory and copies out; measured in benchmarks/RESULTS.md) and turned by moving its pixels
    (:func:`_turn`), anything else by PIL, and CMYK JPEGs too (whose conversion to RGB differs from PIL's
    by a level).

    Raises:
        DataError: naming ``where`` (the file, the sample), if it cannot be decoded.
    """
    if size is None and simplejpeg is not None and data[:2] == b"\xff\xd8":
        try:
            if simplejpeg.decode_jpeg_header(data)[2] in ("Gray", "YCbCr", "RGB"):  # CMYK, YCCK: PIL's conversion
                x = torch.from_numpy(simplejpeg.decode_jpeg(data, colorspace="RGB")).permute(2, 0, 1)
                return _turn(x, jpeg_orientation(data)) if exif_transpose else x
        except (ValueError, OSError):
            pass  # PIL decodes it, or says why not
    try:
        with Image.open(io.BytesIO(data)) as img:
            return pil_to_tensor(img, size, exif_transpose)
    except UnidentifiedImageError:
        raise DataError(f"cannot read image {where}: not an image file PIL can identify") from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"cannot read image {where}: {e}") from None


class TooManyPixels(DataError):
    """An image whose header says it has more pixels than the reader takes (:func:`check_pixels`)."""


def check_pixels(data: bytes, where: str, limit: int) -> int:
    """The pixels of an encoded image (its stored width x height; 0 for bytes that are no image PIL can identify,
    which the decode then refuses), read from its header alone: nothing is decoded, so a small file that would decode
    to gigabytes (a PNG of one colour) costs nothing; refused when over ``limit``. ``limit`` 0: no limit (and 0
    returned, nothing read).

    Raises:
        TooManyPixels: one line naming ``where``, its size and the limit.
    """
    if not limit:
        return 0
    found = jpeg_size(data, exif_transpose=False)
    try:
        if found is None:
            with Image.open(io.BytesIO(data)) as img:
                found = (img.height, img.width, 1)
    except Image.DecompressionBombError as e:  # over PIL's own limit, which it checks on opening
        raise TooManyPixels(f"{where}: {e}; the limit here is {limit:,} pixels") from None
    except (OSError, ValueError):
        return 0
    pixels = found[0] * found[1]
    if pixels > limit:
        raise TooManyPixels(f"{where} is {found[1]:,} x {found[0]:,} = {pixels:,} pixels, more than the {limit:,} this "
                            f"reader takes (--max-image-pixels, data.max_image_pixels)")
    return pixels


Region = tuple[float, float, float, float]  # top, left, height, width, in the upright image's pixels


@dataclass(frozen=True)
class EncodedImage:
    """An image file's bytes, not yet decoded: what a streamed split hands its transforms when they can
    decode only the part and the scale they need (:func:`decode_region`; ``data.scaled_decode``)."""

    data: bytes
    where: str
    exif_transpose: bool = True

    def decode(self) -> Tensor:
        """The whole image, uint8 RGB ``(3, H, W)`` (:func:`decode_image`)."""
        return decode_image(self.data, self.where, exif_transpose=self.exif_transpose)


def _box_stored(box: Region, orientation: int, height: int, width: int) -> Region:
    """``box`` of the upright image (``height x width``) as a box of the stored pixels, for EXIF
    ``orientation``: :func:`_turn` undone (its flips, then its transpose)."""
    top, left, h, w = box
    flips = {2: (-1,), 3: (-2, -1), 4: (-2,), 6: (-1,), 7: (-2, -1), 8: (-2,)}.get(orientation, ())
    if -1 in flips:  # the flips act on the (transposed) image of the upright size
        left = width - left - w
    if -2 in flips:
        top = height - top - h
    return (left, top, w, h) if orientation in (5, 6, 7, 8) else (top, left, h, w)


def jpeg_size(data: bytes, exif_transpose: bool = True) -> tuple[int, int, int] | None:
    """A JPEG's upright ``(height, width)`` and EXIF orientation from its headers (nothing decoded), or None
    for anything :func:`decode_region` does not scale (not a JPEG, CMYK, no libjpeg-turbo)."""
    if simplejpeg is None or data[:2] != b"\xff\xd8":
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    if colorspace not in ("Gray", "YCbCr", "RGB"):
        return None
    orientation = jpeg_orientation(data) if exif_transpose else 1
    return (width, height, orientation) if orientation in (5, 6, 7, 8) else (height, width, orientation)


def dct_scale(height: float, width: float, size: tuple[int, int]) -> int:
    """The DCT scale (1, 2 or 4: decode at 1/scale) for a region of ``height x width`` to be resized to
    ``size``: the largest that leaves the region at least 1.25 times ``size``. A quarter of the resize is
    left to do because the DCT's filter is not the resize's: where it did all of the shrinking, the two
    parted to 39 dB; and not 1/8, which keeps only each 8 x 8 block's mean."""
    scale = 1
    while scale < 4 and height / (2 * scale) >= 1.25 * size[0] and width / (2 * scale) >= 1.25 * size[1]:
        scale *= 2
    return scale


def decode_region(data: bytes, where: str, region: Callable[[int, int], Region], size: tuple[int, int],
                  exif_transpose: bool = True, found: tuple[int, int, int] | None = None) -> Tensor:
    """The ``region(height, width)`` of an encoded image (upright pixels; called with the upright size)
    resized to ``size`` ``(H, W)`` (bicubic, PIL's, with the box's fractions): uint8 RGB ``(3, H, W)``.

    A JPEG is decoded only as large as the region needs (:func:`dct_scale`: libjpeg-turbo's DCT scaling by
    1/2 or 1/4), then the box is cut from the smaller image. Against the full decode and the same crop
    (torchvision's resize) it differs by a resize's rounding: PSNR about 50 dB (benchmarks/RESULTS.md; the
    test asserts >= 40 on each of 30 random resized crops of a real photograph). A region too small to
    scale is cut from the full decode by torchvision's ``resized_crop`` (integer boxes: the pixels of the
    path without scaling). Anything else is decoded whole (:func:`decode_image`) and cut by PIL.

    ``found``: :func:`jpeg_size`'s answer where the caller already read the headers.

    Raises:
        DataError: naming ``where``, if it cannot be decoded.
    """
    found = found or jpeg_size(data, exif_transpose)
    if found is None:
        x = decode_image(data, where, exif_transpose=exif_transpose)
        top, left, h, w = region(x.shape[-2], x.shape[-1])
        img = Image.fromarray(x.permute(1, 2, 0).numpy())
        return pil_to_tensor(img.resize((size[1], size[0]), Image.BICUBIC, box=(left, top, left + w, top + h)))
    height, width, orientation = found
    box = region(height, width)
    scale = dct_scale(box[2], box[3], size)
    stored = (width, height) if orientation in (5, 6, 7, 8) else (height, width)
    try:
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=-(-stored[0] // scale),
                                        min_width=-(-stored[1] // scale))
    except ValueError as e:
        raise DataError(f"cannot read image {where}: {e}") from None
    if scale == 1:  # too small a region to scale: the full decode and torchvision's crop, as without scaling
        x = _turn(torch.from_numpy(pixels).permute(2, 0, 1), orientation)
        top, left, h, w = (round(v) for v in box)
        return resized_crop(x, top, left, h, w, list(size), InterpolationMode.BICUBIC, antialias=True).contiguous()
    top, left, h, w = _box_stored(box, orientation, height, width)
    fy, fx = pixels.shape[0] / stored[0], pixels.shape[1] / stored[1]
    out = (size[1], size[0]) if orientation in (5, 6, 7, 8) else (size[0], size[1])  # (H, W) as stored
    img = Image.fromarray(pixels).resize((out[1], out[0]), Image.BICUBIC,
                                         box=(left * fx, top * fy, (left + w) * fx, (top + h) * fy))
    return _turn(torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1), orientation).contiguous()


def read_image(path: str | Path, size: tuple[int, int] | None = None) -> Tensor:
    """Decode one image file to uint8 RGB ``(3, H, W)`` (:func:`open_image`), resized to ``size`` if given.

    Raises:
        DataError: naming the file, if it cannot be read or decoded.
    """
    return pil_to_tensor(open_image(path, size))


def decode_all(decode: Callable[[int], Tensor], indices: Sequence[int],
               done: Callable[[], None] | None = None) -> Tensor:
    """``decode(i)`` for each index, stacked into one preallocated uint8 ``(N, 3, H, W)`` tensor (every
    image of the same size): the data's size in memory once, not twice as ``torch.stack`` of a list.
    ``done()`` is called after each image (progress)."""
    indices = list(indices)
    if not indices:
        return torch.empty(0, 3, 0, 0, dtype=torch.uint8)
    first = decode(indices[0])
    out = torch.empty((len(indices), *first.shape), dtype=torch.uint8)
    out[0] = first
    for row, i in enumerate(indices[1:], start=1):
        if done is not None:
            done()
        out[row] = decode(i)
    if done is not None:
        done()
    return out
