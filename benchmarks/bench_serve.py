"""Throughput and latency of ``vitlab serve``, with dynamic batching and without (benchmarks/RESULTS.md).

    python benchmarks/bench_serve.py --checkpoint RUN --images DIR --max-batch-size 32 --json OUT.jsonl
    python benchmarks/bench_serve.py --preset vit_small_patch16_224 --images DIR --max-batch-size 1 ...

The server runs in a process of its own (``vitlab serve``, its defaults but the batch size); ``--clients``
concurrent clients (asyncio, one keep-alive connection each, httpx) send ``--requests`` requests between them, each
one image (the files of DIR in turn, as the raw body). Reported: requests a second over the whole run, the median
and 99th percentile of the latency, failed requests, and the server's resident memory after the first 1,000 requests
and at the end (its processes together), and on a GPU the device's memory in use at both times (nvidia-smi).
``--client-processes N`` spreads the clients over N processes (one asyncio client process tops out at a few
thousand requests a second, below what a GPU server answers). ``--preset`` serves a model of that preset with fresh
weights (throughput
does not depend on them). ``--litserve``: the same model behind LitServe (benchmarks/litserve_server.py). Client and
server share the machine's cores, as on a small host.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]


def preset_checkpoint(preset: str, folder: Path) -> Path:
    """A checkpoint of ``preset`` with fresh weights and CIFAR-10's class names."""
    import vitlab
    from vitlab import checkpoint

    model = vitlab.create_model(preset, num_classes=10)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    checkpoint.write_model_files(model, folder, {"task": "classification", "classes": names,
                                                 "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}, preset)
    return folder


def gpu_used_mib() -> float | None:
    """The GPU's memory in use (MiB, nvidia-smi; the server is its only user here), or None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return float(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else None


def tree_rss(pid: int) -> int:
    """The resident memory of a process and of every process it started (LitServe's workers), bytes."""
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def start_server(checkpoint: str, *args: str, litserve: int = 0) -> tuple[subprocess.Popen, str]:
    """``vitlab serve --checkpoint checkpoint *args`` on a free port, once it answers ``/health``: the process and
    its URL. ``litserve``: benchmarks/litserve_server.py at that batch size instead."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, str(ROOT / "benchmarks" / "litserve_server.py"), checkpoint, str(port), str(litserve)] \
        if litserve else [sys.executable, "-m", "vitlab.cli", "serve", "--checkpoint", checkpoint, "--port", str(port),
                          *args]
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while server.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"vitlab serve --checkpoint {checkpoint} did not start (exit {server.returncode})")


async def drive(url: str, images: list[bytes], requests: int, clients: int, rss: dict, pid: int,
                multipart: bool = False, done: Any = None) -> dict:
    latencies: list[float] = []
    failed = 0
    sent = 0

    async def client() -> None:
        nonlocal failed, sent
        async with httpx.AsyncClient(timeout=300) as http:
            while sent < requests:
                i = sent
                sent += 1
                start = time.perf_counter()
                try:
                    if multipart:
                        r = await http.post(f"{url}/predict", files={"file": ("i.png", images[i % len(images)],
                                                                               "image/png")})
                    else:
                        r = await http.post(f"{url}/v1/predict", content=images[i % len(images)],
                                            headers={"Content-Type": "image/png"})
                    ok = r.status_code == 200 and len(r.json()) >= 1
                except httpx.HTTPError:
                    ok = False
                latencies.append(time.perf_counter() - start)
                failed += not ok
                if done is not None:
                    with done.get_lock():
                        done.value += 1
                elif len(latencies) == min(1000, requests):
                    rss["after_1000"], rss["gpu_after_1000"] = tree_rss(pid), gpu_used_mib()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    seconds = time.perf_counter() - start
    return {"latencies": latencies, "failed": failed, "seconds": seconds}


def summary(parts: list[dict], seconds: float) -> dict:
    """Requests a second over the whole run and the latency's median and 99th percentile, of every client."""
    lat = np.concatenate([np.array(p["latencies"]) for p in parts]) * 1000
    return {"requests": len(lat), "failed": sum(p["failed"] for p in parts), "seconds": round(seconds, 2),
            "requests_per_s": round(len(lat) / seconds, 1), "p50_ms": round(float(np.percentile(lat, 50)), 1),
            "p99_ms": round(float(np.percentile(lat, 99)), 1)}


def _client_process(url: str, images: list[bytes], requests: int, clients: int, multipart: bool) -> dict:
    return asyncio.run(drive(url, images, requests, clients, {}, 0, multipart, _DONE))


def drive_processes(url: str, images: list[bytes], requests: int, clients: int, processes: int, rss: dict, pid: int,
                    multipart: bool) -> dict:
    """:func:`drive` in ``processes`` processes at once (clients and requests shared out); the server's memory read
    once 1,000 requests are answered."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    done = context.Value("l", 0)
    share = lambda total, i: total // processes + (i < total % processes)
    with ProcessPoolExecutor(processes, mp_context=context, initializer=_keep, initargs=(done,)) as pool:
        pool.submit(int).result()  # the processes started before the clock does
        start = time.perf_counter()
        futures = [pool.submit(_client_process, url, images, share(requests, i), share(clients, i), multipart)
                   for i in range(processes)]
        while not all(f.done() for f in futures):
            if "after_1000" not in rss and done.value >= min(1000, requests):
                rss["after_1000"], rss["gpu_after_1000"] = tree_rss(pid), gpu_used_mib()
            time.sleep(0.05)
        seconds = time.perf_counter() - start
        if "after_1000" not in rss:
            rss["after_1000"], rss["gpu_after_1000"] = tree_rss(pid), gpu_used_mib()
        return summary([f.result() for f in futures], seconds)


_DONE: Any = None


def _keep(done: Any) -> None:
    global _DONE
    _DONE = done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint")
    parser.add_argument("--preset")
    parser.add_argument("--images", required=True, type=Path)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--client-processes", type=int, default=1, help="processes the clients are spread over")
    parser.add_argument("--json")
    parser.add_argument("--litserve", action="store_true", help="the model behind LitServe instead "
                                                                "(benchmarks/litserve_server.py; multipart uploads)")
    args = parser.parse_args()
    images = [p.read_bytes() for p in sorted(args.images.rglob("*.png"))[:256]]
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint or str(preset_checkpoint(args.preset, Path(tmp)))
        server, url = start_server(checkpoint, "--max-batch-size", str(args.max_batch_size),
                                   litserve=args.max_batch_size if args.litserve else 0)
        rss: dict = {}
        if args.client_processes > 1:
            result = drive_processes(url, images, args.requests, args.clients, args.client_processes, rss, server.pid,
                                     args.litserve)
        else:
            start = time.perf_counter()
            part = asyncio.run(drive(url, images, args.requests, args.clients, rss, server.pid, args.litserve))
            result = summary([part], time.perf_counter() - start)
        rss["end"], rss["gpu_end"] = tree_rss(server.pid), gpu_used_mib()
        children = psutil.Process(server.pid).children(recursive=True)
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
        for child in children:  # LitServe's workers outlive their parent's SIGTERM
            if child.is_running():
                child.kill()
    record = {"server": "litserve" if args.litserve else "vitlab serve", "model": args.preset or args.checkpoint,
              "max_batch_size": args.max_batch_size,
              "clients": args.clients, **result, "rss_after_1000_mb": round(rss["after_1000"] / 2**20, 1),
              "rss_end_mb": round(rss["end"] / 2**20, 1), "rss_ratio": round(rss["end"] / rss["after_1000"], 3),
              "gpu_used_after_1000_mib": rss.get("gpu_after_1000"), "gpu_used_end_mib": rss["gpu_end"],
              "client_processes": args.client_processes,
              "exit_code": code, "cpus": os.cpu_count(), "command": " ".join(sys.argv)}
    print(json.dumps(record))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
