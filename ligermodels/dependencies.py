"""The runtime dependencies, why each is needed, and a check that runs before anything imports them.

Standard library only: ``ligermodels/__init__.py`` calls :func:`require_runtime_dependencies` first,
so a missing package is named before an import deep inside torch or triton fails. When the process
is one of the project's command lines (``python -m ligermodels.train``, ``python -m ligermodels.verify``),
the check prints one ``error:`` line and exits 2; imported as a library, it raises ``ImportError`` with the same text.

``pyproject.toml``'s ``dependencies`` and the README's dependency table list exactly these
(``tests/test_runtime_imports.py`` checks both).
"""

from __future__ import annotations

import importlib.util
import sys

#: import name -> (pip name, why the runtime needs it).
RUNTIME_DEPENDENCIES: dict[str, tuple[str, str]] = {
    "torch": ("torch", "tensors, autograd, FSDP2, torch.distributed.checkpoint, torch.compile"),
    "triton": ("triton", "the kernels (run through Triton's interpreter on a machine without a GPU)"),
    "safetensors": ("safetensors", "reading and writing checkpoints (never pickle)"),
    "huggingface_hub": ("huggingface_hub", "resolving and downloading hub repo ids"),
    "tokenizers": ("tokenizers", "the checkpoints' tokenizer.json, and the demo's character tokenizer"),
    "jinja2": ("jinja2", "rendering a checkpoint's chat template for conversation training data, in Jinja's sandbox "
                         "as transformers renders it"),
    "numpy": ("numpy", "torch.distributed's object collectives (checkpoint planning in torch.distributed.checkpoint, "
                       "broadcast_object_list) decode through numpy, and torch's wheels do not install it"),
}

#: ``python -m`` targets that are command lines: a missing dependency there is an ``error:`` line.
CLI_MODULES = ("ligermodels.train", "ligermodels.verify")


def importable(name: str) -> bool:
    """Whether ``import name`` would find the module (looked up, not imported; ``sys.modules[name] = None``,
    the standard way to block an import, counts as missing)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing_runtime_dependencies() -> list[str]:
    """pip names of the runtime dependencies that cannot be imported."""
    return [pip for name, (pip, _) in RUNTIME_DEPENDENCIES.items() if not importable(name)]


def missing_dependency_message(pip_names: list[str]) -> str:
    """One line naming the missing packages, what each is for, and the command that installs them."""
    why = {pip: reason for pip, reason in RUNTIME_DEPENDENCIES.values()}
    named = "; ".join(f"{p} ({why[p]})" if p in why else p for p in pip_names)
    return f"missing dependency: {named}. Install with: pip install {' '.join(pip_names)}"


def running_cli() -> bool:
    """Whether this process was started as one of :data:`CLI_MODULES` (``python -m NAME ...``)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    return any(a == "-m" and b in CLI_MODULES for a, b in zip(argv, argv[1:], strict=False))


def require_runtime_dependencies() -> None:
    """Name every missing runtime dependency before any of them is imported (see the module docstring)."""
    missing = missing_runtime_dependencies()
    if not missing:
        return
    message = missing_dependency_message(missing)
    if running_cli():
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)
    raise ImportError(message)
