"""Fused linear cross-entropy benchmark: forward+backward time and peak extra memory.

Run on a GPU:  python -m benchmarks.bench_flce [--tokens 16384] [--hidden 4096] [--vocab 128256 152064]
                                               [--budgets-gib 2] [--vocab-budgets-mib 512] [--out DIR]

For each vocabulary, bf16 hidden (N, H) and LM head (V, H), 10% of the targets ignored, times
``loss = f(hidden, weight, target); loss.backward()`` (median of CUDA-event timings, gradients reset
between runs) and measures its peak extra memory: ``torch.cuda.max_memory_allocated()`` during one
forward+backward, minus what was allocated before it (inputs, parameters) and minus the gradients
it leaves (hidden.grad, weight.grad). Implementations, one after another in this process:

* ``ligermodels``: :func:`kernels.cross_entropy.fused_linear_cross_entropy` (strategy "tokens", default
  chunk budget; ``--budgets-gib`` adds rows with other chunk budgets, to tune ``FLCE_CHUNK_BUDGET_BYTES``);
* ``ligermodels-vocab``: the same with ``strategy="vocab"`` (vocabulary windows, 4 GEMMs, no (V, H) fp32
  accumulator; default window budget; ``--vocab-budgets-mib`` adds rows with other window budgets, to
  tune ``FLCE_VOCAB_BUDGET_BYTES``);
* ``eager``: ``F.cross_entropy(F.linear(hidden, weight).float(), target)`` (the Hugging Face recipe);
* ``compile``: the same under ``torch.compile``;
* with the ``ligermodels`` row, ``gemms_only_ms``: only the three GEMMs of "tokens" at its chunk shapes
  (cuBLAS, fp32 weight-gradient accumulation, no loss kernel), and ``overhead_ms``, the rest of our time;
* ``liger`` / ``liger-fp32acc``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (default, and with
  ``accum_dtype=torch.float32`` where that version has it), when ``liger_kernel`` is importable.

The matmul floor is ``6*N*H*V / rate`` with ``rate`` the measured dense bf16 matmul rate
(:func:`benchmarks.common.matmul_tflops`); the targets are ours/floor <= 1.15, faster than every
baseline, and peak extra memory no higher than Liger's ("tokens"); for "vocab", about 1.33x the
floor (one more GEMM) and peak extra memory below Liger's. Writes ``flce-<gpu>-<date>.json``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import traceback

import torch
import torch.nn.functional as F

from benchmarks.common import bench_ms, environment, matmul_tflops, write_results

ce = importlib.import_module("kernels.cross_entropy")  # the module (kernels.cross_entropy is also a function)

GIB = 1 << 30
MIB = 1 << 20


def _inputs(n: int, h: int, v: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", dtype=dtype, generator=g).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", dtype=dtype, generator=g) * h**-0.5).requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    target[::10] = -100
    return hidden, weight, target


def _hf_loss(hidden, weight, target):
    return F.cross_entropy(F.linear(hidden, weight).float(), target)


def _impls(include_liger: bool, notes: list[str]) -> dict:
    impls = {
        "ligermodels": lambda h, w, t: ce.fused_linear_cross_entropy(h, w, t),
        "ligermodels-vocab": lambda h, w, t: ce.fused_linear_cross_entropy(h, w, t, strategy="vocab"),
        "eager": _hf_loss,
        "compile": torch.compile(_hf_loss),
    }
    if not include_liger:
        notes.append("liger: skipped (--no-liger)")
        return impls
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as e:  # not installed, or incompatible with this torch/triton
        notes.append(f"liger: not importable ({type(e).__name__}: {str(e)[:200]})")
        return impls
    liger = LigerFusedLinearCrossEntropyLoss()
    impls["liger"] = lambda h, w, t: liger(w, h, t)
    try:
        liger32 = LigerFusedLinearCrossEntropyLoss(accum_dtype=torch.float32)
        impls["liger-fp32acc"] = lambda h, w, t: liger32(w, h, t)
    except TypeError:
        notes.append("liger: this version has no accum_dtype (bf16 weight-gradient accumulation only)")
    try:  # the package has no __version__; its distribution metadata has the version
        from importlib.metadata import version

        notes.append(f"liger_kernel {version('liger-kernel')}")
    except Exception as e:
        notes.append(f"liger_kernel version unknown ({type(e).__name__})")
    return impls


def _peak_extra_bytes(fn, hidden, weight, target) -> int:
    """Peak bytes one forward+backward allocates beyond what existed before and the gradients it leaves."""
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = fn(hidden, weight, target)
    loss.backward()
    del loss
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (hidden, weight) if t.grad is not None)
    hidden.grad = weight.grad = None
    return peak - base - grads


def _gemms_only(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """The three GEMMs of the "tokens" strategy at its chunk shapes, nothing else (no loss kernel, no
    casts): logits = h @ W.T, dh = dlogits @ W, dW (+)= dlogits.T @ h with fp32 accumulation. What
    cuBLAS alone takes for our GEMMs, against which the rest of our time is overhead."""
    n, h_size = hidden.shape
    c = ce.flce_chunk_plan(n, h_size, weight.shape[0], hidden.dtype).chunk_size
    acc = torch.empty(weight.shape, dtype=torch.float32, device=hidden.device)
    buf = torch.empty(min(c, n), weight.shape[0], dtype=hidden.dtype, device=hidden.device)
    dh = torch.empty_like(hidden)
    with torch.no_grad():
        for s in range(0, n, c):
            hc, logits = hidden[s:s + c], buf[: min(c, n - s)]
            torch.mm(hc, weight.t(), out=logits)
            torch.mm(logits, weight, out=dh[s:s + c])
            ce._accumulate_fp32(acc, logits.t(), hc, beta=0.0 if s == 0 else 1.0)


def _time_ms(fn, hidden, weight, target) -> float:
    def step():
        fn(hidden, weight, target).backward()

    return bench_ms(step, grad_to_none=[hidden, weight], warmup=500, rep=3000)


def _measure(name, fn, n, h, v, floor_ms, extra=None) -> dict:
    row = {"impl": name, "N": n, "H": h, "V": v, **(extra or {})}
    hidden, weight, target = _inputs(n, h, v)
    try:
        fn(hidden, weight, target).backward()  # warm-up: compilation, autotuning, cuBLAS handles
        row["peak_extra_gb"] = round(_peak_extra_bytes(fn, hidden, weight, target) / 1e9, 3)
        ms = _time_ms(fn, hidden, weight, target)
        row.update(ms=round(ms, 3), floor_ms=round(floor_ms, 3), ratio_to_floor=round(ms / floor_ms, 3))
    except Exception as e:  # an implementation that fails (e.g. out of memory) is reported, not hidden
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    finally:
        del hidden, weight, target
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, nargs="*", default=[128256, 152064])
    ap.add_argument("--budgets-gib", type=float, nargs="*", default=[2.0],
                    help="extra ligermodels rows with these chunk budgets (GiB)")
    ap.add_argument("--vocab-budgets-mib", type=float, nargs="*", default=[512.0],
                    help="extra ligermodels-vocab rows with these window budgets (MiB)")
    ap.add_argument("--no-liger", action="store_true")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    torch.manual_seed(0)
    n, h = args.tokens, args.hidden
    notes: list[str] = []
    rate = matmul_tflops()
    print(f"bf16 matmul rate: {rate:.0f} TFLOP/s")
    impls = _impls(not args.no_liger, notes)
    rows = []
    for v in args.vocab:
        floor_ms = 6 * n * h * v / (rate * 1e9)
        ours_info = {}
        for strategy, name in (("tokens", "ligermodels"), ("vocab", "ligermodels-vocab")):
            plan = ce.flce_chunk_plan(n, h, v, torch.bfloat16, strategy=strategy)
            ours_info[name] = {"strategy": strategy, "chunk": plan.chunk_size, "n_chunks": plan.n_chunks,
                               "predicted_extra_gb": round(plan.extra_bytes / 1e9, 3)}
        for name, fn in impls.items():
            rows.append(_measure(name, fn, n, h, v, floor_ms, ours_info.get(name)))
        ours = next(r for r in rows if r["impl"] == "ligermodels" and r["V"] == v)
        if "ms" in ours:
            hidden, weight, _ = _inputs(n, h, v)
            gemm_ms = bench_ms(functools.partial(_gemms_only, hidden, weight), warmup=500, rep=3000)
            ours.update(gemms_only_ms=round(gemm_ms, 3), overhead_ms=round(ours["ms"] - gemm_ms, 3),
                        gemms_only_ratio_to_floor=round(gemm_ms / floor_ms, 3))
            del hidden, weight
            torch.cuda.empty_cache()
        default_budget = ce.FLCE_CHUNK_BUDGET_BYTES
        for gib in args.budgets_gib:
            ce.FLCE_CHUNK_BUDGET_BYTES = int(gib * GIB)
            try:
                plan = ce.flce_chunk_plan(n, h, v, torch.bfloat16)
                info = {"chunk": plan.chunk_size, "n_chunks": plan.n_chunks,
                        "predicted_extra_gb": round(plan.extra_bytes / 1e9, 3), "budget_gib": gib}
                rows.append(_measure(f"ligermodels-{gib:g}GiB", impls["ligermodels"], n, h, v, floor_ms, info))
            finally:
                ce.FLCE_CHUNK_BUDGET_BYTES = default_budget
        default_vocab_budget = ce.FLCE_VOCAB_BUDGET_BYTES
        for mib in args.vocab_budgets_mib:
            ce.FLCE_VOCAB_BUDGET_BYTES = int(mib * MIB)
            try:
                plan = ce.flce_chunk_plan(n, h, v, torch.bfloat16, strategy="vocab")
                info = {"strategy": "vocab", "chunk": plan.chunk_size, "n_chunks": plan.n_chunks,
                        "predicted_extra_gb": round(plan.extra_bytes / 1e9, 3), "budget_mib": mib}
                rows.append(_measure(f"ligermodels-vocab-{mib:g}MiB", impls["ligermodels-vocab"], n, h, v,
                                     floor_ms, info))
            finally:
                ce.FLCE_VOCAB_BUDGET_BYTES = default_vocab_budget

    checks = {}
    for v in args.vocab:
        by = {r["impl"]: r for r in rows if r["V"] == v and "ms" in r}
        baselines = [k for k in ("eager", "compile", "liger", "liger-fp32acc") if k in by]
        for name, max_ratio in (("ligermodels", 1.15), ("ligermodels-vocab", 1.40)):
            ours = by.get(name)
            if ours is None:
                continue
            checks.setdefault(str(v), {})[name] = {
                f"ratio_to_floor_le_{max_ratio}": ours["ratio_to_floor"] <= max_ratio,
                "faster_than": {k: ours["ms"] < by[k]["ms"] for k in baselines},
                "peak_le_liger": ({k: ours["peak_extra_gb"] <= by[k]["peak_extra_gb"]
                                   for k in ("liger", "liger-fp32acc") if k in by} or None),
            }

    print(f"{'impl':>26} {'V':>7} {'ms':>9} {'floor':>8} {'ratio':>6} {'peak+GB':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:>26} {r['V']:>7} ERROR {r['error']}")
        else:
            print(f"{r['impl']:>26} {r['V']:>7} {r['ms']:9.2f} {r['floor_ms']:8.2f} {r['ratio_to_floor']:6.3f} "
                  f"{r['peak_extra_gb']:8.3f}")
    for note in notes:
        print("note:", note)
    print("checks:", checks)
    env = environment()
    gpu = env["gpu"].replace(" ", "_")
    path = write_results(f"flce-{gpu}-{env['date']}", {"tokens": n, "hidden": h, "dtype": "bfloat16",
                                                       "matmul_tflops": round(rate, 1), "rows": rows,
                                                       "checks": checks, "notes": notes}, args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
