"""What cleanlab finds in one split (``pip install 'vitlab[inspect]'``): its ``Datalab`` on the split's labels and
out-of-sample probabilities (:mod:`vitlab.inspection.probabilities`).

- Label issues: confident learning (Northcutt et al., "Confident learning", JAIR 2021); ``label_score`` is the
  given label's quality (self-confidence), low = likely wrong; multi-label data: cleanlab's multi-label rule.
- Outliers: cleanlab's out-of-distribution score of the probabilities (the entropy of each image's probabilities,
  adjusted by each class's typical confidence); ``outlier_score`` low = likely out of place. Not the features' own
  nearest-neighbour distances (Datalab's choice when it has features): a classifier's features draw noise and
  foreign images into its classes' clusters (on CIFAR-10 the features ranked far fewer planted outliers near the
  top than the k-NN probabilities: docs/inspect.md). Multi-label data: by the
  features (cleanlab scores no multi-label probabilities for outliers).

Near-duplicates are :mod:`vitlab.inspection.duplicates`' (why: there).
"""
from __future__ import annotations

import contextlib
import io

import numpy as np
import pandas as pd
from torch import Tensor

from ..errors import ConfigError

__all__ = ["require_cleanlab", "split_issues"]


def require_cleanlab() -> None:
    """One line if cleanlab (with its Datalab: the datasets package) is not installed."""
    try:
        import cleanlab.datalab.datalab  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"vitlab inspect finds issues with cleanlab's Datalab, which is not installed ({e}): "
                          f"pip install 'vitlab[inspect]'") from None


def split_issues(labels: Tensor, probs: Tensor, features: np.ndarray, multi_label: bool) -> pd.DataFrame:
    """Each image's findings in its split, a row each in the split's order: ``is_label_issue``, ``label_score``,
    ``predicted_label`` (single-label), ``is_outlier_issue``, ``outlier_score``. ``labels`` ``(N,)`` or multi-hot
    ``(N, K)``, ``probs`` ``(N, K)`` out of sample; ``features`` ``(N, E)``: multi-label data's outliers (cleanlab
    scores those by the features alone)."""
    from cleanlab import Datalab

    given = [np.flatnonzero(row).tolist() for row in labels.numpy()] if multi_label else labels.numpy()
    lab = Datalab(data={"label": given}, label_name="label", task="multilabel" if multi_label else "classification",
                  verbosity=0)
    with contextlib.redirect_stdout(io.StringIO()):  # its progress lines, verbosity=0 or not
        lab.find_issues(pred_probs=probs.double().clamp(1e-6, 1).numpy(), issue_types={"label": {}, "outlier": {}},
                        features=np.ascontiguousarray(features, dtype=np.float32) if multi_label else None)
    issues = lab.get_issues().reset_index(drop=True)
    if not multi_label:
        issues["predicted_label"] = lab.get_info("label")["predicted_label"]
    return issues
