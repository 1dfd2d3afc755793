"""User-facing errors. Each message names the problem, the offending value and the fix; the
command-line tools print it as one line (no traceback) and exit non-zero."""
from __future__ import annotations

import difflib
from typing import Any, Iterable

__all__ = ["VitlabError", "ConfigError", "DataError", "CheckpointError", "TrainingError", "Preempted",
           "PREEMPTED_EXIT_CODE", "need", "close_matches"]


class VitlabError(ValueError):
    """Base class of vitlab's user-facing errors."""


class ConfigError(VitlabError):
    """A configuration key, type or value that is not allowed (exit status 2)."""


def need(cond: bool, key: str, value: Any, allowed: str) -> None:
    """The rule of a config key: unless ``cond``, one line naming ``key``, its ``value`` and what is ``allowed``."""
    if not cond:
        raise ConfigError(f"{key}={value!r} is invalid; expected {allowed}")


def close_matches(key: str, options: Iterable[str]) -> str:
    """``; did you mean a, b?`` with the up to 3 names of ``options`` closest to ``key``, or ''."""
    matches = difflib.get_close_matches(key, list(options), n=3, cutoff=0.5)
    return f"; did you mean {', '.join(matches)}?" if matches else ""


class DataError(VitlabError):
    """A missing data root, an unreadable image, an inconsistent data set."""


class CheckpointError(VitlabError):
    """A missing, incomplete or corrupt checkpoint."""


class TrainingError(VitlabError):
    """Training cannot go on (a non-finite loss, say)."""


class Preempted(SystemExit):
    """Training stopped on a signal (``train.stop_signals``) after writing ``checkpoints/last/``; the same
    command continues the run. A ``SystemExit`` with status :data:`PREEMPTED_EXIT_CODE`, so a script that
    does not catch it ends with that status and no traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, run the same command again
