"""Timing and reporting shared by the GPU benchmarks (run on the GPU, never in tests).

What the kernel benchmark measures, per op and pass (``time_fwd_bwd`` / ``compare_impls``):

* ``ms``, the **kernel time** (``timing: "cuda-kernels"`` in each row): the summed device duration
  of every CUDA kernel, memcpy and memset the call puts on the GPU, averaged over repetitions, from
  the CUDA profiler (:func:`kernel_ms`). Each repetition is preceded by an L2 flush (a dedicated
  Triton kernel, ``_l2_flush_kernel``, whose events are left out by name), so the op reads its
  inputs from HBM (cold L2, as in the wall timings). Gaps between kernels and all host work (Python,
  autograd, dispatch, launch latency) are not counted. This is what the op costs the GPU inside a
  training step, where the CPU runs ahead of the GPU and launch overhead is hidden behind earlier
  kernels; ``gbs`` and ``frac_copy_bw`` are computed from it.
* ``wall_ms``, the **wall time**: the median time between CUDA events around each call, with the CPU
  launching every call (``triton.testing.do_bench``, L2 flushed between calls). When the GPU work is
  short, this is the host's time to issue the call, not the GPU's; ``wall_ms`` much above ``ms`` means
  the op is host bound at that shape (it matters in a step only where the CPU cannot run ahead).
* ``launches``: device events (kernels, memcpys, memsets) per call, from the same profile.
* ``frac_same_size_copy``: the kernel time of a device copy moving the same bytes, divided by ``ms``
  (1.0: as fast as copying that many bytes; see :func:`same_size_copy_ms`).

Achieved bandwidth counts the fewest bytes an op must move (each input read once, each output
written once), against the device's copy bandwidth measured in the same run, also as kernel time.
Other benchmarks (bench_flce, matmul_tflops) use :func:`bench_ms`, the wall time.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

RESULTS = os.path.join(os.path.dirname(__file__), "results")

#: Name of the L2-flush kernel; its device events are excluded from kernel time by this name.
FLUSH_KERNEL = "_l2_flush_kernel"
#: Bytes the flush writes: five times the L2 of an H100 or H200 (50 MB).
FLUSH_BYTES = 256 << 20
#: Profiler activity types that are GPU work (kineto's names); others on the device timeline
#: (``gpu_user_annotation`` spans, ``cuda_sync`` waits) are not.
DEVICE_WORK = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_NOT_WORK = frozenset({"gpu_user_annotation", "cuda_sync"})


def bench_ms(fn: Callable[[], object], grad_to_none=None, warmup: int = 25, rep: int = 100) -> float:
    """Median wall milliseconds of ``fn()`` (warm-up and repeat in ms, as do_bench takes them)."""
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none,
                                         return_mode="median"))


# ------------------------------------------------------------------------------------- kernel time
@triton.jit
def _l2_flush_kernel(buf_ptr, n, BLOCK: tl.constexpr):
    """Write zeros over ``buf`` (n int32): evicts whatever the op under test left in L2."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(buf_ptr + offs, tl.zeros((BLOCK,), dtype=tl.int32), mask=offs < n)


@functools.cache
def _flush_buffer(device_index: int) -> torch.Tensor:
    return torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=torch.device("cuda", device_index))


def flush_l2() -> None:
    """Launch ``_l2_flush_kernel`` over a FLUSH_BYTES buffer on the current CUDA device and stream."""
    buf = _flush_buffer(torch.cuda.current_device())
    block = 4096
    _l2_flush_kernel[(triton.cdiv(buf.numel(), block),)](buf, buf.numel(), BLOCK=block, num_warps=8)


class DeviceWork(NamedTuple):
    """Device events of one profile, split into the work measured and the flushes left out."""

    us: float  # summed duration of the counted events, microseconds
    events: int  # counted events (kernels, memcpys, memsets)
    flushes: int  # events whose name contains the flush kernel's name (not counted)
    skipped: tuple[str, ...] = ()  # activity types on the device timeline neither counted nor known


def device_work(events: Iterable, device_type: DeviceType = DeviceType.CUDA, exclude: str = FLUSH_KERNEL,
                kinds: frozenset[str] | None = DEVICE_WORK) -> DeviceWork:
    """Sum the device duration of profiler ``FunctionEvent``s that are GPU work, leaving out ``exclude``.

    An event counts when it runs on the device (``evt.device_type == device_type``: kernels, memcpys
    and memsets of the CUDA timeline, not the CPU-side runtime calls that launched them), its
    ``activity_type`` is in ``kinds`` (when the profiler records one; ``kinds=None`` takes every
    device event) and its name does not contain ``exclude``. Its duration is ``evt.time_range``'s
    length, which is what ``FunctionEvent.device_time_total`` (= ``self_device_time_total``) returns
    for a device event, read directly because that property reports 0 for events flagged async.
    """
    us, n, flushes, skipped = 0.0, 0, 0, set()
    for evt in events:
        if evt.device_type != device_type:
            continue
        kind = getattr(evt, "activity_type", None) or None
        if kinds is not None and kind is not None and kind not in kinds:
            if kind not in _NOT_WORK:
                skipped.add(kind)
            continue
        if kind is None and evt.name == "Context Sync":  # a cuda_sync wait, when the type is not recorded
            continue
        if exclude and exclude in evt.name:
            flushes += 1
            continue
        us += evt.time_range.elapsed_us()
        n += 1
    return DeviceWork(us, n, flushes, tuple(sorted(skipped)))


class KernelTime(NamedTuple):
    ms: float  # device milliseconds per call
    launches: float  # device events (kernels, memcpys, memsets) per call


def kernel_time(fn: Callable[[], object], reps: int = 50, warmup: int = 3) -> KernelTime:
    """GPU time of ``fn()`` without host overhead: :func:`device_work` over ``reps`` profiled calls.

    ``fn`` is called ``warmup`` times first (compilation, autotuning, allocator), then ``reps`` times
    under ``torch.profiler`` (CUDA activity only), each call after :func:`flush_l2`. Returns the
    summed device duration of every kernel / memcpy / memset except the flushes, divided by ``reps``.
    Raises RuntimeError when the profile holds no such event or not one flush per repetition (an
    incomplete device trace).
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    for _ in range(warmup):
        fn()
    flush_l2()  # compiles the flush kernel outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush_l2()
            fn()
        torch.cuda.synchronize()
    work = device_work(prof.events())
    if work.skipped:
        warnings.warn(f"kernel_time: device events of activity types {work.skipped} are not counted", stacklevel=2)
    if work.events == 0:
        raise RuntimeError("kernel_time: the CUDA profiler recorded no kernel, memcpy or memset of the timed "
                           f"function ({work.flushes} flush kernels seen); is CUPTI available and the op on CUDA?")
    if work.flushes != reps:
        raise RuntimeError(f"kernel_time: {work.flushes} {FLUSH_KERNEL} events for {reps} repetitions: "
                           "the device trace is incomplete")
    return KernelTime(work.us / reps / 1000.0, work.events / reps)


def kernel_ms(fn: Callable[[], object], reps: int = 50, warmup: int = 3) -> float:
    """Device milliseconds per call of ``fn()``, host overhead excluded (see :func:`kernel_time`)."""
    return kernel_time(fn, reps, warmup).ms


# ----------------------------------------------------------------------------------- references
def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written) on a buffer far over L2, from
    kernel time like the ops it is compared with (the same as wall time at this size)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = kernel_ms(lambda: dst.copy_(src), reps=20)
    return 2 * nbytes / ms / 1e6


@functools.cache
def same_size_copy_ms(nbytes: int) -> float:
    """Kernel time of a device-to-device copy that moves ``nbytes`` (half read, half written), cold L2.

    The context for small ops: a copy of a few tens of MB does not reach the large-buffer copy
    bandwidth either (launch, ramp-up and tail are a larger share), so an op's time is also compared
    with a copy moving the same bytes."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return kernel_ms(lambda: dst.copy_(src), reps=20)


def matmul_tflops(n: int = 8192, dtype=torch.bfloat16) -> float:
    """Dense bf16 matmul rate in TFLOP/s on random (n, n) operands (wall time)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = bench_ms(lambda: a @ b)
    return 2 * n**3 / ms / 1e9


def environment() -> dict:
    """GPU name, software versions, the command and the commit recorded in every results file.

    ``commit``: ``LIGERMODELS_COMMIT`` when set (a GPU machine gets a copy of the tree without .git), else
    ``git rev-parse HEAD`` with ``+dirty`` when tracked files changed, else ``"unknown"``."""
    main = sys.modules["__main__"]
    module = getattr(getattr(main, "__spec__", None), "name", None) or os.path.basename(sys.argv[0])
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
    env["command"] = " ".join(["python", "-m", module, *sys.argv[1:]])
    env["commit"] = os.environ.get("LIGERMODELS_COMMIT") or _git_commit()
    return env


def _git_commit() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        git = functools.partial(subprocess.run, cwd=root, capture_output=True, text=True, check=True, timeout=30)
        head = git(["git", "rev-parse", "HEAD"]).stdout.strip()
        dirty = git(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def write_results(name: str, payload: dict, out_dir: str | None = None) -> str:
    """Write ``{environment..., **payload}`` as ``<out_dir>/<name>.json`` and return its path."""
    out_dir = out_dir or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({**environment(), **payload}, f, indent=1)
    os.replace(path + ".tmp", path)
    return path


# ------------------------------------------------------------------------------ op comparisons
def _flat(out) -> list[torch.Tensor]:
    return [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]


class PassTime(NamedTuple):
    ms: float  # kernel time per call (kernel_time)
    wall_ms: float  # wall time per call (bench_ms)
    launches: float  # device events per call
    method: str = ""  # how a backward was isolated


def timed_pass(fn: Callable[[], object]) -> PassTime:
    """Kernel time, wall time and launches of ``fn()``: one pass of an op, or any call to time."""
    wall = bench_ms(fn)  # first: its warm-up also compiles and autotunes
    k = kernel_time(fn)
    return PassTime(k.ms, wall, k.launches)


def time_fwd_bwd(fn: Callable[..., object], inputs: list[torch.Tensor]) -> tuple[PassTime, PassTime]:
    """(forward, backward) times of ``fn(*inputs)``; backward w.r.t. every input requiring grad.

    Backward is timed by replaying ``autograd.grad`` over one retained graph, so it excludes the
    forward; where a graph cannot be retained (some compiled graphs), as (fwd+bwd) - fwd, for kernel
    time, wall time and launches alike.
    """
    fwd = timed_pass(lambda: fn(*inputs))
    diff = [t for t in inputs if t.requires_grad]
    outs = _flat(fn(*inputs))
    douts = [torch.randn_like(o) for o in outs]
    try:
        torch.autograd.grad(outs, diff, douts, retain_graph=True)
        retained = True
    except RuntimeError:
        retained = False
    if retained:
        bwd = timed_pass(lambda: torch.autograd.grad(outs, diff, douts, retain_graph=True))._replace(
            method="retained-graph")
    else:
        del outs
        both = timed_pass(lambda: torch.autograd.grad(_flat(fn(*inputs)), diff, douts))
        bwd = PassTime(max(both.ms - fwd.ms, 0.0), max(both.wall_ms - fwd.wall_ms, 0.0),
                       max(both.launches - fwd.launches, 0.0), "fwd+bwd minus fwd")
    return fwd, bwd


def compare_impls(op: str, shape: str, dtype: torch.dtype, impls: dict[str, Callable[..., object]],
                  make_inputs: Callable[[], list[torch.Tensor]], fwd_bytes: int, bwd_bytes: int,
                  copy_gbs: float) -> list[dict]:
    """Time each implementation of one op on fresh inputs; one row per (impl, pass).

    ``ms`` is kernel time (``timing: "cuda-kernels"``), and ``gbs`` / ``frac_copy_bw`` come from it;
    ``wall_ms`` is the wall time of the same call (see the module docstring).
    """
    rows = []
    for impl, fn in impls.items():
        base = {"op": op, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "impl": impl}
        try:
            fwd, bwd = time_fwd_bwd(fn, make_inputs())
        except Exception as e:  # a baseline that fails is reported, not hidden
            rows.append({**base, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        for pas, t, nbytes in (("fwd", fwd, fwd_bytes), ("bwd", bwd, bwd_bytes)):
            rows.append(timing_row(base, pas, t, nbytes, copy_gbs))
        torch.cuda.empty_cache()
    return rows


def timing_row(base: dict, pas: str, t: PassTime, nbytes: int, copy_gbs: float) -> dict:
    """One result row: ``base`` (op, shape, dtype, impl) and the pass's times, bytes and bandwidth fractions."""
    gbs = nbytes / t.ms / 1e6 if t.ms > 0 else float("nan")
    same = same_size_copy_ms(nbytes)
    row = {**base, "pass": pas, "ms": round(t.ms, 5), "wall_ms": round(t.wall_ms, 5),
           "launches": round(t.launches, 2), "timing": "cuda-kernels", "bytes": nbytes,
           "gbs": round(gbs, 1), "frac_copy_bw": round(gbs / copy_gbs, 3),
           "same_size_copy_ms": round(same, 5), "frac_same_size_copy": round(same / t.ms, 3)}
    if t.method:
        row["bwd_method"] = t.method
    return row
