"""End-to-end training-step benchmark: ligermodels against transformers eager, transformers + Liger-Kernel
and transformers under ``torch.compile``, on the same model shape and GPU.

One step = forward + backward + fused AdamW step (torch's ``fused=True`` for the transformers impls, our
Triton ``kernels.AdamW`` for ligermodels; ``ligermodels+graph``: the same step captured once as
a CUDA graph and replayed), bf16 parameters (and bf16 optimiser state: the same
for every implementation), random init from the public config's shapes, random tokens, labels = input ids
(the models shift them). Each (impl, model, batch) runs in its own process, so one implementation's
allocator state, compiled graphs or patched modules never reach another. Times are the median of
``--steps`` CUDA-event timed steps after ``--warmup`` steps; peak memory is ``max_memory_allocated``
over the whole run (weights, gradients, optimiser state and activations). The transformers models attend
through SDPA, except where SDPA would skip part of the model's math (``benchmarks.common.HF_ATTENTION``:
Gemma 2's attention soft-capping runs in transformers' eager attention). The shapes are
``benchmarks.common.MODELS``; each worker times its step with ``benchmarks.common.measure`` (which
bench_train's ``bare`` impl runs too).

    python -m benchmarks.bench_e2e --runs llama-1b:8 qwen2-1.5b:4 --impls ligermodels hf hf+liger hf+compile
    python -m benchmarks.bench_e2e --runs llama-1b:8 --impls ligermodels --profile   # + op-category budget
    python -m benchmarks.bench_e2e --runs llama-1b --impls ligermodels hf+liger --max-batch

Writes (and merges into) ``e2e-<gpu>-<date>.json``: rows ``{"impl", "variant", "model", "batch", "seq",
"tokens_per_s", "peak_mem_gb", "mfu", "step_ms", "matmul_floor_ms"}``; an out-of-memory run has
``"oom": true``. MFU = (6 x matmul parameters x tokens + attention flops) / step time / 989 TFLOP/s
(H100/H200 dense bf16 peak), attention flops = 3 (fwd + bwd) x 4 B S^2 Hq D x L / 2 (causal half; a layer
with a sliding window W < S counts B (S W - W^2 / 2) pairs instead of B S^2 / 2).
``matmul_floor_ms`` is the same flops at the bf16 matmul rate measured in the same process. Memory in
GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch

from benchmarks.common import RESULTS, base_row, environment, measure


# --------------------------------------------------------------------------------------- driver
def run_worker(impl: str, model: str, batch: int, args, profile: str | None = None) -> dict:
    """One measurement in a fresh process; an out-of-memory run becomes ``{"oom": true}``."""
    cmd = [sys.executable, "-m", "benchmarks.bench_e2e", "--worker", impl, model, str(batch), "--seq", str(args.seq),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.ac:
        cmd.append("--ac")
    if args.flce_strategy:
        cmd += ["--flce-strategy", args.flce_strategy]
    if profile:
        cmd += ["--profile-to", profile]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith("{")), None)
    if line:
        row = json.loads(line)
    else:
        tail = (p.stderr or p.stdout)[-600:]
        row = base_row(impl, model, batch, args.seq, args.ac)
        if "OutOfMemoryError" in tail or "out of memory" in tail:
            row["oom"] = True
        else:
            row["error"] = tail.strip().splitlines()[-1] if tail.strip() else f"exit {p.returncode}"
            print(tail, file=sys.stderr)
    row["wall_s"] = round(time.time() - t0, 1)
    return row


def max_batch(impl: str, model: str, args, start: int) -> tuple[int, int]:
    """(largest batch that ran two steps, smallest that ran out of memory): doubling from ``start``, then
    bisection until the gap is at most 1/8 of the batch that fits."""
    fits, lo = 0, start

    def ok(b):
        r = run_worker(impl, model, b, argparse.Namespace(**{**vars(args), "steps": 1, "warmup": 1}))
        print(f"  max-batch {impl} {model} batch {b}: {'oom' if r.get('oom') else r.get('error', 'fits')}",
              flush=True)
        return "tokens_per_s" in r

    while ok(lo):
        fits, lo = lo, lo * 2
    hi = lo
    lo = fits
    while hi - lo > max(1, lo // 8):
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def summary(r: dict) -> str:
    """One printed line per result row."""
    head = f"{r['model']:>11} b{r['batch']:<3} {r['impl']:>11} {r['variant']:>7}"
    if r.get("max_batch"):
        return f"{head}  max batch {r['batch']}"
    if "tokens_per_s" not in r:
        return f"{head}  {'OOM' if r.get('oom') else 'ERROR ' + r.get('error', '')}"
    return (f"{head}  {r['tokens_per_s']:9.0f} tok/s  {r['step_ms']:7.1f} ms (floor {r['matmul_floor_ms']:.1f})  "
            f"MFU {100 * r['mfu']:4.1f}%  peak {r['peak_mem_gb']:5.1f} GB"
            + (" (fwd/bwd/opt {forward}/{backward}/{optimizer})".format(**r["peak_phase_gb"])
               if r.get("peak_phase_gb") else "")
            + f"  loss {r['first_loss']}->{r['last_loss']}  [{r['wall_s']} s]")


def merge(path: str, rows: list[dict], extra: dict) -> None:
    """Merge rows into the results file, replacing rows with the same (impl, variant, model, batch, ac)."""
    data = {**environment(), "rows": []}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        if torch.cuda.is_available():  # merging results fetched from the GPU elsewhere keeps their environment
            data.update(environment())

    def key(r):
        return (r["impl"], r.get("variant"), r["model"], r["batch"], r.get("activation_checkpointing", False),
                r.get("max_batch", False), r.get("flce_strategy"), r.get("sdpa_backends"))

    new = {key(r) for r in rows}
    data["rows"] = [r for r in data["rows"] if key(r) not in new] + rows
    data.update(extra)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="*", default=["llama-1b:8"], help="MODEL:BATCH (MODEL alone with --max-batch)")
    ap.add_argument("--impls", nargs="*", default=["ligermodels", "ligermodels+graph", "ligermodels+compile", "hf",
                                                   "hf+liger", "hf+compile"])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ac", action="store_true", help="full activation checkpointing (every implementation)")
    ap.add_argument("--profile", action="store_true", help="profile each impl's step: op-category budget text")
    ap.add_argument("--max-batch", action="store_true", help="find the largest batch each impl fits")
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--worker", nargs=3, metavar=("IMPL", "MODEL", "BATCH"), help=argparse.SUPPRESS)
    ap.add_argument("--flce-strategy", choices=["tokens", "vocab"],
                    help="ligermodels' loss-head strategy (kernels.fused_linear_cross_entropy); default: the model's")
    ap.add_argument("--profile-to", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        impl, model, batch = args.worker
        row = measure(impl, model, int(batch), args.seq, args.steps, args.warmup, args.ac, args.profile_to,
                      args.flce_strategy)
        if args.flce_strategy and impl.startswith("ligermodels"):
            row["flce_strategy"] = args.flce_strategy
        if os.environ.get("LIGERMODELS_SDPA_BACKENDS") and impl.startswith("ligermodels"):
            row["sdpa_backends"] = os.environ["LIGERMODELS_SDPA_BACKENDS"]  # an A/B run of the attention backend
        print(json.dumps(row), flush=True)
        return

    env = environment()
    path = os.path.join(args.out, f"e2e-{env['gpu'].replace(' ', '_')}-{env['date']}.json")
    os.makedirs(args.out, exist_ok=True)
    for run in args.runs:
        model, _, batch = run.partition(":")
        for impl in args.impls:
            if args.max_batch:
                b, oom = max_batch(impl, model, args, int(batch or 4))
                row = {**base_row(impl, model, b, args.seq, args.ac), "max_batch": True, "first_oom_batch": oom}
            else:
                prof = None
                if args.profile:
                    prof = os.path.join(args.out, f"e2e-profile-{impl.replace('+', '-')}-{model}-b{batch}.txt")
                row = run_worker(impl, model, int(batch), args, prof)
            if args.flce_strategy and impl.startswith("ligermodels"):
                row.setdefault("flce_strategy", args.flce_strategy)
            print(summary(row), flush=True)
            merge(path, [row], {})
            gc.collect()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
