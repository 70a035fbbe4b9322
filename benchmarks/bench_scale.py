"""Many GPUs: ``python -m ligermodels.train`` and torchtitan side by side, 1 to 8 GPUs of one host.

Both trainers run under ``torchrun --nproc-per-node N`` on the same model shape (Llama-3.1-8B's
``config.json``, random init; ``--layers`` keeps its first L layers, e.g. for a one-GPU smoke test), the
same local batch (``--batch-size`` rows of ``--seq-len`` tokens per GPU, one micro-batch a step), the
same activation checkpointing mode (``--ac``: ``full``, or ``selective``: ours keeps every matmul and
attention output of a layer, torchtitan's ``selective_ac_option = "op"`` its attention outputs and every
other matmul output; ours' ``lean``, which also recomputes the gate/up projection, runs against torchtitan's
selective runs, torchtitan being skipped for it), bf16 compute with fp32 gradient reduction under FSDP2 (one
FSDP unit per decoder layer), AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.1, lr 1e-5 constant), gradient
clipping at 1.0, with and without ``torch.compile`` on each side (ours: ``--compile``, each decoder layer; torchtitan:
``compile.enable``, each TransformerBlock and the loss). FP8: ours ``--fp8 rowwise`` (``ours+fp8``) against
torchtitan's float8 converter (torchao's Float8Linear; ``titan+compile+float8``: tensorwise scales with the weights
all-gathered in float8, ``titan+compile+float8-rowwise``: torchao's rowwise recipe), the output head in bf16 on both
sides; FP8 runs are compared with FP8 runs only (``checks`` key ``<gpus>:<ac>:fp8``). The float8 runs need torchao
(0.18.0 for torch 2.11: ``pip download --no-deps torchao==0.18.0`` into ``.whl``).
On one GPU neither trainer shards: ours keeps bf16 weights with fp32 master bits in the optimiser,
torchtitan fp32 weights under bf16 autocast (16 bytes a parameter with its gradient and AdamW state, 128 GB
at 8B before activations: it may not fit one GPU).

Data: the same documents. ``WORK/data/data.jsonl`` holds random-word documents (``--doc-tokens`` long on
average) tokenized by a word-level ``tokenizer.json`` that fills the vocabulary (``benchmarks.common``'s
``write_model_dir`` / ``write_data``, as in ``bench_fsdp``). ligermodels.train reads it with ``--data``;
torchtitan reads the same directory as its ``c4_test`` dataset (``training.dataset_path``:
``datasets.load_dataset(dir)``, the ``text`` field), tokenized with the same ``tokenizer.json``
(``model.hf_assets_path``). Both add BOS and EOS to each document and pack the stream into rows, so the
tokens per step are the same. They differ in what a row's loss counts (ours leaves out each document's
first token, torchtitan predicts every token), in the init and in the rows each rank draws, so the two
sides' losses are recorded, not compared. ``--attention causal`` (default) attends across the whole row on
both sides (ours ``--attention causal``, torchtitan's ``8B`` flavor, SDPA); ``documents`` within each
document (ours by default, FlexAttention; torchtitan's ``8B_flex`` flavor, FlexAttention ``block_causal``
split at EOS).

Per run, one row in the JSON (written after every run, so a run that times out loses nothing; rows of
an earlier invocation on the same host with the same file name are kept, so one GPU count or one
trainer per invocation builds one file):

* ``tokens_per_s_per_gpu``: local tokens per step / the median step time over the steps after
  ``--warmup`` (ours: ligermodels.train's own per-step time in ``metrics.jsonl``, with ``--profile`` the
  profiled steps left out; torchtitan: its ``time_metrics/end_to_end(s)``, one log per step);
* ``mfu``: the same formula for both sides, ligermodels.train's ``flops_per_token`` x tokens/s per GPU /
  989 TFLOP/s (H100/H200 dense bf16); ``mfu_own``: what each trainer reports itself;
* ``peak_mem_gb`` (GB = 1e9 B, rank 0): ours ``torch.cuda.max_memory_allocated``; torchtitan the
  largest ``memory/max_active(GiB)`` it logs (active bytes: allocated plus blocks freed but still in
  use by another stream, which FSDP2 does not create; its ``max_reserved`` is kept as
  ``peak_reserved_gb``);
* ``losses``: every step's loss; ``wall_s``; ``first_step_s`` (launch to the first step's log line);
* ours with ``--profile``: ``profile``, ligermodels.train's ``OUT/profile.json`` for steps 6-7
  (``nccl_exposed_ms``: NCCL time during which no other kernel runs, i.e. communication that the overlap
  of all-gather / reduce-scatter with compute does not hide; ``gpu_idle_ms``: the GPU waiting for the
  host), and the table under ``results/profiles/``.

``--prefetch``, ``--reshard-after-forward``, ``--shard-embedding`` and ``--reduce-dtype`` set ligermodels.train's
FSDP2 options (torchtitan keeps its defaults: explicit prefetching off, every block resharded after forward, the
embedding gathered, fp32 reduction); the row's ``label`` names the non-default ones (an explicit
``--shard-embedding`` too: its default, ``auto``, picks per run, and the row's ``shard_embedding`` says so).
``--split-check`` adds, for each N > 1, a one-GPU run of ours with ``--grad-accum N`` (the same global batch) for
``--split-steps`` steps, whose losses must equal the N-GPU run's within fp32 rounding (relative 1e-5).

``checks`` holds the targets (:data:`TARGETS`) per GPU count and AC mode: the faster of ours and
ours + compile at least 1.15x torchtitan + compile in tokens/s per GPU with no higher peak memory; per
trainer, per-GPU tokens/s at 2 GPUs at least 95% and at 8 GPUs at least 90% of its 1-GPU rate (measured
on the same host, in the same file).

torchtitan is a benchmark-only baseline (never a dependency), pinned to 0.2.2 (February 2026, made
against torch 2.11's nightlies; 0.3.0, September 2026, follows later torch nightlies and needs packages the
GPU image lacks: spmd_types, torch_checkpointing, wandb). Its config, the flavors of
benchmarks/titan/flavors.py, its tokenizer and data loader reading these inputs were checked on torch
2.13's CPU build with the same wheels; its trainer needs CUDA, so it runs on the GPU machines (torch
2.11). The GPU machine has no network: fetch the wheels with ``bash benchmarks/fetch_titan_wheels.sh``
where pip reaches PyPI (into ``.whl/``, git-ignored), carry ``.whl`` and install them there first::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site
    python3 -m benchmarks.bench_scale --out /tmp/scale --gpus 1 --layers 4 --steps 12 --ac selective \
        --tag -smoke                                                                             # 1 H100
    python3 -m benchmarks.bench_scale --out /tmp/scale --gpus 2 --ac selective                       # 2 H200
    python3 -m benchmarks.bench_scale --out /tmp/scale --gpus 8 --impls ours ours+compile --profile
    python3 -m benchmarks.bench_scale --out /tmp/scale-tiny --tiny --gpus 1 2 --impls ours   # CPU, seconds

GPU counts above ``torch.cuda.device_count()`` are skipped with a note in the JSON. Writes
``results/scale-<gpu>-<date><tag>.json`` (``--tiny``: under ``--out``).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import shutil
import socket
import statistics
import sys
import time

from benchmarks.common import (
    RESULTS,
    child_env,
    environment,
    read_metrics,
    run_logged,
    titan_flavor,
    torchrun,
    write_data,
    write_model_dir,
    write_results,
)
from ligermodels.train.config import AC_MODES

IMPLS = ("ours", "ours+compile", "ours+fp8", "titan", "titan+compile", "titan+compile+float8",
         "titan+compile+float8-rowwise")
#: torchtitan's float8 settings (torchao's Float8Linear) of the float8 runs; the output head stays bf16 on both sides
#: (ours' --fp8 leaves the loss head in bf16). tensorwise: scales per tensor, the weights all-gathered in float8 with
#: their scales computed once per step for all layers (torchtitan's advice for FSDP); rowwise: torchao's recipe.
TITAN_FLOAT8 = {"titan+compile+float8": {"enable_fsdp_float8_all_gather": True,
                                         "precompute_float8_dynamic_scale_for_fsdp": True, "filter_fqns": ["output"]},
                "titan+compile+float8-rowwise": {"recipe_name": "rowwise", "filter_fqns": ["output"]}}
#: ours' FP8 mode in the "ours+fp8" runs (kernels.fp8.FP8_MODES).
OURS_FP8 = "rowwise"
TITAN_VERSION = "0.2.2"
#: What torchtitan's trainer imports that the GPU image may lack (benchmarks/fetch_titan_wheels.sh brings them).
TITAN_MODULES = ("torchtitan", "tyro", "torchdata", "datasets")
TITAN_FLOAT8_MODULES = ("torchao",)  # the float8 runs' Float8Linear
LR = 1e-5
SEED = 0
PEAK_FLOPS = 989e12  # dense bf16 per GPU, H100 and H200 (ligermodels.train.metrics.PEAK_BF16_FLOPS)
#: The targets (``checks`` in the module docstring); split_rel_loss: |loss(N GPUs) - loss(1 GPU, grad-accum N)| /
#: loss at every step compared.
TARGETS = {"speed_vs_titan_compile": 1.15, "memory_vs_titan_compile": 1.0, "scaling": {"2": 0.95, "4": 0.95, "8": 0.90},
           "split_rel_loss": 1e-5}

#: Llama-3.1-8B's config.json shape (public; no download on the GPU machine). bos/eos: the word-level tokenizer's.
LLAMA_3_1_8B = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
    attention_bias=False, mlp_bias=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    bos_token_id=2, eos_token_id=3)
#: ``--tiny``: the same family on the CPU (gloo, fp32), for a smoke test of this script (ours only).
TINY = {**LLAMA_3_1_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256}


# ------------------------------------------------------------------------------------------ inputs
def model_config(args: argparse.Namespace) -> dict:
    """The HF config.json both trainers build: Llama-3.1-8B (or ``TINY``) with ``--layers`` layers."""
    base = TINY if args.tiny else LLAMA_3_1_8B
    return {**base, "num_hidden_layers": args.layers}


def write_inputs(work: str, config: dict, tokens: int, doc_tokens: int) -> tuple[str, str]:
    """``WORK/model`` (config.json, tokenizer) and ``WORK/data/data.jsonl`` (>= ``tokens``); returns both paths.
    The data directory holds nothing else: torchtitan loads the whole directory as its data set."""
    model_dir, data_dir = os.path.join(work, "model"), os.path.join(work, "data")
    write_model_dir(model_dir, config)
    os.makedirs(data_dir, exist_ok=True)
    data = os.path.join(data_dir, "data.jsonl")
    write_data(data, tokens, config["vocab_size"], doc_tokens, seed=SEED)
    return model_dir, data


# ------------------------------------------------------------------------------------------ commands
def label(impl: str, args: argparse.Namespace) -> str:
    """The row's name: the implementation, plus ours' non-default FSDP2 options."""
    if impl.startswith("titan"):
        return impl
    extra = ("" if args.reshard_after_forward == "default" else f"+reshard-{args.reshard_after_forward}") + (
        f"+prefetch{args.prefetch}" if args.prefetch else "") + (
        {"auto": "", "vocab": "+vocab-embedding", "gather": "+gathered-embedding"}[args.shard_embedding]) + (
        "+reduce-bf16" if args.reduce_dtype == "bf16" else "")
    return impl + extra


def ours_command(args: argparse.Namespace, impl: str, nproc: int, ac: str, model_dir: str, data: str, out: str,
                 grad_accum: int = 1, steps: int | None = None) -> list[str]:
    """``torchrun ... -m ligermodels.train`` for one run (``impl`` "ours" or "ours+compile")."""
    cmd = [*torchrun(nproc), "-m", "ligermodels.train", "--model", model_dir, "--from-scratch", "--data", data,
           "--out", out, "--overwrite", "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
           "--grad-accum", str(grad_accum), "--steps", str(steps or args.steps), "--save-every", "0",
           "--log-every", "1", "--lr", str(LR), "--lr-schedule", "constant", "--warmup-steps", "0",
           "--seed", str(SEED), "--ac", ac, "--attention", args.attention, "--dtype", args.dtype,
           "--device", args.device, "--reshard-after-forward", args.reshard_after_forward,
           "--prefetch", str(args.prefetch), "--shard-embedding", args.shard_embedding,
           "--reduce-dtype", args.reduce_dtype]
    if impl == "ours+compile":
        cmd.append("--compile")
    if impl == "ours+fp8":
        cmd += ["--fp8", OURS_FP8]
    if args.profile and steps is None:
        cmd.append("--profile")
    return cmd


def titan_config(args: argparse.Namespace, impl: str, ac: str, model_dir: str, data: str, out: str) -> dict:
    """torchtitan's JobConfig for one run, as {section: {key: value}} (written as TOML by :func:`toml`)."""
    config = {
        "job": {"dump_folder": out, "description": "benchmarks.bench_scale"},
        "metrics": {"log_freq": 1, "enable_tensorboard": True, "save_tb_folder": "tb", "disable_color_printing": True},
        "model": {"name": "llama3", "flavor": titan_flavor(args.layers, args.attention),
                  "hf_assets_path": model_dir},
        "optimizer": {"name": "AdamW", "lr": LR, "eps": 1e-8, "weight_decay": 0.1, "implementation": "fused"},
        "lr_scheduler": {"warmup_steps": 0, "decay_ratio": 0.0},  # constant lr, as ours
        "training": {"local_batch_size": args.batch_size, "seq_len": args.seq_len, "max_norm": 1.0,
                     "steps": args.steps, "dataset": "c4_test", "dataset_path": os.path.dirname(data),
                     "mixed_precision_param": "bfloat16", "mixed_precision_reduce": "float32"},
        "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
                        "fsdp_reshard_after_forward": "default", "tensor_parallel_degree": 1,
                        "pipeline_parallel_degree": 1, "context_parallel_degree": 1},
        "checkpoint": {"enable": False},
        "activation_checkpoint": {"mode": ac, "selective_ac_option": "op"},
        "compile": {"enable": impl.startswith("titan+compile"), "components": ["model", "loss"]},
        "debug": {"seed": SEED},
    }
    if impl in TITAN_FLOAT8:
        config["model"]["converters"] = ["quantize.linear.float8"]
        config["quantize.linear.float8"] = dict(TITAN_FLOAT8[impl])
    if args.layers != 32:
        config["experimental"] = {"custom_import": "benchmarks.titan.flavors"}
    return config


def toml(config: dict) -> str:
    """TOML text of {section: {key: str | bool | int | float | list[str]}} (the only shapes titan_config makes)."""
    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)  # a TOML basic string
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise TypeError(f"toml: no TOML form for {v!r}")

    lines = []
    for section, values in config.items():
        lines += [f"[{section}]", *(f"{key} = {value(v)}" for key, v in values.items()), ""]
    return "\n".join(lines)


def titan_command(nproc: int, config_path: str) -> list[str]:
    """torchtitan's trainer under torchrun, rank 0's output only (as its run_train.sh)."""
    return [*torchrun(nproc), "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "-m", "torchtitan.train",
            "--job.config_file", config_path]


# ------------------------------------------------------------------------------------------ running
STEP_LINE = re.compile(r"^step\s+\d+/|step:\s*\d+\s+loss:")


def launch(cmd: list[str], log_path: str, timeout: float, env: dict, prefix: str, verbose: bool = False) -> dict:
    """Run ``cmd`` (a torchrun) with its output in ``log_path``; stop it after ``timeout`` seconds.

    Returns {returncode, timed_out, wall_s, tail (last 60 lines), first_step_s (launch to the first step
    line, when there is one)}. torchrun gets SIGTERM, which it forwards to its workers, and SIGKILL to its
    process group if it is still there a minute later.
    """
    print(f"{prefix} {' '.join(cmd[1:])}", flush=True)
    first_step = None

    def on_line(line: str, now: float) -> None:
        nonlocal first_step
        is_step = STEP_LINE.search(line) is not None
        if is_step and first_step is None:
            first_step = now
        if verbose or not is_step:
            sys.stdout.write(f"{prefix} {line}")

    out = run_logged(cmd, env, log_path, timeout, on_line)
    out["wall_s"] = round(out["wall_s"], 1)
    if first_step is not None:
        out["first_step_s"] = round(first_step, 1)
    return out


def failure(run: dict, steps_done: int) -> dict:
    """The error fields of a run that did not finish."""
    tail = run["tail"]
    what = "timed out" if run["timed_out"] else f"exit {run['returncode']}"
    row = {"error": f"{what} after {steps_done} step(s): {tail[-1500:]}"}
    if "OutOfMemoryError" in tail or "out of memory" in tail or "out of GPU memory" in tail:
        row["oom"] = True
    return row


# ------------------------------------------------------------------------------------------ results
def timing(step_s: dict[int, float], losses: dict[int, float | None], tokens_per_gpu_step: int, warmup: int,
           skip: tuple[int, ...] = (), flops_per_token: float | None = None, peak: float | None = None) -> dict:
    """Row fields from per-step times (seconds) and losses, keyed by step (from 1).

    The median is over the steps after ``warmup`` that are not in ``skip`` (profiled steps);
    ``mfu`` = flops_per_token x tokens/s per GPU / peak (None when either is unknown).
    """
    timed = [s for step, s in sorted(step_s.items()) if step > warmup and step not in skip]
    if not timed:
        return {"error": f"no timed steps ({len(step_s)} step(s), warm-up {warmup}, left out {list(skip)})"}
    median = statistics.median(timed)
    tps = tokens_per_gpu_step / median
    return {"tokens_per_s_per_gpu": round(tps, 1), "step_s_median": round(median, 4),
            "mfu": None if flops_per_token is None or peak is None else round(flops_per_token * tps / peak, 4),
            "steps": len(step_s), "steps_timed": len(timed),
            "losses": [None if v is None or not math.isfinite(v) else round(v, 6)
                       for _, v in sorted(losses.items())]}


def ours_steps(metrics: list[dict], tokens_per_step: int) -> tuple[dict[int, float], dict[int, float | None]]:
    """(step time in seconds, loss) by step from ligermodels.train's metrics.jsonl lines."""
    return ({m["step"]: tokens_per_step / m["tokens_per_s"] for m in metrics},
            {m["step"]: m["loss"] for m in metrics})


#: torchtitan's per-step console line (colours off), e.g. "step:  3  loss: 11.93215  grad_norm:  2.1034
#: memory: 60.12GiB(42.11%)  tps: 7,021  tflops: 402.13  mfu: 40.66%".
TITAN_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:\s*(\S+)\s+memory:\s*([\d.]+)GiB\S*\s+"
                        r"tps:\s*([\d,]+)\s+tflops:\s*([\d,.]+)\s+mfu:\s*([\d.]+)%")


def parse_titan_log(text: str) -> dict[int, dict]:
    """torchtitan's step lines as {step: {loss, reserved_gib, tps, mfu_pct}} (the last line of a step wins)."""
    out = {}
    for m in TITAN_LINE.finditer(text):
        out[int(m[1])] = {"loss": float(m[2]), "reserved_gib": float(m[4]), "tps": float(m[5].replace(",", "")),
                          "mfu_pct": float(m[7])}
    return out


#: torchtitan's tensorboard tags -> our names.
TITAN_TAGS = {"loss_metrics/global_avg_loss": "loss", "time_metrics/end_to_end(s)": "step_s",
              "memory/max_active(GiB)": "active_gib", "memory/max_reserved(GiB)": "reserved_gib",
              "throughput(tps)": "tps", "mfu(%)": "mfu_pct"}


def read_titan_tb(folder: str) -> dict[int, dict] | None:
    """torchtitan's tensorboard scalars of rank 0 as {step: {loss, step_s, active_gib, ...}}; None when
    tensorboard is missing or no event file was written (then the console lines are read instead)."""
    files = glob.glob(os.path.join(folder, "**", "events.out.tfevents.*"), recursive=True)
    if not files:
        return None
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return None
    out: dict[int, dict] = {}
    for path in files:
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag, name in TITAN_TAGS.items():
            if tag in acc.Tags().get("scalars", []):
                for e in acc.Scalars(tag):
                    out.setdefault(e.step, {})[name] = e.value
    return out or None


def titan_fields(steps: dict[int, dict], tokens_per_gpu_step: int, warmup: int, flops_per_token: float | None,
                 peak: float | None) -> dict:
    """Row fields from torchtitan's per-step numbers (tensorboard's, or the console's without ``step_s``)."""
    step_s = {k: v["step_s"] if "step_s" in v else tokens_per_gpu_step / v["tps"] for k, v in steps.items()}
    row = timing(step_s, {k: v.get("loss") for k, v in steps.items()}, tokens_per_gpu_step, warmup,
                 flops_per_token=flops_per_token, peak=peak)
    if "error" in row:
        return row
    gib = 2**30 / 1e9
    mfus = [v["mfu_pct"] for k, v in steps.items() if k > warmup and "mfu_pct" in v]
    active = [v["active_gib"] for v in steps.values() if "active_gib" in v]
    reserved = [v["reserved_gib"] for v in steps.values() if "reserved_gib" in v]
    row["mfu_own"] = round(statistics.median(mfus) / 100, 4) if mfus else None
    if active:
        row.update(peak_mem_gb=round(max(active) * gib, 2), peak_mem_kind="max active bytes (torchtitan's log)")
    elif reserved:
        row.update(peak_mem_gb=round(max(reserved) * gib, 2), peak_mem_kind="max reserved bytes (console only)")
    if reserved:
        row["peak_reserved_gb"] = round(max(reserved) * gib, 2)
    return row


# ------------------------------------------------------------------------------------------ targets
def _ok(r: dict) -> bool:
    return "error" not in r and r.get("role") != "split-check"


def fp8_run(r: dict) -> bool:
    """Whether a row's projections ran in FP8 (ours --fp8, torchtitan's float8): compared only with each other."""
    return "fp8" in r["impl"] or "float8" in r["impl"]


def one_gpu_run(r: dict, rows: list[dict]) -> dict | None:
    """The one-GPU run that row ``r``'s per-GPU rate is held to: the same label and AC on 1 GPU, else (a label with
    FSDP2 options, which one GPU does not use) the same implementation and AC under its plain label."""
    for label in (r["label"], r["impl"]):
        found = [o for o in rows if (o["label"], o["ac"], o["gpus"]) == (label, r["ac"], 1) and "error" not in o]
        if found:
            return found[0]
    return None


def targets(rows: list[dict]) -> dict:
    """The targets from the rows of one host: {"<gpus>:<ac>": {...}} for the speed and memory against
    torchtitan + compile, {"<label>:<ac>": {...}} for the scaling, {"split:<gpus>:<ac>"} for split invariance.
    Each entry holds the measured ratio and ``holds`` (None where the target names no threshold)."""
    out: dict[str, dict] = {}
    good = [r for r in rows if _ok(r)]
    for gpus, ac, fp8 in sorted({(r["gpus"], r["ac"], fp8_run(r)) for r in good if r["impl"].startswith("ours")}):
        ours = [r for r in good if (r["gpus"], r["ac"], fp8_run(r)) == (gpus, ac, fp8) and r["impl"].startswith("ours")]
        # torchtitan has no "lean" mode: lean runs are held to its selective ("op") runs, as less memory for speed
        versus_ac = "selective" if ac == "lean" else ac
        titans = [r for r in good if (r["gpus"], r["ac"], fp8_run(r)) == (gpus, versus_ac, fp8)
                  and r["impl"].startswith("titan+compile")]
        if not titans:
            continue
        titan = max(titans, key=lambda r: r["tokens_per_s_per_gpu"])
        best = max(ours, key=lambda r: r["tokens_per_s_per_gpu"])
        speed = best["tokens_per_s_per_gpu"] / titan["tokens_per_s_per_gpu"]
        memory = best["peak_mem_gb"] / titan["peak_mem_gb"] if titan.get("peak_mem_gb") else None
        out[f"{gpus}:{ac}" + (":fp8" if fp8 else "")] = {
            "ours": best["label"], "titan": f"{titan['label']} ({versus_ac})",
            "speed_vs_titan_compile": round(speed, 3),
            "memory_vs_titan_compile": None if memory is None else round(memory, 3),
            "holds": speed >= TARGETS["speed_vs_titan_compile"] and memory is not None
            and memory <= TARGETS["memory_vs_titan_compile"]}
    for r in sorted((r for r in good if r["gpus"] > 1), key=lambda r: (r["label"], r["ac"], r["gpus"])):
        base = one_gpu_run(r, good)
        if base is not None:
            name, ac, gpus = r["label"], r["ac"], r["gpus"]
            ratio = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
            need = TARGETS["scaling"].get(str(gpus))
            out.setdefault(f"{name}:{ac}", {})[f"scaling_{gpus}"] = {
                "ratio": round(ratio, 3), "holds": None if need is None else ratio >= need}
    for split in (r for r in rows if r.get("role") == "split-check" and "error" not in r):
        many = next((r for r in good if r["label"] == split["label"] and r["ac"] == split["ac"]
                     and r["gpus"] == split["grad_accum"] and r["grad_accum"] == 1), None)
        if many is None:
            continue
        pairs = [(a, b) for a, b in zip(split["losses"], many["losses"], strict=False)
                 if a is not None and b is not None]
        if pairs:
            worst = max(abs(a - b) / abs(b) for a, b in pairs)
            out[f"split:{split['grad_accum']}:{split['ac']}"] = {
                "steps": len(pairs), "max_rel_loss_diff": worst, "holds": worst <= TARGETS["split_rel_loss"]}
    return out


def row_key(r: dict) -> tuple:
    return r["label"], r["gpus"], r["ac"], r.get("grad_accum", 1), r.get("role", "")


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with each row that a ``new`` row measures again replaced; new rows appended in order."""
    keys = {row_key(r) for r in new}
    return [r for r in old if row_key(r) not in keys] + new


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="work directory: model/, data/, one directory per run")
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="GPU (process) counts; those above the visible GPUs are skipped with a note")
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    ap.add_argument("--ac", nargs="+", choices=AC_MODES, default=["selective", "full"],
                    help="activation checkpointing modes, each run on both sides")
    ap.add_argument("--layers", type=int, help="decoder layers of the 8B shape (default 32; --tiny 2)")
    ap.add_argument("--batch-size", type=int, default=1, help="rows per GPU per step (the local batch)")
    ap.add_argument("--seq-len", type=int, help="tokens per row (default 8192; --tiny 64)")
    ap.add_argument("--steps", type=int, help="optimiser steps per run, warm-up included (default 20; --tiny 4)")
    ap.add_argument("--warmup", type=int, help="leading steps left out of the median (default 5; --tiny 1)")
    ap.add_argument("--attention", choices=("causal", "documents"), default="causal",
                    help="causal: across the whole row (SDPA on both sides); documents: within each document")
    ap.add_argument("--doc-tokens", type=int, help="mean document length in tokens (default 2048; --tiny 32)")
    ap.add_argument("--reshard-after-forward", choices=("default", "always", "never"), default="default",
                    help="ligermodels.train's FSDP2 reshard policy")
    ap.add_argument("--prefetch", type=int, default=0, help="ligermodels.train's explicit FSDP2 prefetch (layers)")
    ap.add_argument("--shard-embedding", choices=("auto", "gather", "vocab"), default="auto",
                    help="ligermodels.train's embedding under FSDP2: its default (auto), gathered whole, or looked "
                    "up by vocabulary block")
    ap.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="ligermodels.train's FSDP2 gradient reduce-scatter dtype")
    ap.add_argument("--profile", action="store_true",
                    help="ours: ligermodels.train --profile (exposed communication, GPU idle time)")
    ap.add_argument("--split-check", action="store_true",
                    help="ours: for each N > 1, also one GPU with --grad-accum N (same global batch), same losses")
    ap.add_argument("--split-steps", type=int, default=3, help="steps of each --split-check run")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per torchrun before it is stopped")
    ap.add_argument("--tiny", action="store_true", help="smoke test: a 2-layer Llama on the CPU (gloo, fp32)")
    ap.add_argument("--results", help="directory of the results JSON (default benchmarks/results; --tiny: --out)")
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    ap.add_argument("--keep-runs", action="store_true", help="keep ours' OUT/final exports (16 GB at 8B)")
    ap.add_argument("--verbose", action="store_true", help="echo every step line of the runs")
    args = ap.parse_args(argv)
    defaults = dict(layers=2, seq_len=64, steps=4, warmup=1, doc_tokens=32) if args.tiny else dict(
        layers=32, seq_len=8192, steps=20, warmup=5, doc_tokens=2048)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.device = "cpu" if args.tiny else "cuda"
    args.dtype = "fp32" if args.tiny else "bf16"
    args.results = args.results or (args.out if args.tiny else RESULTS)
    if min(args.gpus) < 1:
        ap.error(f"--gpus needs positive counts, got {args.gpus}")
    if not 1 <= args.layers <= 32:
        ap.error(f"--layers must be between 1 and 32 (Llama-3.1-8B has 32), got {args.layers}")
    for name in ("batch_size", "split_steps", "timeout"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.seq_len < 2:
        ap.error(f"--seq-len must be at least 2, got {args.seq_len}")
    if args.warmup < 0 or args.steps <= args.warmup:
        ap.error(f"--steps {args.steps} leaves no timed step after --warmup {args.warmup}")
    if args.profile and args.steps < 8 + args.warmup:
        ap.error(f"--profile profiles steps 6-7: give --steps at least {8 + args.warmup} (timed steps around them)")
    if args.prefetch < 0:
        ap.error(f"--prefetch must be at least 0, got {args.prefetch}")
    if args.doc_tokens < 1:
        ap.error(f"--doc-tokens must be at least 1, got {args.doc_tokens}")
    args.gpus = sorted(set(args.gpus))
    return args


def titan_missing(float8: bool = False) -> list[str]:
    """The modules torchtitan's trainer (with ``float8``, its float8 runs too) needs that this Python cannot import."""
    import importlib.util

    return [m for m in TITAN_MODULES + TITAN_FLOAT8_MODULES * float8 if importlib.util.find_spec(m) is None]


def package_versions(names: tuple[str, ...]) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def results_path(args: argparse.Namespace, env: dict) -> str:
    gpu = (env.get("gpu") or "cpu").replace(" ", "_").replace("/", "_")
    return os.path.join(args.results, f"scale{'-tiny' if args.tiny else ''}-{gpu}-{env['date']}{args.tag}.json")


def load_previous(path: str, host: str) -> dict:
    """The rows, notes and torchtitan package versions of an earlier invocation written to ``path`` on this
    host (none if no such file)."""
    if not os.path.isfile(path):
        return {"rows": [], "notes": [], "titan_packages": {}, "invocations": []}
    with open(path) as f:
        old = json.load(f)
    if old.get("host") != host:
        raise SystemExit(f"error: {path} holds runs of host {old.get('host')!r}, not {host!r}: pass another --tag "
                         "(targets compare runs of one machine)")
    invocations = old.get("invocations") or [{"command": old.get("command"), "commit": old.get("commit")}]
    return {"rows": old.get("rows", []), "notes": old.get("notes", []), "titan_packages": old.get("titan_packages", {}),
            "invocations": invocations}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from ligermodels.families import config_from_hf
    from ligermodels.train.metrics import flops_per_token

    host = socket.gethostname()
    have = torch.cuda.device_count() if args.device == "cuda" else (os.cpu_count() or 1)
    if args.device == "cuda" and have == 0:
        raise SystemExit("error: no CUDA device is visible (use --tiny for the CPU smoke test)")
    env = environment()
    path = results_path(args, env)
    previous = load_previous(path, host)  # before any work: a clash of hosts is refused now
    notes = list(previous["notes"])
    counts = [n for n in args.gpus if n <= have]
    for n in args.gpus:
        if n > have:
            notes.append(f"{n} GPUs skipped on {env['date']}: {have} visible on {host}")
    impls = list(args.impls)
    if args.device == "cpu" and any(i.startswith("titan") for i in impls):
        notes.append("torchtitan skipped: it trains on CUDA only (--tiny runs on the CPU)")
        impls = [i for i in impls if not i.startswith("titan")]
    missing = titan_missing(any(i in TITAN_FLOAT8 for i in impls)) if any(i.startswith("titan") for i in impls) else []
    if missing:
        raise SystemExit(f"error: torchtitan's trainer needs {', '.join(missing)}, not importable here: run "
                         "`bash benchmarks/fetch_titan_wheels.sh` where pip reaches PyPI, carry .whl/ and install it "
                         "(see this module's docstring), or leave titan out of --impls")
    if not counts:
        raise SystemExit(f"error: no GPU count of {args.gpus} fits the {have} visible")

    config = model_config(args)
    work = os.path.abspath(args.out)
    os.makedirs(work, exist_ok=True)
    # enough rows for 8 GPUs (or more) whatever this invocation runs: every invocation writes the same documents
    need = args.steps * args.batch_size * max(8, *counts) * args.seq_len
    t0 = time.perf_counter()
    model_dir, data = write_inputs(work, config, int(need * 1.1) + args.seq_len, args.doc_tokens)
    print(f"inputs: {model_dir}, {data} (>= {need:,} tokens) in {time.perf_counter() - t0:.1f} s", flush=True)
    fpt = flops_per_token(config_from_hf(config), args.seq_len)
    peak = PEAK_FLOPS if args.device == "cuda" and any(g in env["gpu"] for g in ("H100", "H200")) else None
    titan_info = package_versions(("torchtitan", "torchao", "tyro", "torchdata", "datasets", "fsspec", "pyarrow",
                                   "huggingface_hub", "tensorboard")) if any(
        i.startswith("titan") for i in impls) else {}
    rows: list[dict] = []
    this = {"command": env["command"], "commit": env["commit"]}  # every invocation that wrote the file is listed

    def write() -> None:
        all_rows = merge_rows(previous["rows"], rows)
        payload = {
            "benchmark": "many GPUs: ligermodels.train vs torchtitan (FSDP2, bf16, fp32 reduce), per-GPU local batch",
            "host": host, "model": f"Llama-3.1-8B shape, {args.layers} layers, random init" if not args.tiny
            else "tiny Llama (CPU smoke test)", "model_config": config,
            "settings": {"batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps,
                         "warmup_steps_dropped": args.warmup, "attention": args.attention, "lr": LR,
                         "doc_tokens_mean": args.doc_tokens, "dtype": args.dtype, "device": args.device,
                         "flops_per_token": fpt, "peak_flops": peak},
            "titan_packages": titan_info or previous["titan_packages"], "targets": TARGETS, "checks": targets(all_rows),
            "notes": list(dict.fromkeys(notes)),
            "invocations": previous["invocations"] + [this] if this not in previous["invocations"]
            else previous["invocations"],
            "rows": all_rows}
        print(f"wrote {write_results(os.path.basename(path)[:-5], payload, out_dir=args.results)}", flush=True)

    for n in counts:
        for ac in args.ac:
            for impl in impls:
                if ac == "lean" and impl.startswith("titan"):
                    notes.append("torchtitan has no lean mode: its runs are the selective ones")
                    continue
                rows.append(run_one(args, impl, n, ac, model_dir, data, work, fpt, peak, host))
                write()
            if args.split_check and n > 1 and "ours" in impls:
                rows.append(run_one(args, "ours", 1, ac, model_dir, data, work, fpt, peak, host, grad_accum=n))
                write()
    write()  # the notes of the last runs skipped
    print(json.dumps(targets(merge_rows(previous["rows"], rows)), indent=1))


def run_one(args: argparse.Namespace, impl: str, n: int, ac: str, model_dir: str, data: str, work: str,
            fpt: float, peak: float | None, host: str, grad_accum: int = 1) -> dict:
    """One torchrun of one trainer; its row (numbers, or the error)."""
    name = label(impl, args)
    split = grad_accum > 1
    tag = f"{name}-n{n}-{ac}" + (f"-accum{grad_accum}" if split else "")
    out = os.path.join(work, "runs", tag)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    row = {"label": name, "impl": impl, "gpus": n, "ac": ac, "grad_accum": grad_accum, "batch_size": args.batch_size,
           "seq_len": args.seq_len, "layers": args.layers, "attention": args.attention, "host": host,
           "compile": "+compile" in impl, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if split:
        row["role"] = "split-check"
    tokens_per_gpu_step = args.batch_size * grad_accum * args.seq_len
    # torchtitan reads the data directory through datasets, offline, with a cache of its own
    env = child_env(args.device, HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=os.path.join(work, "hf-datasets-cache"),
                    TOKENIZERS_PARALLELISM="false")
    if impl.startswith("ours"):
        row.update(reshard_after_forward=args.reshard_after_forward, prefetch=args.prefetch,
                   shard_embedding=args.shard_embedding, reduce_dtype=args.reduce_dtype)
        cmd = ours_command(args, impl, n, ac, model_dir, data, out, grad_accum, args.split_steps if split else None)
        run = launch(cmd, os.path.join(out, "torchrun.log"), args.timeout, env, f"[{tag}]", args.verbose)
        metrics = read_metrics(out)
        if run["returncode"] != 0:
            row.update(failure(run, len(metrics)))
        else:
            step_s, losses = ours_steps(metrics, tokens_per_gpu_step * n)
            profiled = tuple(range(6, 8)) if args.profile and not split else ()
            warmup = 0 if split else args.warmup
            row.update(timing(step_s, losses, tokens_per_gpu_step, warmup, profiled, fpt, peak))
            row["mfu_own"] = None if metrics[-1]["mfu"] is None else round(
                statistics.median(m["mfu"] for m in metrics if m["step"] > warmup), 4)
            row.update(peak_mem_gb=round(max(m["peak_mem_gb"] for m in metrics), 2),
                       peak_mem_kind="max allocated bytes")
            if profiled and os.path.isfile(os.path.join(out, "profile.json")):
                with open(os.path.join(out, "profile.json")) as f:
                    row["profile"] = json.load(f)
                profiles = os.path.join(args.results, "profiles")
                os.makedirs(profiles, exist_ok=True)
                copy = os.path.join(profiles, f"scale-profile-{tag.replace('+', '-')}.txt")  # '+': not a portable name
                shutil.copyfile(os.path.join(out, "profile.txt"), copy)
                row["profile_file"] = os.path.relpath(copy, args.results)
        if not args.keep_runs:
            shutil.rmtree(os.path.join(out, "final"), ignore_errors=True)
    else:
        config_path = os.path.join(out, "titan.toml")
        with open(config_path, "w") as f:
            f.write(toml(titan_config(args, impl, ac, model_dir, data, out)))
        cmd = titan_command(n, config_path)
        run = launch(cmd, os.path.join(out, "torchrun.log"), args.timeout, env, f"[{tag}]", args.verbose)
        steps = read_titan_tb(os.path.join(out, "tb"))
        if steps is None:
            with open(os.path.join(out, "torchrun.log")) as f:
                steps = parse_titan_log(f.read())
        if run["returncode"] != 0:
            row.update(failure(run, len(steps)))
        else:
            row.update(titan_fields(steps, tokens_per_gpu_step, args.warmup, fpt, peak))
    row["command"] = " ".join(cmd[1:])
    row.update({k: run[k] for k in ("wall_s", "first_step_s") if k in run})
    shown = {k: v for k, v in row.items() if k not in ("losses", "error", "command", "profile")}
    print(f"[{tag}] {shown} {row.get('error', '')[-400:]}", flush=True)
    return row


if __name__ == "__main__":
    main()
