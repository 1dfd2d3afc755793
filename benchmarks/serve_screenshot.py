"""The screenshot of ``vitlab serve``'s page in docs/serving.md: the server on a checkpoint, the page in Chromium
(Playwright), images picked through it, the page as it then shows them.

    python benchmarks/serve_screenshot.py --checkpoint RUN --out docs/serving_page.png IMAGE [IMAGE ...]
"""
from __future__ import annotations

import argparse
import shutil
import signal
import time

from bench_serve import start_server  # benchmarks/, the script's folder
from playwright.sync_api import sync_playwright


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("images", nargs="+")
    args = parser.parse_args()
    server, url = start_server(args.checkpoint)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 900, "height": 640})
            page.goto(url)
            page.wait_for_selector("#about:not(:has-text('loading'))")
            for image in reversed(args.images):  # the page shows the newest first
                page.set_input_files("#pick", image)
                page.wait_for_function("document.querySelectorAll('.card .hint').length >= 1")
            page.wait_for_function(f"document.querySelectorAll('.card .hint').length == {len(args.images)}")
            time.sleep(0.5)  # the attention overlays
            page.screenshot(path=args.out, full_page=True)
            browser.close()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
