"""Ending a ``DataLoader``'s worker processes when a run is done with them.

Training keeps its workers for the whole run (``persistent_workers``). Left to the garbage collector, a
loader whose epoch was cut short (a run stopped by a signal) sat in a reference cycle, and torch's
shutdown, run from inside the collection, reached its workers through queues the collection had already
closed: it waited 5 s for each worker (20 s for a run with 2 workers for training and 2 for evaluation)
before killing them, in whatever came next in the process (a notebook's next cell, the next test). Ended
explicitly, when the run ends, they go at once.
"""
from __future__ import annotations

from typing import Any

__all__ = ["shutdown_workers"]


def shutdown_workers(loader: Any) -> None:
    """End the worker processes of ``loader`` now: a ``DataLoader``, one prepared by Accelerate (its
    ``base_dataloader``), or a loader with a ``shutdown_workers()`` of its own; anything else is left
    alone. The loader starts new workers if it is iterated again."""
    if hasattr(loader, "shutdown_workers"):
        loader.shutdown_workers()
        return
    loader = getattr(loader, "base_dataloader", loader)
    iterator = getattr(loader, "_iterator", None)  # a persistent-workers DataLoader's live iterator
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()  # torch's own shutdown, as the iterator's __del__ would call it
    if hasattr(loader, "_iterator"):
        loader._iterator = None
