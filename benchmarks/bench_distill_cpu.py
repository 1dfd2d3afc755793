"""Does DeiT's distillation pay on this CPU? The quick config's student with a distillation token, hard-
distilled from a convnet teacher vitlab trained (``configs/cifar10_cpu_teacher.yaml``), against the same
student without distillation, at equal student epochs, over several seeds; and the teacher's cost per
student step.

    python train.py --config configs/cifar10_cpu_teacher.yaml data.dataset=imagefolder \\
        data.root=../shared/data/cifar10 data.download=false train.output_dir=runs/teacher
    python benchmarks/bench_distill_cpu.py --data ../shared/data/cifar10 --teacher runs/teacher --seeds 0 1 2
    python benchmarks/bench_distill_cpu.py ... --set train.epochs=20     # another setting: keys for both arms
    python benchmarks/bench_distill_cpu.py --data ../shared/data/cifar10 --teacher-per-seed \
        --set data.train_subset=5000 train.epochs=40 --only baseline distilled soft

``--teacher-per-seed`` trains the teacher itself for each seed, with the same ``--set`` keys and
``train.seed`` as the students (``configs/cifar10_cpu_teacher.yaml``), into ``OUT/teacher_K``: with
``data.train_subset`` (drawn by ``train.seed``) the teacher then sees exactly the students' images and
no others. The arms: ``baseline``, ``distilled`` (hard, DeiT's distillation token) and ``soft``.

Each run is ``python train.py --config configs/cifar10_cpu_quick.yaml`` (plus ``model.distilled=true
distill.type=hard distill.teacher=...`` for the student), one after the other, its final epoch's test
top-1 read from its ``summary.json`` (no selection: the quick config has no validation split). The
teacher's cost is its forward pass on a batch of 128 training images, timed alone, against a student
training step (forward, backward, AdamW) on the same batch: medians of 20.

A run's accuracy is reproducible only with the same torch build and the same number of torch threads (CPU
kernels sum in an order that depends on both): the seed-0 baseline at 5,000 images and 40 epochs gave 50.45%,
51.55% and 51.71% under three of them (benchmarks/RESULTS.md). So the results name both, and arms are compared
only where they match.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(config: list[str], out: Path, base: str = "configs/cifar10_cpu_quick.yaml") -> dict:
    command = [sys.executable, "train.py", "--config", base, *config, f"train.output_dir={out}"]
    start = time.time()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    return {"top1": summary["test_top1"], "wall_s": time.time() - start, "command": " ".join(command[1:])}


def step_costs(teacher_dir: str, batch: int = 128, repeats: int = 20) -> dict:
    import torch

    import vitlab
    from vitlab.tasks.distill import load_teacher

    teacher = load_teacher(teacher_dir, "", 10, "cpu")
    student = vitlab.create_model("vit_cifar_tiny_patch4_32", embed_dim=64, num_heads=2, depth=3, distilled=True)
    student.set_distilled_training(True)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))

    def teacher_step() -> None:
        with torch.no_grad():
            teacher(x)

    def student_step() -> None:
        head, dist = student(x)
        loss = torch.nn.functional.cross_entropy(head, y) + torch.nn.functional.cross_entropy(dist, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    times = {}
    for name, fn in (("teacher_forward_ms", teacher_step), ("student_step_ms", student_step)):
        for _ in range(3):
            fn()
        samples = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e3)
        times[name] = statistics.median(samples)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="CIFAR-10 as class folders (train/, test/)")
    p.add_argument("--teacher", help="the teacher's run directory")
    p.add_argument("--teacher-per-seed", action="store_true",
                   help="train a teacher for each seed on the students' own images (see above)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--only", nargs="+", choices=["baseline", "distilled", "soft"], default=["baseline", "distilled"],
                   help="the arms to run (distilled: hard distillation; soft: DeiT's soft distillation, tau 1)")
    p.add_argument("--out", default="runs/bench_distill", help="where the runs go")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="config overrides for both arms (e.g. train.epochs=20)")
    p.add_argument("--distill-set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="config overrides for the distilled arms (e.g. distill.tau=3)")
    p.add_argument("--no-costs", action="store_true", help="skip timing the teacher's cost per step")
    args = p.parse_args()
    if bool(args.teacher) == args.teacher_per_seed:
        p.error("give --teacher DIR or --teacher-per-seed (one of the two)")
    data = ["data.dataset=imagefolder", f"data.root={Path(args.data).resolve()}", "data.download=false"]
    out = ROOT / args.out

    def teacher(seed: int) -> Path:
        return out / f"teacher_{seed}" if args.teacher_per_seed else Path(args.teacher).resolve()

    def arm_keys(arm: str, seed: int) -> list[str]:
        if arm == "baseline":
            return []
        kind = "hard" if arm == "distilled" else "soft"
        return ["model.distilled=true", f"distill.type={kind}", f"distill.teacher={teacher(seed)}", *args.distill_set]

    import torch

    threads = torch.get_num_threads()  # what each train.py child gets too: OMP_NUM_THREADS, else a thread a core
    results: dict = {"environment": {"torch": torch.__version__, "torch_threads": threads}}
    results.update({arm: {} for arm in args.only})
    print(f"torch {torch.__version__}, {threads} torch thread(s) a run", flush=True)
    for seed in args.seeds:
        if args.teacher_per_seed and set(args.only) - {"baseline"}:
            results.setdefault("teachers", {})[seed] = run([*data, *args.set, f"train.seed={seed}"], teacher(seed),
                                                           "configs/cifar10_cpu_teacher.yaml")
            print(f"teacher, seed {seed}: test top-1 {results['teachers'][seed]['top1']:.2%}", flush=True)
        for arm in args.only:
            results[arm][seed] = run([*data, *arm_keys(arm, seed), *args.set, f"train.seed={seed}"],
                                     out / f"{arm}_{seed}")
            print(f"{arm}, seed {seed}: test top-1 {results[arm][seed]['top1']:.2%}, "
                  f"{results[arm][seed]['wall_s']:.0f} s", flush=True)
    for arm in args.only:
        tops = [r["top1"] for r in results[arm].values()]
        print(f"{arm}: test top-1 {', '.join(f'{t:.2%}' for t in tops)} (mean {statistics.mean(tops):.2%}); wall "
              f"{', '.join(str(round(r['wall_s'])) for r in results[arm].values())} s", flush=True)
    if set(args.only) - {"baseline"} and not args.no_costs:
        first = teacher(args.seeds[0])
        results["teacher"] = json.loads((first / "summary.json").read_text())["test_top1"]
        results["costs"] = step_costs(str(first))
        print(f"teacher test top-1 {results['teacher']:.2%}; teacher forward "
              f"{results['costs']['teacher_forward_ms']:.1f} ms, student step "
              f"{results['costs']['student_step_ms']:.1f} ms a batch of 128")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
