"""Preference tuning as users run it: ``python -m ligermodels.train --objective dpo|orpo`` against TRL 1.16's
``DPOTrainer`` / ``ORPOTrainer`` (plain, ``use_liger_kernel=True``, ``torch_compile=True``), same pairs, same
precision, one machine, each run its own process.

Inputs: ``WORK/<model>/model`` (the public config.json shape of ``benchmarks.common.MODELS``, a word-level tokenizer
filling its vocabulary: one token per word) and ``WORK/<model>/pairs.jsonl``: ``--pairs`` lines of a ``--prompt-words``
word prompt and ``--completion-words`` word chosen and rejected completions (random words, seed 0). Every sequence
is then prompt + completion + EOS, the same length, so every step of every implementation trains on the same number
of tokens (``4 x 2 x (256 + 769) = 8200`` at the defaults) whatever order each side draws the pairs in (each its own
seeded order). Both sides start from a random init of the shape (each its own draw).

Precision and optimiser, the same on both sides: fp32 master weights, bf16 compute, AdamW (betas 0.9/0.95, eps 1e-8,
weight decay 0.1), constant lr 1e-6, clipping at 1.0, ``--batch`` pairs a micro-batch, no gradient accumulation.
The reference (DPO, ``--reference``): ``model``: a reference forward every step (ours: a frozen bf16 copy; TRL: its
default, a second model loaded in fp32 and run under bf16 autocast); ``precompute``: reference log-probs computed
before the first step on both sides (TRL's ``precompute_ref_log_probs=True``), not timed. TRL pads each micro-batch's
chosen and rejected sequences to their longest (here all equal: no padding) and builds the full logits (its
Liger-Kernel option leaves the fused linear loss off under DPO); ours packs the pairs into one row without padding
and never builds the logits.

``--lora``: LoRA on both sides (``bench_train.LORA``: rank 16, alpha 32, no dropout, all seven projections) over a
random bf16 base checkpoint ``WORK/<model>/base`` (``bench_train.ensure_base``) that both load: ours ``--lora-rank
16 ...``, TRL + PEFT ``get_peft_model`` (adapters fp32, ``bench_train.peft_model``); the reference is the base with
the adapters off on both sides (no second copy), a forward every step or precomputed as above.

Per run: ``tokens_per_s`` (median over the steps after ``--warmup`` of the step's input tokens / step time: ours from
its metrics.jsonl, TRL's from the time between consecutive ``on_step_end`` callbacks after a device sync),
``peak_mem_gb`` (``max_memory_allocated`` from the loaded model on), ``losses``; with ``--gpu-clocks``,
``gpu_clocks`` (:class:`benchmarks.common.GPUClocks`: the SM clock and the power-capped share while the GPU worked);
with ``--profile``, ours' ``profile_file`` (ligermodels.train's table for steps 6-7, which the median leaves out).

    python -m benchmarks.bench_preference --out /tmp/bp --model qwen2-1.5b --objective dpo --reference model

Writes ``results/preference-<gpu>-<date><tag>.json``, merged into an existing file of that name (rows keyed by
model, objective, reference and implementation), so several calls may fill one file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time

from benchmarks.bench_train import LORA, ensure_base, lora_flags, lora_modules, peft_model, run_child, summarize
from benchmarks.common import MODELS, RESULTS, SPECIALS, GPUClocks, environment, write_model_dir, write_results

#: ours and the flags each adds (eager with each prompt once, the default; the step replayed from a CUDA graph,
#: which runs each prompt twice; eager with each prompt twice, as TRL runs it), then TRL's variants
OUR_FLAGS = {"ligermodels": [], "ligermodels-graph": ["--cuda-graph"],
             "ligermodels-prompt-twice": ["--prompt-pass", "twice"],
             "ligermodels-graph-prompt-twice": ["--cuda-graph", "--prompt-pass", "twice"]}
OURS = tuple(OUR_FLAGS)
TRL_IMPLS = ("trl", "trl+liger", "trl+compile")
IMPLS = (*OURS, *TRL_IMPLS)
SEED = 0
LR = 1e-6
#: ours against the fastest TRL variant (tokens/s, at least) and TRL + Liger-Kernel (peak memory, at most)
TARGETS = {"speed_vs_fastest_trl": 1.3, "memory_vs_trl_liger": 0.7}


#: ``--shrink`` (tests only): the shape cut to this, to run both sides on a CPU in seconds
SHRUNK = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16)


def model_config(model: str, shrink: bool) -> dict:
    return {**MODELS[model], "bos_token_id": 2, "eos_token_id": 3, **(SHRUNK if shrink else {})}


def write_inputs(work: str, model: str, pairs: int, prompt_words: int, completion_words: int,
                 shrink: bool = False) -> tuple[str, str]:
    """WORK/<model>/model and WORK/<model>/pairs.jsonl (see the module docstring)."""
    config = model_config(model, shrink)
    directory = os.path.join(work, model)
    model_dir, data = os.path.join(directory, "model"), os.path.join(directory, "pairs.jsonl")
    write_model_dir(model_dir, config)
    rng = random.Random(SEED)
    words = lambda n: " ".join(f"w{rng.randrange(len(SPECIALS), config['vocab_size'])}" for _ in range(n))  # noqa: E731
    with open(data, "w") as f:
        for _ in range(pairs):
            f.write(json.dumps({"prompt": words(prompt_words), "chosen": " " + words(completion_words),
                                "rejected": " " + words(completion_words)}) + "\n")
    return model_dir, data


def ours_command(args, model_dir: str, data: str, out: str) -> list[str]:
    lora = lora_flags(lora_modules(MODELS[args.model])) if args.lora else ["--from-scratch"]
    return [sys.executable, "-m", "ligermodels.train", "--model", model_dir, *lora, "--data", data,
            "--out", out, "--overwrite", "--objective", args.objective, "--reference", args.reference,
            "--batch-size", str(args.batch), "--steps", str(args.steps), "--seq-len", str(args.seq), "--lr", str(LR),
            "--lr-schedule", "constant", "--warmup-steps", "0", "--weight-decay", "0.1", "--max-grad-norm", "1.0",
            "--save-every", "0", "--seed", str(SEED), "--ac", args.ac, *(["--device", "cpu"] if args.shrink else [])]


def run_ours(args, impl: str, model_dir: str, data: str) -> dict:
    out = os.path.join(args.out, f"{impl}-{args.model}-{args.objective}-{args.reference}")
    profile = ["--profile"] if args.profile else []
    res = run_child(ours_command(args, model_dir, data, out) + OUR_FLAGS[impl] + profile, args.timeout)
    if res.returncode != 0:
        return {"error": res.stderr[-2000:]}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    profiled, row = set(), {}
    if args.profile and os.path.isfile(os.path.join(out, "profile.json")):  # the profiled steps are not timed
        with open(os.path.join(out, "profile.json")) as f:
            profiled = set(json.load(f)["steps"])
        copy = os.path.join(args.results, "profiles", f"preference-profile-{os.path.basename(out)}.txt")
        os.makedirs(os.path.dirname(copy), exist_ok=True)
        shutil.copyfile(os.path.join(out, "profile.txt"), copy)
        row = {"steps_profiled": sorted(profiled), "profile_file": os.path.relpath(copy, args.results)}
    tps = sorted(m["tokens_per_s"] for m in metrics[args.warmup:] if m["step"] not in profiled)
    return {"tokens_per_s": round(tps[len(tps) // 2], 1),
            "peak_mem_gb": round(max(m["peak_mem_gb"] for m in metrics), 2),
            "tokens_per_step": metrics[-1]["tokens"], "steps": len(metrics), "steps_timed": len(tps),
            "losses": [round(m["loss"], 5) for m in metrics], **row}


def trl_worker(args) -> dict:
    """(In a child process.) TRL's trainer on the same pairs; the row."""
    import datasets
    import torch
    import transformers
    import trl

    device = "cpu" if args.shrink else "cuda"
    config = transformers.AutoConfig.for_model(**model_config(args.model, args.shrink))

    def random_model():
        torch.manual_seed(SEED)
        with torch.device(device):
            m = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        m.config.use_cache = False
        return m

    if args.lora:  # the base loaded in bf16, PEFT's fp32 adapters; the reference: the base, adapters off
        model, ref = peft_model(args.model_dir, device), None
    else:
        model = random_model()
        ref = random_model() if args.objective == "dpo" and args.reference == "model" else None
    tokenizer = trl_tokenizer(args.model_dir)
    with open(args.data) as f:
        pairs = datasets.Dataset.from_list([json.loads(line) for line in f])
    times, losses = [], []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *a, **k):
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter())
            print(f"TRL step {len(times)} done at {times[-1] - start:.1f} s", file=sys.stderr, flush=True)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    common = dict(output_dir=os.path.join(args.out, "trl"), per_device_train_batch_size=args.batch,
                  max_steps=args.steps, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                  weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0,
                  bf16=not args.shrink, optim="adamw_torch" if args.shrink else "adamw_torch_fused", logging_steps=1,
                  save_strategy="no", report_to=[], disable_tqdm=True, seed=SEED, data_seed=SEED,
                  dataloader_num_workers=2, use_liger_kernel=args.worker.endswith("+liger"),
                  torch_compile=args.worker.endswith("+compile"), max_length=args.seq, use_cpu=args.shrink,
                  gradient_checkpointing=args.ac == "full")
    if args.objective == "dpo":
        targs = trl.DPOConfig(beta=0.1, precompute_ref_log_probs=args.reference == "precompute", **common)
        trainer = trl.DPOTrainer(model=model, ref_model=ref, args=targs, train_dataset=pairs,
                                 processing_class=tokenizer, callbacks=[Clock()])
    else:
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        trainer = ORPOTrainer(model=model, args=ORPOConfig(beta=0.1, **common), train_dataset=pairs,
                              processing_class=tokenizer, callbacks=[Clock()])
    # What TRL tokenised: both sequences of every pair, each prompt + completion + EOS (ORPO: BOS too)
    per_pair = 2 * (args.prompt_words + args.completion_words + 1 + (args.objective == "orpo"))
    lengths = {len(e["prompt_ids"]) * 2 + len(e["chosen_ids"]) + len(e["rejected_ids"]) if "prompt_ids" in e
               else len(e["chosen_input_ids"]) + len(e["rejected_input_ids"]) for e in trainer.train_dataset}
    if lengths != {per_pair}:
        return {"error": f"TRL tokenised the pairs to {sorted(lengths)} tokens each, not {per_pair}"}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else 0.0
    step_s = [b - a for a, b in zip([start, *times], times, strict=False)]
    tokens = per_pair * args.batch
    return {**summarize(step_s, losses, peak, tokens, args.warmup), "tokens_per_step": tokens}


def trl_tokenizer(model_dir: str):
    """The word-level ``tokenizer.json`` as a transformers tokenizer. Not ``AutoTokenizer``: transformers 5 builds
    the tokenizer class of config.json's ``model_type`` (Qwen2's byte-level BPE) from the vocabulary, without merges,
    and that turns every word of these pairs into nothing."""
    import transformers

    return transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_dir, "tokenizer.json"),
                                                bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                                unk_token="<unk>")


def run_trl(args, impl: str, model_dir: str, data: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.bench_preference", "--worker", impl, "--model-dir", model_dir,
           "--data", data, *args.passed]
    res = run_child(cmd, args.timeout)
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"error": res.stderr[-2000:]}
    return json.loads(lines[-1])


def setting(row: dict) -> tuple[str, ...]:
    """What a row's numbers compare within: model, objective, reference, ac (and ``lora`` for LoRA rows)."""
    return (row["model"], row["objective"], row["reference"], row["ac"], *(("lora",) if row.get("lora_rank") else ()))


def checks(rows: list[dict]) -> dict:
    """Per :func:`setting` and each of our impls run there (keyed ``.../--cuda-graph`` for ``ligermodels-graph``, and
    so on: :data:`OUR_FLAGS`): ours / the fastest TRL variant, and ours / TRL + Liger-Kernel's memory."""
    out = {}
    for key in {setting(r) for r in rows}:
        by = {r["impl"]: r for r in rows if setting(r) == key and "error" not in r}
        for impl in (i for i in OURS if i in by):
            out["/".join((*key, *([" ".join(OUR_FLAGS[impl])] if OUR_FLAGS[impl] else [])))] = _check(by[impl], by)
    return out


def _check(ours: dict, by: dict) -> dict:
    result = {}
    rivals = [by[i] for i in TRL_IMPLS if i in by]
    if rivals:
        fastest = max(rivals, key=lambda r: r["tokens_per_s"])
        ratio = ours["tokens_per_s"] / fastest["tokens_per_s"]
        result["speed_vs_fastest_trl"] = {"ratio": round(ratio, 3), "fastest": fastest["impl"],
                                          "holds": ratio >= TARGETS["speed_vs_fastest_trl"],
                                          "rivals_run": sorted(by)}
    if "trl+liger" in by:
        ratio = ours["peak_mem_gb"] / by["trl+liger"]["peak_mem_gb"]
        result["memory_vs_trl_liger"] = {"ratio": round(ratio, 3), "holds": ratio <= TARGETS["memory_vs_trl_liger"]}
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/bench_preference")
    p.add_argument("--model", default="qwen2-1.5b", choices=sorted(MODELS))
    p.add_argument("--objective", default="dpo", choices=("dpo", "orpo"))
    p.add_argument("--reference", default="model", choices=("model", "precompute"))
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--batch", type=int, default=4, help="pairs a micro-batch")
    p.add_argument("--prompt-words", type=int, default=256)
    p.add_argument("--completion-words", type=int, default=768)
    p.add_argument("--seq", type=int, default=2048, help="the longest sequence (TRL's max_length)")
    p.add_argument("--ac", default="full", choices=("none", "full"),
                   help="activation checkpointing of every layer on both sides (TRL's default gradient_checkpointing "
                        "is on: full)")
    p.add_argument("--lora", action="store_true", help="LoRA rank 16 on all seven projections over a bf16 base "
                   "checkpoint, both sides (TRL + PEFT)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--profile", action="store_true", help="ours: ligermodels.train --profile (steps 6-7, left out "
                   "of the median); the table under results/profiles/")
    p.add_argument("--profile-stacks", default="auto", choices=("auto", "on", "off"),
                   help="ours: ligermodels.train --profile-stacks (off: the host's own pace, the launch sites unnamed)")
    p.add_argument("--gpu-clocks", action="store_true", help="sample the GPU's SM clock, power and power capping "
                   "during each run (nvidia-smi; benchmarks.common.GPUClocks)")
    p.add_argument("--shrink", action="store_true", help="a tiny shape on the CPU (tests only; no timing claims)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--tag", default="")
    p.add_argument("--results", default=RESULTS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.passed = list(argv if argv is not None else sys.argv[1:])
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(trl_worker(args)), flush=True)
        return
    model_dir, data = write_inputs(args.out, args.model, args.steps * args.batch, args.prompt_words,
                                   args.completion_words, args.shrink)
    if args.lora:  # both sides load this random bf16 checkpoint (config and tokenizer of model_dir)
        model_dir = ensure_base(args.out, args.model, int(args.timeout))
    for impl in args.impls:
        t0 = time.perf_counter()
        with GPUClocks() if args.gpu_clocks else contextlib.nullcontext() as clocks:
            try:
                row = run_ours(args, impl, model_dir, data) if impl in OURS else run_trl(args, impl, model_dir, data)
            except subprocess.TimeoutExpired as e:  # with the child's last line: how far it got
                err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
                last = (err.strip().splitlines() or [""])[-1]
                row = {"error": f"did not finish {args.steps} steps within --timeout {args.timeout:g} s"
                       + (f" (its last line: {last})" if last else "")}
        if clocks is not None:
            row["gpu_clocks"] = clocks.summary
        row = {"impl": impl, "model": args.model, "objective": args.objective, "reference": args.reference,
               "ac": args.ac, **({"lora_rank": LORA["rank"]} if args.lora else {}), **row,
               "wall_s": round(time.perf_counter() - t0, 1)}
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
        print(write_row(args, row), flush=True)  # after each run: a later one may not finish


def write_row(args, row: dict) -> str:
    """Merge ``row`` into this machine's and day's results file (replacing the row of the same setting)."""
    env = environment()
    row = {**row, "command": env["command"], "commit": env["commit"]}  # a file merges the rows of several calls
    name = f"preference-{env['gpu'].replace(' ', '_')}-{env['date']}{args.tag}"
    path = os.path.join(args.results, f"{name}.json")
    key = lambda r: (*setting(r), r["impl"])  # noqa: E731
    rows = []
    if os.path.isfile(path):
        with open(path) as f:
            rows = [r for r in json.load(f)["rows"] if key(r) != key(row)]
    rows.append(row)
    settings = {k: getattr(args, k) for k in ("batch", "prompt_words", "completion_words", "seq", "steps", "warmup")}
    return write_results(name, {"settings": settings, "rows": rows, "checks": checks(rows)}, args.results)

if __name__ == "__main__":
    main()
