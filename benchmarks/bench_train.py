"""What users run, side by side (issue 18): ``python -m ligermodels.train`` against ``transformers.Trainer``
(plain, ``use_liger_kernel=True``, ``torch_compile=True``) on the same rows, precision and shape.

Every implementation trains the same model shape from random init (the public config.json shapes of
``benchmarks.bench_e2e.MODELS``) on the same packed rows: ``WORK/data.jsonl`` holds random-word
documents of 200-3000 words (``--doc-words``), tokenized by a word-level tokenizer that fills the
model's vocabulary and packed by ``ligermodels.data.PackedRows`` (seed 0) into rows of ``--seq``
tokens, position ids restarting at each document. ligermodels.train reads them itself; the Trainer
gets row ``i`` as dataset item ``i`` with a sequential sampler, so step ``k`` of every implementation
trains on rows ``k*B .. k*B + B - 1``, and its labels (-100 on each document's first token) and
position ids. transformers builds its packed-sequence attention mask from those position ids
(``masking_utils.find_packed_sequence_indices``), so both sides attend within documents only.

Precision regime, the same everywhere: fp32 master weights, bf16 compute, AdamW (betas 0.9/0.95,
eps 1e-8, weight decay 0.1 on matrices; lr 1e-5 constant, no warmup), gradient clipping at 1.0.
ligermodels.train runs with its CUDA defaults (``--save-every 0``); the Trainer with ``bf16=True``
(fp32 parameters under bf16 autocast) and ``optim="adamw_torch_fused"``, attending through SDPA (eager for
Gemma 2, whose attention soft-capping SDPA cannot express: ``bench_e2e.HF_ATTENTION``); ``use_liger_kernel``
patches the model by its ``model_type`` (liger-kernel's own table: Llama, Qwen2, Qwen3, Gemma, Gemma 2, ...).
Each run is its own process.

Per run: ``tokens_per_s`` (median over the steps after ``--warmup`` of all input tokens / step time,
the step time being ligermodels.train's own per-step figure, or the time between the Trainer's
consecutive ``on_step_end`` callbacks after a device sync), ``peak_mem_gb``
(``max_memory_allocated``, whole run), and ``losses`` (every step's loss, to compare the runs'
numbers). ``ligermodels-vocab`` is the same run with ``--loss-strategy vocab`` (no fp32 vocab x hidden
gradient buffer in the loss head: less memory at large vocabularies, one more GEMM).
``ligermodels-causal`` is the same run attending across whole rows (``--attention causal``):
the step's cost of attending within documents. ``bare`` is the same model's training step alone
(``benchmarks.bench_e2e``'s ligermodels step with the training loop's optimiser: bf16 parameters,
fp32 master weights, no data loader, no document mask, no clipping, no logging) on random tokens,
the loop's upper bound.

    python -m benchmarks.bench_train --out /tmp/bt --runs qwen2-1.5b:4 llama-1b:8 gemma-2b:4 qwen2-1.5b:8
    python -m benchmarks.bench_train --out /tmp/bt --runs qwen3-1.7b:4 gemma2-2b:4 --tag n4
    python -m benchmarks.bench_train --out /tmp/bt --runs qwen2-1.5b:4 --impls ligermodels --profile

Writes ``results/train-<gpu>-<date><tag>.json`` (the README reads each shape from its newest file).
``--profile`` adds ligermodels.train's own ``--profile`` table (GPU time per category, host gaps)
under ``results/profiles``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPLS = ("ligermodels", "ligermodels-causal", "ligermodels-vocab", "hf", "hf+liger", "hf+compile", "bare")
HF_IMPLS = ("hf", "hf+liger", "hf+compile")
SEED = 0
LR = 1e-5


# ------------------------------------------------------------------------------------------ inputs
def write_inputs(work: str, model: str, tokens: int, doc_words: tuple[int, int]) -> tuple[str, str]:
    """WORK/<model>/model (config.json + word-level tokenizer) and WORK/<model>/data.jsonl (>= ``tokens``)."""
    from benchmarks.bench_e2e import MODELS
    from benchmarks.bench_fsdp import SPECIALS, write_model_dir

    config = {**MODELS[model], "bos_token_id": 2, "eos_token_id": 3}
    config["max_position_embeddings"] = max(config.get("max_position_embeddings", 0), 8192)
    directory = os.path.join(work, model)
    model_dir, data = os.path.join(directory, "model"), os.path.join(directory, "data.jsonl")
    write_model_dir(model_dir, config)
    rng = random.Random(SEED)
    total = 0
    with open(data, "w") as f:
        while total < tokens:
            n = rng.randint(*doc_words)
            f.write(json.dumps({"text": " ".join(f"w{rng.randrange(len(SPECIALS), config['vocab_size'])}"
                                                 for _ in range(n))}) + "\n")
            total += n + 2  # BOS + words + EOS
    return model_dir, data


def packed_rows(model_dir: str, data: str, seq: int):
    """The rows ligermodels.train reads for ``--model model_dir --data data --seq-len seq --seed 0``."""
    from ligermodels.data import PackedRows, read_jsonl, special_token_ids, tokenize
    from ligermodels.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    bos, eos = special_token_ids(tokenizer, model_dir)
    return PackedRows(tokenize(read_jsonl(data), tokenizer, bos, eos), seq, SEED)


# ------------------------------------------------------------------------------------------ workers
def run_ligermodels(args, model_dir: str, data: str, batch: int, out: str, profile: bool,
                    attention: str = "documents", loss_strategy: str = "tokens") -> dict:
    """``python -m ligermodels.train`` as users run it; the row from its metrics.jsonl."""
    cmd = [sys.executable, "-m", "ligermodels.train", "--model", model_dir, "--from-scratch", "--data", data,
           "--out", out, "--overwrite", "--seq-len", str(args.seq), "--batch-size", str(batch),
           "--steps", str(args.steps), "--save-every", "0", "--log-every", "10", "--lr", str(LR),
           "--lr-schedule", "constant", "--warmup-steps", "0", "--seed", str(SEED), "--ac", args.ac,
           "--attention", attention, "--loss-strategy", loss_strategy]
    if profile:
        cmd += ["--profile"]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    sys.stdout.write(res.stdout[-3000:])
    if res.returncode != 0:
        return {"error": res.stderr[-2000:], "oom": "out of GPU memory" in res.stderr, "wall_s": round(wall, 1)}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    row = summarize([batch * args.seq / m["tokens_per_s"] for m in metrics], [m["loss"] for m in metrics],
                    max(m["peak_mem_gb"] for m in metrics), batch * args.seq, args.warmup)
    row["wall_s"] = round(wall, 1)
    if profile and os.path.isfile(os.path.join(out, "profile.txt")):
        with open(os.path.join(out, "profile.txt")) as f:
            row["profile"] = f.read()
    return row


def hf_worker(args) -> dict:
    """(In a child process.) transformers.Trainer on the same rows; the row."""
    import torch
    import transformers

    from benchmarks.bench_e2e import MODELS, hf_attention

    rows = packed_rows(args.model_dir, args.data, args.seq)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return args.steps * args.batch

        def __getitem__(self, i):
            ids, labels, positions = (t[0] for t in rows.rows(i, 1))
            return {"input_ids": ids, "labels": labels, "position_ids": positions}

    class InOrder(transformers.Trainer):
        def _get_train_sampler(self, *a, **k):  # row i at position i: the rows ligermodels.train reads
            return torch.utils.data.SequentialSampler(self.train_dataset)

    times, losses = [], []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *a, **k):
            torch.cuda.synchronize()
            times.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    config = transformers.AutoConfig.for_model(**{**MODELS[args.model], "bos_token_id": 2, "eos_token_id": 3})
    torch.manual_seed(SEED)
    with torch.device("cuda"):
        # SDPA, or what computes the model's whole math where SDPA would not (Gemma 2: eager; bench_e2e.HF_ATTENTION)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                              attn_implementation=hf_attention(config.model_type))
    model.config.use_cache = False
    targs = transformers.TrainingArguments(
        output_dir=os.path.join(args.out, "trainer"), per_device_train_batch_size=args.batch, max_steps=args.steps,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.1, adam_beta1=0.9,
        adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0, bf16=True, optim="adamw_torch_fused",
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=SEED, data_seed=SEED,
        dataloader_num_workers=2, dataloader_pin_memory=True, remove_unused_columns=False,
        use_liger_kernel=args.worker == "hf+liger", torch_compile=args.worker == "hf+compile",
        gradient_checkpointing=args.ac != "none")
    torch.cuda.reset_peak_memory_stats()
    trainer = InOrder(model=model, args=targs, train_dataset=Rows(), callbacks=[Clock()])
    start = time.perf_counter()
    trainer.train()
    step_s = [b - a for a, b in zip([start, *times], times, strict=False)]
    row = summarize(step_s, losses, torch.cuda.max_memory_allocated() / 1e9, args.batch * args.seq, args.warmup)
    if model.config._attn_implementation != "sdpa":  # shown with the row (report.train_table)
        row["hf_attention"] = model.config._attn_implementation
    return row


def bare_worker(args) -> dict:
    """(In a child process.) bench_e2e's ligermodels step with the loop's fp32-master optimiser."""
    from benchmarks import bench_e2e

    row = bench_e2e.measure("ligermodels+master", args.model, args.batch, args.seq, args.steps - args.warmup,
                            args.warmup, args.ac != "none", None)
    return {"tokens_per_s": row["tokens_per_s"], "step_ms": row["step_ms"], "peak_mem_gb": row["peak_mem_gb"],
            "mfu": row["mfu"]}


def run_worker(args, impl: str, model: str, batch: int, model_dir: str, data: str, out: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.bench_train", "--worker", impl, "--model", model, "--batch",
           str(batch), "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--ac", args.ac, "--model-dir", model_dir, "--data", data, "--out", out]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    if res.returncode != 0 or not lines:
        tail = res.stderr[-2000:]
        return {"error": tail, "oom": "OutOfMemoryError" in tail or "out of memory" in tail, "wall_s": round(wall, 1)}
    return {**json.loads(lines[-1]), "wall_s": round(wall, 1)}


def summarize(step_s: list[float], losses: list[float], peak_gb: float, tokens_per_step: int, warmup: int) -> dict:
    timed = step_s[warmup:]
    if not timed:
        return {"error": f"no timed steps ({len(step_s)} steps, warm-up {warmup})"}
    return {"tokens_per_s": round(tokens_per_step / statistics.median(timed), 1),
            "step_ms": round(1e3 * statistics.median(timed), 2), "peak_mem_gb": round(peak_gb, 2),
            "steps": len(step_s), "steps_timed": len(timed), "losses": [round(v, 5) for v in losses]}


def child_env() -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# ------------------------------------------------------------------------------------------ targets
#: Issue 18's targets: ours against the fastest transformers variant, Trainer + Liger's memory, the bare step.
TARGETS = {"speed_vs_fastest_hf": 1.15, "memory_vs_hf_liger": 0.75, "speed_vs_bare": 0.90,
           "document_attention_cost": 0.03}


def targets(rows: list[dict]) -> dict:
    """For one shape's rows: each target's measured ratio and whether it holds (None where a run is missing)."""
    by = {r["impl"]: r for r in rows if "error" not in r}
    ours = by.get("ligermodels")
    hf = [by[i] for i in HF_IMPLS if i in by]
    out = {}
    if ours and hf:
        fastest = max(hf, key=lambda r: r["tokens_per_s"])
        ratio = ours["tokens_per_s"] / fastest["tokens_per_s"]
        out["speed_vs_fastest_hf"] = {"ratio": round(ratio, 3), "fastest": fastest["impl"],
                                      "holds": ratio >= TARGETS["speed_vs_fastest_hf"]}
    if ours and "hf+liger" in by:
        ratio = ours["peak_mem_gb"] / by["hf+liger"]["peak_mem_gb"]
        out["memory_vs_hf_liger"] = {"ratio": round(ratio, 3), "holds": ratio <= TARGETS["memory_vs_hf_liger"]}
    if ours and "ligermodels-causal" in by:  # what attending within documents costs the step
        cost = by["ligermodels-causal"]["tokens_per_s"] / ours["tokens_per_s"] - 1
        out["document_attention_cost"] = {"fraction": round(cost, 4),
                                          "holds": cost <= TARGETS["document_attention_cost"]}
    if ours and "bare" in by:
        ratio = ours["tokens_per_s"] / by["bare"]["tokens_per_s"]
        out["speed_vs_bare"] = {"ratio": round(ratio, 3), "holds": ratio >= TARGETS["speed_vs_bare"]}
    return out


# ------------------------------------------------------------------------------------------ main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="work directory (inputs, runs)")
    ap.add_argument("--runs", nargs="+", default=["qwen2-1.5b:4"], help="MODEL:BATCH, MODEL from bench_e2e.MODELS")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="leading steps left out of the median")
    ap.add_argument("--ac", choices=("none", "full", "selective"), default="none")
    ap.add_argument("--doc-words", default="200,3000", help="document length range in words, LOW,HIGH")
    ap.add_argument("--profile", action="store_true", help="ligermodels.train --profile; table under results/profiles")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run")
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--tag", default="", help="suffix of the results file name (one file per call)")
    ap.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        row = hf_worker(args) if args.worker in HF_IMPLS else bare_worker(args)
        print(json.dumps(row))
        return
    from benchmarks.harness import environment

    env = environment()
    low, high = (int(v) for v in args.doc_words.split(","))
    rows, checks = [], {}
    for run in args.runs:
        model, batch = run.split(":")
        batch = int(batch)
        need = args.steps * batch * args.seq
        model_dir, data = write_inputs(os.path.abspath(args.out), model, int(need * 1.1) + args.seq, (low, high))
        shape_rows = []
        for impl in args.impls:
            out = os.path.join(os.path.abspath(args.out), model, f"{impl}-b{batch}")
            print(f"=== {impl} {model} b{batch} x {args.seq} ({time.strftime('%T')})", flush=True)
            if impl.startswith("ligermodels"):
                row = run_ligermodels(args, model_dir, data, batch, out, args.profile and impl == "ligermodels",
                                      "causal" if impl == "ligermodels-causal" else "documents",
                                      "vocab" if impl == "ligermodels-vocab" else "tokens")
            else:
                row = run_worker(args, impl, model, batch, model_dir, data, out)
            row = {"impl": impl, "model": model, "batch": batch, "seq": args.seq, "ac": args.ac, **row}
            profile = row.pop("profile", None)
            if profile:
                name = f"train-profile-{model}-b{batch}.txt"
                os.makedirs(os.path.join(args.results, "profiles"), exist_ok=True)
                with open(os.path.join(args.results, "profiles", name), "w") as f:
                    f.write(profile)
                row["profile_file"] = f"profiles/{name}"
            print({k: v for k, v in row.items() if k not in ("losses", "error")}, row.get("error", "")[-600:],
                  flush=True)
            shape_rows.append(row)
        rows += shape_rows
        checks[f"{model}:b{batch}"] = targets(shape_rows)
        print(json.dumps(checks[f"{model}:b{batch}"]), flush=True)
        write(args, env, rows, checks, low, high)  # after every shape: a later one that runs out of time loses nothing


def write(args, env: dict, rows: list[dict], checks: dict, low: int, high: int) -> None:
    from benchmarks.harness import write_results

    payload = {"benchmark": "training loops users run (issue 18): ligermodels.train vs transformers.Trainer",
               "settings": {"seq": args.seq, "steps": args.steps, "warmup_steps_dropped": args.warmup,
                            "ac": args.ac, "doc_words": [low, high], "lr": LR, "lr_schedule": "constant",
                            "precision": "fp32 master weights, bf16 compute", "grad_clip": 1.0},
               "targets": TARGETS, "checks": checks, "rows": rows}
    gpu = (env.get("gpu") or "cpu").replace(" ", "_")
    path = write_results(f"train-{gpu}-{env['date']}{args.tag}", payload, out_dir=args.results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
