"""Where vitlab may write: never over the user's files. A file a command writes is refused in one line, before any
work starts, when it exists already or lies inside a data set the command reads (its folder, or one of its files)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from .errors import ConfigError

__all__ = ["inside", "check_new_file", "check_output_folder"]


def inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies below it, through links and ``..`` (both resolved)."""
    path, folder = path.expanduser().resolve(), folder.expanduser().resolve()
    return path == folder or path.is_relative_to(folder)


def _check_outside(path: Path, flag: str, data: Iterable[Path]) -> None:
    for folder in data:
        if inside(path, folder):
            raise ConfigError(f"{flag} {path}: that is inside the data set being read ({folder}); vitlab never writes "
                              f"into the user's data: give a path outside it")


def check_new_file(path: Path, flag: str, data: Iterable[Path] = ()) -> None:
    """Refuse ``path`` (a file a command is about to write, given as ``flag``) when it exists already or lies inside
    one of the data sets ``data`` (folders, or files such as a csv table, that the command reads).

    Raises:
        ConfigError: one line naming the path and the fix.
    """
    _check_outside(path, flag, data)
    if path.exists():
        raise ConfigError(f"{flag} {path}: that file exists already and vitlab never overwrites a file it did not "
                          f"write in this command: give a new path, or move the old file away")


def check_output_folder(path: Path, flag: str, data: Iterable[Path] = ()) -> None:
    """Refuse the folder ``path`` a command writes into (given as ``flag``) when it lies inside one of the data sets
    ``data`` reads, or is an existing file.

    Raises:
        ConfigError: one line naming the path and the fix.
    """
    _check_outside(path, flag, data)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path}: that is a file; give a folder to write into")
