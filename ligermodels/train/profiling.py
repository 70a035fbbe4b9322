"""``--profile``: where a step's time and memory go, from torch.profiler over two steps.

:class:`StepProfiler` writes ``OUT/profile.txt`` (the GPU's busy time by kernel category, its idle time and
what launched the work after each gap, the communication no computation hides, the top kernels and host
ops, the memory at the peak) and ``OUT/profile.json`` (the same totals as numbers, for benchmarks). The
functions before it are the interval arithmetic and the allocator-trace replay it uses.
"""

from __future__ import annotations

import json
import math
import os
import re
import time

import torch


def memory_at_peak(events: list[dict], base_bytes: int, top: int = 25
                   ) -> tuple[int, str, list[tuple[str, int, int]]]:
    """Where the allocated memory sits at its peak, from a CUDA caching-allocator trace
    (``torch.cuda.memory._snapshot()["device_traces"][i]``: events with ``action``, ``addr``, ``size`` and
    the allocating Python ``frames``, innermost first) recorded from a moment ``base_bytes`` were allocated.

    Replays ``alloc`` / ``free_completed``; returns (peak bytes, base included; the site of the allocation
    that reached it; the live allocations at that moment grouped by site: [(site, bytes, count)], largest
    first, ``top`` of them). A site is the innermost
    frame in this package (``ligermodels/``, ``kernels/``), with the innermost frame overall after ``<-`` when
    it lies elsewhere (torch); tensors allocated before the trace started are one line of their own."""
    live: dict[int, tuple[int, str]] = {}
    before = total = peak = before_at_peak = base_bytes  # ``before``: what is left of the base
    at_peak: dict[int, tuple[int, str]] = {}
    peak_site = "(no allocation in the trace)"
    for e in events:
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = (e["size"], _alloc_site(e.get("frames") or []))
            total += e["size"]
            if total > peak:
                peak, at_peak, before_at_peak = total, dict(live), before
                peak_site = live[e["addr"]][1]
        elif action == "free_completed":
            if e["addr"] in live:
                total -= live.pop(e["addr"])[0]
            else:  # allocated before the trace began
                total -= e["size"]
                before -= e["size"]
    sites: dict[str, list[int]] = {}
    for size, site in at_peak.values():
        entry = sites.setdefault(site, [0, 0])
        entry[0] += size
        entry[1] += 1
    rows = [(site, b, n) for site, (b, n) in sorted(sites.items(), key=lambda kv: -kv[1][0])]
    rows = [("allocated before the profiled steps (weights, optimiser state, ...)", before_at_peak, 0)] + rows[:top]
    return peak, peak_site, rows


def _alloc_site(frames: list[dict]) -> str:
    """``file:line function`` of the innermost frame in this package (``<-`` the innermost overall if elsewhere)."""
    def name(f):
        path = f.get("filename", "?")
        short = "/".join(path.split(os.sep)[-2:])
        return f"{short}:{f.get('line', '?')} {f.get('name', '?')}"

    ours = next((f for f in frames if re.search(r"[/\\](ligermodels|kernels)[/\\]", f.get("filename", ""))), None)
    if ours is None:
        return name(frames[0]) if frames else "(no Python frame)"
    return name(ours) if ours is frames[0] else f"{name(ours)} <- {name(frames[0])}"


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: the time at least one of them runs."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def exposed_us(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """Time during which some ``comm`` interval runs and no ``compute`` interval does: communication that
    does not overlap computation, |comm U compute| - |compute|."""
    return union_us(comm + compute) - union_us(compute)


def exposed_by_label(comm: list[tuple[float, float, str]], compute: list[tuple[float, float]]) -> dict[str, float]:
    """:func:`exposed_us` for each label of the ``comm`` intervals (start, end, label: the collective), {label: us}."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for start, end, label in comm:
        spans.setdefault(label, []).append((start, end))
    return {label: exposed_us(s, compute) for label, s in spans.items()}


#: Host-side ranges that device work is charged to, the innermost around the op that launched it: FSDP2's
#: (``FSDP::all_gather (layers.3)``, ``FSDP::post_backward_reduce (layers.3)``), this package's ops and ranges
#: (``ligermodels::glu_fwd``, ``ligermodels::vocab_embedding_backward``) and the optimiser's step.
OWNER_PREFIXES = ("FSDP::", "ligermodels::", "Optimizer.")


def launch_owner(op) -> str:
    """What launched a kernel whose host op is ``op`` (a profiler event with ``name`` and ``cpu_parent``): the
    innermost range of :data:`OWNER_PREFIXES` up its parent chain, else the outermost op of the chain;
    ``(unknown host op)`` for None."""
    if op is None:
        return "(unknown host op)"
    outer = op
    while op is not None:
        if op.name.startswith(OWNER_PREFIXES):
            return op.name
        outer, op = op, op.cpu_parent
    return outer.name


def device_time_by_category(averages, categories, steps: int, other: str = "other elementwise"
                            ) -> tuple[dict[str, float], dict[str, float]]:
    """GPU time per step (ms) by kernel category and by kernel, from torch.profiler's ``key_averages()``:
    ``categories`` is ((name, regex on the kernel name), ...), first match wins, else ``other``. Only device
    work counts: user annotations on the GPU timeline (``FSDP::all_gather (layers.3)``,
    ``nccl:_reduce_scatter_base``) span kernels that are counted on their own, and so are skipped, as are
    host-side ``#`` ranges (``Optimizer.step#AdamW.step``)."""
    per_cat: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for e in averages:
        if (e.device_type != torch.autograd.DeviceType.CUDA or "#" in e.key
                or getattr(e, "is_user_annotation", False)):
            continue
        ms = getattr(e, "self_device_time_total", 0) / steps / 1e3
        if ms <= 0:
            continue
        cat = next((c for c, pat in categories if re.search(pat, e.key, re.I)), other)
        per_cat[cat] = per_cat.get(cat, 0.0) + ms
        kernels[e.key] = kernels.get(e.key, 0.0) + ms
    return per_cat, kernels


def idle_by_launch_site(kernels: list[tuple[float, float, int]], ops: dict[int, tuple[str, list[str]]],
                        min_gap_us: float = 10.0) -> list[tuple[str, str, float, int]]:
    """Where the GPU waits for the host: each gap of at least ``min_gap_us`` between device work (``kernels``:
    (start, end, correlation id of the host op that launched it), microseconds, any order; overlapping work
    counted once) is charged to the op that launched the work right after it (``ops``: correlation id ->
    (op name, its Python stack, innermost first)). Returns [(op, site, idle us, gaps)], most idle first, the
    site being the innermost stack frame in this package (else the innermost one). A gap after a kernel
    launched late names what the host was busy with until then: the Python around that launch."""
    by: dict[tuple[str, str], list[float]] = {}
    end = None
    for start, stop, corr in sorted(kernels):
        if end is not None and start - end >= min_gap_us:
            name, stack = ops.get(corr, ("(unknown host op)", []))
            ours = [f for f in stack if re.search(r"(ligermodels|kernels)[/\\][^/\\]+\.py", f)]
            site = (ours or stack or ["(no Python stack)"])[0]
            entry = by.setdefault((name, site), [0.0, 0])
            entry[0] += start - end
            entry[1] += 1
        end = stop if end is None else max(end, stop)
    return sorted(((name, site, us, n) for (name, site), (us, n) in by.items()), key=lambda r: -r[2])


class StepProfiler:
    """``--profile``: torch.profiler over two steps after the first five (fewer in a short run); rank 0
    writes ``OUT/profile.txt``: the profiled steps' wall time, the GPU's busy time by kernel category
    and the rest (the GPU idle: host work, syncs, launch gaps), the communication (NCCL kernels) that
    no computation overlaps, then the top kernels; and ``OUT/profile.json``, the same totals per step as
    numbers (for benchmarks).

    The memory at the peak (the allocator's trace with Python stacks) is recorded only by a single process
    without activation checkpointing (``memory_trace``): on two H100s under FSDP2, and on one GPU with
    ``--ac selective`` (torch 2.11), the Python tracer and the allocator's Python stacks together made an
    autograd Function's ``apply`` return NULL without an exception ("corrupted double-linked list"), and the
    process aborted at the first profiled step; without the allocator trace the same runs profile.

    Python stacks (for the host-wait and idle-gap tables) are recorded only with ``stacks``, which the trainer gives a
    single process unless ``--profile-stacks`` says otherwise: recording them slows each rank's host by a different
    amount, and under FSDP2 a rank then waits for the others in its collectives, which reads as exposed communication.
    On 2 H200s at 8 layers of Llama-3.1-8B's shape the profiled steps took 273 ms against 252 ms unprofiled, with 25.5
    ms of exposed all-gather (benchmarks/results/scale-NVIDIA_H200-2026-11-28-x4l8-vocab.json, the rows'
    ``profile``)."""

    #: Kernel-name patterns -> category, first match wins.
    CATEGORIES = (("attention", r"flash|fmha|attention|_attn|sdpa|flex"),  # before matmul: FlashAttention's
                  ("matmul", r"gemm|matmul|cutlass|nvjet|xmma|cublas|splitk"),  # names hold "cutlass::"
                  ("communication (NCCL)", r"nccl"),
                  ("optimizer", r"adam|multi_tensor|FusedOptim"),
                  ("ligermodels kernels", r"_rms_norm|_rope|_glu|_ce_|_flce|_scale_cast"),
                  ("copies and casts", r"copy|cast|cat|fill|zero"))

    #: Host calls that block until the device catches up (a copy from pageable memory, a read of a device value).
    WAITS = ("cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
             "aten::nonzero", "aten::item", "aten::_local_scalar_dense", "aten::index")

    #: Kineto activity types of device events that are GPU work (not sync waits or annotations).
    DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")

    def __init__(self, enabled: bool, steps: int, memory_trace: bool, first: int = 5, count: int = 2,
                 stacks: bool = True):
        first = min(first, max(0, steps - count))
        self.memory_trace, self.stacks = memory_trace, stacks
        self.steps = range(first + 1, min(first + count, steps) + 1) if enabled else range(0)
        self.prof, self.t0 = None, 0.0
        self.mem_base: int | None = None  # CUDA: bytes allocated when the profiled steps began

    def before(self, step: int, device: torch.device) -> None:
        """Called before step ``step`` (1-based) starts."""
        if step == self.steps.start:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            self.prof = profile(activities=activities, with_stack=self.stacks)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                if self.memory_trace:  # see the class docstring
                    self.mem_base = torch.cuda.memory_allocated(device)
                    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def wants(self, step: int) -> bool:
        """Whether step ``step`` is the last profiled one: its numbers are read at once, ending the profile."""
        return self.prof is not None and step == self.steps.stop - 1

    def after(self, step: int, path: str, rank: int) -> None:
        """Called after step ``step`` finished (the host waited for the device)."""
        if self.prof is None or step != self.steps.stop - 1:
            return
        wall_ms = (time.perf_counter() - self.t0) * 1e3 / len(self.steps)
        self.prof.__exit__(None, None, None)
        memory = None
        if self.mem_base is not None:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            index = torch.cuda.current_device()
            traces = snapshot.get("device_traces") or []
            memory = memory_at_peak(traces[index] if index < len(traces) else [], self.mem_base)
        if rank == 0:
            timeline = self.timeline(wall_ms)
            if memory is not None:
                timeline["memory_peak_gb"] = round(memory[0] / 1e9, 3)
                timeline["memory_peak_reached_at"] = memory[1]
                timeline["memory_at_peak"] = [{"site": site, "gb": round(b / 1e9, 3), "tensors": n}
                                              for site, b, n in memory[2]]
            with open(path, "w") as f:
                f.write(self.report(wall_ms, timeline))
            with open(os.path.splitext(path)[0] + ".json", "w") as f:
                json.dump(timeline, f, indent=1)
        self.prof = None

    def timeline(self, wall_ms: float) -> dict:
        """Per profiled step, from the device timeline: ``wall_ms``; ``gpu_active_ms``, the time some kernel,
        copy or fill runs on any stream; ``gpu_idle_ms`` = wall - active (the host not keeping the GPU fed,
        syncs); ``nccl_ms``, the time some NCCL kernel runs; ``nccl_exposed_ms``, the part of it during which
        nothing else runs (communication that computation does not hide)."""
        events = list(self.prof.events())
        ops = {e.id: e for e in events
               if e.device_type == torch.autograd.DeviceType.CPU and not getattr(e, "linked_correlation_id", 0)}
        model_own = "|".join(pat for cat, pat in self.CATEGORIES if cat in ("attention", "matmul"))
        comm, comm_launched, compute, owned = [], [], [], {}

        def owner(e) -> str:  # walked only for the kernels the tables charge (not the GEMMs and attention)
            return launch_owner(ops.get(getattr(e, "linked_correlation_id", 0)))

        for e in events:
            if not self.device_work(e):
                continue
            span = (e.time_range.start, e.time_range.end)
            if "nccl" in e.name.lower():
                label = self.collective_label(e.name)
                comm.append((*span, label))
                comm_launched.append((*span, f"{label} <- {owner(e)}"))
                continue
            compute.append(span)
            if not re.search(model_own, e.name, re.I):  # the GEMMs and attention: the layers' own work
                key = (owner(e), e.name.split("(")[0].split("<")[0][:60])
                owned[key] = owned.get(key, 0.0) + span[1] - span[0]
        n = len(self.steps)
        spans = [(a, b) for a, b, _ in comm]
        active = union_us(spans + compute) / n / 1e3
        by_launch = sorted(exposed_by_label(comm_launched, compute).items(), key=lambda kv: -kv[1])
        by = sorted(exposed_by_label(comm, compute).items(), key=lambda kv: -kv[1])
        return {"steps": list(self.steps), "wall_ms": round(wall_ms, 3), "gpu_active_ms": round(active, 3),
                "gpu_idle_ms": round(wall_ms - active, 3), "nccl_ms": round(union_us(spans) / n / 1e3, 3),
                "nccl_exposed_ms": round(exposed_us(spans, compute) / n / 1e3, 3),
                "nccl_exposed_by": [{"collective": k, "ms": round(us / n / 1e3, 3)} for k, us in by[:12] if us > 0],
                "nccl_exposed_by_launch": [{"collective": k, "ms": round(us / n / 1e3, 3)}
                                           for k, us in by_launch[:16] if us > 0],
                "other_kernels_by_launch": [{"launched_in": o, "kernel": k, "ms": round(us / n / 1e3, 3)}
                                            for (o, k), us in sorted(owned.items(), key=lambda kv: -kv[1])[:20]],
                "idle_by_launch_site": [{"op": op, "site": site, "ms": round(us / n / 1e3, 3), "gaps": k // n}
                                        for op, site, us, k in self.idle_sites()[:15]]}

    @staticmethod
    def collective_label(kernel: str) -> str:
        """The collective an NCCL kernel runs, from its name: ``ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(...)``
        -> ``ReduceScatter f32``. (FSDP2's GPU-side annotations do not bound its kernels tightly enough to name
        the module: an all-gather's kernel can overlap the copy-out of the one before.)"""
        m = re.search(r"(AllGather|ReduceScatter|AllReduce|Broadcast|SendRecv|AllToAll|Reduce)(?:_\w+?_(\w+?)_)?",
                      kernel)
        if m is None:
            return kernel.split("(")[0]
        return f"{m.group(1)} {m.group(2)}" if m.group(2) else m.group(1)

    @classmethod
    def device_work(cls, e) -> bool:
        """Whether profiler event ``e`` is work on a GPU (a kernel, copy or fill), not a sync wait or annotation."""
        kind = getattr(e, "activity_type", None) or None  # kineto's type (None where the build does not say)
        return (e.device_type == torch.autograd.DeviceType.CUDA and kind in (None, *cls.DEVICE_WORK)
                and not getattr(e, "is_user_annotation", False) and e.name != "Context Sync")

    def idle_sites(self) -> list[tuple[str, str, float, int]]:
        """:func:`idle_by_launch_site` over the profiled steps' device work and the host ops that launched it."""
        kernels, ops = [], {}
        for e in self.prof.events():
            if e.device_type == torch.autograd.DeviceType.CPU:
                if not getattr(e, "linked_correlation_id", 0):  # a PyTorch op (not a runtime call)
                    ops[e.id] = (e.name, list(e.stack or []))
            elif self.device_work(e):
                kernels.append((e.time_range.start, e.time_range.end, getattr(e, "linked_correlation_id", 0)))
        return idle_by_launch_site(kernels, ops)

    def report(self, wall_ms: float, timeline: dict) -> str:
        n = len(self.steps)
        per_cat, kernels = device_time_by_category(self.prof.key_averages(), self.CATEGORIES, n)
        busy = sum(per_cat.values())
        lines = [f"# steps {self.steps.start}-{self.steps.stop - 1}: {wall_ms:.2f} ms a step (wall, host clock); "
                 f"GPU kernel time {busy:.2f} ms ({100 * busy / wall_ms:.1f}%; summed over streams, so kernels",
                 "# side by side, such as NCCL's beside a GEMM's, count twice: the timeline below counts them once)",
                 *(("# (recording Python stacks slows the host: the GPU's idle time here is an upper bound; compare "
                    "the", "# timeline's active time with the unprofiled steps' time in metrics.jsonl)") if self.stacks
                   else ("# (no Python stacks recorded (--profile-stacks, off by default on several ranks, so that "
                         "they", "# keep pace): the host-wait callers and the idle gaps' launch sites are not named)")),
                 "",
                 f"{'category':32s} {'ms/step':>9s} {'% step':>7s}"]
        for cat, ms in sorted(per_cat.items(), key=lambda kv: -kv[1]):
            lines.append(f"{cat:32s} {ms:9.2f} {100 * ms / wall_ms:6.1f}%")
        t = timeline
        lines += ["", "Device timeline, all streams (kernels that overlap counted once):",
                  f"{'GPU active':32s} {t['gpu_active_ms']:9.2f} {100 * t['gpu_active_ms'] / wall_ms:6.1f}%",
                  f"{'GPU idle':32s} {t['gpu_idle_ms']:9.2f} {100 * t['gpu_idle_ms'] / wall_ms:6.1f}%",
                  f"{'NCCL running':32s} {t['nccl_ms']:9.2f} {100 * t['nccl_ms'] / wall_ms:6.1f}%",
                  f"{'NCCL exposed (nothing else runs)':32s} {t['nccl_exposed_ms']:9.2f} "
                  f"{100 * t['nccl_exposed_ms'] / wall_ms:6.1f}%"]
        lines += [f"  {r['collective'][:60]:60s} {r['ms']:9.2f}" for r in t["nccl_exposed_by"]]
        if t["nccl_exposed_by_launch"]:
            lines += ["", "NCCL exposed, by the host range that launched it (ms/step):"]
            lines += [f"  {r['collective'][:90]:90s} {r['ms']:9.2f}" for r in t["nccl_exposed_by_launch"]]
        if t["other_kernels_by_launch"]:
            lines += ["", "Device work other than GEMMs, attention and NCCL, by the host range that launched it "
                      "(ms/step):"]
            lines += [f"{r['ms']:9.3f}  {r['launched_in'][:60]:60s} {r['kernel']}"
                      for r in t["other_kernels_by_launch"]]
        lines += ["", "Top 30 GPU kernels (ms/step):"]
        lines += [f"{ms:9.3f}  {k[:120]}" for k, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:30]]
        lines += ["", "Top 30 host ops by self CPU time (ms/step):"]
        host = sorted((e for e in self.prof.key_averages()
                       if e.device_type == torch.autograd.DeviceType.CPU and ".py(" not in e.key),
                      key=lambda e: -e.self_cpu_time_total)[:30]
        lines += [f"{e.self_cpu_time_total / n / 1e3:9.3f}  {e.count // n:6d}x  {e.key[:100]}" for e in host]
        lines += ["", "Host calls that can wait for the device, by Python caller (ms/step):"]
        waits: dict[tuple[str, ...], list[float]] = {}
        for e in self.prof.events():
            if e.name in self.WAITS:
                frames, parent = [], e.cpu_parent
                while parent is not None and len(frames) < 4:
                    if ".py(" in parent.name:
                        frames.append(parent.name)
                    parent = parent.cpu_parent
                entry = waits.setdefault((e.name, *frames), [0.0, 0])
                entry[0] += e.self_cpu_time_total / n / 1e3
                entry[1] += 1
        for (name, *frames), (ms, count) in sorted(waits.items(), key=lambda kv: -kv[1][0])[:12]:
            lines.append(f"{ms:9.3f}  {count // n:6d}x  {name}  <- {' <- '.join(frames)}")
        if timeline.get("idle_by_launch_site"):
            lines += ["", "GPU idle before work launched by (ms/step, gaps/step, host op, innermost frame of this "
                      "package; gaps of 10 us and more, the profiler's own overhead included):"]
            lines += [f"{r['ms']:9.3f}  {r['gaps']:6d}x  {r['op'][:40]}  {r['site'][:110]}"
                      for r in timeline["idle_by_launch_site"]]
        if "memory_at_peak" in timeline:
            lines += ["", f"Allocated memory at its peak in the profiled steps: {timeline['memory_peak_gb']:.2f} GB, "
                      f"reached by an allocation at {timeline['memory_peak_reached_at']}; live tensors by "
                      "allocating site (GB, count):"]
            lines += [f"{r['gb']:9.3f}  {r['tensors']:6d}  {r['site'][:150]}" for r in timeline["memory_at_peak"]]
        return "\n".join(lines) + "\n"
