"""The measurements of ``vitlab inspect`` on the real CIFAR-10 images (benchmarks/RESULTS.md, docs/inspect.md).

    python benchmarks/inspect_cifar10.py backbone-list ../shared/data/cifar10 OUT   # the subset, to leave out
    python benchmarks/inspect_cifar10.py prepare ../shared/data/cifar10 OUT       # the planted data set
    python benchmarks/inspect_cifar10.py run OUT --checkpoint RUN                  # inspect it (--knn, --folds 5)
    python benchmarks/inspect_cifar10.py train OUT --seeds 0,1,2                   # noisy list against clean list
    python benchmarks/inspect_cifar10.py threshold OUT --checkpoint RUN            # the duplicate threshold
    python benchmarks/inspect_cifar10.py report OUT                                # precision, recall, counts

The subset: 1,000 training images of each class (10,000), drawn with seed 0 from the sorted listing. The features
come from a backbone that never saw them: ``configs/vit_cifar10_fast.yaml`` trained on the other 40,000 training
images (``backbone-list`` writes the 10,000 to leave out of its training set). The planted data set
(``prepare``), a csv data set:

- ``train``: the subset, 1,000 of them (10%, seed 1) relabeled to another class drawn at random (``noise.csv``),
  and 100 outliers given a class at random (``outliers.csv``): 50 of noise (uniform, Gaussian, salt and pepper,
  flat colour, stripes) and 50 images of other kinds (handwritten digits and crops of the two photographs
  scikit-learn ships, a temple and a flower; all drawn with seed 2).
- ``test``: CIFAR-10's 10,000 test images and 200 near-duplicates of subset images (seed 3), each JPEG re-encoded
  (quality 75), resized by a factor in [0.9, 1.1], shifted by up to 3 pixels (edge padding) and colour-jittered
  (brightness, contrast, saturation by up to 10%), with its true label (``duplicates.csv``).
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageEnhance

PER_CLASS = 1000
NOISE_SHARE = 0.10
DUPLICATES = 200
OUTLIERS = 100


def training_files(cifar: Path) -> dict[str, list[str]]:
    """Each class's training images, paths relative to ``cifar``, sorted."""
    return {c.name: sorted(str(p.relative_to(cifar)) for p in c.glob("*.png"))
            for c in sorted((cifar / "train").iterdir()) if c.is_dir()}


def subset(cifar: Path) -> list[tuple[str, str]]:
    """The 10,000 (path relative to ``cifar``, class) of the subset, class by class."""
    generator = torch.Generator().manual_seed(0)
    chosen = []
    for name, files in training_files(cifar).items():
        order = torch.randperm(len(files), generator=generator)[:PER_CLASS].sort().values
        chosen += [(files[i], name) for i in order.tolist()]
    return chosen


def backbone_list(cifar: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "subset.txt").write_text("".join(f"{path}\n" for path, _ in subset(cifar)))
    print(f"wrote {out / 'subset.txt'}: the {PER_CLASS * 10:,} subset images, to leave out of the backbone's "
          f"training set")


def _write_csv(path: Path, rows: list[tuple], header: tuple[str, ...]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def near_duplicate(image: Image.Image, rng: np.random.Generator) -> tuple[Image.Image, dict]:
    """A near-duplicate of ``image``: shifted by up to 3 px (edge padding), colour-jittered by up to 10%, resized
    by a factor in [0.9, 1.1]; the JPEG re-encoding is the caller's (quality 75)."""
    a = np.asarray(image)
    dy, dx = (int(v) for v in rng.integers(-3, 4, size=2))
    a = np.pad(a, ((3, 3), (3, 3), (0, 0)), mode="edge")[3 - dy:3 - dy + image.height, 3 - dx:3 - dx + image.width]
    out = Image.fromarray(a)
    factors = rng.uniform(0.9, 1.1, size=4)
    for enhance, f in zip((ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color), factors):
        out = enhance(out).enhance(float(f))
    side = max(8, round(image.width * float(factors[3])))
    return out.resize((side, side), Image.BICUBIC), {"shift": [dy, dx], "jitter": factors[:3].round(3).tolist(),
                                                     "size": side}


def outlier_images(rng: np.random.Generator) -> list[tuple[Image.Image, str]]:
    """50 images of noise and 50 of other kinds (scikit-learn's digits and crops of its two photographs), 32 px."""
    from sklearn.datasets import load_digits, load_sample_images

    images: list[tuple[Image.Image, str]] = []
    for i in range(10):
        images.append((Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)), "uniform noise"))
        g = np.clip(rng.normal(128, 40, (32, 32, 3)), 0, 255).astype(np.uint8)
        images.append((Image.fromarray(g), "gaussian noise"))
        sp = np.where(rng.random((32, 32, 1)) < 0.5, 0, 255).repeat(3, 2).astype(np.uint8)
        images.append((Image.fromarray(sp), "salt and pepper"))
        images.append((Image.new("RGB", (32, 32), tuple(int(v) for v in rng.integers(0, 256, 3))), "flat colour"))
        period = int(rng.integers(2, 9))
        stripes = ((np.arange(32)[:, None] // period + (np.arange(32)[None, :] // period) * (i % 2)) % 2) * 255
        images.append((Image.fromarray(np.repeat(stripes[..., None], 3, 2).astype(np.uint8)), "stripes"))
    digits = load_digits().images
    for i in rng.choice(len(digits), 25, replace=False):
        d = (255 - digits[i] * 255 / 16).astype(np.uint8)
        images.append((Image.fromarray(d).resize((32, 32), Image.BICUBIC).convert("RGB"), "handwritten digit"))
    photos = load_sample_images().images
    for k in range(25):
        photo = photos[k % 2]
        side = int(rng.integers(48, 161))
        y, x = int(rng.integers(0, photo.shape[0] - side)), int(rng.integers(0, photo.shape[1] - side))
        crop = Image.fromarray(photo[y:y + side, x:x + side]).resize((32, 32), Image.BICUBIC)
        images.append((crop, "temple photo crop" if k % 2 == 0 else "flower photo crop"))
    return images


def prepare(cifar: Path, out: Path) -> None:
    """The planted data set under ``out/data`` (csv) and the lists of what was planted (see the module)."""
    data = out / "data"
    (data / "planted").mkdir(parents=True, exist_ok=True)
    if not (data / "cifar10").exists():
        (data / "cifar10").symlink_to(cifar)
    chosen = subset(cifar)
    classes = sorted({c for _, c in chosen})
    rng = np.random.default_rng(1)
    noisy = rng.choice(len(chosen), int(NOISE_SHARE * len(chosen)), replace=False)
    given = {i: classes[(classes.index(chosen[i][1]) + int(rng.integers(1, len(classes)))) % len(classes)]
             for i in noisy.tolist()}
    train = [(f"cifar10/{p}", given.get(i, c)) for i, (p, c) in enumerate(chosen)]
    _write_csv(out / "noise.csv", [(f"cifar10/{chosen[i][0]}", chosen[i][1], g) for i, g in sorted(given.items())],
               ("image", "true", "given"))
    rng = np.random.default_rng(2)
    outliers = []
    for k, (image, kind) in enumerate(outlier_images(rng)):
        name = f"planted/outlier_{k:03d}.png"
        image.save(data / name)
        outliers.append((name, kind, classes[int(rng.integers(len(classes)))]))
    train += [(name, label) for name, _, label in outliers]
    _write_csv(out / "outliers.csv", outliers, ("image", "kind", "given"))
    test = [(f"cifar10/{p.relative_to(cifar)}", p.parent.name) for p in sorted((cifar / "test").glob("*/*.png"))]
    _write_csv(data / "cifar_test.csv", test, ("image", "labels"))
    rng = np.random.default_rng(3)
    duplicates = []
    for k, i in enumerate(sorted(rng.choice(len(chosen), DUPLICATES, replace=False).tolist())):
        path, label = chosen[i]
        with Image.open(cifar / path) as source:
            image, how = near_duplicate(source.convert("RGB"), rng)
        name = f"planted/duplicate_{k:03d}.jpg"
        image.save(data / name, quality=75)
        duplicates.append((name, f"cifar10/{path}", label, json.dumps(how)))
    test += [(name, label) for name, _, label, _ in duplicates]
    _write_csv(out / "duplicates.csv", duplicates, ("image", "original", "label", "how"))
    _write_csv(data / "train.csv", train, ("image", "labels"))
    _write_csv(data / "test.csv", test, ("image", "labels"))
    print(f"wrote {data}: train.csv {len(train):,} images ({len(given):,} relabeled, {len(outliers)} outliers), "
          f"test.csv {len(test):,} ({len(duplicates)} near-duplicates of training images), cifar_test.csv "
          f"{len(test) - len(duplicates):,}; what was planted: {out}/noise.csv, outliers.csv, duplicates.csv")


def _timed(command: list[str], log: Path) -> float:
    start = time.time()
    with open(log, "w") as f:
        subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, check=True)
    return time.time() - start


def run(out: Path, checkpoint: str) -> None:
    """``vitlab inspect --knn`` (the features computed), then ``--folds 5`` on a copy of those features: each timed
    alone, a record a line in ``out/runs.jsonl``."""
    import shutil

    vitlab = [sys.executable, "-m", "vitlab.cli", "inspect", "--checkpoint", checkpoint, "--batch-size", "256"]
    data = ["data.dataset=csv", f"data.root={out / 'data'}"]
    records = []
    knn = [*vitlab, "--knn", "20", "--output", str(out / "knn"), "--write-clean", str(out / "data" / "clean_knn.csv"),
           *data]
    records.append({"arm": "knn", "command": " ".join(knn[2:]), "seconds": _timed(knn, out / "knn.log"),
                    "with": "features computed"})
    shutil.rmtree(out / "folds", ignore_errors=True)
    shutil.copytree(out / "knn" / "features", out / "folds" / "features")
    folds = [*vitlab, "--folds", "5", "--output", str(out / "folds"), "--write-clean",
             str(out / "data" / "clean_folds.csv"), *data]
    records.append({"arm": "folds", "command": " ".join(folds[2:]), "seconds": _timed(folds, out / "folds.log"),
                    "with": "the knn run's features"})
    with open(out / "runs.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    for r in records:
        print(f"{r['arm']}: {r['seconds']:.0f} s ({r['with']})")


def train(out: Path, seeds: list[int], epochs: int, arms: list[str]) -> None:
    """configs/cifar10_cpu_quick.yaml on the noisy list (arm ``noisy``) and on clean lists (``clean_knn``,
    ``clean_folds``), tested on CIFAR-10's 10,000 test images (cifar_test.csv): the final epoch's test top-1 a line in
    ``out/train.jsonl``."""
    for seed in seeds:
        for arm, split in ((a, "train" if a == "noisy" else a) for a in arms):
            run_dir = out / "runs" / f"{arm}_s{seed}"
            command = [sys.executable, "train.py", "--config", "configs/cifar10_cpu_quick.yaml", "data.dataset=csv",
                       f"data.root={out / 'data'}", f"data.train_split={split}", "data.test_split=cifar_test",
                       f"train.epochs={epochs}", f"train.seed={seed}", f"train.output_dir={run_dir}", "--json"]
            seconds = _timed(command, out / f"train_{arm}_s{seed}.log")
            summary = json.loads((run_dir / "summary.json").read_text())
            images = sum(1 for _ in open(out / "data" / f"{split}.csv")) - 1
            record = {"arm": arm, "seed": seed, "images": images, "seconds": round(seconds),
                      "test_top1": summary["test_top1"], "command": " ".join(command[1:])}
            with open(out / "train.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"{arm} seed {seed}: test top-1 {100 * record['test_top1']:.2f}% ({seconds:.0f} s)")


THRESHOLDS = (0.90, 0.93, 0.95, 0.97, 0.98, 0.99)


def threshold(out: Path, checkpoint: str) -> None:
    """Choose the near-duplicate threshold on a planting of its own: 200 other near-duplicates of subset images
    (seed 4, made as ``prepare`` makes its own), looked for among the features ``run`` computed (the training split
    as the bank; CIFAR-10's test images and these 200 as the queries). The highest threshold of
    :data:`THRESHOLDS` that finds 97% of them or more is chosen."""
    from vitlab import load_model
    from vitlab.inspection.duplicates import duplicate_pairs
    from vitlab.inspection.splits import list_splits, split_features

    cifar = (out / "data" / "cifar10").resolve()
    chosen = subset(cifar)
    taken = {r["original"] for r in _rows(out / "duplicates.csv")}
    rng = np.random.default_rng(4)
    pool = [i for i, (p, _) in enumerate(chosen) if f"cifar10/{p}" not in taken]
    rows = []
    for k, i in enumerate(sorted(rng.choice(pool, DUPLICATES, replace=False).tolist())):
        path, label = chosen[i]
        with Image.open(cifar / path) as source:
            image, _ = near_duplicate(source.convert("RGB"), rng)
        name = f"planted/val_duplicate_{k:03d}.jpg"
        image.save(out / "data" / name, quality=75)
        rows.append((name, label, f"cifar10/{path}"))
    _write_csv(out / "data" / "val_duplicates.csv", [r[:2] for r in rows], ("image", "labels"))
    model = load_model(checkpoint)
    (split,), _, _ = list_splits(["data.dataset=csv", f"data.root={out / 'data'}"], ["val_duplicates"], True)
    features, thumbs = split_features(model, split, out / "threshold" / "features", 256, 2, "run")
    bank = out / "knn" / "features"
    names = (bank / "train.paths.txt").read_text().splitlines()
    test_names = (bank / "test.paths.txt").read_text().splitlines()
    real = [i for i, n in enumerate(test_names) if not n.startswith("planted/")]
    queries = torch.cat([torch.from_numpy(np.load(bank / "test.npy")[real]), torch.from_numpy(np.asarray(features))])
    query_thumbs = torch.cat([torch.from_numpy(np.load(bank / "test.thumbnails.npy")[real]),
                              torch.from_numpy(np.asarray(thumbs))])
    original = {len(real) + k: names.index(r[2]) for k, r in enumerate(rows)}
    pairs = duplicate_pairs(queries, query_thumbs, torch.from_numpy(np.load(bank / "train.npy")),
                            torch.from_numpy(np.load(bank / "train.thumbnails.npy")), threshold=min(THRESHOLDS))
    result = {}
    for t in THRESHOLDS:
        kept = [(i, j) for i, j, r in pairs if r >= t]
        found = sum(original.get(i) == j for i, j in kept)
        result[t] = {"recall": found / DUPLICATES, "other_pairs": len(kept) - found}
        print(f"threshold {t}: {found} of {DUPLICATES} found ({found / DUPLICATES:.3f}), "
              f"{len(kept) - found} other pairs")
    best = max(t for t in THRESHOLDS if result[t]["recall"] >= 0.97)
    print(f"chosen: {best} (the highest that finds 97% or more)")
    (out / "threshold.json").write_text(json.dumps({"by_threshold": result, "chosen": best}, indent=1))


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _scores(out: Path, arm: str) -> dict[str, float]:
    """Every training image's outlier score (cleanlab's, low = out of place), from the arm's features as vitlab
    inspect computes them (issues.csv lists only the flagged)."""
    from vitlab.inspection.findings import split_issues
    from vitlab.inspection.probabilities import cross_fitted, fold_of, knn_out_of_sample

    features = torch.from_numpy(np.load(out / arm / "features" / "train.npy"))
    names = (out / arm / "features" / "train.paths.txt").read_text().splitlines()
    rows = {r["image"]: r["labels"] for r in _rows(out / "data" / "train.csv")}
    classes = sorted(set(rows.values()))
    labels = torch.tensor([classes.index(rows[n]) for n in names])
    probs = cross_fitted(features, labels, 10, fold_of(labels, 5)) if arm == "folds" else \
        knn_out_of_sample(features, labels, 10, 20)
    issues = split_issues(labels, probs, features.numpy(), False)
    return dict(zip(names, issues["outlier_score"].tolist()))


def report(out: Path) -> None:
    """Precision and recall of the label issues against the relabeled list, the planted near-duplicates found and
    the other pairs, the planted outliers among the 200 lowest outlier scores, for each arm; the trainings."""
    noisy = {r["image"] for r in _rows(out / "noise.csv")}
    outliers = {r["image"]: r["kind"] for r in _rows(out / "outliers.csv")}
    planted = {(r["image"], f"train:{r['original']}") for r in _rows(out / "duplicates.csv")}
    runs = {}
    if (out / "runs.jsonl").is_file():
        runs = {json.loads(line)["arm"]: json.loads(line) for line in open(out / "runs.jsonl")}
    result = {}
    for arm in ("knn", "folds"):
        if not (out / arm / "issues.csv").is_file():
            continue
        rows = _rows(out / arm / "issues.csv")
        flagged = {r["image"] for r in rows if r["issue"] == "label" and r["split"] == "train"} - set(outliers)
        hit = len(flagged & noisy)
        leaks = {(r["image"], r["duplicate_of"]) for r in rows if r["issue"] == "leak"}
        scores = _scores(out, arm)
        lowest = sorted(scores, key=scores.get)[:200]
        by_kind: dict[str, int] = {}
        for name in lowest:
            if name in outliers:
                by_kind[outliers[name]] = by_kind.get(outliers[name], 0) + 1
        result[arm] = {"seconds": runs.get(arm, {}).get("seconds"), "label_flagged": len(flagged),
                       "precision": hit / max(len(flagged), 1), "recall": hit / len(noisy),
                       "planted_duplicates_found": len(leaks & planted), "other_leak_pairs": len(leaks - planted),
                       "near_duplicates_in_train": sum(r["issue"] == "near_duplicate" and r["split"] == "train"
                                                       for r in rows),
                       "outliers_in_lowest_200": sum(by_kind.values()), "outliers_by_kind": by_kind,
                       "outliers_flagged": sum(r["issue"] == "outlier" and r["image"] in outliers for r in rows),
                       "flagged_outliers_total": sum(r["issue"] == "outlier" for r in rows)}
        r = result[arm]
        print(f"{arm}: label issues {r['label_flagged']:,} flagged among the 10,000, precision {r['precision']:.3f} "
              f"recall {r['recall']:.3f}; leaks: {r['planted_duplicates_found']} of {len(planted)} planted found, "
              f"{r['other_leak_pairs']} other pairs; outliers: {r['outliers_in_lowest_200']} of {len(outliers)} in "
              f"the 200 lowest scores {r['outliers_by_kind']}, {r['outliers_flagged']} of "
              f"{r['flagged_outliers_total']} flagged" + (f"; {r['seconds']:.0f} s" if r["seconds"] else ""))
    if (out / "train.jsonl").is_file():
        trained = [json.loads(line) for line in open(out / "train.jsonl")]
        for arm in ("noisy", "clean_knn", "clean_folds"):
            tops = [100 * t["test_top1"] for t in trained if t["arm"] == arm]
            if tops:
                print(f"train on {arm}: test top-1 {' / '.join(f'{v:.2f}' for v in tops)} (mean {np.mean(tops):.2f})")
                result[f"train_{arm}"] = tops
    (out / "report.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("backbone-list")
    b.add_argument("cifar", type=Path)
    b.add_argument("out", type=Path)
    p = sub.add_parser("prepare")
    p.add_argument("cifar", type=Path)
    p.add_argument("out", type=Path)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--checkpoint", required=True)
    t = sub.add_parser("train")
    t.add_argument("out", type=Path)
    t.add_argument("--seeds", default="0,1,2")
    t.add_argument("--epochs", type=int, default=30)
    t.add_argument("--arms", default="noisy,clean_knn")
    th = sub.add_parser("threshold")
    th.add_argument("out", type=Path)
    th.add_argument("--checkpoint", required=True)
    rp = sub.add_parser("report")
    rp.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.cmd == "backbone-list":
        backbone_list(args.cifar.resolve(), args.out)
    elif args.cmd == "prepare":
        prepare(args.cifar.resolve(), args.out)
    elif args.cmd == "run":
        run(args.out, args.checkpoint)
    elif args.cmd == "threshold":
        threshold(args.out, args.checkpoint)
    elif args.cmd == "report":
        report(args.out)
    elif args.cmd == "train":
        train(args.out, [int(s) for s in args.seeds.split(",")], args.epochs, args.arms.split(","))


if __name__ == "__main__":
    main()
