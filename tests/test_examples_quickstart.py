"""Smoke test of examples/quickstart.py: it runs offline on a tiny random Llama, from its default and from --model."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "quickstart.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # CPU reference kernels: fast
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_quickstart_default_tiny_model_runs_offline():
    res = _run("--prompt", "Hello there", "--max-new-tokens", "8")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Hello there" in res.stdout


def test_quickstart_from_checkpoint_dir_with_sampling(tmp_path):
    spec = importlib.util.spec_from_file_location("quickstart", SCRIPT)
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    ckpt = quickstart.build_tiny_checkpoint(str(tmp_path / "tiny"))
    assert sorted(os.listdir(ckpt)) == ["config.json", "generation_config.json", "model.safetensors",
                                       "tokenizer.json"]
    res = _run("--model", ckpt, "--prompt", "abc", "--max-new-tokens", "6", "--temperature", "0.8", "--top-p", "0.9")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("abc")
