"""The runtime needs only its declared dependencies, and a missing one is an ``error:`` line.

The test extras (pytest, transformers, ...) are installed wherever the suite runs, so a runtime
import of one of them would pass every other test and crash a user's fresh install. Here the
children run with those packages blocked (``sys.modules[name] = None`` from a ``sitecustomize``
on their path, before anything is imported): every module of the three packages imports, both
command lines answer ``--help``, and the demo saves a checkpoint and resumes from it. The blocked
set is read from ``pyproject.toml`` (the ``test`` extra less the runtime dependencies), so a new
test-only package is blocked without editing this file.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from ligermodels.cli import environment_error
from ligermodels.dependencies import RUNTIME_DEPENDENCIES

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("kernels", "ligermodels", "checkpoints_tools")
TIMEOUT = 300


def _name(requirement: str) -> str:
    """The distribution name of a requirement string ("pytest>=8" -> "pytest")."""
    return re.match(r"[A-Za-z0-9_.\-]+", requirement)[0].lower().replace("-", "_")


def _project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _test_only_modules() -> list[str]:
    project = _project()
    runtime = {_name(r) for r in project["dependencies"]}
    return sorted({_name(r) for r in project["optional-dependencies"]["test"]} - runtime)


def _run(args: list[str], tmp_path, blocked: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``python ARGS`` in a child where the ``blocked`` modules cannot be imported."""
    site = tmp_path / "blocker"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        f"import sys\nfor _name in {blocked!r}:\n    sys.modules[_name] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), ROOT]), "TRITON_INTERPRET": "0",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], cwd=kwargs.pop("cwd", ROOT), env=env, capture_output=True,
                          text=True, timeout=TIMEOUT, **kwargs)


def test_the_blocked_set_holds_the_test_only_packages():
    blocked = _test_only_modules()
    assert {"pytest", "transformers"} <= set(blocked), blocked
    assert not set(blocked) & {pip for pip, _ in RUNTIME_DEPENDENCIES.values()}


def test_every_module_imports_without_the_test_only_packages(tmp_path):
    blocked = _test_only_modules()
    script = textwrap.dedent(f"""
        import importlib, pkgutil
        for name in {blocked!r}:  # the blocker works: a test-only import fails here
            try:
                importlib.import_module(name)
            except ImportError:
                pass
            else:
                raise SystemExit(f"{{name}} was importable")
        names = []
        for package in {PACKAGES!r}:
            module = importlib.import_module(package)
            names.append(package)
            for info in pkgutil.walk_packages(module.__path__, package + "."):
                importlib.import_module(info.name)
                names.append(info.name)
        print("imported", len(names), "modules:", " ".join(names))
    """)
    res = _run(["-c", script], tmp_path, blocked)
    assert res.returncode == 0, res.stderr[-4000:]
    for must in ("ligermodels.train", "ligermodels.train.loop", "ligermodels.verify", "checkpoints_tools.verify",
                 "kernels.adamw"):
        assert must in res.stdout.split(), res.stdout


def test_both_command_lines_run_without_the_test_only_packages(tmp_path):
    for module, usage in (("ligermodels.train", "usage: python -m ligermodels.train"),
                          ("ligermodels.verify", "usage: python -m ligermodels.verify")):
        res = _run(["-m", module, "--help"], tmp_path, _test_only_modules())
        assert res.returncode == 0 and usage in res.stdout, (module, res.stderr[-4000:])


def test_a_checkpoint_saves_and_resumes_without_the_test_only_packages(tmp_path):
    """The demo's run in small: a checkpoint at step 2 (torch.distributed.checkpoint), then --resume to step 3,
    the HF export, completions; the runs' metrics continue each other."""
    out = tmp_path / "run"
    common = ["-m", "ligermodels.train", "--out", str(out), "--batch-size", "4", "--seq-len", "32",
              "--lr-schedule", "constant", "--warmup-steps", "0", "--save-every", "2", "--log-every", "1"]
    first = _run([*common, "--steps", "2"], tmp_path, _test_only_modules())
    assert first.returncode == 0, first.stderr[-4000:]
    assert (out / "checkpoints" / "step_00000002" / "train_state.json").exists()
    resumed = _run([*common, "--steps", "3", "--resume"], tmp_path, _test_only_modules())
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "(step 2)" in resumed.stdout and "additions answered right" in resumed.stdout, resumed.stdout
    assert (out / "checkpoints" / "step_00000003" / "train_state.json").exists()
    assert (out / "final" / "model.safetensors").exists()
    with open(out / "metrics.jsonl") as f:
        assert [int(re.search(r'"step": (\d+)', line)[1]) for line in f] == [1, 2, 3]


@pytest.mark.parametrize("module", ["ligermodels.train", "ligermodels.verify"])
def test_a_missing_runtime_dependency_is_one_error_line_naming_it(tmp_path, module):
    res = _run(["-m", module, "--help"], tmp_path, ["tokenizers"])
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: missing dependency: tokenizers"), res.stderr
    assert "pip install tokenizers" in lines[0]


def test_report_to_a_missing_package_is_one_error_line_naming_it(tmp_path):
    """--report-to tensorboard without tensorboard (a test-only package, blocked here): refused before any work."""
    out = tmp_path / "run"
    res = _run(["-m", "ligermodels.train", "--out", str(out), "--steps", "1", "--report-to", "tensorboard"], tmp_path,
               _test_only_modules())
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == ["error: --report-to tensorboard needs the tensorboard package: pip "
                                               "install tensorboard"]
    assert not (out / "metrics.jsonl").exists()


def test_a_missing_runtime_dependency_raises_import_error_in_a_library(tmp_path):
    res = _run(["-c", "import ligermodels"], tmp_path, ["safetensors"])
    assert res.returncode == 1 and "ImportError: missing dependency: safetensors" in res.stderr, res.stderr


def test_runtime_dependencies_are_declared_and_documented():
    declared = {_name(r) for r in _project()["dependencies"]}
    assert declared == {pip for pip, _ in RUNTIME_DEPENDENCIES.values()}
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme[readme.index("## Dependencies"):]
    for pip, _ in RUNTIME_DEPENDENCIES.values():
        assert re.search(rf"^\| {re.escape(pip)} \| \S", section, re.M), f"README's dependency table lacks {pip}"


def test_environment_errors_name_the_package_the_device_or_the_path():
    message = environment_error(ModuleNotFoundError("No module named 'numpy'", name="numpy"))
    assert message.startswith("missing dependency: numpy (") and "pip install numpy" in message
    message = environment_error(ModuleNotFoundError("No module named 'yaml.x'", name="yaml.x"))
    assert "pip install yaml" in message
    assert "--batch-size" in environment_error(torch.OutOfMemoryError("CUDA out of memory"))
    message = environment_error(PermissionError(13, "Permission denied", "/ro/ckpt"))
    assert "/ro/ckpt" in message and "writable" in message
    assert environment_error(KeyError("a bug")) is None


_KERNEL_LISTS = """
import json, sys
import torch._library.triton as library_triton
import ligermodels.train.loop  # what a training process imports
from kernels._common import _KernelsOnFirstRead

ours = {n: k for n, k in library_triton.triton_ops_to_kernels.items() if n.startswith("ligermodels::")}
deferred = all(isinstance(k, _KernelsOnFirstRead) for k in ours.values())
inductor_at_import = "torch._inductor" in sys.modules
pending = {n: k._pending for n, k in ours.items()}

def names(kernels):
    return [getattr(k, "__name__", None) or k.fn.__name__ for k in kernels]

print(json.dumps({"deferred": deferred, "inductor_at_import": inductor_at_import,
                  "read": {n: names(library_triton.get_triton_kernels_for_op(n)) for n in ours},
                  "at_registration": {n: names(find(fn)) for n, (find, fn) in pending.items()}}))
"""


@pytest.mark.skipif(not hasattr(importlib.import_module("torch._library.triton"), "get_inner_triton_kernels"),
                    reason="this torch does not look for a triton_op's kernels at registration")
def test_the_ops_kernels_are_found_when_first_read_and_importing_the_trainer_leaves_inductor_unimported():
    """Registering this package's ops reads no kernel source and imports no torch._inductor (a second or more of
    every process's start); torch.compile's cache, reading the lists later, gets what registration would have found
    (compiled kernels: TRITON_INTERPRET=0, where torch recognises them)."""
    import json

    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-c", _KERNEL_LISTS], env=env, capture_output=True, text=True,
                         timeout=TIMEOUT, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["deferred"] and not out["inductor_at_import"]
    assert out["read"] == out["at_registration"]
    assert out["read"]["ligermodels::rms_norm_fwd"] == ["_rms_norm_fwd_kernel"]
    assert sum(bool(k) for k in out["read"].values()) >= 20, out["read"]  # most ops launch a kernel they name
