"""The package's rooms and the direction of their imports: a lower room never imports a higher one."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vitlab"

# Lowest first. Modules of one room may import each other; a room may import only rooms before it.
ROOMS: list[tuple[str, set[str]]] = [
    ("foundation", {"errors", "files", "outputs", "seeding", "progress", "runtime", "schema"}),
    ("attention", {"attention"}),
    ("layers", {"layers"}),
    ("models", {"models", "text"}),
    ("data", {"data"}),
    ("inference", {"inference"}),
    ("visualize", {"visualize"}),
    ("tasks", {"tasks"}),
    # The engine, in floors: what a run is made of (its config, checkpoints, stop signals, conversions), the jobs on a
    # trained model (evaluation, prediction), what runs them (the training loop, inspection, the server), commands.
    ("engine", {"config", "checkpoint", "preemption", "interop", "export"}),
    ("jobs", {"evaluation", "prediction", "unknown"}),
    ("runs", {"training", "inspection", "serving", "tuning"}),
    ("commands", {"cli", "commands", "__init__"}),
]
ALLOWED_BELOW = {  # models and data are siblings: neither needs the other
    "data": {"foundation"},
    "models": {"foundation", "attention", "layers"},
}


def _room(top: str) -> int:
    for i, (_, members) in enumerate(ROOMS):
        if top in members:
            return i
    raise AssertionError(f"vitlab/{top} is in no room of the layout; add it to ROOMS")


def _runtime_imports(path: Path) -> set[str]:
    """The vitlab top-level names ``path`` imports at run time (``if TYPE_CHECKING:`` blocks excluded)."""
    tree = ast.parse(path.read_text())
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]  # e.g. ('vitlab', 'tasks')
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - node.level + 1]) + (node.module.split(".") if node.module else [])
                names = [base + [a.name] for a in node.names] if not node.module else [base]
            else:
                names = [node.module.split(".")]
            found |= {n[1] for n in names if n[0] == "vitlab" and len(n) > 1}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("vitlab.")}
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_lower_rooms_never_import_higher_ones(path: Path) -> None:
    rel = path.relative_to(PACKAGE)
    top = rel.parts[0].removesuffix(".py")
    room = _room(top)
    name = ROOMS[room][0]
    for imported in _runtime_imports(path) - {top}:
        other = _room(imported)
        allowed = ALLOWED_BELOW.get(name)
        ok = other == room or (ROOMS[other][0] in allowed if allowed is not None else other < room)
        assert ok, f"vitlab/{rel} ({name}) imports vitlab.{imported} ({ROOMS[other][0]})"


def test_attention_imports_only_torch_and_einops() -> None:
    for path in (PACKAGE / "attention").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level:
                assert node.module.split(".")[0] in {"torch", "einops", "__future__", "typing", "dataclasses",
                                                     "math"}, f"{path.name} imports {node.module}"
            if isinstance(node, ast.Import):
                for a in node.names:
                    assert a.name.split(".")[0] in {"torch", "einops", "math"}, f"{path.name} imports {a.name}"


def test_the_public_import_paths_keep_working() -> None:
    from vitlab.attention import KVCache, MultiHeadAttention, scaled_dot_product_attention  # noqa: F401
    from vitlab.models import Seq2SeqTransformer
    from vitlab.text import Seq2SeqTransformer as TextSeq2Seq

    assert TextSeq2Seq is Seq2SeqTransformer  # one definition, two public names


def _dotted(path: Path) -> str:
    """A module's dotted name ('vitlab.layers.moe'); a package's ``__init__.py`` is the package ('vitlab.training')."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports(path: Path) -> set[str]:
    """The vitlab modules (dotted, e.g. 'vitlab.layers.moe') ``path`` imports anywhere in it, function
    bodies included, ``if TYPE_CHECKING:`` blocks left out. An import of a package is an import of its
    ``__init__.py`` (which imports what it re-exports), as Python runs it."""
    tree = ast.parse(path.read_text())
    package = list(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    modules = {_dotted(p) for p in MODULES}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, ast.ImportFrom):
            continue
        base = (package[:len(package) - node.level + 1] if node.level else []) + (node.module or "").split(".")
        base = [b for b in base if b]
        for alias in node.names:
            for candidate in (".".join(base + [alias.name]), ".".join(base)):
                if candidate in modules and candidate != _dotted(path):
                    found.add(candidate)
                    break
    return found


def test_an_import_of_a_package_counts_as_an_import_of_its_init() -> None:
    # from .training import x runs vitlab/training/__init__.py: the circle check must see it
    assert "vitlab.runtime" in _module_imports(PACKAGE / "training" / "__init__.py")
    assert "vitlab.training" in _module_imports(PACKAGE / "cli.py")


def test_no_modules_import_each_other_in_a_circle() -> None:
    # A circle of any length (even through a function-level import) means its modules hold one idea between
    # them: registry -> vit -> hub -> registry was one.
    graph = {_dotted(p): _module_imports(p) for p in MODULES}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            circle = path[path.index(module):] + [module]
            raise AssertionError(f"modules import each other in a circle: {' -> '.join(circle)}")
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


# What the last redesign reached (issue 61), kept: a module reads in one sitting, a function in a screen or two.
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def _too_long(path: Path) -> list[str]:
    """The module itself if over :data:`MAX_MODULE_LINES`, and each function (its signature, docstring and body)
    over :data:`MAX_FUNCTION_LINES`."""
    source = path.read_text()
    found = [f"{path.name}: {source.count(chr(10))} lines"] if source.count("\n") > MAX_MODULE_LINES else []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path.name}:{node.lineno} {node.name}: {length} lines")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_over_450_lines_and_no_function_over_80(path: Path) -> None:
    assert not _too_long(path), f"split by what each part does: {'; '.join(_too_long(path))}"


def test_the_size_check_sees_a_long_function(tmp_path: Path) -> None:
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + "    x = 1\n" * 81)
    assert _too_long(long) == ["long.py:1 f: 82 lines"]
