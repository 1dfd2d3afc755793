"""Near-duplicates, within a split and between splits (leaks), found by hand rather than by cleanlab.

cleanlab's rule (images nearer than a share of the median nearest-neighbour distance of the features) leans on
features that tell one photo from another. A classifier's pooled features tell classes apart instead: they draw
each class tight, so a re-encoded, shifted, recoloured copy is no nearer its original than to the class's other
images (on CIFAR-10 cleanlab's default found none of the planted copies, and few at 4 times its threshold among
many other pairs: docs/inspect.md). Here the features only propose: each image's
``candidates`` nearest images by the features (cosine) and as many by a colour thumbnail (8 x 8, its mean taken
away, cosine), and the pixels decide: two images are near-duplicates when their 32 x 32 thumbnails, one shifted
against the other by up to :data:`MAX_SHIFT` pixels either way, correlate (over the overlap, each colour channel
less its mean) at ``threshold`` or more at the best shift."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..tasks.knn import nearest

__all__ = ["THUMBNAIL", "MAX_SHIFT", "DUPLICATE_THRESHOLD", "thumbnails", "duplicate_pairs"]

THUMBNAIL = 32  # the side of the thumbnails the pixels are compared at
MAX_SHIFT = 3  # pixels of a thumbnail: a shift of up to about a tenth of the image's side
# The correlation at which a pair is reported: chosen on a planted set of its own (docs/inspect.md).
DUPLICATE_THRESHOLD = 0.90


def thumbnails(images: Tensor) -> Tensor:
    """uint8 ``(B, 3, 32, 32)`` thumbnails of uint8 images ``(B, 3, H, W)`` (area averages)."""
    return F.adaptive_avg_pool2d(images.float(), THUMBNAIL).round().clamp(0, 255).to(torch.uint8)


def _coarse(thumbs: Tensor) -> Tensor:
    """The thumbnails' colour layout, 8 x 8, its mean taken away, unit length: the second way to propose."""
    x = F.adaptive_avg_pool2d(thumbs.float(), 8).flatten(1)
    return F.normalize(x - x.mean(1, keepdim=True), dim=1)


def aligned_correlation(query: Tensor, candidates: Tensor, shift: int = MAX_SHIFT) -> Tensor:
    """The best correlation ``(B, C)`` of each query thumbnail ``(B, 3, S, S)`` with each of its candidates
    ``(B, C, 3, S, S)`` over the shifts of up to ``shift`` pixels either way: the query's centre (its border of
    ``shift`` left out) against the candidate's window at each offset, each colour channel less its own mean (so two
    images of one colour and different content do not correlate), the three channels together."""
    s = query.shape[-1]
    centre = query.float()[..., shift:s - shift, shift:s - shift]
    centre = F.normalize((centre - centre.mean((-2, -1), keepdim=True)).flatten(1), dim=1)
    cands = candidates.float()
    best = torch.full(cands.shape[:2], -1.0)
    for dy in range(-shift, shift + 1):
        for dx in range(-shift, shift + 1):
            window = cands[..., shift + dy:s - shift + dy, shift + dx:s - shift + dx]
            window = F.normalize((window - window.mean((-2, -1), keepdim=True)).flatten(2), dim=2)
            best = torch.maximum(best, torch.einsum("bf,bcf->bc", centre, window))
    return best


def _nearest(query: Tensor, bank: Tensor, k: int, offset: int | None, chunk: int) -> Tensor:
    """``(M, k)`` positions in ``bank`` of each query row's ``k`` nearest (:func:`~vitlab.tasks.knn.nearest`)."""
    return torch.cat([index for _, index in nearest(query, bank, k, offset, chunk)])


def duplicate_pairs(features: Tensor, thumbs: Tensor, bank_features: Tensor | None = None,
                    bank_thumbs: Tensor | None = None, threshold: float = DUPLICATE_THRESHOLD, candidates: int = 10,
                    chunk: int = 1024) -> list[tuple[int, int, float]]:
    """Near-duplicate pairs ``(i, j, correlation)``, most alike first: ``i`` a row of ``features`` ``(M, E)`` /
    ``thumbs`` ``(M, 3, 32, 32)``, ``j`` a row of the bank (another split's); without a bank, pairs within the
    rows themselves, each once (``i > j``)."""
    within = bank_features is None
    bank_features, bank_thumbs = (features, thumbs) if within else (bank_features, bank_thumbs)
    if len(bank_features) - within < 1 or len(features) == 0:
        return []
    proposed = torch.cat([_nearest(F.normalize(features.float(), dim=1), F.normalize(bank_features.float(), dim=1),
                                   candidates, 0 if within else None, chunk),
                          _nearest(_coarse(thumbs), _coarse(bank_thumbs), candidates, 0 if within else None, chunk)], 1)
    pairs: dict[tuple[int, int], float] = {}
    for start in range(0, len(features), chunk // 8):
        ids = proposed[start:start + chunk // 8]
        scores = aligned_correlation(thumbs[start:start + len(ids)], bank_thumbs[ids])
        for r, c in (scores >= threshold).nonzero().tolist():
            i, j = start + r, int(ids[r, c])
            key = (max(i, j), min(i, j)) if within else (i, j)
            pairs[key] = max(pairs.get(key, -1.0), float(scores[r, c]))
    return sorted(((i, j, s) for (i, j), s in pairs.items()), key=lambda p: -p[2])
