"""What answering ``unknown`` costs ``vitlab predict``: the seconds an image of a whole predict job (files decoded,
rows written) with the threshold off, with a logit score (energy), with ViM (the default) and with the k-NN score, its
bank the run's own and one of ``--bank`` features (the run's training features repeated up to that many: the search
costs the same for any bank of that size). Each setting ``--repeats`` times, in turns, in one process; the median of
each. Then the k-NN score alone (:class:`~vitlab.inference.open_set.KNNScore`, k 50, 64-wide features, batches of 256)
against banks of 27,000 and ``--bank`` random features: what the search costs without the job around it.

    python benchmarks/bench_unknown.py --checkpoint runs/quick_val --images ../shared/data/cifar10/test/cat \\
        --count 1000 --bank 50000
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vitlab import load_model
from vitlab.checkpoint import resolve_checkpoint
from vitlab.prediction import list_images, predict_images
from vitlab.unknown import calibrate_unknown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a run with a validation split")
    parser.add_argument("--images", required=True, nargs="+", help="files, folders, globs")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--bank", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--output", help="the medians as JSON")
    args = parser.parse_args()
    files = list_images(args.images)[:args.count]
    work = Path(tempfile.mkdtemp())
    try:
        copies = {}
        for name, score in (("off", "energy"), ("energy", "energy"), ("vim", "vim"), ("knn", "knn"),
                            (f"knn {args.bank}", "knn")):
            copy = work / name.replace(" ", "_")
            shutil.copytree(resolve_checkpoint(args.checkpoint), copy)
            calibrate_unknown(copy, score)
            copies[name] = copy
        state = copies[f"knn {args.bank}"] / "open_set.model.safetensors"
        bank = load_file(str(state))["bank"]
        save_file({"bank": bank.repeat(-(-args.bank // len(bank)), 1)[:args.bank].contiguous()}, str(state))
        times: dict[str, list[float]] = {name: [] for name in copies}
        for _ in range(args.repeats):
            for name, copy in copies.items():
                model = load_model(copy)
                out = work / f"{name.replace(' ', '_')}.csv"
                out.unlink(missing_ok=True)
                start = time.perf_counter()
                predict_images(model, files, out, batch_size=args.batch_size, num_workers=0,
                               unknown="off" if name == "off" else "on")
                times[name].append((time.perf_counter() - start) / len(files))
    finally:
        shutil.rmtree(work)
    medians = {name: statistics.median(t) for name, t in times.items()}
    search = {n: _search_seconds(n, args.repeats) for n in (27_000, args.bank)}
    for n, seconds in search.items():
        print(f"the k-NN score alone, a bank of {n:,}: {1e3 * seconds:.3f} ms an image")
    for name, m in medians.items():
        print(f"{name:<12} {1e3 * m:.3f} ms an image ({m / medians['off']:.2f}x off)  runs: "
              + ", ".join(f"{1e3 * t:.3f}" for t in times[name]))
    if args.output:
        Path(args.output).write_text(json.dumps({"images": len(files), "threads": torch.get_num_threads(),
                                                 "seconds_an_image": medians, "runs": times,
                                                 "knn_search_seconds_an_image": search}, indent=1) + "\n")


def _search_seconds(bank: int, repeats: int, batch: int = 256, width: int = 64) -> float:
    from vitlab.inference.open_set import KNNScore

    generator = torch.Generator().manual_seed(0)
    score = KNNScore(50).fit(torch.randn(bank, width, generator=generator))
    queries = torch.randn(batch, width, generator=generator)
    score(queries)  # warm
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        score(queries)
        runs.append((time.perf_counter() - start) / batch)
    return statistics.median(runs)


if __name__ == "__main__":
    main()
