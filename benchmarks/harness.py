"""Timing and reporting shared by the GPU benchmarks (run on the GPU, never in tests).

Times are medians of CUDA-event timings (``triton.testing.do_bench``) after warm-up. Achieved
bandwidth counts the fewest bytes an op must move (each input read once, each output written
once), against the device's copy bandwidth measured in the same run.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Callable

import torch
import triton

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def bench_ms(fn: Callable[[], object], grad_to_none=None, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn()`` (warm-up and repeat in ms, as do_bench takes them)."""
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none,
                                         return_mode="median"))


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), on a buffer far over L2."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def matmul_tflops(n: int = 8192, dtype=torch.bfloat16) -> float:
    """Dense bf16 matmul rate in TFLOP/s on random (n, n) operands."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = bench_ms(lambda: a @ b)
    return 2 * n**3 / ms / 1e9


def environment() -> dict:
    """GPU name and software versions recorded in every results file."""
    env = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def write_results(name: str, payload: dict, out_dir: str | None = None) -> str:
    """Write ``{environment..., **payload}`` as ``<out_dir>/<name>.json`` and return its path."""
    out_dir = out_dir or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({**environment(), **payload}, f, indent=1)
    os.replace(path + ".tmp", path)
    return path


def _flat(out) -> list[torch.Tensor]:
    return [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]


def time_fwd_bwd(fn: Callable[..., object], inputs: list[torch.Tensor]) -> tuple[float, float]:
    """(forward ms, backward ms) of ``fn(*inputs)``; backward w.r.t. every input requiring grad.

    Backward is timed by replaying ``autograd.grad`` over one retained graph, so it excludes the
    forward; where a graph cannot be retained (some compiled graphs), as (fwd+bwd) - fwd.
    """
    fwd = bench_ms(lambda: fn(*inputs))
    diff = [t for t in inputs if t.requires_grad]
    outs = _flat(fn(*inputs))
    douts = [torch.randn_like(o) for o in outs]
    try:
        torch.autograd.grad(outs, diff, douts, retain_graph=True)
        bwd = bench_ms(lambda: torch.autograd.grad(outs, diff, douts, retain_graph=True))
    except RuntimeError:
        both = bench_ms(lambda: torch.autograd.grad(_flat(fn(*inputs)), diff, douts))
        bwd = max(both - fwd, 0.0)
    return fwd, bwd


def compare_impls(op: str, shape: str, dtype: torch.dtype, impls: dict[str, Callable[..., object]],
                  make_inputs: Callable[[], list[torch.Tensor]], fwd_bytes: int, bwd_bytes: int,
                  copy_gbs: float) -> list[dict]:
    """Time each implementation of one op on fresh inputs; one row per (impl, pass)."""
    rows = []
    for impl, fn in impls.items():
        try:
            fwd, bwd = time_fwd_bwd(fn, make_inputs())
        except Exception as e:  # a baseline that fails is reported, not hidden
            rows.append({"op": op, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "impl": impl,
                         "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        for pas, ms, nbytes in (("fwd", fwd, fwd_bytes), ("bwd", bwd, bwd_bytes)):
            gbs = nbytes / ms / 1e6 if ms > 0 else float("nan")
            rows.append({"op": op, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "impl": impl,
                         "pass": pas, "ms": round(ms, 5), "bytes": nbytes, "gbs": round(gbs, 1),
                         "frac_copy_bw": round(gbs / copy_gbs, 3)})
        torch.cuda.empty_cache()
    return rows
