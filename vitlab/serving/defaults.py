"""What ``vitlab serve`` takes unless told otherwise, written once: the command line, :func:`~vitlab.serving.serve`,
:func:`~vitlab.serving.app.create_app` and :class:`~vitlab.serving.batching.DynamicBatcher` read these."""
from __future__ import annotations

__all__ = ["MAX_BATCH_SIZE", "MAX_WAIT_MS", "MAX_UPLOAD_MB", "MAX_IMAGES", "MAX_IMAGE_PIXELS"]

MAX_BATCH_SIZE = 32  # images a forward pass at most
MAX_WAIT_MS = 5.0  # how long a forward pass waits for company
MAX_UPLOAD_MB = 20.0  # a larger request body is refused before it is read whole
MAX_IMAGES = 64  # images a request
MAX_IMAGE_PIXELS = 40_000_000  # a 40-megapixel photo (7,744 x 5,164) is served; a 9,000 x 9,000 PNG is not
