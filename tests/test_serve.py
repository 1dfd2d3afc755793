"""``vitlab serve``: its answers against ``vitlab predict``'s, dynamic batching, bad uploads, the API key, CORS,
SIGTERM, and the page in a real browser (Chromium driven by Playwright)."""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import forked

pytest.importorskip("fastapi", reason="vitlab[serve] is not installed")
pytest.importorskip("multipart", reason="vitlab[serve] (python-multipart) is not installed")
httpx = pytest.importorskip("httpx", reason="httpx (FastAPI's test client) is not installed")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tiny_run):
    return tiny_run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """``vitlab serve`` in a process of its own (forked from the test's: :func:`helpers.forked.start`), on a free
    port, until stopped; :meth:`stop` gives its output, standard output then standard error."""

    def __init__(self, run: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = forked.start(["-m", "vitlab.cli", "serve", "--checkpoint", str(run), "--port", str(self.port),
                                  "--device", "cpu", *args], {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                                 cwd=ROOT)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
            if self.proc.poll() is not None:
                break
        raise AssertionError(f"the server did not start: {self.stop()}")

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, err = self.proc.communicate(timeout=60)
        return out + err


def _test_images(root: Path) -> list[Path]:
    return sorted((root / "test").rglob("*.png"))[::4]


def test_answers_equal_vitlab_predicts_and_requests_share_forward_passes(run, tiny_imagefolder, tmp_path, on_cpu):
    import uvicorn

    from vitlab.checkpoint import load_model
    from vitlab.cli import main
    from vitlab.serving.app import create_app

    files = _test_images(tiny_imagefolder)
    main(["predict", "--checkpoint", str(run), "--output", str(tmp_path / "p.jsonl"), "--topk", "3",
          "--num-workers", "0", *map(str, files)])
    expected = {r["image"]: dict(zip(r["classes"], r["probs"])) for r in map(json.loads, open(tmp_path / "p.jsonl"))}
    app = create_app(load_model(run), checkpoint=run, max_batch_size=64, max_wait_ms=200, device="cpu")
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        url = f"http://127.0.0.1:{port}"

        def ask(path: Path) -> list[dict]:
            return httpx.post(f"{url}/v1/predict?top_k=3", content=path.read_bytes(),
                              headers={"Content-Type": "image/png"}, timeout=60).json()

        with ThreadPoolExecutor(len(files)) as pool:  # arriving together: they share forward passes
            answers = list(pool.map(ask, files))
        batches = app.state.batcher.batches
        assert batches < len(files)
        for path, answer in zip(files, answers):
            assert [a["label"] for a in answer] == list(expected[str(path)])
            for a in answer:
                assert a["score"] == pytest.approx(expected[str(path)][a["label"]], abs=1e-6)
        several = httpx.post(f"{url}/v1/predict?top_k=3", files=[("files", (p.name, p.read_bytes(), "image/png"))
                                                                  for p in files[:3]], timeout=60).json()
        # a list an image, in the order sent (another batch: a score's last bits may differ, as on 16 cores)
        assert [[a["label"] for a in r] for r in several] == [[a["label"] for a in r] for r in answers[:3]]
        assert [[a["score"] for a in r] for r in several] == [pytest.approx([a["score"] for a in r], abs=1e-6)
                                                              for r in answers[:3]]
        embedded = httpx.post(f"{url}/v1/embed", files=[("files", ("a.png", files[0].read_bytes(), "image/png"))],
                              timeout=60).json()["embeddings"]
        assert len(embedded) == 1 and len(embedded[0]) == 32
        info = httpx.get(f"{url}/v1/model").json()
        assert info["classes"] == ["class_0", "class_1", "class_2"] and info["input_size"] == [3, 32, 32]
        assert 0 <= info["metrics"]["test_top1"] <= 1
        rollout = httpx.post(f"{url}/v1/attention", content=files[0].read_bytes(),
                             headers={"Content-Type": "image/png"}).json()
        assert (rollout["rows"], rollout["cols"]) == (8, 8) and max(max(r) for r in rollout["grid"]) == 1.0
        assert "/v1/predict" in httpx.get(f"{url}/openapi.json").json()["paths"]
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_multi_label_answer_lists_every_class_predict_lists(tiny_imagefolder, tmp_path, on_cpu):
    """Eight classes at or above their thresholds: the answer lists all eight, as predict's row does (top_k is for
    single-label runs)."""
    import torch
    from fastapi.testclient import TestClient

    import vitlab
    from vitlab.prediction import predict_images
    from vitlab.serving.app import create_app

    model = vitlab.create_model("vit_cifar_tiny_patch4_32", embed_dim=32, depth=1, num_heads=2).eval()
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.copy_(torch.linspace(-2, 2, 10))  # sigmoids 0.12 ... 0.88, whatever the image
    names = [f"class {k}" for k in range(10)]
    model.pretrained_cfg = {"label_names": names, "input_size": [3, 32, 32], "mean": [0.5] * 3, "std": [0.25] * 3,
                            "multi_label": True, "thresholds": [0.2] * 10}
    image = _test_images(tiny_imagefolder)[0]
    predict_images(model, [str(image)], tmp_path / "p.jsonl", num_workers=0, device="cpu")
    expected = json.loads((tmp_path / "p.jsonl").read_text())["labels"]
    assert len(expected) == 8
    with TestClient(create_app(model, device="cpu")) as client:
        answer = client.post("/v1/predict", content=image.read_bytes(), headers={"Content-Type": "image/png"}).json()
    assert [a["label"] for a in answer] == expected[::-1]  # highest first
    assert [a["score"] for a in answer] == sorted((a["score"] for a in answer), reverse=True)


@pytest.mark.slow
def test_bad_uploads_get_one_line_each_and_the_next_request_is_served(run, tiny_imagefolder, tmp_path, on_cpu):
    from PIL import Image

    good = _test_images(tiny_imagefolder)[0].read_bytes()
    huge = tmp_path / "huge.jpg"  # 100 megapixels (a flat colour: a small file, a large decode)
    Image.new("RGB", (10_000, 10_000), (200, 30, 30)).save(huge, quality=80)
    server = _Server(run, "--max-upload-mb", "2", "--max-image-pixels", "100000000")
    try:
        def post(content: bytes, kind: str = "image/png") -> httpx.Response:
            return httpx.post(f"{server.url}/v1/predict", content=content, headers={"Content-Type": kind}, timeout=60)

        many = [("files", (f"{i}.png", good, "image/png")) for i in range(66)]
        cases = {
            "not an image": (post(b"plain text, not pixels"), 400, "is not an image that can be read"),
            "a small PNG of 120 megapixels": (post(_png_header(12_000, 10_000)), 413,
                                              "is 12,000 x 10,000 = 120,000,000 pixels, more than the 100,000,000"),
            "65 files": (httpx.post(f"{server.url}/v1/predict", files=many[:65], timeout=60), 413,
                         "more than 64 images in one request; this server takes at most 64"),
            "66 files": (httpx.post(f"{server.url}/v1/predict", files=many, timeout=60), 413,
                         "more than 64 images in one request; this server takes at most 64"),
            "truncated": (post(good[:len(good) // 2]), 400, "is not an image that can be read"),
            "empty": (post(b""), 400, "is empty (0 bytes)"),
            "too large": (post(b"\0" * (3 * 2**20)), 413, "at most 2 MB"),
            "a path, as JSON": (post(json.dumps({"path": "/etc/passwd"}).encode(), "application/json"), 415,
                                "not application/json"),
            "a path, as a form field": (httpx.post(f"{server.url}/v1/predict", data={"image": "/etc/passwd"},
                                                   files={"x": ("", b"")}, timeout=60), 400,
                                        "no image in the request"),
        }
        for name, (response, status, words) in cases.items():
            body = response.json()
            assert response.status_code == status and words in body["error"], name
            assert list(body) == ["error"] and "\n" not in body["error"], name
            assert "object at 0x" not in body["error"], name  # the file and the reason, no internal object
            assert post(good).status_code == 200, f"after {name}"
        assert httpx.head(f"{server.url}/health").status_code == 200  # what load balancers send
        pid = server.proc.pid
        before = _peak_rss(pid)
        answer = post(huge.read_bytes(), "image/jpeg")
        assert answer.status_code == 200 and len(answer.json()) == 3
        assert _peak_rss(pid) - before < 150 * 2**20  # decoded scaled: not the 300 MB of its pixels
        # no --cors-origin: no page elsewhere may call it from a browser
        response = httpx.get(f"{server.url}/v1/model", headers={"Origin": "http://allowed.example"})
        assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
    finally:
        out = server.stop()
    assert server.proc.returncode == 0, out
    assert f"at http://127.0.0.1:{server.port}" in out  # this machine only, unless --host says otherwise


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header says ``width x height`` (RGB, 8 bits) and whose data is a few bytes: what a small file of one
    colour that would decode to a large image looks like before decoding (the limit must be read from the header)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def test_the_pixels_decoded_at_once_are_bounded_across_requests():
    from vitlab.serving.uploads import PixelBudget

    budget, order = PixelBudget(100), []
    first_in, first_out = threading.Event(), threading.Event()

    def big(name: str, pixels: int, hold: threading.Event | None = None) -> None:
        with budget.hold(pixels):
            order.append(f"{name} in")
            if hold is not None:
                first_in.set()
                hold.wait(10)
            order.append(f"{name} out")

    a = threading.Thread(target=big, args=("a", 70, first_out))
    a.start()
    first_in.wait(10)
    b = threading.Thread(target=big, args=("b", 40))  # 70 + 40 > 100: waits for a
    c = threading.Thread(target=big, args=("c", 30))  # 70 + 30 fits: goes beside a
    b.start()
    c.start()
    c.join(10)
    b.join(0.2)
    assert b.is_alive() and order == ["a in", "c in", "c out"] and budget.held == 70  # b still waits for a
    first_out.set()
    a.join(10)
    b.join(10)
    assert order[3:] == ["a out", "b in", "b out"] and budget.held == 0
    with budget.hold(10**9):  # more than the whole budget: alone
        assert budget.held == 100


def _peak_rss(pid: int) -> int:
    """A process's peak resident memory (VmHWM), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.slow
def test_the_api_key_guards_every_route_but_health_and_sigterm_answers_what_is_in_flight(run, tiny_imagefolder,
                                                                                           on_cpu):
    # --max-wait-ms 1500: a request waits 1.5 s for company before its forward pass (in flight when SIGTERM comes)
    server = _Server(run, "--api-key-env", "VITLAB_TEST_KEY", "--cors-origin", "http://allowed.example",
                     "--max-wait-ms", "1500", env={"VITLAB_TEST_KEY": "s3cret-key"})
    key = {"Authorization": "Bearer s3cret-key"}
    image = _test_images(tiny_imagefolder)[0].read_bytes()
    try:
        url = server.url
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "images_pending": 0}
        for path in ("/v1/model", "/", "/openapi.json"):
            refused = httpx.get(f"{url}{path}")
            assert refused.status_code == 401 and "Authorization: Bearer" in refused.json()["error"]
        assert httpx.get(f"{url}/").headers["www-authenticate"] == 'Basic realm="vitlab"'  # a browser asks for it
        assert httpx.get(f"{url}/v1/model", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{url}/v1/model", headers=key).status_code == 200
        basic = base64.b64encode(b"anyone:s3cret-key").decode()
        assert httpx.get(f"{url}/", headers={"Authorization": f"Basic {basic}"}).status_code == 200
        assert httpx.post(f"{url}/v1/predict", content=image, headers={"Content-Type": "image/png"}).status_code == 401
        # a browser's preflight carries no key (the Fetch standard leaves credentials out of it): CORS answers it
        preflight = {"Origin": "http://allowed.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        allowed = httpx.options(f"{url}/v1/predict", headers=preflight)
        assert allowed.status_code == 200
        assert allowed.headers.get("access-control-allow-origin") == "http://allowed.example"
        assert "authorization" in allowed.headers.get("access-control-allow-headers", "").lower()
        other = httpx.options(f"{url}/v1/predict", headers={**preflight, "Origin": "http://other.example"})
        assert "access-control-allow-origin" not in other.headers
        # the page's own requests: answered with the key, refused without it, and either way readable by the page
        origin = {"Origin": "http://allowed.example"}
        with_key = httpx.post(f"{url}/v1/predict", content=image, headers={"Content-Type": "image/png", **key, **origin})
        assert with_key.status_code == 200 and with_key.headers["access-control-allow-origin"] == origin["Origin"]
        without = httpx.post(f"{url}/v1/predict", content=image, headers={"Content-Type": "image/png", **origin})
        assert without.status_code == 401 and without.headers["access-control-allow-origin"] == origin["Origin"]
        bomb = httpx.post(f"{url}/v1/predict", content=_png_header(9000, 9000),
                          headers={"Content-Type": "image/png", **key})
        assert bomb.status_code == 413 and "more than the 40,000,000" in bomb.json()["error"]  # the default
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{url}/v1/predict", content=image,
                                  headers={"Content-Type": "image/png", **key}, timeout=60)
            deadline = time.time() + 30
            while httpx.get(f"{url}/health").json()["images_pending"] < 1:  # in flight
                assert time.time() < deadline and not pending.done(), "the request was not seen in flight"
                time.sleep(0.02)
            server.proc.send_signal(signal.SIGTERM)
            answer = pending.result()
        server.proc.wait(60)  # exits by itself: a second SIGTERM from stop() while it exits would find the default
    finally:
        out = server.stop()
    assert answer.status_code == 200 and len(answer.json()) == 3
    assert server.proc.returncode == 0, out
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=2)


def test_a_missing_extra_is_one_line(monkeypatch):
    import builtins

    from vitlab.errors import ConfigError
    from vitlab.serving.server import require_serving

    real = builtins.__import__

    def no_uvicorn(name, *args, **kwargs):
        if name == "uvicorn":
            raise ImportError("No module named 'uvicorn'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvicorn)
    with pytest.raises(ConfigError, match=r"needs uvicorn, which is not installed: pip install 'vitlab\[serve\]'"):
        require_serving()


def _chromium() -> str | None:
    return next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)


@pytest.mark.slow
@pytest.mark.browser
def test_the_page_in_a_real_browser_shows_the_top_1_vitlab_predict_gives(run, tiny_imagefolder, tmp_path, on_cpu):
    # The run served with an unknown threshold above every image's maximum softmax (2.0): the page says so above
    # the classes, as the API answers it first
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    browser_path = _chromium()
    if browser_path is None:
        pytest.skip("no Chromium on this machine (Debian: apt install chromium)")
    from vitlab.checkpoint import resolve_checkpoint
    from vitlab.cli import main
    from vitlab.models.calibrated import set_calibration

    run = Path(shutil.copytree(run, tmp_path / "run"))
    set_calibration(resolve_checkpoint(run), "model.safetensors", unknown={"score": "msp", "threshold": 2.0,
                                                                            "keep": 0.95})
    image = _test_images(tiny_imagefolder)[5]
    main(["predict", "--checkpoint", str(run), "--output", str(tmp_path / "p.jsonl"), "--num-workers", "0",
          str(image)])
    expected = json.loads((tmp_path / "p.jsonl").read_text())["classes"][0]
    server = _Server(run)
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
            page = browser.new_page()
            offline: list[str] = []  # every request the page makes must be to this server (no CDN)
            page.on("request", lambda r: None if r.url.startswith(server.url) or r.url.startswith("blob:")
                    or r.url.startswith("data:") else offline.append(r.url))
            page.goto(server.url)
            page.wait_for_selector("#about:not(:has-text('loading'))")
            assert "3 classes, input 32 x 32" in page.inner_text("#about")
            page.set_input_files("#pick", str(image))
            page.wait_for_selector(".card .row")
            shown = page.inner_text(".card .row .label")
            rows = page.locator(".card .row").count()
            said = page.inner_text(".card .unknown")
            browser.close()
        assert shown == expected and rows == 3 and offline == []
        assert said.startswith("unknown: score 0.") and said.endswith("below 2.000")
    finally:
        server.stop()
