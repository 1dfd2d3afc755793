"""User-facing errors. Each message names the problem, the offending value and the fix; the
command-line tools print it as one line (no traceback) and exit non-zero."""
from __future__ import annotations

__all__ = ["VitlabError", "ConfigError", "DataError", "CheckpointError", "TrainingError"]


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
