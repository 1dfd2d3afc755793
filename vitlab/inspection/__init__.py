"""Know a data set before training on it (``vitlab inspect``): images of little information (CleanVision, from the
pixels alone), wrong labels and outliers (cleanlab on out-of-sample probabilities), near-duplicates within a split
and between splits (leaks), the class balance.

Rooms: :mod:`.splits` (listing and features), :mod:`.pixels` (CleanVision), :mod:`.probabilities` (out of sample:
k-NN or cross-fitted heads), :mod:`.findings` (cleanlab), :mod:`.duplicates` (by the pixels), :mod:`.report` (the
files), :mod:`.job` (the command's work)."""
from .job import inspect_data

__all__ = ["inspect_data"]
