"""User-facing errors. Each message names the problem, the offending value and the fix; the
command-line tools print it as one line (no traceback) and exit non-zero."""
from __future__ import annotations

__all__ = ["VitlabError", "ConfigError", "DataError", "CheckpointError", "TrainingError", "Preempted",
           "PREEMPTED_EXIT_CODE"]


class VitlabError(ValueError):
    """Base class of vitlab's user-facing errors."""


class ConfigError(VitlabError):
    """A configuration key, type or value that is not allowed (exit status 2)."""


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
