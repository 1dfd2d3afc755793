"""The HTTP API of ``vitlab serve`` (FastAPI on uvicorn; ``pip install 'vitlab[serve]'``, which this module needs).

=========================  ==========================================================================================
``POST /v1/predict``       one or several images (multipart files, or one image as the raw body with an ``image/*``
                           content type); ``top_k`` (default 5): Hugging Face's image-classification answer, a list of
                           ``{"label", "score"}`` an image (a list of such lists for several), scores at the run's
                           temperature; a multi-label run's: every class at or above its threshold (``top_k`` is
                           for single-label runs), as ``vitlab predict`` lists them
``POST /v1/embed``         the same images: ``{"embeddings": [[...], ...]}``, the pooled features
``POST /v1/attention``     one image: its attention rollout over the patch grid (``{"rows", "cols", "grid"}``)
``GET /v1/model``          the classes, the input size, the temperature and thresholds, the run's test metrics
``GET /health``            ``{"status": "ok", "images_pending": n}`` (images taken, not yet answered), the only
                           route open without the key
``GET /``                  a page to try it: drop or pick images, see the top 5 and where the model looked
``GET /docs``              the OpenAPI page (its script comes from a CDN; ``/openapi.json`` is served here)
=========================  ==========================================================================================

Every image goes through :func:`~vitlab.serving.uploads.model_images` (predict's reading) and
:class:`~vitlab.prediction.BatchPredictor` (predict's forward pass), batched by
:class:`~vitlab.serving.batching.DynamicBatcher`: the answers are those ``vitlab predict`` gives for the same files.
A bad request gets a 4xx answer ``{"error": "<one line>"}`` and the next request is served."""
from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from torch import Tensor, nn

from ..data.decode import TooManyPixels
from ..errors import DataError
from ..inference.forward import cpu_chunk
from ..inference.open_set import UnknownRule, stored_rule
from ..prediction import BatchPredictor
from ..runtime import autocast_dtype, default_device
from .batching import DynamicBatcher
from .defaults import MAX_BATCH_SIZE, MAX_IMAGE_PIXELS, MAX_IMAGES, MAX_UPLOAD_MB, MAX_WAIT_MS
from .uploads import PixelBudget, checked_pixels, model_images

__all__ = ["create_app"]


def _key_given(header: str, key: str) -> bool:
    """Whether an ``Authorization`` header carries ``key``: ``Bearer <key>``, or HTTP Basic with ``key`` as the
    password (what a browser sends once asked, so the page works behind the key too)."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return hmac.compare_digest(value.strip().encode(), key.encode())
    if scheme.lower() == "basic":
        try:
            password = base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return False
        return hmac.compare_digest(password.encode(), key.encode())
    return False


def _model_record(model: nn.Module, checkpoint: str | Path | None) -> dict[str, Any]:
    cfg = model.pretrained_cfg
    record: dict[str, Any] = {"name": cfg.get("architecture") or type(model).__name__,
                              "classes": list(cfg.get("label_names") or []), "input_size": list(cfg["input_size"]),
                              "multi_label": bool(cfg.get("multi_label")), "temperature": cfg.get("temperature", 1.0),
                              "thresholds": cfg.get("thresholds"), "metrics": {}}
    if checkpoint is not None:
        from ..checkpoint import read_json, resolve_checkpoint

        config = read_json(resolve_checkpoint(checkpoint) / "config.json")
        evaluation = (config.get("training") or {}).get("evaluation") or {}
        record["metrics"] = {k: v for k, v in evaluation.items() if k.startswith("test_")}
        record["evaluations"] = config.get("evaluations", [])
    return record


def create_app(model: nn.Module, *, checkpoint: str | Path | None = None, max_batch_size: int = MAX_BATCH_SIZE,
               max_wait_ms: float = MAX_WAIT_MS, max_upload_mb: float = MAX_UPLOAD_MB, max_images: int = MAX_IMAGES,
               api_key: str | None = None,
               cors_origins: tuple[str, ...] = (), device: str | torch.device | None = None,
               precision: str = "run", max_image_pixels: int = MAX_IMAGE_PIXELS, unknown: str = "auto",
               unknown_label: str = "unknown") -> FastAPI:
    """The FastAPI application serving ``model`` (a vitlab image classifier): the routes of the module's table.

    ``max_batch_size``, ``max_wait_ms``: the dynamic batching (1: a forward pass a request). ``max_upload_mb``: a
    larger body is refused (413) before it is read whole; ``max_images``: images a request; ``max_image_pixels``: an
    image whose header gives more pixels (width x height) is refused (413) before it is decoded, and the requests in
    flight decode at most that many pixels at once (:class:`~vitlab.serving.uploads.PixelBudget`). ``api_key``: every
    route but ``/health`` asks for it. ``cors_origins``: the origins whose pages may call the API (none by
    default). ``unknown``, ``unknown_label``: as ``vitlab predict``'s: an image below the threshold ``vitlab
    calibrate --unknown`` kept is answered first ``{"label": unknown_label, "score": its score, "unknown": true,
    "threshold": ...}``, then its classes."""
    names = list(model.pretrained_cfg.get("label_names") or [])
    device = default_device() if device is None else torch.device(device)
    model = model.to(device).eval()
    size = tuple(model.pretrained_cfg["input_size"][1:])
    chunk = cpu_chunk(model, (3, *size)) if device.type == "cpu" else 0
    rule = stored_rule(model.pretrained_cfg, unknown_label, unknown)
    predictor = BatchPredictor(model, device=device, dtype=autocast_dtype(model, precision, device), chunk=chunk,
                               names=names, unknown=rule)

    def run(kind: str, images: Tensor) -> Tensor:
        with torch.no_grad():
            if kind == "embed":
                return predictor.features(images)
            probs, scores = predictor.predictions(images)
            return probs if scores is None else torch.cat([probs, scores[:, None]], dim=1)  # the score: a last column

    batcher = DynamicBatcher(run, max_batch_size, max_wait_ms)
    record = _model_record(model, checkpoint)
    record["unknown"] = {"score": rule.score, "threshold": rule.threshold, "label": rule.label} if rule else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        batcher.start()
        yield
        await batcher.stop()
        predictor.close()

    app = FastAPI(title="vitlab", version="1", lifespan=lifespan,
                  description=f"{record['name']}: {len(names)} classes, input {record['input_size']}")
    app.state.batcher = batcher
    _error_answers(app)
    if api_key:
        _require_key(app, api_key)
    if cors_origins:  # added last, so outermost: it answers a preflight (which carries no key) and marks every answer
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    limits = _Limits(int(max_upload_mb * 2**20), max_images, max_image_pixels)
    _routes(app, model, device, batcher, record, limits, predictor.thresholds, rule)
    return app


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _error_answers(app: FastAPI) -> None:
    """Every error as ``{"error": "<one line>"}``: FastAPI's own, and a request refused (:class:`_Refused`)."""
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        return _error(422, f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}")

    @app.exception_handler(_Refused)
    async def refused(request: Request, exc: _Refused) -> JSONResponse:
        return _error(exc.status, exc.message)


def _require_key(app: FastAPI, api_key: str) -> None:
    """Every route but ``/health`` answers 401 without ``api_key`` (:func:`_key_given`); the page's 401 asks the
    browser for it (HTTP Basic)."""
    @app.middleware("http")
    async def require_key(request: Request, call_next: Any) -> Any:
        if request.url.path == "/health" or _key_given(request.headers.get("authorization", ""), api_key):
            return await call_next(request)
        return _error(401, "this server asks for its API key: send 'Authorization: Bearer <key>'",
                      {"WWW-Authenticate": 'Basic realm="vitlab"'} if request.url.path == "/" else None)


class _Limits:
    def __init__(self, upload_bytes: int, images: int, pixels: int) -> None:
        self.upload_bytes, self.images, self.pixels = upload_bytes, images, pixels
        self.decoding = PixelBudget(pixels)

    def too_many_images(self) -> str:
        return f"more than {self.images} images in one request; this server takes at most {self.images}"


async def _read_images(request: Request, limits: _Limits) -> tuple[list[bytes], list[str]]:
    """The request's images (the raw body, or multipart files) and a name for each, read up to the size limit;
    :class:`_Refused` for a body too large (413), of another content type (415), without images or with an empty one
    (400), with too many (413)."""
    mb = limits.upload_bytes / 2**20
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limits.upload_bytes:
        raise _Refused(413, f"the request is {int(length) / 2**20:.1f} MB; this server takes at most {mb:g} MB "
                            f"(--max-upload-mb)")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limits.upload_bytes:
            raise _Refused(413, f"the request is over {mb:g} MB, the most this server takes (--max-upload-mb)")
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind.startswith("image/") or kind == "application/octet-stream":
        blobs, labels = [bytes(body)], ["the image"]
    elif kind == "multipart/form-data":
        request._body = bytes(body)  # parsed from what was read (starlette reads request._body when it is set)
        try:
            form = await request.form(max_files=limits.images)
        except StarletteHTTPException as e:  # starlette's own count of the files, at the same limit
            raise _Refused(413 if "Too many files" in str(e.detail) else 400,
                           limits.too_many_images() if "Too many files" in str(e.detail) else str(e.detail)) from None
        uploads = [v for _, v in form.multi_items() if hasattr(v, "read")]
        blobs = [await u.read() for u in uploads]
        labels = [f"file {u.filename!r}" if u.filename else f"file {i + 1}" for i, u in enumerate(uploads)]
    else:
        raise _Refused(415, f"send images as multipart/form-data files or as the raw body with an image/* content "
                            f"type, not {kind or 'no content type'}")
    if not blobs:
        raise _Refused(400, "no image in the request: send one or more image files")
    if len(blobs) > limits.images:
        raise _Refused(413, limits.too_many_images())
    empty = [n for n, b in zip(labels, blobs) if not b]
    if empty:
        raise _Refused(400, f"{empty[0]} is empty (0 bytes)")
    return blobs, labels


def _routes(app: FastAPI, model: nn.Module, device: torch.device, batcher: DynamicBatcher, record: dict[str, Any],
            limits: _Limits, thresholds: Tensor | None, rule: UnknownRule | None = None) -> None:
    """The routes of the module's table (``thresholds``: a multi-label run's, as predict applies them; ``rule``: the
    unknown threshold, whose scores the batches' rows carry as a last column)."""
    from starlette.concurrency import run_in_threadpool

    names = record["classes"]

    async def model_input(request: Request) -> tuple[Tensor, int]:
        blobs, labels = await _read_images(request, limits)
        try:
            pixels = checked_pixels(blobs, labels, limits.pixels)  # from the headers: nothing decoded yet
        except TooManyPixels as e:
            raise _Refused(413, str(e)) from None

        def decode() -> Tensor:
            with limits.decoding.hold(pixels):
                return model_images(model, blobs, labels)

        try:
            return await run_in_threadpool(decode), len(blobs)
        except DataError as e:
            raise _Refused(400, str(e)) from None

    @app.post("/v1/predict", summary="classify images (Hugging Face image-classification answer)")
    async def predict(request: Request, top_k: int = 5) -> Any:
        if top_k < 1:
            raise _Refused(422, f"top_k={top_k}: give how many classes to list, 1 or more")
        images, count = await model_input(request)
        probs = await batcher.submit("predict", images)
        if rule is None:
            answers = [_answer(row, names, top_k, thresholds) for row in probs]
        else:
            answers = [_unknown(float(row[-1]), rule) + _answer(row[:-1], names, top_k, None) for row in probs]
        return answers[0] if count == 1 and not _is_multipart(request) else answers

    @app.post("/v1/embed", summary="the pooled features of images")
    async def embed(request: Request) -> Any:
        images, _ = await model_input(request)
        return {"embeddings": (await batcher.submit("embed", images)).tolist()}

    @app.post("/v1/attention", summary="one image's attention rollout over the patch grid")
    async def attention(request: Request) -> Any:
        if not hasattr(model, "get_attention_maps"):
            raise _Refused(404, f"{type(model).__name__} gives no attention maps")
        images, count = await model_input(request)
        if count != 1:
            raise _Refused(422, f"one image a request, not {count}")
        heat = await run_in_threadpool(_rollout, model, images[0], device)
        return {"rows": heat.shape[0], "cols": heat.shape[1], "grid": heat.tolist()}

    @app.get("/v1/model", summary="what this model is")
    async def model_info() -> Any:
        return record

    @app.get("/health", summary="whether the server is up, and the images it is working on (no key asked)")
    async def health() -> Any:
        return {"status": "ok", "images_pending": batcher.pending}

    app.head("/health", include_in_schema=False)(health)  # what load balancers send

    page = files("vitlab.serving").joinpath("page.html").read_text()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def home() -> Any:
        return page


class _Refused(Exception):
    """A request refused with an HTTP status and one line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _is_multipart(request: Any) -> bool:
    return request.headers.get("content-type", "").lower().startswith("multipart/")


def _answer(probs: Tensor, names: list[str], top_k: int, thresholds: Tensor | None) -> list[dict[str, Any]]:
    """One image's ``[{"label", "score"}, ...]``, highest first: its ``top_k`` classes; a multi-label run's
    (``thresholds``: :class:`~vitlab.prediction.BatchPredictor`'s) every class at or above its threshold, as ``vitlab
    predict``'s row lists them (``top_k`` is for single-label runs)."""
    order = probs.argsort(descending=True).tolist()
    if thresholds is not None:
        return [{"label": names[k], "score": float(probs[k])} for k in order if probs[k] >= thresholds[k]]
    return [{"label": names[k], "score": float(probs[k])} for k in order[:top_k]]


def _unknown(score: float, rule: UnknownRule) -> list[dict[str, Any]]:
    """The entry that says an image is of none of the classes (its score below the rule's threshold), or none."""
    if score >= rule.threshold:
        return []
    return [{"label": rule.label, "score": score, "unknown": True, "threshold": rule.threshold}]


def _rollout(model: nn.Module, image: Tensor, device: torch.device) -> Tensor:
    """The attention rollout ``(rows, cols)`` of one uint8 image as eval shows it, scaled to [0, 1]."""
    from ..data.transforms import ModelInput
    from ..visualize.rollout import attention_rollout, cls_attention_map

    cfg = model.pretrained_cfg
    with torch.no_grad():
        x = ModelInput(cfg["mean"], cfg["std"])(image[None].to(device))
        maps = model.get_attention_maps(x)
        heat = cls_attention_map(attention_rollout(maps, "mean", 0.0, model.num_prefix_tokens), model)[0].float().cpu()
    return (heat - heat.min()) / (heat.max() - heat.min()).clamp(min=1e-12)
