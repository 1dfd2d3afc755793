"""Files written whole or not at all: :func:`replaced` gives a file of this process's own beside the one to write,
puts it in that one's place (``os.replace``: atomic on one filesystem) when the writing ends without an error, and
removes it when it does not. A reader never sees half a file, a failed writing leaves the old file as it was, and
processes writing one file at once each put a whole one in place.

Knows no model, data set or task: the rooms above import it.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

__all__ = ["replaced"]


@contextlib.contextmanager
def replaced(path: str | Path) -> Iterator[Path]:
    """Write the file the ``with`` block is given (``.NAME.PID.tmp`` beside ``path``); it becomes ``path`` when the
    block ends without an error, and is removed when it raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
