"""Every code block a user can paste runs: the ``python`` and ``bash`` blocks of the README and of ``docs/``.

Each page runs in a directory of its own, its blocks in order (a later block uses what an earlier one
trained), as a user who pastes the page top to bottom would. The directory holds the repository's
``configs/`` and ``train.py``, ``benchmarks/``, ``cat.png`` and ``ship.jpg``, and beside it ``../shared/data`` with small
subsets of the real data sets the suite can see (CIFAR-10, Multi30k, tiny Shakespeare: the first files
of each class, the first lines of each file); a block that reads one the suite cannot see skips.

The one departure from "as written": a training command (``python train.py``, ``vitlab train``,
``make train CONFIG=... ARGS=...``, ``torchrun ... train.py``) gets a few keys appended that make it
seconds long (:func:`_shortened`): one epoch, tiny subsets, no tracker and no ``curves.png`` unless it names them,
and for a CIFAR-10 config that would download, the same images from the shared copy; a k-NN open-set score
(``vitlab calibrate --unknown``, ``vitlab eval --unknown-images``) gets ``--unknown-k 5``, for the subsets' few
images.
``vitlab`` commands and ``train.py`` run in this process (their arguments and output are those of the command
line), ``torchrun --nproc_per_node 2 train.py ...`` in two processes forked from it with torchrun's environment
(``helpers.forked.run_two``; torchrun itself is test_preemption's subject); other commands run in ``bash``; a block that starts a background job (a line ending in ``&``: a server) runs
whole in one ``bash``. ``source .venv/bin/activate`` does nothing here: the suite runs in the
environment. A block marked ``<!-- skip: reason -->`` on the line before it is reported as skipped with
its reason; it needs what the suite cannot have (a GPU, network, SLURM).

The site itself is built with MkDocs, warnings as errors.
"""
from __future__ import annotations

import gzip
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import launch_env, reset_accelerate, run_two

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"<!--\s*skip:\s*(.+?)\s*-->")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks(page: Path) -> list[Block]:
    """The page's fenced ``python`` and ``bash`` blocks, each with the skip reason marked before it."""
    lines, found, i = page.read_text().splitlines(), [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marked = SKIP.search(before)
        if fence.group(1) in ("python", "bash"):
            found.append(Block(page, i + 1, fence.group(1), "\n".join(lines[i + 1:end]),
                               marked.group(1) if marked else None))
        i = end + 1
    return found


BLOCKS = [b for page in PAGES for b in _blocks(page)]


# --- the directory a page runs in -------------------------------------------------------------------

def _first_files(folder: Path, n: int) -> list[Path]:
    return sorted(folder.iterdir())[:n]


@pytest.fixture(scope="session")
def shared_data(tmp_path_factory) -> Path:
    """``shared/data``: small subsets of the real data sets that the suite can see."""
    data = tmp_path_factory.mktemp("shared") / "data"
    cifar = os.environ.get("VITLAB_CIFAR10_DIR")
    if cifar and (Path(cifar) / "train").is_dir():
        for split, n in (("train", 6), ("test", 3)):
            for cls in sorted((Path(cifar) / split).iterdir()):
                (data / "cifar10" / split / cls.name).mkdir(parents=True)
                for f in _first_files(cls, n):
                    (data / "cifar10" / split / cls.name / f.name).symlink_to(f)
    else:  # a stand-in for the training commands that name no data (what they would download)
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(0)
        for split, n in (("train", 6), ("test", 3)):
            for c in range(10):
                (data / "standin" / split / f"class_{c}").mkdir(parents=True)
                for i in range(n):
                    pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                    Image.fromarray(pixels).save(data / "standin" / split / f"class_{c}" / f"{i}.png")
    multi30k = os.environ.get("VITLAB_MULTI30K_DIR")
    if multi30k and Path(multi30k).is_dir():
        (data / "multi30k").mkdir(parents=True)
        for f in Path(multi30k).glob("*.gz"):
            with gzip.open(f, "rt", encoding="utf-8") as text:
                head = [next(text) for _ in range(200 if f.name.startswith("train") else 10)]
            with gzip.open(data / "multi30k" / f.name, "wt", encoding="utf-8") as out:
                out.writelines(head)
    shakespeare = os.environ.get("VITLAB_TINYSHAKESPEARE")
    if shakespeare and Path(shakespeare).is_file():
        (data / "tinyshakespeare").mkdir(parents=True)
        (data / "tinyshakespeare" / "input.txt").write_text(Path(shakespeare).read_text()[:40_000])
    return data


def _pictures(directory: Path, shared: Path) -> None:
    """``cat.png`` and ``ship.jpg``: CIFAR-10 test images where the suite has them, else drawn."""
    from PIL import Image

    for name, cls, colour in (("cat.png", "cat", (150, 120, 90)), ("ship.jpg", "ship", (60, 90, 160))):
        source = shared / "cifar10" / "test" / cls
        image = Image.open(_first_files(source, 1)[0]) if source.is_dir() else Image.new("RGB", (32, 32), colour)
        image.convert("RGB").save(directory / name)


class PageRun:
    """A page's directory and how far its blocks have run."""

    def __init__(self, page: Path, root: Path, shared: Path) -> None:
        self.page, self.done = page, 0
        self.unwritten: dict[str, str] = {}  # what a block skipped for its data would have written -> the reason
        self.cwd = root / "repo"
        self.cwd.mkdir(parents=True)
        (root / "shared").symlink_to(shared.parent)
        for name in ("configs", "train.py", "benchmarks"):
            (self.cwd / name).symlink_to(ROOT / name)
        _pictures(self.cwd, shared)
        self.shared = shared


@pytest.fixture(scope="session")
def page_runs(tmp_path_factory, shared_data) -> dict[Path, PageRun]:
    return {page: PageRun(page, tmp_path_factory.mktemp(page.stem.lower()), shared_data) for page in PAGES}


# --- running a block ------------------------------------------------------------------------------

def _config_task(args: list[str], cwd: Path) -> tuple[str, dict]:
    """The task and the data section of a training command's config (``--config``, or a resumed run's)."""
    if "--config" in args:
        path = cwd / args[args.index("--config") + 1]
    else:
        resumed = cwd / args[args.index("--resume") + 1]
        path = next(p for p in (resumed / "run_config.yaml", resumed / "config.yaml") if p.is_file())
    raw = yaml.safe_load(path.read_text()) or {}
    return raw.get("task", "classification"), raw.get("data") or {}


def _shortened(args: list[str], cwd: Path, shared: Path) -> list[str]:
    """The keys appended to a training command: one epoch on tiny subsets (see the module's docstring)."""
    given = {a.split("=", 1)[0] for a in args if "=" in a and not a.startswith("-")}
    task, data = _config_task(args, cwd)
    task = next((a.split("=", 1)[1] for a in args if a.startswith("task=")), task)
    extra = ["train.epochs=1"]
    if (task in ("classification", "mae", "dino") and "data.dataset" not in given
            and data.get("dataset", "cifar10") == "cifar10" and "--config" in args):  # the shared copy, not a download
        copy = shared / "cifar10" if (shared / "cifar10").is_dir() else shared / "standin"
        extra += ["data.dataset=imagefolder", f"data.root={copy}"]
    if task == "classification":
        extra += ["data.train_subset=40", "data.test_subset=20", "train.batch_size=20", "data.num_workers=0"]
        if "data.val_size" in given or data.get("val_size"):
            extra.append("data.val_size=10")
    elif task in ("mae", "dino"):  # pretraining: tiny subsets of its images and of its k-NN monitor's
        extra += ["data.train_subset=40", "train.batch_size=20", "data.num_workers=0", "monitor.train_subset=40",
                  "monitor.test_subset=20"]
    elif task == "seq2seq":
        extra += ["generate.eval_subset=8"]
        if data.get("dataset") != "parallel":
            extra += ["data.num_train=64", "data.num_test=16"]
    else:
        extra += ["data.steps_per_epoch=2", "data.eval_batches=2"]
    if "train.log_with" not in given:
        extra.append("train.log_with=none")
    if "train.curves" not in given:  # its figure is most of a run this short
        extra.append("train.curves=false")
    return [*args, *extra]


def _in_process(fn, argv: list[str]) -> None:
    try:
        fn(argv)
    except SystemExit as e:
        assert e.code in (0, None), f"exit status {e.code}"
    finally:
        reset_accelerate()


def _run_command(command: str, run: PageRun, monkeypatch: pytest.MonkeyPatch) -> None:
    from vitlab.cli import main, train_main

    argv = shlex.split(command, comments=True)
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):  # VAR=value command ...
        name, value = argv.pop(0).split("=", 1)
        monkeypatch.setenv(name, value)
    if not argv or argv[:2] in (["source", ".venv/bin/activate"], [".", ".venv/bin/activate"]):
        return
    tool = Path(argv[0]).name
    if tool in ("python", "python3") and argv[1:2] == ["train.py"]:
        return _in_process(train_main, _shortened(argv[2:], run.cwd, run.shared))
    if tool == "vitlab" and argv[1:2] == ["train"]:
        return _in_process(train_main, _shortened(argv[2:], run.cwd, run.shared))
    if tool == "vitlab" and argv[1:2] == ["tune"]:  # one trial, a run shortened as the training commands
        args = argv[2:]
        if "--trials" in args:
            args[args.index("--trials") + 1] = "1"
        return _in_process(main, ["tune", *_shortened(args, run.cwd, run.shared)])
    if tool == "vitlab" and ("--unknown-images" in argv or argv[1:2] == ["calibrate"] and "--unknown" in argv) \
            and "--unknown-k" not in argv:  # the k-NN score's neighbour among the tiny subsets' few training images
        return _in_process(main, [*argv[1:], "--unknown-k", "5"])
    if tool == "vitlab":
        return _in_process(main, argv[1:])
    if argv[:2] == ["make", "train"]:
        settings = dict(a.split("=", 1) for a in argv[2:] if "=" in a)
        args = ["--config", settings.get("CONFIG", "configs/vit_cifar10.yaml"), *shlex.split(settings.get("ARGS", ""))]
        return _in_process(train_main, _shortened(args, run.cwd, run.shared))
    if tool == "torchrun":
        script = next(i for i, a in enumerate(argv) if a.endswith("train.py"))
        options, args = argv[1:script], [argv[script], *_shortened(argv[script + 1:], run.cwd, run.shared)]
        env = {**launch_env(2), "OMP_NUM_THREADS": "1"}
        if [o for o in options if o != "--standalone"] == ["--nproc_per_node", "2"]:  # its 2 workers, forked
            done = run_two(args, env)
        else:
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *options, *args], cwd=run.cwd,
                                  capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # `python`: the suite's own
    done = subprocess.run(["bash", "-c", command], cwd=run.cwd, capture_output=True, text=True,
                          env={**os.environ, "PATH": path})
    assert done.returncode == 0, done.stderr[-3000:]


def _commands(code: str) -> list[str]:
    """A bash block's commands: continuation lines joined, blank lines and comments left out."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


# What a block uses that an optional extra of pyproject.toml brings: (pattern in the block, module, extra).
EXTRAS = ((r"data\.dataset=hf|^import datasets", "datasets", "hf"), (r"data\.dataset=wds|vitlab shards", "webdataset", "wds"),
          (r"--format onnx", "onnxscript", "export"), (r"model\.lora_r|add_lora", "peft", "lora"),
          (r"transformers:|_transformers", "transformers", "transformers"),
          (r"vitlab serve|vitlab\.serving", "fastapi", "serve"), (r"vitlab inspect|vitlab\.inspection", "cleanlab", "inspect"))


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _what_is_missing(block: Block, run: PageRun) -> str | None:
    """Why ``block`` cannot run here (real data or a tracker's package not installed, as on the GPU
    machine without mlflow), or None."""
    # The block's own text and the configs it names (configs/multi30k_de_en.yaml reads shared/data/multi30k).
    configs = [ROOT / c for c in re.findall(r"configs/[\w.-]+\.yaml", block.code) if (ROOT / c).is_file()]
    text = "\n".join([block.code, *(c.read_text() for c in configs)])
    reasons = [f"real data not available: set {variable}" for name, variable in (
        ("cifar10", "VITLAB_CIFAR10_DIR"), ("multi30k", "VITLAB_MULTI30K_DIR"),
        ("tinyshakespeare", "VITLAB_TINYSHAKESPEARE")) if f"shared/data/{name}" in text and not (run.shared / name).exists()]
    reasons += [f"the {tracker} package is not installed: pip install 'vitlab[{tracker}]'"
                for tracker in re.findall(r"train\.log_with=(\w+)", block.code)
                if tracker not in ("none", "all") and importlib.util.find_spec(tracker) is None]
    # An optional extra the environment lacks (make test-lowest installs the test extra alone).
    reasons += [f"the {extra} extra is not installed: pip install 'vitlab[{extra}]'"
                for pattern, module, extra in EXTRAS if re.search(pattern, block.code, re.M) and not _installed(module)]
    if reasons:
        # what it would have written: the run directories and files it names, else its configs' (the quick start's)
        outs = _outputs(block.code) or [(yaml.safe_load(c.read_text()).get("train") or {}).get("output_dir")
                                        for c in configs]
        run.unwritten.update({out: reasons[0] for out in outs if out})
        return reasons[0]
    # A block that reads what a skipped block would have written skips with it, and so do the blocks that read what
    # this one would have written (an export of a run that was not trained, then the code that loads the export).
    reason = next((reason for out, reason in run.unwritten.items() if out in block.code), None)
    if reason:
        run.unwritten.update({out: reason for out in _outputs(block.code)})
    return reason


def _outputs(code: str) -> list[str]:
    """What a block writes: the run directories (``train.output_dir=``) and files (``--output``) it names."""
    return re.findall(r"train\.output_dir=(\S+)", code) + re.findall(r"--output[= ](\S+)", code)


def _run_block(block: Block, run: PageRun, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(run.cwd)
    if block.lang == "python":
        import matplotlib

        # `vitlab` and `python` of a subprocess the block starts: the suite's own, as in an activated .venv
        monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")

        matplotlib.use("Agg")
        try:
            exec(compile(block.code, block.name, "exec"), {"__name__": "__main__"})
        finally:
            reset_accelerate()
        return
    if any(line.rstrip().endswith("&") for line in _commands(block.code)):  # a background job (a server): the
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # block whole, in one bash
        done = subprocess.run(["bash", "-c", f"set -e\n{block.code}"], cwd=run.cwd, capture_output=True, text=True,
                              env={**os.environ, "PATH": path}, timeout=300)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        return
    for command in _commands(block.code):
        with monkeypatch.context() as m:
            _run_command(command, run, m)


def _marked(block: Block) -> pytest.param:
    """A block as a test case: slow (a docs page's commands train and evaluate for real), and multiprocess where it
    launches two processes."""
    marks = [pytest.mark.slow]
    if re.search(r"\btorchrun\b|accelerate launch", block.code):
        marks.append(pytest.mark.multiprocess)
    return pytest.param(block, marks=marks, id=block.name)


@pytest.mark.parametrize("block", [_marked(b) for b in BLOCKS])
def test_snippet_runs(block: Block, page_runs: dict[Path, PageRun], monkeypatch: pytest.MonkeyPatch) -> None:
    run = page_runs[block.page]
    blocks = [b for b in BLOCKS if b.page == block.page]
    index = blocks.index(block)
    for earlier in blocks[run.done:index]:  # what this block builds on, when it is run alone
        if not earlier.skip and not _what_is_missing(earlier, run):
            _run_block(earlier, run, monkeypatch)
    run.done = max(run.done, index + 1)
    if block.skip:
        pytest.skip(block.skip)
    missing = _what_is_missing(block, run)
    if missing:
        pytest.skip(missing)
    _run_block(block, run, monkeypatch)


def test_a_block_reading_what_a_skipped_block_would_have_written_skips(tmp_path: Path) -> None:
    """Without the real data (a fresh clone's ``make test``): training skips, so the export of its run skips, so the
    code that loads the exported file skips too, instead of failing on a file never written."""
    empty = tmp_path / "data"
    empty.mkdir()
    page = ROOT / "docs" / "serving.md"
    run = PageRun(page, tmp_path / "page", empty)
    train = Block(page, 1, "bash", "python train.py --config configs/cifar10_cpu_quick.yaml data.root=../shared/data/"
                  "cifar10 train.output_dir=runs/quick", None)
    export = Block(page, 2, "bash", "vitlab export --checkpoint runs/quick --format onnx --output runs/model.onnx",
                   None)
    load = Block(page, 3, "python", "import onnx\nonnx.load('runs/model.onnx')", None)
    elsewhere = Block(page, 4, "python", "print('runs/other.onnx')", None)
    assert _what_is_missing(train, run) == "real data not available: set VITLAB_CIFAR10_DIR"
    assert _what_is_missing(export, run) == _what_is_missing(load, run) == _what_is_missing(train, run)
    assert _what_is_missing(elsewhere, run) is None


def test_every_skip_says_why_and_the_quick_start_runs_whole() -> None:
    assert all(len(b.skip) > 10 for b in BLOCKS if b.skip)  # a reason, not a bare marker
    text = (ROOT / "README.md").read_text()
    start, end = text.index("[start:quickstart]"), text.index("[end:quickstart]")
    quick_start = [b for b in BLOCKS if b.page.name == "README.md" and start < text.index(b.code) < end]
    assert len(quick_start) == 6 and not any(b.skip for b in quick_start)


def test_the_documentation_site_builds_without_warnings(tmp_path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install 'vitlab[docs]'")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "api" / "index.html").is_file()
    # The README's quick start is the home page's: one home, included.
    assert "vitlab eval --checkpoint runs/cifar10_cpu_quick" in (tmp_path / "site" / "index.html").read_text()
