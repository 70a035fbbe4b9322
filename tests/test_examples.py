"""Smoke tests: the examples run end to end on tiny configs (PyTorch reference kernels on CPU)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_custom_model_example_trains_saves_and_matches_transformers(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "custom_model.py"), "--steps", "12",
                          "--out", str(tmp_path / "m")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": ROOT})  # the checkout
    assert out.returncode == 0, out.stderr[-2000:]
    losses = [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("step")]
    assert losses[-1] < losses[0]
    assert (tmp_path / "m" / "config.json").exists()
    err = float(out.stdout.split("logits rel. error")[1].split()[0])
    assert err < 1e-5
