"""Helpers shared by the benchmarks: everything that more than one of ``benchmarks/bench_*.py``,
``benchmarks/report.py``, the kernel cases (``benchmarks/kernel_cases/``) and the torchtitan flavors
(``benchmarks/titan/flavors.py``) uses.

* Paths and results files: :data:`ROOT`, :data:`RESULTS`, :func:`environment` (what every results file records),
  :func:`write_results`, :func:`newest_results`.
* Timing on the GPU: :func:`bench_ms` (wall time), :func:`kernel_time` / :func:`kernel_ms` (kernel time), the
  copy bandwidth and matmul rate references, and :func:`compare_impls` (one op's implementations, forward and
  backward), described below.
* Model shapes: :data:`MODELS` (public config.json shapes), :func:`hf_attention` (the transformers attention
  each family needs), :func:`projections` (a decoder layer's projection GEMMs).
* The end-to-end training step: :func:`measure` times one implementation's step (bench_e2e's workers, and
  bench_train's ``bare`` impl), with :func:`step_flops` and the ``--profile`` budget (:func:`profile_budget`).
* Inputs and child processes of the training benchmarks: :func:`write_model_dir` (config.json and a word-level
  tokenizer), :func:`write_documents` / :func:`write_data` (random-word documents), :func:`child_env` (with
  NVLink multicast off), :func:`torchrun`, :func:`run_logged`, :func:`read_metrics`, :func:`titan_flavor`.

Nothing here runs on import; the GPU helpers need CUDA only when called.

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
import glob
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from ligermodels.train.profiling import device_time_by_category

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


# ------------------------------------------------------------------------------------ results files
def environment() -> dict:
    """GPU name, software versions (NCCL's too on a GPU), the ``NCCL_*`` / ``TORCH_NCCL_*`` variables set, the
    command and the commit recorded in every results file.

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
    if torch.cuda.is_available():
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    env["host_cpu"] = host_cpu()
    settings = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "TORCH_NCCL_"))}
    if settings:
        env["nccl_env"] = settings
    env["command"] = " ".join(["python", "-m", module, *sys.argv[1:]])
    env["commit"] = os.environ.get("LIGERMODELS_COMMIT") or _git_commit()
    return env


#: What one small launch costs the host, run in a child process so that a parent that only starts the timed runs
#: never holds a CUDA context of its own (its memory would sit beside theirs).
_LAUNCH_PROBE = """
import statistics, time, torch
x = torch.zeros(1, device="cuda")
rounds = []
for _ in range(6):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        x.add_(1)
    rounds.append((time.perf_counter() - t0) / 200 * 1e6)
print(round(statistics.median(rounds[1:]), 2))  # the first round warms the path up
"""


@functools.cache
def host_cpu() -> dict:
    """The host CPU: ``/proc/cpuinfo``'s model name and the logical CPUs; on a GPU also ``launch_us``, what one small
    launch costs it (the host time of 200 one-element in-place adds, no synchronisation among them: the median of
    5 rounds, per add). An eager step of many small launches runs at its host's pace: one GPU model ran the same
    eager step 25% slower on one machine than on another, where a CUDA graph ran level (docs/preference.md)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    out = {"cpu": model, "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        try:
            res = subprocess.run([sys.executable, "-c", _LAUNCH_PROBE], capture_output=True, text=True, timeout=120,
                                 check=True)
            out["launch_us"] = float(res.stdout.split()[-1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass  # not recorded rather than a benchmark lost
    return out


def _git_commit() -> str:
    try:
        git = functools.partial(subprocess.run, cwd=ROOT, capture_output=True, text=True, check=True, timeout=30)
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


def newest_results(prefix: str, gpu: str | None = None, results: str | None = None) -> str | None:
    """Path of the newest ``<prefix>-*.json`` under ``results`` (default benchmarks/results), optionally only
    those recorded on ``gpu``: by the ``date`` each file records, then by file name (``...-2026-11-23b`` after
    ``...-2026-11-23``). Not by modification time: after a checkout every file has about the same one."""
    best = None
    for path in glob.glob(os.path.join(results or RESULTS, f"{prefix}-*.json")):
        with open(path) as f:
            data = json.load(f)
        if gpu is not None and data.get("gpu") != gpu:
            continue
        key = (str(data.get("date", "")), os.path.basename(path))
        if best is None or key > best[0]:
            best = (key, path)
    return best[1] if best else None


# ------------------------------------------------------------------------------------------- timing
#: Name of the L2-flush kernel; its device events are excluded from kernel time by this name.
FLUSH_KERNEL = "_l2_flush_kernel"
#: Bytes the flush writes: five times the L2 of an H100 or H200 (50 MB).
FLUSH_BYTES = 256 << 20
#: Profiler activity types that are GPU work (kineto's names); others on the device timeline
#: (``gpu_user_annotation`` spans, ``cuda_sync`` waits) are not.
DEVICE_WORK = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_NOT_WORK = frozenset({"gpu_user_annotation", "cuda_sync"})


class GPUClocks:
    """``with GPUClocks() as clocks: ...``, then ``clocks.summary``: the GPU's SM clock and power while it worked,
    sampled by ``nvidia-smi`` every ``period_ms`` (samples drawing more than ``busy_w`` watts). ``power_capped``
    is the share of those samples whose clock-event reasons include the software power cap (bit 0x4): the
    clock held below its maximum to keep the board under ``power_limit_w``. For reading a step's time: a GPU
    kept busy without gaps can run its GEMMs at a lower clock than one that idles between bursts. Which GPU:
    the first of ``CUDA_VISIBLE_DEVICES`` (0 when unset). ``summary`` is None where nvidia-smi is missing."""

    QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"

    def __init__(self, period_ms: int = 200, busy_w: float = 250.0):
        self.period_ms, self.busy_w, self.summary = period_ms, busy_w, None
        self.index = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]

    def _smi(self, *args: str, **kwargs):
        return subprocess.Popen(["nvidia-smi", "-i", self.index, *args, "--format=csv,noheader,nounits"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, **kwargs)

    def __enter__(self) -> GPUClocks:
        try:
            self.proc = self._smi(f"--query-gpu={self.QUERY}", f"--loop-ms={self.period_ms}")
        except FileNotFoundError:
            self.proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        out = self.proc.communicate()[0]
        limits = self._smi("--query-gpu=power.limit,clocks.max.sm").communicate()[0].split(",")
        busy = []
        for line in out.splitlines():
            try:
                clock, watts, reasons = (v.strip() for v in line.split(","))
                busy += [(float(clock), float(watts), int(reasons, 16))] if float(watts) > self.busy_w else []
            except ValueError:
                continue
        if busy:
            self.summary = {"samples": len(busy), "period_ms": self.period_ms,
                            "sm_clock_mhz_median": statistics.median(c for c, _, _ in busy),
                            "sm_clock_mhz_max": float(limits[1]) if len(limits) > 1 else None,
                            "power_w_median": round(statistics.median(w for _, w, _ in busy), 1),
                            "power_limit_w": float(limits[0]) if limits[0].strip() else None,
                            "power_capped": round(sum(bool(r & 4) for _, _, r in busy) / len(busy), 3)}


def bench_ms(fn: Callable[[], object], grad_to_none=None, warmup: int = 25, rep: int = 100) -> float:
    """Median wall milliseconds of ``fn()`` (warm-up and repeat in ms, as do_bench takes them)."""
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none,
                                         return_mode="median"))


# -------------------------------------------------------------------------------------- kernel time
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


# --------------------------------------------------------------------------------------- references
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


# ----------------------------------------------------------------------------------- op comparisons
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


# ------------------------------------------------------------------------------------- model shapes
#: The benchmark shapes by name: the public config.json of each model (transformers 5 field names),
#: written out here because the GPU machines have no network.
MODELS: dict[str, dict] = {
    "llama-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                     max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
    "qwen2-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                       num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                       use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "gemma-2b": dict(model_type="gemma", vocab_size=256000, hidden_size=2048, intermediate_size=16384,
                     num_hidden_layers=18, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                     max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
                     hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         hidden_act="silu", rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                             "factor": 8.0, "low_freq_factor": 1.0,
                                                             "high_freq_factor": 4.0,
                                                             "original_max_position_embeddings": 8192}),
    "qwen2-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
                     use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Qwen/Qwen3-1.7B: q/k head norms (fused with RoPE in ligermodels), explicit head_dim, no sliding window.
    "qwen3-1.7b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                       attention_bias=False, use_sliding_window=False, max_window_layers=28,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # google/gemma-2-2b: sandwich norms, attention-logit (50) and final-logit (30) soft-capping, a 4096 window on
    # alternate layers (transformers' default layer_types: the even layers slide), attention scale 256 ** -0.5.
    "gemma2-2b": dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                      num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                      max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", attention_bias=False,
                      query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                      sliding_window=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Qwen/Qwen3-30B-A3B and mistralai/Mixtral-8x7B-v0.1 with their layers cut to what trains on one 80 GB GPU with
    # fp32 master weights and AdamW (every implementation the same): 4 of 48 and 2 of 32 layers.
    "qwen3-30b-a3b-l4": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                             moe_intermediate_size=768, num_hidden_layers=4, num_attention_heads=32,
                             num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                             router_aux_loss_coef=0.001, output_router_logits=False, max_position_embeddings=40960,
                             rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
                             use_sliding_window=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "mixtral-8x7b-l2": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                            num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                            num_experts_per_tok=2, router_aux_loss_coef=0.02, output_router_logits=False,
                            max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
                            hidden_act="silu", sliding_window=None,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}
#: Qwen/Qwen3-30B-A3B whole (48 layers, 30.5e9 parameters): the LoRA runs' shape (a bf16 base on one H200).
MODELS["qwen3-30b-a3b"] = {**MODELS["qwen3-30b-a3b-l4"], "num_hidden_layers": 48}

#: transformers' attention implementation per ``model_type`` where SDPA (the default here) would not compute
#: the model's math. Gemma 2 soft-caps its attention logits (``attn_logit_softcapping``), which SDPA cannot
#: express: transformers 5.24 refuses ``attn_implementation="sdpa"`` for it (``Gemma2PreTrainedModel.
#: _supports_sdpa = False``: a ValueError when the model is built), while 5.17 (the GPU machine's) accepts it
#: and drops the cap without a word (tests/test_models_gpu.py). "eager" applies the cap
#: (``eager_attention_forward(..., softcap=...)``), as ligermodels does (FlexAttention's ``score_mod`` on CUDA),
#: so both sides compute the same attention: a baseline computing less would not be a fair comparison. Eager
#: materialises the (B, Hq, S, S) scores, so it is slower and larger than a fused kernel would be.
HF_ATTENTION = {"gemma2": "eager"}


def hf_attention(model_type: str) -> str:
    """The ``attn_implementation`` the transformers baselines use for ``model_type`` (see HF_ATTENTION)."""
    return HF_ATTENTION.get(model_type, "sdpa")


def projections(model: str) -> dict[str, tuple[int, list[int]]]:
    """{name: (K, [N of each part])} of one decoder layer's projections (o and down have one part)."""
    d = MODELS[model]
    h, inter, hq, hkv = d["hidden_size"], d["intermediate_size"], d["num_attention_heads"], d["num_key_value_heads"]
    hd = d.get("head_dim", h // hq)
    return {"qkv": (h, [hq * hd, hkv * hd, hkv * hd]), "o": (hq * hd, [h]),
            "gate_up": (h, [inter, inter]), "down": (inter, [h])}


# --------------------------------------------------------------------- the end-to-end training step
#: Dense bf16 peak of an H100 or H200, TFLOP/s: the MFU denominator.
PEAK_BF16_TFLOPS = 989.0
#: Liger-Kernel's patch per ``model_type`` (liger-kernel 0.8.5 names), applied to the transformers classes
#: before the model is built.
LIGER_PATCH = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2",
               "gemma": "apply_liger_kernel_to_gemma", "mistral": "apply_liger_kernel_to_mistral",
               "qwen3": "apply_liger_kernel_to_qwen3", "gemma2": "apply_liger_kernel_to_gemma2",
               "qwen3_moe": "apply_liger_kernel_to_qwen3_moe", "mixtral": "apply_liger_kernel_to_mixtral"}


def attended_pairs(seq: int, window: int | None) -> float:
    """(query, key) pairs one causal attention computes per sequence: seq^2 / 2, or with a sliding window
    shorter than the sequence seq * window - window^2 / 2 (the same at window = seq)."""
    if window is None or window >= seq:
        return seq * seq / 2
    return seq * window - window * window / 2


def step_flops(model: str, batch: int, seq: int) -> float:
    """Flops of one training step: 6 x matmul parameters x tokens + causal attention (fwd + bwd). A
    mixture-of-experts layer counts its router and the k experts each token reaches (active parameters).

    Attention is 4 * D flops per (query, key) pair and head forward (scores and the value product), three
    times that forward + backward, over each layer's attended pairs (its sliding window, if any, from the
    ligermodels config of the model: Gemma 2's alternate layers, Qwen layers marked sliding). The q/k head
    norms, soft-capping and the other elementwise work are not counted."""
    from ligermodels.families import config_from_hf

    d = MODELS[model]
    h, layers, v = d["hidden_size"], d["num_hidden_layers"], d["vocab_size"]
    hq, hkv = d["num_attention_heads"], d["num_key_value_heads"]
    hd = d.get("head_dim", h // hq)
    c = config_from_hf(d)
    mlp = [h * c.num_experts + 3 * h * c.experts_per_token * c.moe_intermediate_size if c.sparse_layer(i)
           else 3 * h * d["intermediate_size"] for i in range(layers)]
    matmul_params = layers * (h * (hq + 2 * hkv) * hd + hq * hd * h) + sum(mlp) + v * h  # the head: tied or not
    tokens = batch * seq
    windows = c.layer_windows  # one entry per layer, None = full attention
    attention = 3 * 4 * batch * hq * hd * sum(attended_pairs(seq, w) for w in windows)
    return 6 * matmul_params * tokens + attention


def base_row(impl: str, model: str, batch: int, seq: int, ac: bool) -> dict:
    """The identifying fields of a result row. ``ligermodels+compile`` is impl "ligermodels", variant "compile"
    (our model under ``torch.compile``); ``ligermodels+graph`` is variant "graph" (the whole step replayed
    from a CUDA graph, :class:`ligermodels.train.cuda_graph.CUDAGraphStep`); ``ligermodels+master`` is variant
    "master" (fp32 master weights in the optimiser, bf16 parameters: the precision of ligermodels.train);
    the transformers impls keep their ``--impls`` names."""
    variant = impl.split("+", 1)[1] if impl.startswith("ligermodels+") or impl.endswith("+compile") else "eager"
    name = "ligermodels" if impl.startswith("ligermodels") else impl
    return {"impl": name, "variant": variant, "model": model, "batch": batch, "seq": seq,
            "activation_checkpointing": ac}


def build(impl: str, model: str, activation_checkpointing: bool, flce_strategy: str | None = None):
    """(step-loss callable (ids, labels) -> loss, parameters) for one implementation, on the GPU in bf16
    (``flce_strategy``: see :func:`measure`)."""
    d = dict(MODELS[model])
    model_type = d["model_type"]
    if impl.startswith("ligermodels"):
        from ligermodels.families import config_from_hf, family_of

        torch.manual_seed(0)
        with torch.device("cuda"):  # +master: fp32 weights, made bf16 by the optimiser (measure)
            m = family_of(model_type).cls(config_from_hf(d)).init_weights()
        if impl != "ligermodels+master":
            m = m.to(torch.bfloat16)
        if activation_checkpointing:
            from ligermodels.train.parallelize import apply_activation_checkpointing

            apply_activation_checkpointing(m, "full")
        m.train()
        fn = functools.partial(m.loss, strategy=flce_strategy) if flce_strategy else m.loss
        if impl == "ligermodels+compile":
            fn = torch.compile(fn)
        return fn, list(m.parameters())

    import transformers

    if impl == "hf+liger":
        import liger_kernel.transformers as lk

        if model_type not in LIGER_PATCH:
            raise ValueError(f"no Liger-Kernel patch listed for model_type {model_type!r} (LIGER_PATCH)")
        getattr(lk, LIGER_PATCH[model_type])()
    config = transformers.AutoConfig.for_model(**d)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                          attn_implementation=hf_attention(model_type))
    if activation_checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.config.use_cache = False
    m.train()
    run = torch.compile(m) if impl == "hf+compile" else m

    def fn(ids, labels):
        return run(input_ids=ids, labels=labels).loss

    return fn, list(m.parameters())


def measure(impl: str, model: str, batch: int, seq: int, steps: int, warmup: int, ac: bool, profile: str | None,
            flce_strategy: str | None = None) -> dict:
    """Time ``steps`` training steps of one implementation; returns the result row. ``flce_strategy``: the
    strategy of ligermodels' loss head (``kernels.fused_linear_cross_entropy``; None: the model's default)."""
    row = base_row(impl, model, batch, seq, ac)
    attention = hf_attention(MODELS[model]["model_type"])
    if not impl.startswith("ligermodels") and attention != "sdpa":  # shown with the row (report._e2e_variant)
        row["hf_attention"] = attention
    tflops = matmul_tflops()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fn, params = build(impl, model, ac, flce_strategy)
    graph = impl.endswith("+graph")
    if impl.startswith("ligermodels"):  # our step: the Triton AdamW (kernels.adamw), the same math
        from kernels import AdamW

        opt = AdamW(params, lr=1e-5, capturable=graph, master_weights=impl == "ligermodels+master")
        if impl == "ligermodels+master":  # what ligermodels.train does on one GPU: fp32 masters, bf16 weights
            opt.init_master_weights_(torch.bfloat16)
    else:
        opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    vocab = MODELS[model]["vocab_size"]
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)

    def step():
        loss = fn(ids, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if graph:
        from ligermodels.train.cuda_graph import CUDAGraphStep

        step = functools.partial(CUDAGraphStep(fn, opt, ids, ids), ids, ids)

    # The steps are queued back to back and read once at the end, as ligermodels.train's loop does: a wait
    # on each step's end leaves the device idle while the host queues the next step's first kernels.
    events, losses = [], []
    for _ in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        losses.append(step().detach().clone())  # (a graph replay reuses its output buffer)
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in events[warmup:]]
    losses = [float(loss) for loss in losses]
    ms = statistics.median(times)
    flops = step_flops(model, batch, seq)
    row.update(tokens_per_s=round(batch * seq / ms * 1e3, 1), step_ms=round(ms, 2),
               peak_mem_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2),
               mfu=round(flops / (ms * 1e-3) / (PEAK_BF16_TFLOPS * 1e12), 4),
               matmul_floor_ms=round(flops / (tflops * 1e12) * 1e3, 2), matmul_tflops=round(tflops, 1),
               first_loss=round(losses[0], 4), last_loss=round(losses[-1], 4))
    if not graph:
        try:
            row["peak_phase_gb"] = phase_peaks(fn, opt, ids)
        except torch.OutOfMemoryError:  # the timed steps fit; an extra untimed one must not turn the row into OOM
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            row["peak_phase_gb"] = None
    if profile:
        with open(profile, "w") as f:
            f.write(profile_budget(step, row))
    return row


def phase_peaks(fn, opt, ids) -> dict[str, float]:
    """Peak allocated GB (everything alive: weights, optimiser state, activations) during the forward, the
    backward and the optimiser step of one more step: where the step's memory peak sits, so the lever
    that lowers it can be chosen (activations and the loss head bind in forward, gradients in backward)."""
    def peak_of(work) -> tuple[float, object]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out = work()
        torch.cuda.synchronize()
        return round(torch.cuda.max_memory_allocated() / 1e9, 2), out

    peaks = {}
    peaks["forward"], loss = peak_of(lambda: fn(ids, ids))
    peaks["backward"], _ = peak_of(loss.backward)
    peaks["optimizer"], _ = peak_of(opt.step)
    opt.zero_grad(set_to_none=True)
    return peaks


#: Kernel-name patterns -> category of the ``--profile`` budget, first match wins.
CATEGORIES = [
    ("optimizer (fused AdamW)", r"adam|multi_tensor|FusedOptim"),
    ("attention (flash/cuDNN/flex)", r"flash|fmha|attention|_attn|sdpa|dot_do_o|dq_to_16"),
    ("matmul (cuBLAS/CUTLASS)", r"gemm|matmul|cutlass|nvjet|xmma|cublas|splitk"),
    ("ligermodels kernels: rms_norm", r"_rms_norm"),
    ("ligermodels kernels: rope", r"_rope"),
    ("ligermodels kernels: glu", r"_glu"),
    ("ligermodels kernels: cross-entropy", r"_ce_|_flce|_scale_cast"),
    ("embedding", r"embedding|index_select|indexing_backward|index_put|scatter"),
    ("copies and casts", r"copy|cast|cat|fill|zero"),
]


def profile_budget(step, row: dict) -> str:
    """Profile two steps; GPU time per op category, against the step's matmul floor (text table)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    per_cat, kernels = device_time_by_category(prof.key_averages(), CATEGORIES, 2, "other elementwise/reductions")
    busy = sum(per_cat.values())
    lines = [f"# Step-time budget: {row['impl']} ({row['variant']}), {row['model']}, batch {row['batch']} x "
             f"{row['seq']}, {torch.cuda.get_device_name()}",
             f"step (CUDA events, median) {row['step_ms']:.1f} ms; GPU busy (profiler, 2 steps / 2) {busy:.1f} ms; "
             f"matmul floor {row['matmul_floor_ms']:.1f} ms (all step flops at the measured "
             f"{row['matmul_tflops']:.0f} TFLOP/s)", "",
             f"{'category':40s} {'ms/step':>9s} {'% step':>7s}"]
    for cat, t in sorted(per_cat.items(), key=lambda kv: -kv[1]):
        lines.append(f"{cat:40s} {t:9.2f} {100 * t / row['step_ms']:6.1f}%")
    lines.append(f"{'idle / launch gaps (step - GPU busy)':40s} {row['step_ms'] - busy:9.2f} "
                 f"{100 * (row['step_ms'] - busy) / row['step_ms']:6.1f}%")
    lines += ["", "Top 25 kernels (ms/step):"]
    for k, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:25]:
        lines.append(f"{t:9.2f}  {k[:110]}")
    return "\n".join(lines + ["", *gemm_table(prof)]) + "\n"


#: The profiler's GEMM ops, grouped by input shapes in the ``--profile`` budget.
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def gemm_flops(shapes: list) -> int:
    """2*m*k*n of a GEMM op from its recorded input shapes: the first (m, k) and (k, n) operands that chain."""
    mats = [tuple(s) for s in shapes if isinstance(s, (list, tuple)) and len(s) in (2, 3)]
    for a, b in zip(mats, mats[1:], strict=False):
        if len(a) == len(b) and a[:-2] == b[:-2] and a[-1] == b[-2]:
            batch = a[0] if len(a) == 3 else 1
            return 2 * batch * a[-2] * a[-1] * b[-1]
    return 0


def gemm_table(prof, steps: int = 2, top: int = 30) -> list[str]:
    """GEMM ops grouped by input shapes: GPU ms per step, calls per step, achieved TFLOP/s (text lines).

    Where the step's matmul time goes, shape by shape, so two implementations can be compared GEMM
    for GEMM (which projection, which pass), not only kernel name by kernel name."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key not in GEMM_OPS or e.device_type == torch.autograd.DeviceType.CUDA:
            continue
        t = getattr(e, "self_device_time_total", None)  # the op's own kernels, never a nested op's twice
        t = (getattr(e, "self_cuda_time_total", 0) if t is None else t) / steps / 1e3
        if t <= 0:
            continue
        calls = e.count / steps
        flops = gemm_flops(e.input_shapes) * calls
        rows.append((t, calls, flops / (t * 1e-3) / 1e12 if flops else float("nan"), e.key, e.input_shapes))
    total = sum(r[0] for r in rows)
    lines = [f"GEMM ops by input shapes ({total:.1f} ms/step in {len(rows)} groups; top {top}):",
             f"{'ms/step':>9s} {'calls':>6s} {'TFLOP/s':>8s}  op, input shapes"]
    for t, calls, rate, key, shapes in sorted(rows, key=lambda r: -r[0])[:top]:
        lines.append(f"{t:9.2f} {calls:6.1f} {rate:8.1f}  {key} {[list(s) for s in shapes if s]}")
    return lines


# ------------------------------------------------------------------------------------------- inputs
#: The word-level tokenizer's special tokens, ids 0-3 (BOS = <s>, EOS = </s>); words are "w<id>" past them.
SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")


def write_model_dir(directory: str, config: dict) -> None:
    """config.json + a word-level tokenizer ("w<id>" -> id for every id past the specials) + tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(directory, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), config["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "<pad>", "unk_token": "<unk>"}, f, indent=1)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def write_documents(path: str, tokens: int, vocab_size: int, low: int, high: int, seed: int = 0) -> int:
    """JSON lines (``{"text": ...}``) of random-word documents of ``low`` to ``high`` words (uniform) totalling
    >= ``tokens``, each document counted as BOS + words + EOS; words are drawn from the whole vocabulary past
    :data:`SPECIALS` (see :func:`write_model_dir`). Returns the number of documents."""
    rng = random.Random(seed)
    n_docs, total = 0, 0
    with open(path, "w") as f:
        while total < tokens:
            n = rng.randint(low, high)
            words = " ".join(f"w{rng.randrange(len(SPECIALS), vocab_size)}" for _ in range(n))
            f.write(json.dumps({"text": words}) + "\n")
            n_docs, total = n_docs + 1, total + n + 2
    return n_docs


def write_data(path: str, tokens: int, vocab_size: int, doc_tokens: int, seed: int = 0) -> int:
    """:func:`write_documents` with lengths uniform in doc_tokens x [0.5, 1.5]; returns the number of documents."""
    return write_documents(path, tokens, vocab_size, max(1, doc_tokens // 2), max(1, doc_tokens * 3 // 2), seed)


# ---------------------------------------------------------------------------------- child processes
#: NVLink multicast off (NCCL's NVLS, PyTorch's symmetric memory, NVSHMEM): the shared GPU hosts require it of
#: every multi-GPU process; harmless elsewhere.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def child_env(device: str = "cuda", **extra: str) -> dict:
    """The environment of a benchmark's child process: this process's, with unbuffered output, the HF hub
    offline, the repository first on ``PYTHONPATH``, :data:`NO_MULTICAST` (where not already set), on
    ``device`` "cpu" the PyTorch reference kernels (not the Triton interpreter) and one thread per rank, then
    ``extra``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for key, value in NO_MULTICAST.items():
        env.setdefault(key, value)
    if device == "cpu":
        env.update(TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def torchrun(nproc: int) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node=<nproc>``: what a command after it
    (``-m MODULE ...``) runs under, one process per GPU."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def run_logged(cmd: list[str], env: dict, log_path: str, timeout: float, on_line) -> dict:
    """Run ``cmd`` (a torchrun) with its output written to ``log_path`` as it arrives, each line also passed
    to ``on_line(line, seconds since launch)``; stop it after ``timeout`` seconds: SIGTERM, which torchrun
    forwards to its workers (each in its own session) before exiting; SIGKILL to its process group if it is
    still there a minute later. Returns {returncode, timed_out, wall_s, tail (the last 60 lines)}."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)
    timed_out = threading.Event()

    def stop():
        timed_out.set()
        if proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    timer = threading.Timer(timeout, stop)
    timer.start()
    tail: list[str] = []
    try:
        with open(log_path, "w") as log:
            for line in proc.stdout:
                log.write(line)
                tail = (tail + [line])[-60:]
                on_line(line, time.perf_counter() - t0)
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:  # interrupted while reading
            stop()
            proc.wait()
    return {"returncode": rc, "timed_out": timed_out.is_set(), "wall_s": time.perf_counter() - t0,
            "tail": "".join(tail)}


def read_metrics(out: str) -> list[dict]:
    """The lines of ``ligermodels.train``'s ``OUT/metrics.jsonl`` (one per logged step); [] where there is none."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------------------- torchtitan
def titan_flavor(layers: int, attention: str) -> str:
    """torchtitan's flavor of Llama-3.1-8B's shape with ``layers`` layers (see benchmarks/titan/flavors.py)."""
    base = "8B_flex" if attention == "documents" else "8B"
    return base if layers == 32 else f"{base}_layers{layers}"
