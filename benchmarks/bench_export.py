"""``vitlab export --with-preprocess`` (float32 and ``--quantize int8``) against ``vitlab predict`` on CIFAR-10's
10,000 test images: the top-1 of each file, how often it equals predict's, its test top-1, and its images a second
on this machine's CPU (onnxruntime, batches of 64, the median of 3 passes over 2,048 images).

    python benchmarks/bench_export.py --checkpoint RUN --cifar ../shared/data/cifar10 --out DIR
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--cifar", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    import onnxruntime

    from vitlab.cli import main as vitlab

    args.out.mkdir(parents=True, exist_ok=True)
    files = sorted((args.cifar / "test").rglob("*.png"))
    classes = sorted(p.name for p in (args.cifar / "test").iterdir())
    labels = np.array([classes.index(f.parent.name) for f in files])
    pixels = np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files])
    record: dict = {"checkpoint": args.checkpoint, "images": len(files), "command": " ".join(sys.argv)}
    predicted = {}
    for precision in ("no", "run"):  # float32, and the run's own (what predict does by default)
        out = args.out / f"predict_{precision}.jsonl"
        if not out.is_file():
            vitlab(["predict", "--checkpoint", args.checkpoint, "--output", str(out), "--topk", "1",
                    "--batch-size", "256", "--precision", precision, str(args.cifar / "test")])
        rows = {r["image"]: r["indices"][0] for r in map(json.loads, open(out))}
        predicted[precision] = np.array([rows[str(f)] for f in files])
        record[f"predict_{precision}_top1"] = float((predicted[precision] == labels).mean())
    for name, extra in (("float32", []), ("int8", ["--quantize", "int8"])):
        path = args.out / f"model_{name}.onnx"
        vitlab(["export", "--checkpoint", args.checkpoint, "--output", str(path), "--with-preprocess", *extra])
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 0  # onnxruntime's default: a thread a core
        session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        top1 = np.concatenate([session.run(None, {"images": pixels[i:i + 500]})[0].argmax(1)
                               for i in range(0, len(files), 500)])
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            for i in range(0, 2048, 64):
                session.run(None, {"images": pixels[i:i + 64]})
            seconds.append(time.perf_counter() - start)
        record[name] = {"file_mb": round(path.stat().st_size / 2**20, 1), "test_top1": float((top1 == labels).mean()),
                        "equal_to_predict_float32": int((top1 == predicted["no"]).sum()),
                        "equal_to_predict_run_precision": int((top1 == predicted["run"]).sum()),
                        "images_per_s": round(2048 / float(np.median(seconds)), 1)}
        print(name, json.dumps(record[name]), flush=True)
    record["int8_speedup"] = round(record["int8"]["images_per_s"] / record["float32"]["images_per_s"], 2)
    record["int8_top1_drop_points"] = round(100 * (record["float32"]["test_top1"] - record["int8"]["test_top1"]), 2)
    print(json.dumps(record))
    with open(args.out / "export.json", "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
