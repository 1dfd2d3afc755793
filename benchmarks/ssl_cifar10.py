"""Issue 62's measurement: CIFAR-10 with 4,000 labels on 2 CPU cores, from scratch against self-supervised
pretraining on all 50,000 training images (their labels unused), then fine-tuning, k-NN or a linear probe.

The labelled images are a fixed list, ``benchmarks/cifar10_4000_labels.txt`` (400 a class, drawn once by
``numpy.random.default_rng(0)`` from each class's sorted files: ``prepare --new-list`` wrote it); a second list,
``cifar10_4000_labels_seed1.txt``, was drawn the same way with seed 1 (``prepare --list-seed 1 --new-list``). Every arm reads
them as a csv data set (``data.dataset=csv``) and holds 400 of them out (``data.val_size=400``, stratified, from the
run's seed) to choose on; the 10,000 test images are for reporting only, the final epoch's figure.

    python benchmarks/ssl_cifar10.py prepare --cifar ../shared/data/cifar10 --out /tmp/c10_4k [--list-seed 1]
    python benchmarks/ssl_cifar10.py report --out runs/ssl       # the table of what ran
    python benchmarks/ssl_cifar10.py run ARM --data /tmp/c10_4k --cifar ../shared/data/cifar10 --seed S \\
        --out runs/ssl [key=value ...]

ARM is ``scratch`` (the quick config at its best budget on the 4,000, 100 epochs), ``scratch_ft`` (the
fine-tuning recipe without the pretrained backbone: the control for its augmentation), ``mae`` (pretraining),
``mae_ft``, ``dino`` (pretraining), ``dino_knn``, ``dino_probe``, ``dino_ft``, and the full-label case
``full_scratch``, ``full_mae_ft`` (all 50,000 labels, 1,000 held out; the epochs given as overrides); each is one ``train.py`` (or ``vitlab eval``) command, printed, timed from launch to exit, and its
result appended to ``OUT/results.jsonl`` with the command and the seconds it took.

    python benchmarks/ssl_cifar10.py baselines --data /tmp/c10_4k --seed S --out runs/ssl [--tag T key=value ...]

reads a pretrained backbone's k-NN against what needs no pretraining, by the same rule (DINO's weighted k-NN, k 20,
the labelled images the bank, the test images the queries): the raw pixels, the pixels less the bank's mean, and the
DINO run ``OUT/dino_sS``'s model untrained (its checkpoint with the weights ``torch.manual_seed(S)`` draws, through
``vitlab eval --knn 20``), appended as arms ``pixels_knn``, ``centred_pixels_knn`` and ``dino_init_knn``.
"""
from __future__ import annotations

import argparse
import csv
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PER_CLASS = 400

# The backbone every arm shares (the quick config's model: 64 wide, 3 blocks, 2 heads, patch 4, MLP ratio 2).
BACKBONE = ("model.embed_dim=64", "model.depth=3", "model.num_heads=2")


def list_file(seed: int) -> Path:
    """The list of labelled images drawn with ``seed`` (seed 0's is the benchmark's first list)."""
    return ROOT / "benchmarks" / ("cifar10_4000_labels.txt" if seed == 0 else f"cifar10_4000_labels_seed{seed}.txt")


def new_list(cifar: Path, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    chosen = []
    for folder in sorted(p for p in (cifar / "train").iterdir() if p.is_dir()):
        files = sorted(f.name for f in folder.glob("*.png"))
        chosen += [f"train/{folder.name}/{files[i]}" for i in sorted(rng.permutation(len(files))[:PER_CLASS])]
    return chosen


def prepare(cifar: Path, out: Path, write_list: bool, seed: int = 0) -> None:
    """``out/train.csv`` (the 4,000 labelled images of the list drawn with ``seed``), ``out/test.csv`` (the 10,000
    test images), and ``out/train``, ``out/test`` linked to CIFAR-10's folders."""
    if write_list:
        list_file(seed).write_text("\n".join(new_list(cifar, seed)) + "\n")
    elif not list_file(seed).is_file():
        raise SystemExit(f"{list_file(seed)} does not exist: draw it with prepare --list-seed {seed} --new-list")
    labelled = list_file(seed).read_text().split()
    assert len(labelled) == 10 * PER_CLASS and len(set(labelled)) == len(labelled)
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        link = out / split
        if not link.exists():
            link.symlink_to((cifar / split).resolve())
    with (out / "train.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["image", "labels"])
        writer.writerows([path, path.split("/")[1]] for path in labelled)
    with (out / "test.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["image", "labels"])
        writer.writerows([f"test/{p.parent.name}/{p.name}", p.parent.name]
                         for p in sorted((cifar / "test").glob("*/*.png")))
    print(f"{out}: train.csv {len(labelled)} labelled images, test.csv 10,000")


def labelled(data: Path) -> tuple[str, ...]:
    return ("data.dataset=csv", f"data.root={data}", "data.val_size=400", "data.download=false")


def full_labels(cifar: Path) -> tuple[str, ...]:
    return ("data.dataset=imagefolder", f"data.root={cifar}", "data.val_size=1000", "data.download=false")


def command(arm: str, data: Path, cifar: Path, seed: int, out: Path, extra: list[str], tag: str = "") -> list[str]:
    """The command of an arm; ``tag`` names a variant's run directory (``OUT/ARM+TAG_sS``)."""
    train = [sys.executable, str(ROOT / "train.py")]
    run = out / f"{arm}{tag}_s{seed}"
    common = [f"train.seed={seed}", f"train.output_dir={run}", *extra]
    monitor = ("monitor.dataset=csv", f"monitor.root={data}", "monitor.k=20")
    pretrained = lambda kind: f"model.pretrained={out / f'{kind}_s{seed}'}"
    if arm == "scratch":  # 100 epochs: validation top-1 55.5% against 54.0% at 50 and 52.25% at 200 (seed 0)
        return [*train, "--config", str(ROOT / "configs/cifar10_cpu_quick.yaml"), *labelled(data), "train.epochs=100",
                *common]
    if arm == "scratch_ft":
        return [*train, "--config", str(ROOT / "configs/finetune_ssl_cifar10_cpu.yaml"), *labelled(data),
                "model.pretrained=", "optim.layer_decay=0", *common]
    if arm == "full_scratch":
        return [*train, "--config", str(ROOT / "configs/cifar10_cpu_quick.yaml"), *full_labels(cifar), *common]
    if arm == "full_mae_ft":
        return [*train, "--config", str(ROOT / "configs/finetune_ssl_cifar10_cpu.yaml"), *full_labels(cifar),
                pretrained("mae"), *common]
    if arm in ("mae", "dino"):
        return [*train, "--config", str(ROOT / f"configs/{arm}_cifar10_cpu.yaml"), "data.dataset=imagefolder",
                f"data.root={cifar}", *monitor, *common]
    if arm in ("mae_ft", "dino_ft"):
        return [*train, "--config", str(ROOT / "configs/finetune_ssl_cifar10_cpu.yaml"), *labelled(data),
                pretrained(arm.split("_")[0]), *common]
    if arm == "dino_probe":
        return [*train, "--config", str(ROOT / "configs/cifar10_cpu_quick.yaml"), *labelled(data), *BACKBONE,
                pretrained("dino"), "model.freeze=backbone", "train.cache_features=true", "data.loader=torch",
                "data.crop_padding=0", "data.hflip=false", *common]
    if arm == "dino_knn":
        return [sys.executable, "-m", "vitlab.cli", "eval", "--checkpoint", str(out / f"dino_s{seed}"), "--knn", "20",
                "--output", str(run.with_suffix(".json")), *extra]
    raise SystemExit(f"unknown arm {arm!r}")


def run(args: argparse.Namespace) -> None:
    cmd = command(args.arm, Path(args.data), Path(args.cifar), args.seed, Path(args.out), args.overrides, args.tag)
    print("$", shlex.join(cmd), flush=True)
    start = time.time()
    done = subprocess.run([*cmd, *(["--json"] if cmd[1].endswith("train.py") else [])], capture_output=True,
                          text=True)
    seconds = time.time() - start
    sys.stdout.write(done.stdout[-3000:])
    if done.returncode:
        sys.stderr.write(done.stderr[-3000:])
        raise SystemExit(done.returncode)
    if args.arm == "dino_knn":
        result = json.loads(Path(cmd[cmd.index("--output") + 1]).read_text())
    else:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    record = {"arm": args.arm + args.tag, "seed": args.seed, "seconds": round(seconds, 1), "command": shlex.join(cmd),
              **{k: v for k, v in result.items() if isinstance(v, (int, float, str))}}
    with (Path(args.out) / "results.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))


def baselines(data: Path, seed: int, out: Path, tag: str = "", overrides: tuple[str, ...] = ()) -> None:
    """The k-NN of the pixels, of the pixels less the bank's mean, and of ``OUT/dino_sS``'s model untrained
    (``overrides`` go to its ``vitlab eval``: ``monitor.root=`` another list's bank)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from vitlab.data import read_image
    from vitlab.models.registry import model_class
    from vitlab.tasks.knn import knn_predict

    def pixels(split: str) -> tuple[torch.Tensor, list[str]]:
        with (data / f"{split}.csv").open() as f:
            rows = list(csv.DictReader(f))
        # (row, column, channel) as the file holds them: the order of a sum moves a tie in the vote's last digit
        images = torch.stack([read_image(data / row["image"]).permute(1, 2, 0).flatten() for row in rows]).float()
        return images, [row["labels"] for row in rows]

    def record(arm: str, top1: float, seconds: float, command: str) -> None:
        line = {"arm": arm + tag, "seed": seed, "seconds": round(seconds, 1), "command": command, "knn_top1": top1}
        with (out / "results.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")
        print(json.dumps(line))

    trained, untrained = out / f"dino_s{seed}" / "checkpoints" / "last", out / f"dino_init_s{seed}"
    if not (trained / "config.json").is_file():
        raise SystemExit(f"{trained} is not a checkpoint: run the dino arm with --seed {seed} --out {out} first")
    start = time.time()
    (bank, bank_names), (queries, query_names) = pixels("train"), pixels("test")
    classes = sorted(set(bank_names))
    labels = torch.tensor([classes.index(n) for n in bank_names])
    truth = torch.tensor([classes.index(n) for n in query_names])
    mean = bank.mean(dim=0)
    for arm, b, q in (("pixels_knn", bank, queries), ("centred_pixels_knn", bank - mean, queries - mean)):
        top1 = (knn_predict(b, labels, q, len(classes), k=20) == truth).float().mean().item()
        record(arm, top1, time.time() - start, shlex.join(sys.argv))  # the first: the images' reading too
        start = time.time()

    shutil.rmtree(untrained, ignore_errors=True)
    shutil.copytree(trained, untrained / "checkpoints" / "last")
    meta = json.loads((trained / "config.json").read_text())
    torch.manual_seed(seed)
    state = model_class(meta["architecture"])(**meta["model_args"]).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, untrained / "checkpoints" / "last" / "model.safetensors",
              metadata={"format": "pt"})
    output = untrained.parent / f"dino_init_knn{tag}_s{seed}.json"
    cmd = [sys.executable, "-m", "vitlab.cli", "eval", "--checkpoint", str(untrained), "--knn", "20", "--output",
           str(output), *overrides]
    start = time.time()
    subprocess.run(cmd, check=True, capture_output=True)
    record("dino_init_knn", json.loads(output.read_text())["knn_top1"], time.time() - start, shlex.join(cmd))


def report(out: Path) -> None:
    """A markdown table of ``out/results.jsonl``: an arm a row, its seeds in order (the last record of each)."""
    records: dict[str, dict[int, dict]] = {}
    for line in (out / "results.jsonl").read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["arm"], {})[record["seed"]] = record
    print("| arm | seeds | test top-1, % | mean | validation top-1, % | wall time a run, s |")
    print("|---|---|---|---|---|---|")
    for arm, by_seed in records.items():
        rows = [by_seed[seed] for seed in sorted(by_seed)]
        metric = "test_top1" if "test_top1" in rows[0] else next(k for k in rows[0] if k.endswith("knn_top1"))
        tests = [100 * r[metric] for r in rows]
        vals = [f"{100 * r['val_top1']:.2f}" for r in rows if "val_top1" in r]
        print(f"| {arm} | {', '.join(str(s) for s in sorted(by_seed))} | {', '.join(f'{t:.2f}' for t in tests)} | "
              f"{sum(tests) / len(tests):.2f} | {', '.join(vals) or '-'} | "
              f"{', '.join(str(round(r['seconds'])) for r in rows)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--cifar", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--new-list", action="store_true", help="draw the list of labelled images anew")
    p.add_argument("--list-seed", type=int, default=0, help="the seed the list of labelled images is drawn with")
    r = sub.add_parser("run")
    r.add_argument("arm")
    r.add_argument("--data", required=True)
    r.add_argument("--cifar", required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", required=True)
    r.add_argument("--tag", default="", help="a variant's name: OUT/ARM+TAG_sS, arm ARM+TAG in results.jsonl")
    r.add_argument("overrides", nargs="*")
    b = sub.add_parser("baselines", help="the k-NN of the pixels and of OUT/dino_sS's model untrained")
    b.add_argument("--data", required=True)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", required=True)
    b.add_argument("--tag", default="", help="appended to the arms' names in results.jsonl")
    b.add_argument("overrides", nargs="*", help="key=value for the untrained model's vitlab eval")
    t = sub.add_parser("report", help="a markdown table of OUT/results.jsonl")
    t.add_argument("--out", required=True)
    args, rest = parser.parse_known_args()
    if args.command == "run":
        args.overrides = [*args.overrides, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "prepare":
        prepare(Path(args.cifar), Path(args.out), args.new_list, args.list_seed)
    elif args.command == "report":
        report(Path(args.out))
    elif args.command == "baselines":
        baselines(Path(args.data), args.seed, Path(args.out), args.tag, tuple(args.overrides))
    else:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        run(args)


if __name__ == "__main__":
    main()
