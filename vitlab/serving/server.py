"""``vitlab serve``: the API of :mod:`vitlab.serving.app` on uvicorn. It binds to 127.0.0.1 unless told otherwise,
and on SIGTERM (or Ctrl-C) it stops taking connections, answers the requests in flight, and exits 0."""
from __future__ import annotations

import os
import signal
from pathlib import Path

from ..errors import ConfigError
from .defaults import MAX_BATCH_SIZE, MAX_IMAGE_PIXELS, MAX_UPLOAD_MB, MAX_WAIT_MS

__all__ = ["require_serving", "serve"]


def require_serving() -> None:
    """One line if the ``serve`` extra (FastAPI, uvicorn, python-multipart) is not installed."""
    for module, package in (("fastapi", "fastapi"), ("uvicorn", "uvicorn"), ("multipart", "python-multipart")):
        try:
            __import__(module)
        except ImportError:
            raise ConfigError(f"vitlab serve needs {package}, which is not installed: pip install 'vitlab[serve]'") \
                from None


def serve(checkpoint: str | Path, host: str = "127.0.0.1", port: int = 8000, *, max_batch_size: int = MAX_BATCH_SIZE,
          max_wait_ms: float = MAX_WAIT_MS, max_upload_mb: float = MAX_UPLOAD_MB, api_key_env: str | None = None,
          cors_origins: tuple[str, ...] = (), device: str | None = None, precision: str = "run",
          log_level: str = "info", max_image_pixels: int = MAX_IMAGE_PIXELS, unknown: str = "auto",
          unknown_label: str = "unknown") -> None:
    """Serve the classifier in ``checkpoint`` at ``http://host:port`` until SIGTERM; ``api_key_env``: the
    environment variable holding the key every route but ``/health`` asks for; ``unknown``, ``unknown_label``: as
    :func:`~vitlab.serving.app.create_app`'s."""
    require_serving()
    if not 1 <= max_batch_size <= 4096:
        raise ConfigError(f"--max-batch-size {max_batch_size}: give 1 (a forward pass a request) to 4096")
    if max_wait_ms < 0 or max_upload_mb <= 0:
        raise ConfigError("--max-wait-ms must be >= 0 and --max-upload-mb > 0")
    if max_image_pixels < 1:
        raise ConfigError(f"--max-image-pixels {max_image_pixels}: give the most pixels (width x height) an image may "
                          f"have, 1 or more")
    key = None
    if api_key_env:
        key = os.environ.get(api_key_env, "")
        if not key:
            raise ConfigError(f"--api-key-env {api_key_env}: the variable is not set or empty; export "
                              f"{api_key_env}=<a long random string> first")
    import uvicorn

    from ..checkpoint import load_model
    from .app import create_app

    model = load_model(checkpoint)
    if not (model.pretrained_cfg or {}).get("label_names"):
        raise ConfigError(f"{checkpoint}: not an image classifier with class names; vitlab serve serves one")
    app = create_app(model, checkpoint=checkpoint, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms,
                     max_upload_mb=max_upload_mb, api_key=key, cors_origins=cors_origins, device=device,
                     precision=precision, max_image_pixels=max_image_pixels, unknown=unknown,
                     unknown_label=unknown_label)
    print(f"serving {checkpoint} at http://{host}:{port} (the page: /, the API: /docs"
          f"{'; every route but /health asks for the key in $' + api_key_env if key else ''})", flush=True)
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again under the handler it found: this one
    # takes it, so a server stopped so has done its job and exits 0 (SIGINT keeps Python's: KeyboardInterrupt, 130).
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print("stopped: the requests in flight were answered", flush=True)
