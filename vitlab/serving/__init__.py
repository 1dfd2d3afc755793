"""Serving a classifier over HTTP (``vitlab serve``): :mod:`.uploads` (images from bytes, as predict reads files),
:mod:`.batching` (dynamic batching), :mod:`.app` (the FastAPI routes and the page), :mod:`.server` (uvicorn)."""
from .server import serve

__all__ = ["serve"]
