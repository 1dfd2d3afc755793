"""Images that say little from their pixels alone, found by CleanVision (cleanlab's image library; ``pip install
'vitlab[inspect]'``) before any model looks at them: dark, light (washed out), low information (blank, one colour,
a few flat regions), blurry, and of an odd size or aspect ratio for the split, each at CleanVision's own thresholds.

The images that carry no information (low information, dark, light) are reported under their kind alone: they are
left out of the search for wrong labels, outliers and near-duplicates, where a set of blank frames would otherwise
show up as near-duplicates of each other and as wrong labels (60 noise and two-tone frames planted in CIFAR-10 came
out as 112 near-duplicate rows and 36 label issues before this module). Blurry and oddly sized images are reported
and still searched.

Not found here: images of pure noise. CleanVision's checks read brightness, entropy, sharpness and size, and noise
is bright, sharp and of high entropy like a photograph; such images are what cleanlab's outlier score ranks high
(:mod:`vitlab.inspection.findings`)."""
from __future__ import annotations

import contextlib
import io
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
from PIL import Image

from ..data.shards import ShardIndex
from ..errors import ConfigError, DataError

if TYPE_CHECKING:
    from .splits import Split

__all__ = ["PIXEL_KINDS", "NO_INFORMATION", "require_cleanvision", "pixel_issues"]

# CleanVision's issue types vitlab asks for, and what a row's score (1 - CleanVision's, higher = surer) is.
PIXEL_KINDS = {
    "low_information": "1 - CleanVision's information score (the entropy of the grey levels)",
    "dark": "1 - CleanVision's darkness score (the brightness of the brightest pixels)",
    "light": "1 - CleanVision's lightness score (the brightness of the darkest pixels)",
    "blurry": "1 - CleanVision's blurriness score (the edges' strength)",
    "odd_size": "1 - CleanVision's size score (against the split's typical size)",
    "odd_aspect_ratio": "1 - CleanVision's aspect-ratio score",
}
NO_INFORMATION = ("low_information", "dark", "light")


def require_cleanvision() -> None:
    """One line if CleanVision is not installed."""
    try:
        import cleanvision  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"vitlab inspect finds images of little information with CleanVision, which is not installed "
                          f"({e}): pip install 'vitlab[inspect]'") from None


class _Images:
    """A split's images as CleanVision reads a torchvision data set: ``(PIL image,)`` by position, in order (shards
    read through once); None for an image that cannot be read (CleanVision leaves it unscored)."""

    def __init__(self, split: Split) -> None:
        self.split, self.stream, self.at = split, None, 0

    def __len__(self) -> int:
        return len(self.split)

    def _shard_samples(self) -> Iterator[Any]:
        index = self.split.index
        for shard, count in enumerate(index.counts):
            yield from index.read(shard, 0, count)

    def __getitem__(self, i: int) -> tuple[Image.Image | None, int]:
        index = self.split.index
        try:
            if isinstance(index, ShardIndex):  # read in order; a second pass starts over
                if self.stream is None or i != self.at:
                    self.stream, self.at = self._shard_samples(), 0
                    for _ in range(i):
                        next(self.stream)
                        self.at += 1
                sample = next(self.stream)
                self.at += 1
                return Image.fromarray(index.decode(sample, None).permute(1, 2, 0).numpy()), 0
            return index.open(i), 0
        except DataError:
            return None, 0


def pixel_issues(split: Split) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each of :data:`PIXEL_KINDS` for every image of ``split``: ``{kind: (flagged bool (N,), score float (N,))}``,
    the score 1 - CleanVision's (higher = surer; 0 for an image that cannot be read, never flagged)."""
    from cleanvision import Imagelab

    images = _Images(split)
    if len(images) == 0:
        return {kind: (np.zeros(0, bool), np.zeros(0)) for kind in PIXEL_KINDS}
    first = next((k for k in range(len(images)) if images[k][0] is not None), None)
    if first is None:
        return {kind: (np.zeros(len(images), bool), np.zeros(len(images))) for kind in PIXEL_KINDS}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its report, its bar
        lab = Imagelab(torchvision_dataset=_FirstReadable(images, first))
        lab.find_issues({kind: {} for kind in PIXEL_KINDS}, n_jobs=1, verbose=False)
    found = lab.issues.reindex(range(len(images)))
    return {kind: (found[f"is_{kind}_issue"].fillna(False).to_numpy(bool),
                   (1 - found[f"{kind}_score"].astype(float)).fillna(0.0).to_numpy())
            for kind in PIXEL_KINDS}


class _FirstReadable:
    """``images`` with item 0 a readable one first asked for (CleanVision looks at item 0 to find which element of a
    sample is the image), then every item as it is."""

    def __init__(self, images: _Images, first: int) -> None:
        self.images, self.first, self.asked = images, first, False

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[Image.Image | None, int]:
        if i == 0 and not self.asked:
            self.asked = True
            return self.images[self.first]
        return self.images[i]
