"""The scripts under benchmarks/ against the package they measure: every name one imports from vitlab exists (a move
inside the package must move their imports too), and the loader benchmarks run end to end on tiny arguments."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


def _vitlab_imports(path: Path) -> list[tuple[str, str, int]]:
    """``(module, name, line)`` of every ``from vitlab... import name`` in ``path``, in functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vitlab":
            found += [(node.module, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "vitlab"]
    return found


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_every_name_a_benchmark_imports_from_vitlab_exists(path):
    missing = []
    for module, name, line in _vitlab_imports(path):
        try:
            imported = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"line {line}: {module} ({e})")
            continue
        if name and not hasattr(imported, name):
            try:
                importlib.import_module(f"{module}.{name}")  # a submodule
            except ImportError:
                missing.append(f"line {line}: {name} from {module}")
    assert not missing, f"{path.name}: " + "; ".join(missing)


def test_the_static_check_sees_a_name_that_moved(tmp_path):
    script = tmp_path / "moved.py"
    script.write_text("def main():\n    from vitlab.data.images import train_transform\n")
    with pytest.raises(AssertionError, match="line 2: train_transform from vitlab.data.images"):
        test_every_name_a_benchmark_imports_from_vitlab_exists(script)


@pytest.mark.slow
def test_the_streaming_benchmark_runs_one_epoch_on_tiny_data(tiny_imagefolder):
    """bench_streaming.py's child (one streamed epoch, its peak memory as JSON): what stopped at an ImportError when
    the transforms moved."""
    import json

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_streaming.py"), "--data",
                           str(tiny_imagefolder), "--size", "32", "--child", "64"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    memory = json.loads(done.stdout.strip().splitlines()[-1])
    assert memory["main_mib"] > 0 and memory["worker_mib"] > 0
