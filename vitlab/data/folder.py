"""Image sources on disk: an ImageFolder (``root/<split>/<class>/<image>``) and torchvision's CIFAR-10,
each listed as a :class:`~vitlab.data.split.SplitIndex`."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from PIL import Image

from ..errors import DataError
from .decode import decode_image, open_image
from .split import SplitIndex, label_indices

if TYPE_CHECKING:
    import numpy as np

__all__ = ["IMAGE_EXTENSIONS", "index_imagefolder", "index_image_tree", "index_cifar10"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".ppm", ".tif", ".tiff")


class FolderFiles:
    """A folder split's image files, read by position, upright by their EXIF orientation unless
    ``exif_transpose=False``. A plain object (a list of paths), so it pickles: DataLoader workers started
    by fork, forkserver or spawn all get it."""

    def __init__(self, files: list[Path], exif_transpose: bool = True, root: Path | None = None) -> None:
        self.files, self.exif_transpose, self.root = files, exif_transpose, root

    def key(self, i: int) -> str:
        """File ``i``'s path under the split's folder (``<class>/<name>``); a file elsewhere (a csv table's absolute
        path), its path as listed."""
        if self.root is None:
            return self.files[i].name
        file = self.files[i]
        return file.relative_to(self.root).as_posix() if file.is_relative_to(self.root) else file.as_posix()

    def open(self, i: int) -> Image.Image:
        return open_image(self.files[i], exif_transpose=self.exif_transpose)

    def path(self, i: int) -> Path:
        """File ``i`` as the listing found it."""
        return self.files[i]

    def encoded(self, i: int) -> bytes:
        return self.files[i].read_bytes()

    def stamp(self, i: int) -> str:
        """File ``i``'s size and modification time (ns): what a decode cache checks."""
        st = self.files[i].stat()
        return f"{st.st_size}.{st.st_mtime_ns}"

    def read(self, i: int) -> torch.Tensor:
        return decode_image(self.encoded(i), repr(str(self.files[i])), exif_transpose=self.exif_transpose)


class ArrayImages:
    """Images held as a NumPy array ``(N, H, W, 3)`` (torchvision's CIFAR-10), opened by position; pickles."""

    def __init__(self, array: "np.ndarray") -> None:
        self.array = array

    def open(self, i: int) -> Image.Image:
        return Image.fromarray(self.array[i])


def index_imagefolder(root: Path, split: str, classes: list[str] | None = None,
                      exif_transpose: bool = True) -> SplitIndex:
    """List ``root/<split>/<class>/*`` (class folders sorted give the labels; with ``classes``, the
    training split's, a split may lack some of them), to be read upright by the files' EXIF orientation
    unless ``exif_transpose=False``. Nothing is decoded.

    Raises:
        DataError: one line, if the folder, its class folders or its images are missing, or it has a
            class folder that ``classes`` does not.
    """
    if not root.is_dir():
        raise DataError(f"data.root={str(root)!r} does not exist; point it at a folder with train/ and test/ "
                        f"class folders")
    split_dir = root / split
    per_class = f"one folder of images per class ({', '.join(IMAGE_EXTENSIONS)})"
    if not split_dir.is_dir():
        found = sorted(p.name for p in root.iterdir() if p.is_dir())
        other = next((f for f in found if f != "train"), None)
        hint = f" (here: data.test_split={other})" if other and split in ("val", "validation", "test") else ""
        if any(f.suffix.lower() in IMAGE_EXTENSIONS for d in found[:50] for f in (root / d).iterdir()):
            raise DataError(f"data.root={str(root)!r} holds class folders of images itself ({', '.join(found[:5])}"
                            f"{' ...' if len(found) > 5 else ''}), no {split!r} folder: set data.test_size=0.2 to "
                            f"train on them and hold out a fifth, balanced, as the test split (or a count: "
                            f"data.test_size=500)")
        raise DataError(f"data.root={str(root)!r} has no {split!r} folder; its folders: "
                        f"{', '.join(map(repr, found)) or 'none'}. Name the folder of each split with "
                        f"data.train_split and data.test_split{hint}; each holds {per_class}")
    folders = sorted(p.name for p in split_dir.iterdir() if p.is_dir())
    if not folders:
        raise DataError(f"no class folders in {str(split_dir)!r}; it should hold {per_class}")
    files, names = [], []
    for name in folders:
        for f in sorted((split_dir / name).iterdir()):
            if f.suffix.lower() in IMAGE_EXTENSIONS:
                files.append(f)
                names.append(name)
    if not files:
        raise DataError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {str(split_dir)!r}")
    where = f"split {split!r} of data.root={str(root)!r}"
    labels, classes = label_indices(names, classes if classes is not None else folders, where)
    reader = FolderFiles(files, exif_transpose, split_dir)
    return SplitIndex(labels, classes, reader.open, where, encoded=reader.encoded, read=reader.read, key=reader.key,
                      upright=exif_transpose, stamp=reader.stamp, path=reader.path)


def index_image_tree(root: Path, split: str, exif_transpose: bool = True) -> SplitIndex:
    """Every image under ``root/<split>`` (or under ``root`` itself, where it has no such folder), in folders of any
    depth or none, sorted by path, without labels (every label 0): the images of self-supervised pretraining,
    class folders or not. Nothing is decoded.

    Raises:
        DataError: one line, if the folder does not exist or holds no images.
    """
    if not root.is_dir():
        raise DataError(f"data.root={str(root)!r} does not exist; point it at a folder of images (in folders of any "
                        f"kind, or none)")
    top = root / split if (root / split).is_dir() else root
    files = sorted(Path(folder) / name for folder, _, names in os.walk(top, followlinks=True) for name in names
                   if Path(name).suffix.lower() in IMAGE_EXTENSIONS)  # through linked folders, as ImageFolder
    if not files:
        raise DataError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {str(top)!r}, in it or below it: "
                        f"self-supervised pretraining needs a folder of images (class folders are optional)")
    reader = FolderFiles(files, exif_transpose, top)
    where = f"the images under {str(top)!r}"
    return SplitIndex(torch.zeros(len(files), dtype=torch.long), ["image"], reader.open, where,
                      encoded=reader.encoded, read=reader.read, key=reader.key, upright=exif_transpose,
                      stamp=reader.stamp, path=reader.path)


def index_cifar10(root: Path, split: str, download: bool) -> SplitIndex:
    """torchvision's CIFAR-10 under ``root`` (downloaded if ``download`` and absent), already in memory.

    Raises:
        DataError: one line naming the way out, if it is absent or cannot be downloaded.
    """
    from torchvision.datasets import CIFAR10

    try:
        ds = CIFAR10(str(root), train=split == "train", download=download)
    except RuntimeError as e:
        raise DataError(f"CIFAR-10 not found under data.root={str(root)!r} ({e}); set data.download=true to "
                        f"download it, or use data.dataset=imagefolder for a copy in ImageFolder layout") from None
    except OSError as e:  # urllib's URLError (no network, DNS, proxy) and socket errors are OSErrors
        reason = getattr(e, "reason", None) or e
        raise DataError(f"could not download CIFAR-10 into data.root={str(root)!r} ({reason}); without network, "
                        f"point data.root at a copy: data.dataset=imagefolder data.root=<dir with train/ and test/ "
                        f"class folders>, or data.download=false data.root=<dir with cifar-10-batches-py/>") from None
    images = torch.from_numpy(ds.data).permute(0, 3, 1, 2)  # (N, 32, 32, 3) -> (N, 3, 32, 32), a view
    return SplitIndex(torch.tensor(ds.targets), list(ds.classes), ArrayImages(ds.data).open,
                      f"CIFAR-10 {split!r} under data.root={str(root)!r}", pixels=images)
