"""The shape of the three packages: they import each other in one direction, and no module grows past a size a
reader takes in.

``kernels`` imports nothing of the project; ``checkpoints_tools`` (HF files, key maps, the transformers reference of
verify) imports nothing of ``ligermodels`` or ``kernels``; ``ligermodels`` imports both. Every import statement
counts, those inside functions included (they are read from the source, not from ``sys.modules``).
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("kernels", "checkpoints_tools", "ligermodels")
#: What each package may import of the project besides itself.
ALLOWED = {"kernels": set(), "checkpoints_tools": set(), "ligermodels": {"kernels", "checkpoints_tools"}}
#: Most lines of a module in these packages (kernels/ holds whole op families, forward and backward).
MAX_LINES = {"ligermodels": 600, "checkpoints_tools": 600}
#: The training loop reads in one sitting.
MAX_LOOP_LINES = 300


def _modules(package: str) -> list[str]:
    out = []
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
        out += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    return sorted(out)


def _project_imports(path: str) -> set[tuple[str, int]]:
    """(top-level project package, line) of every import statement in ``path``, at any depth."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {(n.split(".")[0], node.lineno) for n in names if n.split(".")[0] in PACKAGES}
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_each_other_in_one_direction(package):
    wrong = [f"{os.path.relpath(path, ROOT)}:{line} imports {other}" for path in _modules(package)
             for other, line in sorted(_project_imports(path)) if other != package and other not in ALLOWED[package]]
    assert not wrong, wrong


def test_the_import_check_sees_imports_inside_functions(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\n\ndef f():\n    from ligermodels.model import CausalLM\n    import kernels.glu\n")
    assert _project_imports(str(path)) == {("ligermodels", 4), ("kernels", 5)}


@pytest.mark.parametrize("package", sorted(MAX_LINES))
def test_no_module_is_longer_than_a_reader_takes_in(package):
    long = {}
    for path in _modules(package):
        with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES[package]:
            long[os.path.relpath(path, ROOT)] = n
    assert not long, long


def test_the_training_loop_reads_in_one_sitting():
    with open(os.path.join(ROOT, "ligermodels", "train", "loop.py"), encoding="utf-8") as f:
        assert sum(1 for _ in f) <= MAX_LOOP_LINES


#: Packages whose private names tests and benchmarks never use: the model and training API, what users call. (A
#: kernel family's tests look inside it: which kernel ran, its launch tiling.)
PUBLIC_ONLY = ("ligermodels", "checkpoints_tools")


def _private_uses(path: str) -> list[str]:
    """Private names (``_x``) of :data:`PUBLIC_ONLY` packages that ``path`` imports or reaches through a module
    alias."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    modules, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in PUBLIC_ONLY:
            found += [f"{node.lineno}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            modules |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name.split(".")[0] in PUBLIC_ONLY}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


@pytest.mark.parametrize("folder", ["tests", "benchmarks", "examples"])
def test_tests_benchmarks_and_examples_use_public_names_only(folder):
    """What a user can rely on is what the tests and benchmarks exercise: no ``_private`` name of the packages."""
    used = {os.path.relpath(p, ROOT): u for p in _modules(folder) if (u := _private_uses(p))}
    assert not used, used
