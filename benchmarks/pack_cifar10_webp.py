"""Carry an ImageFolder tree of small images to a machine that takes a limited transfer per call, losslessly.

CIFAR-10's 60,000 PNGs are 135 MB (three calls of 45 MB under a 64 MiB limit). Re-encoded as lossless WebP
(libwebp through Pillow, method 4) they are 103 MB: two calls. Every image is decoded to RGB here and the
WebP checked to give back the same pixels before it is written; the unpacker writes PNGs again and prints
the pixel digest (SHA-256 over each image's SHA-256 of its RGB bytes, in path order), which must equal the
one the packer printed.

    python benchmarks/pack_cifar10_webp.py pack ../shared/data/cifar10 .gpu/cifar10.webp --parts 2
    python benchmarks/pack_cifar10_webp.py unpack .gpu/cifar10.webp.0 .gpu/cifar10.webp.1 --out /tmp/w/cifar10

``--exclude LIST`` leaves out the images LIST names (paths relative to the source, a line each); ``--quality Q``
writes lossy WebP at quality Q (CIFAR-10 at 95: 0.73 KB an image against 1.8 KB lossless), the digest then of the
pixels the WebP gives back (what the unpacker prints), not of the source's.

The stream: an 8-byte little-endian length, a JSON index ``[[relative path, size], ...]``, the WebP bytes.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import struct
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from PIL import Image

SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def _encode(job: tuple[str, int]) -> tuple[bytes, bytes]:
    """(WebP bytes, SHA-256 of the RGB pixels they give back) of one image file: lossless (quality 0), or lossy at
    that quality."""
    path, quality = job
    with Image.open(path) as img:
        rgb = img.convert("RGB")
    buf = io.BytesIO()
    rgb.save(buf, "WEBP", lossless=not quality, quality=quality or 100, method=4)
    data = buf.getvalue()
    with Image.open(io.BytesIO(data)) as back:
        pixels = back.convert("RGB").tobytes()
    if not quality and pixels != rgb.tobytes():
        raise RuntimeError(f"{path}: the WebP does not give back the same pixels")
    return data, hashlib.sha256(pixels).digest()


def _decode_to_png(job: tuple[bytes, str]) -> bytes:
    """Write one WebP as a PNG at ``dest``; the SHA-256 of its RGB pixels."""
    data, dest = job
    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
    rgb.save(dest, "PNG", compress_level=1)
    return hashlib.sha256(rgb.tobytes()).digest()


def pack(src: Path, out: str, parts: int, workers: int, exclude: Path | None = None, quality: int = 0) -> None:
    left_out = set(exclude.read_text().split("\n")) if exclude is not None else set()
    paths = sorted(p for p in src.rglob("*") if p.suffix.lower() in SUFFIXES and str(p.relative_to(src)) not in left_out)
    start = time.time()
    with ProcessPoolExecutor(workers) as pool:
        encoded = list(pool.map(_encode, [(str(p), quality) for p in paths], chunksize=256))
    index = [[str(p.relative_to(src)), len(data)] for p, (data, _) in zip(paths, encoded)]
    head = json.dumps(index).encode()
    blob = struct.pack("<Q", len(head)) + head + b"".join(data for data, _ in encoded)
    digest = hashlib.sha256(b"".join(h for _, h in encoded)).hexdigest()
    size = -(-len(blob) // parts)
    for i in range(parts):
        Path(f"{out}.{i}").parent.mkdir(parents=True, exist_ok=True)
        Path(f"{out}.{i}").write_bytes(blob[i * size:(i + 1) * size])
    source_bytes = sum(p.stat().st_size for p in paths)
    print(f"{len(paths)} images, {source_bytes / 1e6:.1f} MB as files -> {len(blob) / 1e6:.1f} MB in {parts} parts "
          f"of {size / 1e6:.1f} MB ({time.time() - start:.0f} s); pixel digest {digest}")


def unpack(parts: list[str], out: Path, workers: int) -> None:
    start = time.time()
    blob = b"".join(Path(p).read_bytes() for p in parts)
    (n,) = struct.unpack("<Q", blob[:8])
    index = json.loads(blob[8:8 + n])
    offset, jobs = 8 + n, []
    for rel, size in index:
        dest = out / rel
        dest = dest.with_suffix(".png")
        dest.parent.mkdir(parents=True, exist_ok=True)
        jobs.append((blob[offset:offset + size], str(dest)))
        offset += size
    if offset != len(blob):
        raise SystemExit(f"the parts hold {len(blob)} bytes, the index {offset}: a part is missing or cut")
    with ProcessPoolExecutor(workers) as pool:
        hashes = list(pool.map(_decode_to_png, jobs, chunksize=256))
    digest = hashlib.sha256(b"".join(hashes)).hexdigest()
    print(f"{len(jobs)} images as PNG under {out} ({time.time() - start:.1f} s); pixel digest {digest}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("src", type=Path)
    p.add_argument("out")
    p.add_argument("--parts", type=int, default=2)
    p.add_argument("--exclude", type=Path, help="a file of paths relative to SRC (a line each) to leave out")
    p.add_argument("--quality", type=int, default=0, help="lossy WebP at this quality (1-100); 0: lossless")
    u = sub.add_parser("unpack")
    u.add_argument("parts", nargs="+")
    u.add_argument("--out", type=Path, required=True)
    for s in (p, u):
        s.add_argument("--workers", type=int, default=os.cpu_count())
    args = parser.parse_args()
    if args.cmd == "pack":
        pack(args.src, args.out, args.parts, args.workers, args.exclude, args.quality)
    else:
        unpack(args.parts, args.out, args.workers)


if __name__ == "__main__":
    main()
