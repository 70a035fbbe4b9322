"""FSDP2 scaling of the training loop: a Qwen2-1.5B-shaped model fine-tuned on 1 and on 2 GPUs.

Each process count runs ``torchrun --standalone --nproc-per-node N -m ligermodels.train`` on the same
inputs, made here with no download: ``WORK/model`` (a Qwen2-1.5B ``config.json`` for ``--from-scratch``
plus a word-level ``tokenizer.json`` whose vocabulary fills the model's 151936 ids) and
``WORK/data.jsonl`` (documents of random words, packed by ``ligermodels.train.data`` into full rows, enough
for every step without repeating a token). bf16 compute with fp32 master weights, fp32 gradient
reduction, AdamW (fused), no checkpoints (``--save-every 0``); the per-rank micro-batch, sequence length
and gradient accumulation are the same for every N, so N GPUs train on N times the tokens per step
(weak scaling). Random init ("from scratch") costs the same per step as fine-tuning a loaded checkpoint.

From each run's ``metrics.jsonl`` (one line per optimiser step, written by rank 0) the first
``--warmup`` steps are dropped (FlexAttention compilation, allocator growth); over the rest:

* ``tokens_per_s_total``: all input tokens of the timed steps / their summed step time (all GPUs);
  ``tokens_per_s_per_gpu`` = that / N; ``scaling_efficiency`` = per-GPU rate / the 1-GPU per-GPU rate;
* ``mfu``: per GPU, ligermodels.train's FLOPs per token (``6 N + 12 L Hq D S``) x tokens / time / (N x 989 TFLOP/s
  dense bf16, H100/H200), aggregated over the timed steps as the tokens/s are (null off those GPUs);
* ``peak_mem_gb``: rank 0's ``torch.cuda.max_memory_allocated`` (1e9 bytes), whole run;
* ``step_s_median``, ``loss_first`` / ``loss_last``, ``wall_s`` (the whole torchrun), ``startup_s`` (launch to
  the end of step 1, less step 1) and ``export_s`` (ligermodels.train always writes ``OUT/final``, an HF checkpoint
  gathered on rank 0's host: about 3 GB in bf16; it is deleted afterwards unless ``--keep-runs``).

    python -m benchmarks.bench_fsdp --out /tmp/fsdp --nproc 1,2          # GPUs: results/fsdp-<gpu>-<date>.json
    python -m benchmarks.bench_fsdp --out /tmp/fsdp-tiny --tiny          # CPU smoke test (gloo), seconds

``--tiny`` swaps in a 2-layer model of the same family and runs on the CPU (fp32, PyTorch reference
kernels) unless ``--device cuda``; its results go to ``--out``, never to benchmarks/results.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import time

from benchmarks.common import (
    RESULTS,
    child_env,
    environment,
    read_metrics,
    run_logged,
    torchrun,
    write_data,
    write_model_dir,
    write_results,
)
from ligermodels.train.config import AC_MODES

#: Qwen2-1.5B's shape (HF config.json fields): 1.54B parameters, tied embeddings, q/k/v bias.
QWEN2_1_5B = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 1536,
    "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": True,
    "rope_theta": 1000000.0, "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 28,
    "attention_dropout": 0.0, "bos_token_id": 2, "eos_token_id": 3,
}
#: ``--tiny``: the same family and features, small enough for a CPU smoke test.
TINY = {**QWEN2_1_5B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


# ------------------------------------------------------------------------------------------ one run
def train_command(args: argparse.Namespace, nproc: int, model_dir: str, data: str, out: str) -> list[str]:
    return [*torchrun(nproc), "-m", "ligermodels.train", "--model", model_dir, "--from-scratch", "--data", data,
            "--out", out, "--overwrite", "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
            "--grad-accum", str(args.grad_accum), "--steps", str(args.steps), "--dtype", args.dtype,
            "--device", args.device, "--ac", args.ac, "--save-every", "0", "--log-every", "1",
            "--warmup-steps", "1", "--lr", "1e-5"]


def run_training(args: argparse.Namespace, nproc: int, model_dir: str, data: str, out: str) -> dict:
    """Run ligermodels.train under torchrun; returns {returncode, timed_out, wall_s, tail, step1_at, last_step_at,
    wrote_at}.

    Output lines are timestamped as they arrive (ligermodels.train prints one per step with --log-every 1 on a
    non-terminal), which splits the wall time into start-up, loop and export.
    """
    cmd = train_command(args, nproc, model_dir, data, out)
    os.makedirs(out, exist_ok=True)
    print(f"\n=== {nproc} process(es): {' '.join(cmd[1:])}", flush=True)
    marks: dict[str, float] = {}

    def on_line(line: str, now: float) -> None:
        step = re.match(r"step\s+(\d+)/", line)
        if step:
            marks.setdefault("step1_at", now)
            marks["last_step_at"] = now
        elif line.startswith("wrote "):
            marks["wrote_at"] = now
        if args.verbose or not step or int(step[1]) in (1, args.steps):
            sys.stdout.write(f"  [{nproc}] {line}")
            sys.stdout.flush()

    run = run_logged(cmd, child_env(args.device), os.path.join(out, "torchrun.log"), args.timeout, on_line)
    return {**run, **marks}


def summarize(nproc: int, args: argparse.Namespace, metrics: list[dict], run: dict) -> dict:
    """One result row from a run's metrics (warm-up steps dropped) and its timings."""
    row = {"nproc": nproc, "batch_size": args.batch_size, "seq_len": args.seq_len, "grad_accum": args.grad_accum,
           "global_batch_rows": args.batch_size * nproc * args.grad_accum, "dtype": args.dtype, "ac": args.ac}
    timed = [m for m in metrics if m["step"] > args.warmup]
    if not timed:
        return {**row, "error": f"no timed steps (metrics for {len(metrics)} step(s), warm-up {args.warmup})"}
    tokens_per_step = args.batch_size * nproc * args.grad_accum * args.seq_len
    step_s = [tokens_per_step / m["tokens_per_s"] for m in timed]
    total = tokens_per_step * len(timed) / sum(step_s)
    mfus = [m["mfu"] for m in timed]
    # mfu_i * step_s_i is the same for every step (fixed flops), so the time-weighted mean is harmonic
    mfu = None if any(v is None for v in mfus) else len(mfus) / sum(1.0 / v for v in mfus)
    row.update(tokens_per_s_total=round(total, 1), tokens_per_s_per_gpu=round(total / nproc, 1),
               mfu=None if mfu is None else round(mfu, 4),
               peak_mem_gb=round(max(m["peak_mem_gb"] for m in metrics), 2), steps_timed=len(timed),
               step_s_median=round(statistics.median(step_s), 4), tokens_per_step=tokens_per_step,
               loss_first=round(metrics[0]["loss"], 4), loss_last=round(metrics[-1]["loss"], 4),
               wall_s=round(run["wall_s"], 1))
    loop_s = sum(tokens_per_step / m["tokens_per_s"] for m in metrics)
    if "step1_at" in run:
        row["startup_s"] = round(run["step1_at"] - tokens_per_step / metrics[0]["tokens_per_s"], 1)
    if "wrote_at" in run and "last_step_at" in run:
        row["export_s"] = round(run["wrote_at"] - run["last_step_at"], 1)
    row["loop_s"] = round(loop_s, 1)
    return row


# ------------------------------------------------------------------------------------------ report
def table(rows: list[dict]) -> str:
    head = (f"{'GPUs':>4} {'batch':>5} {'seq':>5} {'accum':>5} {'tok/s total':>12} {'tok/s/GPU':>10} {'scaling':>7} "
            f"{'MFU':>6} {'peak GB':>8} {'step s':>7} {'timed':>5} {'loss':>15} {'wall s':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['nproc']:>4} {r['batch_size']:>5} {r['seq_len']:>5} {r['grad_accum']:>5}  "
                         f"{'OOM' if r.get('oom') else 'ERROR'}: {r['error'][:120]}")
            continue
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        scaling = "-" if r.get("scaling_efficiency") is None else f"{100 * r['scaling_efficiency']:.0f}%"
        lines.append(f"{r['nproc']:>4} {r['batch_size']:>5} {r['seq_len']:>5} {r['grad_accum']:>5} "
                     f"{r['tokens_per_s_total']:>12,.0f} {r['tokens_per_s_per_gpu']:>10,.0f} {scaling:>7} {mfu:>6} "
                     f"{r['peak_mem_gb']:>8.2f} {r['step_s_median']:>7.3f} {r['steps_timed']:>5} "
                     f"{r['loss_first']:>7.3f}->{r['loss_last']:<7.3f} {r['wall_s']:>7.1f}")
    return "\n".join(lines)


def results_name(env: dict, tiny: bool) -> str:
    gpu = (env.get("gpu") or "cpu").replace(" ", "_").replace("/", "_")
    return f"fsdp{'-tiny' if tiny else ''}-{gpu}-{env['date']}"


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="work directory: model/, data.jsonl, one run directory per N")
    ap.add_argument("--results", help="directory of the results JSON (default benchmarks/results; --tiny: --out)")
    ap.add_argument("--nproc", default="1,2", help="comma-separated process (GPU) counts, e.g. 1,2")
    ap.add_argument("--steps", type=int, help="optimiser steps per run, warm-up included (default 20; --tiny 6)")
    ap.add_argument("--warmup", type=int, default=3, help="leading steps left out of the averages")
    ap.add_argument("--batch-size", type=int, help="rows per GPU per micro-batch (default 4; --tiny 2)")
    ap.add_argument("--seq-len", type=int, help="tokens per row (default 2048; --tiny 64)")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimiser step")
    ap.add_argument("--ac", choices=AC_MODES, default="none", help="activation checkpointing")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), help="compute dtype (default bf16; --tiny on cpu fp32)")
    ap.add_argument("--device", choices=("cuda", "cpu"), help="default cuda (--tiny: cpu)")
    ap.add_argument("--doc-tokens", type=int, help="mean document length in tokens (default: --seq-len)")
    ap.add_argument("--tiny", action="store_true", help="smoke test: a 2-layer Qwen2, CPU (gloo) by default")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per torchrun before it is killed")
    ap.add_argument("--keep-runs", action="store_true", help="keep each run's OUT/final export (~3 GB on GPUs)")
    ap.add_argument("--verbose", action="store_true", help="echo every step line of the runs")
    args = ap.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    args.steps = args.steps or (6 if args.tiny else 20)
    args.batch_size = args.batch_size or (2 if args.tiny else 4)
    args.seq_len = args.seq_len or (64 if args.tiny else 2048)
    args.doc_tokens = args.doc_tokens or args.seq_len
    args.nprocs = [int(n) for n in args.nproc.split(",") if n.strip()]
    if not args.nprocs or min(args.nprocs) < 1:
        ap.error("--nproc needs positive process counts, e.g. 1,2")
    if args.steps <= args.warmup:
        ap.error(f"--steps {args.steps} leaves no timed step after --warmup {args.warmup}")
    if args.results is None:
        args.results = args.out if args.tiny else RESULTS
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = TINY if args.tiny else QWEN2_1_5B
    if args.device == "cuda":
        import torch

        have = torch.cuda.device_count()
        if max(args.nprocs) > have:
            raise SystemExit(f"--nproc {args.nproc} needs {max(args.nprocs)} GPUs; {have} visible")
    work = os.path.abspath(args.out)
    model_dir, data = os.path.join(work, "model"), os.path.join(work, "data.jsonl")
    t0 = time.perf_counter()
    write_model_dir(model_dir, config)
    need = args.steps * args.batch_size * max(args.nprocs) * args.grad_accum * args.seq_len
    docs = write_data(data, int(need * 1.05) + args.seq_len, config["vocab_size"], args.doc_tokens)
    print(f"inputs: {model_dir} ({config['num_hidden_layers']} layers, hidden {config['hidden_size']}, vocab "
          f"{config['vocab_size']}), {data} ({docs} documents, >= {need:,} tokens) in {time.perf_counter() - t0:.1f} s",
          flush=True)

    rows = []
    for nproc in args.nprocs:
        out = os.path.join(work, f"run-n{nproc}")
        run = run_training(args, nproc, model_dir, data, out)
        metrics = read_metrics(out)
        if run["returncode"] == 0:
            row = summarize(nproc, args, metrics, run)
        else:
            row = {"nproc": nproc, "batch_size": args.batch_size, "seq_len": args.seq_len,
                   "grad_accum": args.grad_accum, "wall_s": round(run["wall_s"], 1),
                   "error": ("timed out" if run["timed_out"] else f"exit {run['returncode']}")
                   + f" after {len(metrics)} step(s)"}
            if "OutOfMemoryError" in run["tail"] or "out of memory" in run["tail"]:
                row["oom"] = True
            print(run["tail"], file=sys.stderr)
        if not args.keep_runs:
            shutil.rmtree(os.path.join(out, "final"), ignore_errors=True)
        rows.append(row)

    base = next((r for r in rows if r["nproc"] == 1 and "error" not in r), None)
    for r in rows:
        if base is not None and "error" not in r:
            r["scaling_efficiency"] = round(r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"], 3)

    env = environment()
    payload = {
        "benchmark": "FSDP2 training loop (ligermodels.train under torchrun), weak scaling over GPUs",
        "model": "qwen2-tiny (smoke test)" if args.tiny else "qwen2-1.5b shape (random init, --from-scratch)",
        "model_config": config,
        "settings": {"steps": args.steps, "warmup_steps_dropped": args.warmup, "dtype": args.dtype,
                     "device": args.device, "ac": args.ac, "doc_tokens_mean": args.doc_tokens,
                     "optimizer": "AdamW (fused on cuda), fp32 master weights, bf16 compute, fp32 grad reduce"},
        "notes": "tokens_per_s_* count every input token of the timed steps; mfu is per GPU against 989 TFLOP/s "
                 "(H100/H200 dense bf16) with ligermodels.train's flops_per_token (full-S attention term); "
                 "peak_mem_gb is rank 0's max_memory_allocated; export_s is ligermodels.train's final HF export "
                 "(not in the rates).",
        "rows": rows,
    }
    path = write_results(results_name(env, args.tiny), payload, out_dir=args.results)
    print("\n" + table(rows))
    print(f"wrote {path}")
    if any("error" in r for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
