"""What users run, side by side: ``python -m ligermodels.train`` against ``transformers.Trainer``
(plain, ``use_liger_kernel=True``, ``torch_compile=True``) on the same rows, precision and shape.

Every implementation trains the same model shape from random init (the public config.json shapes of
``benchmarks.common.MODELS``) on the same packed rows: ``WORK/data.jsonl`` holds random-word
documents of 200-3000 words (``--doc-words``), tokenized by a word-level tokenizer that fills the
model's vocabulary and packed by ``ligermodels.train.data.PackedRows`` (seed 0) into rows of ``--seq``
tokens, position ids restarting at each document. ligermodels.train reads them itself; the Trainer
gets row ``i`` as dataset item ``i`` with a sequential sampler, so step ``k`` of every implementation
trains on rows ``k*B .. k*B + B - 1``, and its labels (-100 on each document's first token) and
position ids. transformers builds its packed-sequence attention mask from those position ids
(``masking_utils.find_packed_sequence_indices``), so both sides attend within documents only.

Precision regime, the same everywhere: fp32 master weights, bf16 compute, AdamW (betas 0.9/0.95,
eps 1e-8, weight decay 0.1 on matrices; lr 1e-5 constant, no warmup), gradient clipping at 1.0.
ligermodels.train runs with its CUDA defaults (``--save-every 0``); the Trainer with ``bf16=True``
(fp32 parameters under bf16 autocast) and ``optim="adamw_torch_fused"``, attending through SDPA (eager for
Gemma 2, whose attention soft-capping SDPA cannot express: ``benchmarks.common.HF_ATTENTION``); ``use_liger_kernel``
patches the model by its ``model_type`` (liger-kernel's own table: Llama, Qwen2, Qwen3, Gemma, Gemma 2, ...).
Each run is its own process.

Per run: ``tokens_per_s`` (median over the steps after ``--warmup`` of all input tokens / step time,
the step time being ligermodels.train's own per-step figure, or the time between the Trainer's
consecutive ``on_step_end`` callbacks after a device sync), ``peak_mem_gb``
(``max_memory_allocated``, whole run), and ``losses`` (every step's loss, to compare the runs'
numbers). ``ligermodels`` runs the CLI's default loss head (``--loss-strategy auto``: ``tokens`` unless its fp32
vocabulary x hidden buffer takes 1/32 of the GPU's memory); ``ligermodels-tokens`` / ``ligermodels-vocab`` force one
(``vocab``: no fp32 vocab x hidden gradient buffer in the loss head, less memory, one more GEMM).
``ligermodels-causal`` is the same run attending across whole rows (``--attention causal``):
the step's cost of attending within documents. ``bare`` is the same model's training step alone
(``benchmarks.common.measure``, bench_e2e's ligermodels step, with the training loop's optimiser: bf16 parameters,
fp32 master weights, no data loader, no document mask, no clipping, no logging) on random tokens,
the loop's upper bound.

    python -m benchmarks.bench_train --out /tmp/bt --runs qwen2-1.5b:4 llama-1b:8 gemma-2b:4 qwen2-1.5b:8
    python -m benchmarks.bench_train --out /tmp/bt --runs qwen3-1.7b:4 gemma2-2b:4 --tag n4
    python -m benchmarks.bench_train --out /tmp/bt --runs qwen2-1.5b:4 --impls ligermodels --profile

Writes ``results/train-<gpu>-<date><tag>.json`` (docs/performance.md shows each shape from its newest file).
``--profile`` adds ligermodels.train's own ``--profile`` table (GPU time per category, host gaps, memory at
the peak) under ``results/profiles``; the profiled steps are left out of the median.

LoRA (``--lora``, or names of :data:`LORA_IMPLS` in ``--impls``; never mixed with the runs above): rank 16,
alpha 32, dropout 0 on all seven projections (q, k, v, o, gate, up, down), the frozen base in bf16, the
adapters fp32, trained with the same AdamW, clipping and rows (lr 1e-4 constant, :data:`LORA_LR`), bf16
compute. A LoRA base must be read from disk (``--from-scratch`` with LoRA needs ``--merge``), so every LoRA
run of a shape loads the same checkpoint, ``WORK/<model>/base``: the shape's random init
(``CausalLM.init_weights``, seed 0) written in bf16 by ``save_hf`` in a process of its own, once, and reused
while ``WORK/<model>/base.json`` records the same config (Qwen2-7B: 15 GB, so one per shape and work
directory). Its A's differ between the implementations (each draws its own), its B's are zero, so the
first step's loss is the same base loss on both sides.

* ``ligermodels-lora``: ``python -m ligermodels.train --model WORK/<model>/base --lora-rank 16 --lora-alpha 32
  --lora-dropout 0 --lora-targets q,k,v,o,gate,up,down`` and the flags above. Its peak memory is the whole
  process's, loading included (the trainer reads the base in fp32 and casts it to bf16 on the GPU).
* ``ligermodels-lora-fp8``: the same with ``--fp8 rowwise`` (the frozen base's GEMMs in FP8, the adapters' bf16).
* ``hf+peft+liger`` / ``hf+peft+compile``: the Trainer (``use_liger_kernel=True`` / ``torch_compile=True``)
  on ``peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16),
  LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=[q_proj, ..., down_proj]))``: PEFT keeps
  the adapters fp32 on a bf16 base, the Trainer's bf16 autocast computes in bf16. Peak memory from the
  loaded model on (the bf16 base resident). ``hf+peft`` (the Trainer alone) runs only when named in ``--impls``.

QLoRA (named in ``--impls``; written to ``results/qlora-lora-<gpu>-<date><tag>.json``, shown by docs/qlora.md):

* ``ligermodels-qlora`` / ``ligermodels-qlora-graph``: ``ligermodels-lora``'s command with ``--quantize nf4`` (and
  ``--cuda-graph``): the base's projections in NF4, quantised on the GPU while loading.
* ``hf+peft+bnb+liger`` / ``hf+peft+bnb+compile`` / ``hf+peft+bnb``: the PEFT Trainers on transformers'
  ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
  bnb_4bit_compute_dtype=torch.bfloat16)`` base (no ``prepare_model_for_kbit_training``, which would cast the
  norms, embeddings and head to fp32); with ``--ac full`` the Trainer's ``gradient_checkpointing``
  (``use_reentrant=False``).

Their targets (:data:`QLORA_TARGETS`): the faster of ours eager and graphed at least 1.5x the fastest of those
Trainers in tokens/s, and at most 0.7x the peak memory of the leanest. ``--max-batch --memory-cap 24`` finds the
largest micro-batch within 24 GB (``torch.cuda.set_per_process_memory_fraction`` in each process).

The LoRA targets (:data:`LORA_TARGETS`, in each shape's ``checks``): tokens/s at least 1.3x the faster of the
two Trainers, peak memory at most 0.7x Trainer + PEFT + Liger's. Written to ``results/lora-<gpu>-<date><tag>.json``,
merged into an existing file of that name (rows by impl and shape, max-batch entries by impl; the checks
computed again from the merged rows), so one shape's impls may be run by several calls with the same
``--results`` and ``--tag``.

``--max-batch`` (LoRA only): the largest micro-batch each implementation runs :data:`MAX_BATCH_STEPS` steps
at, at each ``--runs`` model (``MODEL:START``, the first batch tried). One process per implementation loads
the model once and tries batches in it (:func:`largest_batch`: doubling from START, or halving while START
does not fit, then bisection to the exact boundary), an out-of-memory error ending a try and the memory
freed before the next. ``ligermodels-lora`` runs there through the library, not the CLI (a process start
that loads a 7B model costs ~30 s): ``ligermodels.train``'s own ``parse_args`` on the CLI run's flags,
``load_inputs``, ``build_model``, then per try a fresh ``build_optimizer`` and :func:`train_step` (the
loop's step on one rank, no gradient accumulation). The Trainers' tries each make a Trainer for
``max_steps`` 2 on the model loaded once; under ``torch_compile`` dynamo compiles for the first batch and,
when the batch changes, recompiles as it does (automatic dynamic shapes: once more with a dynamic batch
dimension, which later tries reuse), so the compiled Trainer's memory at a batch may differ a little from
a process compiled for that batch alone.

    python -m benchmarks.bench_train --out /tmp/bt --lora --runs llama-1b:8 qwen2-7b:4 --steps 16
    python -m benchmarks.bench_train --out /tmp/bt --lora --max-batch --runs qwen2-7b:4
    python -m benchmarks.bench_train --out /tmp/bt --impls ligermodels-qlora-graph hf+peft+bnb+liger \\
        hf+peft+bnb+compile --runs llama-3.1-8b:1 llama-3.1-8b:4 --ac full --steps 12 --warmup 4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from benchmarks.common import (
    MODELS,
    RESULTS,
    ROOT,
    child_env,
    environment,
    hf_attention,
    measure,
    write_documents,
    write_model_dir,
    write_results,
)

FULL_IMPLS = ("ligermodels", "ligermodels-causal", "ligermodels-tokens", "ligermodels-vocab", "ligermodels-graph",
              "hf", "hf+liger", "hf+compile", "bare")
#: The LoRA runs: ``--lora`` runs the first three; ``hf+peft`` (the Trainer alone) only when named in --impls.
LORA_IMPLS = ("ligermodels-lora", "hf+peft+liger", "hf+peft+compile", "hf+peft", "ligermodels-lora-graph",
              "ligermodels-lora-fp8", "ligermodels-qlora", "ligermodels-qlora-graph", "hf+peft+bnb+liger",
              "hf+peft+bnb+compile", "hf+peft+bnb")
IMPLS = FULL_IMPLS + LORA_IMPLS
#: What runs without ``--impls``: the loss-head variants only when asked for.
DEFAULT_FULL_IMPLS = tuple(i for i in FULL_IMPLS
                           if i not in ("ligermodels-tokens", "ligermodels-vocab", "ligermodels-graph"))
HF_IMPLS = ("hf", "hf+liger", "hf+compile")
HF_LORA_IMPLS = ("hf+peft+liger", "hf+peft+compile", "hf+peft", "hf+peft+bnb+liger", "hf+peft+bnb+compile",
                 "hf+peft+bnb")
#: QLoRA's rivals: the Trainer + PEFT on transformers' bitsandbytes 4-bit base.
HF_QLORA_IMPLS = ("hf+peft+bnb+liger", "hf+peft+bnb+compile", "hf+peft+bnb")
SEED = 0
LR = 1e-5
#: The LoRA runs' adapters (rank 16 on all seven projections) and learning rate (constant).
LORA = {"rank": 16, "alpha": 32.0, "dropout": 0.0, "targets": ("q", "k", "v", "o", "gate", "up", "down")}
LORA_LR = 1e-4
#: Optimiser steps each --max-batch try runs (the first allocates the optimiser state; the second runs as all later).
MAX_BATCH_STEPS = 2


# ------------------------------------------------------------------------------------------ inputs
def write_inputs(work: str, model: str, tokens: int, doc_words: tuple[int, int]) -> tuple[str, str]:
    """WORK/<model>/model (config.json + word-level tokenizer) and WORK/<model>/data.jsonl (>= ``tokens``)."""
    config = {**MODELS[model], "bos_token_id": 2, "eos_token_id": 3}
    config["max_position_embeddings"] = max(config.get("max_position_embeddings", 0), 8192)
    directory = os.path.join(work, model)
    model_dir, data = os.path.join(directory, "model"), os.path.join(directory, "data.jsonl")
    write_model_dir(model_dir, config)
    write_documents(data, tokens, config["vocab_size"], *doc_words, seed=SEED)
    return model_dir, data


def packed_rows(model_dir: str, data: str, seq: int):
    """The rows ligermodels.train reads for ``--model model_dir --data data --seq-len seq --seed 0``."""
    from ligermodels.tokenizer import load_tokenizer
    from ligermodels.train.data import PackedRows, read_jsonl, special_token_ids, tokenize

    tokenizer = load_tokenizer(model_dir)
    bos, eos = special_token_ids(tokenizer, model_dir)
    return PackedRows(tokenize(read_jsonl(data), tokenizer, bos, eos), seq, SEED)


def _base_record(model_dir: str) -> dict:
    """What ``WORK/<model>/base.json`` records of a base checkpoint: the config it was made from, seed, dtype."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return {"config": json.load(f), "seed": SEED, "dtype": "bfloat16"}


def write_base(model_dir: str, base: str, device: str) -> None:
    """The LoRA runs' frozen base: ``model_dir``'s config at random init (``CausalLM.init_weights`` after
    ``torch.manual_seed(SEED)``, built on ``device``), cast to bf16 and written by ``save_hf`` as an HF
    checkpoint at ``base`` (``model_dir``'s tokenizer files copied along), then ``base + ".json"`` recording
    :func:`_base_record` (written last: a base without it is incomplete and written again)."""
    import torch

    from checkpoints_tools import read_config
    from ligermodels.families import config_from_hf, family_of
    from ligermodels.hf_io import save_hf

    config = config_from_hf(read_config(model_dir))
    torch.manual_seed(SEED)
    with torch.device(device):
        model = family_of(config.model_type).cls(config)
    model.init_weights().to(torch.bfloat16)
    save_hf(model, base, copy_from=model_dir)
    with open(base + ".json", "w") as f:
        json.dump(_base_record(model_dir), f, indent=1)


def ensure_base(work: str, model: str, timeout: int) -> str:
    """``WORK/<model>/base`` (see :func:`write_base`), reused when its record matches the shape's config, else
    written in a child process (on the GPU when there is one; the driver itself never holds GPU memory)."""
    model_dir, base = os.path.join(work, model, "model"), os.path.join(work, model, "base")
    record = base + ".json"
    if os.path.isfile(record) and os.path.isfile(os.path.join(base, "config.json")):
        with open(record) as f:
            if json.load(f) == _base_record(model_dir):
                print(f"reusing the base checkpoint {base}", flush=True)
                return base
    if os.path.exists(record):
        os.remove(record)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "benchmarks.bench_train", "--worker", "base", "--out", base, "--model-dir", model_dir]
    res = run_child(cmd, timeout)
    if res.returncode != 0 or not os.path.isfile(record):
        raise RuntimeError(f"writing the base checkpoint {base} failed (exit {res.returncode}): {res.stderr[-2000:]}")
    print(f"wrote the base checkpoint {base} in {time.perf_counter() - t0:.0f} s", flush=True)
    return base


# ------------------------------------------------------------------------------------------ workers
def train_command(args, impl: str, model_dir: str, data: str, batch: int, out: str, profile: bool = False) -> list[str]:
    """The ``python -m ligermodels.train`` command of a ligermodels impl: ``model_dir`` from scratch, or for
    ``ligermodels-lora`` the base checkpoint ``model_dir`` loaded, with the LoRA flags (:data:`LORA`)."""
    lora = impl.startswith(("ligermodels-lora", "ligermodels-qlora"))
    cmd = [sys.executable, "-m", "ligermodels.train", "--model", model_dir, *([] if lora else ["--from-scratch"]),
           "--data", data, "--out", out, "--overwrite", "--seq-len", str(args.seq), "--batch-size", str(batch),
           "--steps", str(args.steps), "--save-every", "0", "--log-every", "10", "--lr", str(LORA_LR if lora else LR),
           "--lr-schedule", "constant", "--warmup-steps", "0", "--seed", str(SEED), "--ac", args.ac,
           "--attention", "causal" if impl == "ligermodels-causal" else "documents",
           *(["--loss-strategy", impl.split("-")[1]] if impl in ("ligermodels-tokens", "ligermodels-vocab") else []),
           *(["--cuda-graph"] if impl.endswith("-graph") else []),
           *(["--fp8", "rowwise"] if impl.endswith("-fp8") else []),
           *(["--quantize", "nf4"] if impl.startswith("ligermodels-qlora") else [])]
    if lora:  # one set of targets a call (parse_args)
        cmd += lora_flags(lora_modules(MODELS[args.runs[0][0]]))
    return cmd + (["--profile"] if profile else [])


def lora_modules(config: dict) -> tuple[str, ...]:
    """The projections LoRA adapts on a model of Hugging Face config ``config`` (a dict): :data:`LORA`'s seven, or
    on a mixture-of-experts model the attention's four. transformers keeps each layer's experts as stacked
    parameters, not ``nn.Linear`` modules, so PEFT's ``target_modules`` cannot reach them (its
    ``target_parameters`` can, another comparison)."""
    moe = config.get("num_experts") or config.get("num_local_experts")
    return LORA["targets"][:4] if moe else LORA["targets"]


def lora_flags(targets: tuple[str, ...] = LORA["targets"]) -> list[str]:
    """:data:`LORA` as ``ligermodels.train`` flags, on ``targets``."""
    return ["--lora-rank", str(LORA["rank"]), "--lora-alpha", str(LORA["alpha"]), "--lora-dropout",
            str(LORA["dropout"]), "--lora-targets", ",".join(targets)]


def run_ligermodels(args, impl: str, model_dir: str, data: str, batch: int, out: str, profile: bool) -> dict:
    """``python -m ligermodels.train`` as users run it (:func:`train_command`); the row from its metrics.jsonl."""
    cmd = train_command(args, impl, model_dir, data, batch, out, profile)
    t0 = time.perf_counter()
    res = run_child(cmd, args.timeout)
    wall = time.perf_counter() - t0
    sys.stdout.write(res.stdout[-3000:])
    if res.returncode != 0:
        return {"error": res.stderr[-2000:], "oom": "out of GPU memory" in res.stderr, "wall_s": round(wall, 1)}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    profiled = set()
    if profile and os.path.isfile(os.path.join(out, "profile.json")):  # the profiled steps are not timed
        with open(os.path.join(out, "profile.json")) as f:
            profiled = set(json.load(f)["steps"])
    timed = [m for m in metrics if m["step"] not in profiled]
    row = summarize([batch * args.seq / m["tokens_per_s"] for m in timed], [m["loss"] for m in metrics],
                    max(m["peak_mem_gb"] for m in metrics), batch * args.seq, args.warmup)
    row["wall_s"] = round(wall, 1)
    if profiled:
        row["steps_profiled"] = sorted(profiled)
    if profile and os.path.isfile(os.path.join(out, "profile.txt")):
        with open(os.path.join(out, "profile.txt")) as f:
            row["profile"] = f.read()
    return row


def make_trainer(model, args, impl: str, batch: int, steps: int, rows, callbacks=()):
    """A ``transformers.Trainer`` for ``steps`` steps of ``batch`` rows on ``model``: row ``i`` of ``rows``
    (:func:`packed_rows`) as item ``i``, read in order; the settings of the module docstring (lr
    :data:`LORA_LR` for the PEFT impls), Liger-Kernel or torch.compile as ``impl`` names them."""
    import torch
    import transformers

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return steps * batch

        def __getitem__(self, i):
            ids, labels, positions = (t[0] for t in rows.rows(i, 1))
            return {"input_ids": ids, "labels": labels, "position_ids": positions}

    class InOrder(transformers.Trainer):
        def _get_train_sampler(self, *a, **k):  # row i at position i: the rows ligermodels.train reads
            return torch.utils.data.SequentialSampler(self.train_dataset)

    targs = transformers.TrainingArguments(
        output_dir=os.path.join(args.out, "trainer"), per_device_train_batch_size=batch, max_steps=steps,
        learning_rate=LORA_LR if impl in HF_LORA_IMPLS else LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0, bf16=True,
        optim="adamw_torch_fused", logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=SEED,
        data_seed=SEED, dataloader_num_workers=2, dataloader_pin_memory=True, remove_unused_columns=False,
        use_liger_kernel=impl.endswith("+liger"), torch_compile=impl.endswith("+compile"),
        gradient_checkpointing=args.ac != "none", gradient_checkpointing_kwargs={"use_reentrant": False},
        use_cpu=next(model.parameters()).device.type == "cpu")  # a CPU model (tests) stays there
    return InOrder(model=model, args=targs, train_dataset=Rows(), callbacks=list(callbacks))


def peft_model(base: str, device: str, dtype=None, four_bit: bool = False):
    """``peft.get_peft_model`` on the base checkpoint loaded by transformers (bf16 unless ``dtype``) onto
    ``device``: :data:`LORA`'s adapters on ``q_proj`` ... ``down_proj`` (:func:`lora_modules`), drawn after
    ``torch.manual_seed(SEED)``;
    PEFT keeps them fp32 (``autocast_adapter_dtype``). ``four_bit``: QLoRA's base, transformers' bitsandbytes
    ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
    bnb_4bit_compute_dtype=bf16)`` (the projections in NF4; embeddings, norms and head bf16, as ours), without
    ``prepare_model_for_kbit_training`` (which would cast the norms, embeddings and head to fp32)."""
    import peft
    import torch
    import transformers

    model_type = transformers.AutoConfig.from_pretrained(base).model_type
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_use_double_quant=True,
                                            bnb_4bit_compute_dtype=dtype or torch.bfloat16) if four_bit else None
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype or torch.bfloat16,
                                                              attn_implementation=hf_attention(model_type),
                                                              device_map=device, quantization_config=quant)
    model.config.use_cache = False
    torch.manual_seed(SEED)
    config = peft.LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                             target_modules=[f"{t}_proj" for t in lora_modules(model.config.to_dict())],
                             task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def hf_worker(args) -> dict:
    """(In a child process.) transformers.Trainer on the same rows (the PEFT impls: on :func:`peft_model`
    of the base checkpoint ``--model-dir``); the row. Peak memory counts from the loaded model on."""
    import torch
    import transformers

    rows = packed_rows(args.model_dir, args.data, args.seq)
    times, losses = [], []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *a, **k):
            torch.cuda.synchronize()
            times.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    if args.worker in HF_LORA_IMPLS:
        model = peft_model(args.model_dir, "cuda", four_bit=args.worker in HF_QLORA_IMPLS)
    else:
        config = transformers.AutoConfig.for_model(**{**MODELS[args.model], "bos_token_id": 2, "eos_token_id": 3})
        torch.manual_seed(SEED)
        with torch.device("cuda"):
            # SDPA, or what computes the model's whole math where SDPA would not (Gemma 2: eager; HF_ATTENTION)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                                  attn_implementation=hf_attention(config.model_type))
        model.config.use_cache = False
    torch.cuda.reset_peak_memory_stats()
    trainer = make_trainer(model, args, args.worker, args.batch, args.steps, rows, [Clock()])
    start = time.perf_counter()
    trainer.train()
    step_s = [b - a for a, b in zip([start, *times], times, strict=False)]
    row = summarize(step_s, losses, torch.cuda.max_memory_allocated() / 1e9, args.batch * args.seq, args.warmup)
    if model.config._attn_implementation != "sdpa":  # shown with the row (report.train_table)
        row["hf_attention"] = model.config._attn_implementation
    return row


def bare_worker(args) -> dict:
    """(In a child process.) bench_e2e's ligermodels step (:func:`benchmarks.common.measure`) with the loop's
    fp32-master optimiser and loss head."""
    import torch

    from ligermodels.train.parallelize import auto_loss_strategy

    model = MODELS[args.model]  # the loss head ligermodels.train picks by default (--loss-strategy auto)
    strategy = auto_loss_strategy(model["vocab_size"], model["hidden_size"], torch.device("cuda"))
    row = measure("ligermodels+master", args.model, args.batch, args.seq, args.steps - args.warmup, args.warmup,
                  args.ac != "none", None, strategy)
    return {"tokens_per_s": row["tokens_per_s"], "step_ms": row["step_ms"], "peak_mem_gb": row["peak_mem_gb"],
            "mfu": row["mfu"]}


# ------------------------------------------------------------------------------------------ max batch
def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is the device running out of memory (the allocator's error, or cuBLAS failing to
    allocate its workspace), as opposed to a bug a try must not hide."""
    import torch

    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and ("out of memory" in str(e) or "CUBLAS_STATUS_ALLOC_FAILED" in str(e)))


def fits(run: Callable[[int], None], batch: int) -> bool:
    """``run(batch)``; False when it ran out of memory, after the failed try's memory is freed (its
    exception, and the traceback holding its tensors, are gone once the ``except`` block ends)."""
    import torch

    try:
        run(batch)
        ok = True
    except (RuntimeError, torch.OutOfMemoryError) as e:
        if not out_of_memory(e):
            raise
        ok = False
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return ok


def largest_batch(fit: Callable[[int], bool], start: int = 1, limit: int = 1024
                  ) -> tuple[int, int | None, list[dict]]:
    """(largest batch that fits, smallest that does not or None, the tries in order as ``{"batch", "fits"}``).

    ``fit(batch) -> bool``, batches from 1 to ``limit``: ``start``, then doubling while it fits (the last
    doubling capped at ``limit``; halving while it does not, down to 1), then bisection between the largest
    batch that fit and the smallest that did not, to the exact boundary (they differ by 1). Assumes a batch
    that fits means every smaller one does. (0, 1, ...) when batch 1 does not fit; (``limit``, None, ...)
    when ``limit`` fits.
    """
    if not 1 <= start <= limit:
        raise ValueError(f"the first batch to try, {start}, must be between 1 and the limit {limit}")
    tries: list[dict] = []

    def tried(b: int) -> bool:
        ok = fit(b)
        tries.append({"batch": b, "fits": ok})
        return ok

    good, bad = 0, None
    b = start
    if tried(b):
        good = b
        while bad is None and b < limit:
            b = min(2 * b, limit)
            if tried(b):
                good = b
            else:
                bad = b
    else:
        bad = b
        while good == 0 and b > 1:
            b //= 2
            if tried(b):
                good = b
            else:
                bad = b
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        if tried(mid):
            good = mid
        else:
            bad = mid
    return good, bad, tries


def train_step(model, optimizer, rows, start: int, batch: int, targs, device):
    """One optimiser step of ``ligermodels.train``'s loop on one rank with ``--grad-accum 1``: rows
    ``start .. start + batch - 1`` through the loop's own ``forward_backward``, clipping at
    ``--max-grad-norm``, the AdamW step, gradients freed; the loss (a device scalar)."""
    import torch

    from ligermodels.attention import to_device
    from ligermodels.train.data import count_loss_tokens
    from ligermodels.train.objectives import forward_backward

    input_ids, labels, positions = rows.rows(start, batch)
    num_items = to_device(torch.tensor(count_loss_tokens(labels)), device).clamp(min=1)
    loss = forward_backward(model, input_ids, labels, positions, num_items, targs, 1, device)
    optimizer.clip_grad_norm_(targs.max_grad_norm if targs.max_grad_norm > 0 else float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


class LigermodelsTries:
    """``ligermodels-lora``'s --max-batch tries in this process: the model of the CLI run (its flags parsed by
    ``ligermodels.train.parse_args`` and resolved; ``load_inputs`` and ``build_model``, a process group of one)
    built once,
    its frozen base in bf16 on one GPU; each try ``run(batch)`` builds a fresh optimiser (``build_optimizer``:
    fresh adapter moments) and runs :data:`MAX_BATCH_STEPS` :func:`train_step` s.
    ``close()`` leaves the process group."""

    def __init__(self, args, base: str, data: str, impl: str = "ligermodels-lora"):
        import torch

        from ligermodels.train import parse_args
        from ligermodels.train.data import PackedRows, load_inputs
        from ligermodels.train.parallelize import build_model, setup_distributed

        targs = parse_args(train_command(args, impl, base, data, 1,
                                         os.path.join(args.out, "max-batch"))[3:])
        self.rank, self.world, self.device = setup_distributed(targs.device)
        inputs = load_inputs(targs)
        self.targs = targs.resolved(inputs.config.max_position_embeddings)
        self.rows = PackedRows(inputs.documents, self.targs.seq_len, self.targs.seed)
        self.model = build_model(inputs, self.targs, self.rank, self.world, self.device)
        gc.collect()  # the host copy of the checkpoint build_model read, before the first try
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.losses: list[float] = []  # every step's loss, try after try

    def __call__(self, batch: int) -> None:
        import torch

        from ligermodels.train.parallelize import build_optimizer

        optimizer = build_optimizer(self.model, self.targs, self.world)
        try:
            losses = [train_step(self.model, optimizer, self.rows, i * batch, batch, self.targs, self.device)
                      for i in range(MAX_BATCH_STEPS)]
            self.losses += torch.stack(losses).tolist()  # waits for the device: the try has run
        finally:
            optimizer.zero_grad(set_to_none=True)
            del optimizer

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def hf_tries(args, impl: str, device: str = "cuda") -> Callable[[int], None]:
    """A Trainer impl's --max-batch tries in this process: :func:`peft_model` loaded once (``run.model``);
    each try ``run(batch)`` trains it :data:`MAX_BATCH_STEPS` steps with a Trainer of its own
    (:func:`make_trainer`)."""
    import torch

    model = peft_model(args.model_dir, device, four_bit=impl in HF_QLORA_IMPLS)
    rows = packed_rows(args.model_dir, args.data, args.seq)

    def run(batch: int) -> None:
        trainer = make_trainer(model, args, impl, batch, MAX_BATCH_STEPS, rows)
        try:
            trainer.train()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        finally:
            model.zero_grad(set_to_none=True)
            del trainer

    run.model = model
    return run


def max_batch_worker(args) -> dict:
    """(In a child process.) :func:`largest_batch` for ``--worker IMPL`` from ``--batch``, each try in this
    process; ``{"max_batch", "first_oom_batch", "tries"}`` (each try with its peak memory in GB)."""
    import torch

    if args.memory_cap and torch.cuda.is_available():  # a smaller card: the allocator refuses beyond the cap
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap * 1e9 / total))
    tries = (LigermodelsTries(args, args.model_dir, args.data, args.worker)
             if args.worker in ("ligermodels-lora", "ligermodels-qlora") else None)
    run = tries if tries is not None else hf_tries(args, args.worker, "cuda" if torch.cuda.is_available() else "cpu")
    peaks = []

    cuda = torch.cuda.is_available()  # (on the CPU, a test of the search: no memory figures)

    def fit(batch: int) -> bool:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        ok = fits(run, batch)
        peaks.append(round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None)
        print(f"  max-batch {args.worker} {args.model} batch {batch}: {'fits' if ok else 'out of memory'} "
              f"(peak {peaks[-1]} GB)", flush=True)
        return ok

    try:
        good, bad, log = largest_batch(fit, args.batch, args.max_batch_limit)
    finally:
        if tries is not None:
            tries.close()
    return {"max_batch": good, "first_oom_batch": bad,
            "tries": [{**t, "peak_mem_gb": p} for t, p in zip(log, peaks, strict=True)]}


def run_worker(args, impl: str, model: str, batch: int, model_dir: str, data: str, out: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.bench_train", "--worker", impl, "--model", model, "--batch",
           str(batch), "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--ac", args.ac, "--model-dir", model_dir, "--data", data, "--out", out]
    if args.max_batch:
        cmd += ["--max-batch", "--max-batch-limit", str(args.max_batch_limit)]
        if args.memory_cap:
            cmd += ["--memory-cap", str(args.memory_cap)]
    t0 = time.perf_counter()
    res = run_child(cmd, args.timeout)
    wall = time.perf_counter() - t0
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    if res.returncode != 0 or not lines:
        tail = res.stderr[-2000:]
        return {"error": tail, "oom": "OutOfMemoryError" in tail or "out of memory" in tail, "wall_s": round(wall, 1)}
    return {**json.loads(lines[-1]), "wall_s": round(wall, 1)}


def run_child(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` run from the repository root in :func:`benchmarks.common.child_env` (with the tokenizers' own
    threads off), its output captured; stopped after ``timeout`` seconds."""
    return subprocess.run(cmd, cwd=ROOT, env=child_env(TOKENIZERS_PARALLELISM="false"), capture_output=True, text=True,
                          timeout=timeout)


def summarize(step_s: list[float], losses: list[float], peak_gb: float, tokens_per_step: int, warmup: int) -> dict:
    timed = step_s[warmup:]
    if not timed:
        return {"error": f"no timed steps ({len(step_s)} steps, warm-up {warmup})"}
    return {"tokens_per_s": round(tokens_per_step / statistics.median(timed), 1),
            "step_ms": round(1e3 * statistics.median(timed), 2), "peak_mem_gb": round(peak_gb, 2),
            "steps": len(step_s), "steps_timed": len(timed), "losses": [round(v, 5) for v in losses]}


# ------------------------------------------------------------------------------------------ targets
#: The targets: ours against the fastest transformers variant, Trainer + Liger's memory, the bare step.
TARGETS = {"speed_vs_fastest_hf": 1.15, "memory_vs_hf_liger": 0.75, "speed_vs_bare": 0.90,
           "document_attention_cost": 0.03}


#: The mixture-of-experts shapes' targets (speed and memory; their runs go in files of their own).
MOE_TARGETS = {**TARGETS, "speed_vs_fastest_hf": 1.5, "memory_vs_hf_liger": 0.7}


def goals_of(models) -> dict:
    """:data:`MOE_TARGETS` when every model named is a mixture of experts, else :data:`TARGETS`."""
    moe = [bool(MODELS[m].get("num_experts") or MODELS[m].get("num_local_experts")) for m in models]
    return MOE_TARGETS if moe and all(moe) else TARGETS


#: The LoRA targets: ligermodels-lora against the faster Trainer + PEFT, and Trainer + PEFT + Liger's memory.
LORA_TARGETS = {"speed_vs_fastest_peft": 1.3, "memory_vs_peft_liger": 0.7}
#: The QLoRA targets: ligermodels-qlora against the fastest Trainer + PEFT + bitsandbytes and the lowest peak memory
#: of those; Llama-3.1-8B at micro-batch 1 in at most 10 GB (bench_train's rows at batch 1 show it).
QLORA_TARGETS = {"speed_vs_fastest_peft_bnb": 1.5, "memory_vs_peft_bnb": 0.7}


def _speed_memory(by: dict, ours: dict, speed_key: str, rivals: tuple[str, ...], memory_key: str, liger: str,
                  goals: dict) -> dict:
    """``speed_key``: ours / the fastest of ``rivals`` (tokens/s, at least ``goals[speed_key]``), and
    ``memory_key``: ours / ``liger`` (peak memory, at most ``goals[memory_key]``), each where the runs exist."""
    out = {}
    others = [by[i] for i in rivals if i in by]
    if others:
        fastest = max(others, key=lambda r: r["tokens_per_s"])
        ratio = ours["tokens_per_s"] / fastest["tokens_per_s"]
        out[speed_key] = {"ratio": round(ratio, 3), "fastest": fastest["impl"], "holds": ratio >= goals[speed_key]}
    if liger in by:
        ratio = ours["peak_mem_gb"] / by[liger]["peak_mem_gb"]
        out[memory_key] = {"ratio": round(ratio, 3), "holds": ratio <= goals[memory_key]}
    return out


def targets(rows: list[dict]) -> dict:
    """For one shape's rows: each target's measured ratio and whether it holds (None where a run is missing)."""
    by = {r["impl"]: r for r in rows if "error" not in r}
    ours = by.get("ligermodels")
    if not ours:
        return {}
    goals = goals_of([ours["model"]])
    out = _speed_memory(by, ours, "speed_vs_fastest_hf", HF_IMPLS, "memory_vs_hf_liger", "hf+liger", goals)
    if "ligermodels-causal" in by:  # what attending within documents costs the step
        cost = by["ligermodels-causal"]["tokens_per_s"] / ours["tokens_per_s"] - 1
        out["document_attention_cost"] = {"fraction": round(cost, 4),
                                          "holds": cost <= TARGETS["document_attention_cost"]}
    if "bare" in by:
        ratio = ours["tokens_per_s"] / by["bare"]["tokens_per_s"]
        out["speed_vs_bare"] = {"ratio": round(ratio, 3), "holds": ratio >= TARGETS["speed_vs_bare"]}
    return out


def lora_targets(rows: list[dict]) -> dict:
    """For one LoRA shape's rows: :data:`LORA_TARGETS`' measured ratios and whether they hold: ligermodels-lora's
    tokens/s over the faster of hf+peft+liger / hf+peft+compile, its peak memory over hf+peft+liger's (a key
    is absent where a run is missing or failed)."""
    by = {r["impl"]: r for r in rows if "error" not in r}
    ours = by.get("ligermodels-lora")
    out = {} if not ours else _speed_memory(by, ours, "speed_vs_fastest_peft", HF_LORA_IMPLS[:2],
                                            "memory_vs_peft_liger", "hf+peft+liger", LORA_TARGETS)
    if "ligermodels-lora-fp8" in by:  # the frozen base in FP8 (--fp8 rowwise) against the bf16 Trainers
        fp8 = _speed_memory(by, by["ligermodels-lora-fp8"], "speed_vs_fastest_peft", HF_LORA_IMPLS[:2],
                            "memory_vs_peft_liger", "hf+peft+liger", LORA_TARGETS)
        out.update({f"fp8_{k}": v for k, v in fp8.items()})
    qlora = [by[i] for i in ("ligermodels-qlora", "ligermodels-qlora-graph") if i in by]
    if qlora:  # the 4-bit base (the faster of eager and CUDA-graph steps) against Trainer + PEFT + bitsandbytes
        rivals = [i for i in HF_QLORA_IMPLS if i in by]
        leanest = min(rivals, key=lambda i: by[i]["peak_mem_gb"]) if rivals else None
        ours = max(qlora, key=lambda r: r["tokens_per_s"])
        out.update(_speed_memory(by, ours, "speed_vs_fastest_peft_bnb", HF_QLORA_IMPLS, "memory_vs_peft_bnb",
                                 leanest, QLORA_TARGETS))
        if "speed_vs_fastest_peft_bnb" in out:
            out["speed_vs_fastest_peft_bnb"]["ours"] = ours["impl"]
    return out


# ------------------------------------------------------------------------------------------ main
def parse_args(argv=None) -> argparse.Namespace:
    """The flags; a driver call's ``--runs`` and ``--impls`` are checked here (``args.runs`` becomes
    ``[(model, batch)]``, ``args.impls`` the resolved list and ``args.lora`` whether they are the LoRA runs)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="work directory (inputs, base checkpoints, runs)")
    ap.add_argument("--runs", nargs="+", default=["qwen2-1.5b:4"],
                    help="MODEL:BATCH, MODEL from benchmarks.common.MODELS (--max-batch: MODEL[:FIRST BATCH TRIED], "
                         "default 1)")
    ap.add_argument("--impls", nargs="+", choices=IMPLS,
                    help=f"default: {' '.join(DEFAULT_FULL_IMPLS)}; with --lora: {' '.join(LORA_IMPLS[:3])}")
    ap.add_argument("--lora", action="store_true", help="the LoRA runs (rank 16 on all seven projections; on a "
                    "mixture-of-experts model on the attention's four)")
    ap.add_argument("--max-batch", action="store_true",
                    help="LoRA: find each impl's largest micro-batch, in one process per impl")
    ap.add_argument("--max-batch-limit", type=int, default=256, help="the largest micro-batch --max-batch tries")
    ap.add_argument("--memory-cap", type=float, default=None,
                    help="--max-batch: cap each process's GPU memory at this many GB (a 24 GB card: 24), through "
                         "torch.cuda.set_per_process_memory_fraction")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="leading steps left out of the median")
    ap.add_argument("--ac", choices=("none", "selective", "lean", "full"), default="none",  # train.config.AC_MODES
                    help="ligermodels.train's --ac; a Trainer checkpoints every layer whole for any mode but none")
    ap.add_argument("--doc-words", default="200,3000", help="document length range in words, LOW,HIGH")
    ap.add_argument("--profile", action="store_true", help="ligermodels.train --profile; table under results/profiles")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run (--max-batch: per implementation)")
    ap.add_argument("--results", default=RESULTS)
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    ap.add_argument("--worker", choices=(*IMPLS, "base"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return args
    if args.impls is None:
        args.impls = list(LORA_IMPLS[:3] if args.lora or args.max_batch else DEFAULT_FULL_IMPLS)
    lora = [i for i in args.impls if i in LORA_IMPLS]
    full = [i for i in args.impls if i not in LORA_IMPLS]
    if lora and full:
        ap.error(f"--impls mixes full fine-tuning ({' '.join(full)}) and LoRA ({' '.join(lora)}) runs: run them in "
                 "separate calls (they write separate results files)")
    if args.lora and full:
        ap.error(f"--lora runs the LoRA impls ({' '.join(LORA_IMPLS)}), got {' '.join(full)}")
    if args.max_batch and full:
        ap.error(f"--max-batch is for the LoRA impls ({' '.join(LORA_IMPLS)}), got {' '.join(full)}")
    if args.max_batch and any(i.endswith("-graph") for i in args.impls):
        ap.error("--max-batch tries the trainer's step in-process, eagerly: leave out the -graph impls")
    args.lora = bool(lora)
    runs = []
    for run in args.runs:
        model, sep, batch = run.partition(":")
        if model not in MODELS:
            ap.error(f"--runs {run}: unknown model {model!r} (known: {', '.join(MODELS)})")
        if not sep and not args.max_batch:
            ap.error(f"--runs {run}: give MODEL:BATCH")
        if sep and not (batch.isdigit() and int(batch) >= 1):
            ap.error(f"--runs {run}: the batch must be a whole number of at least 1, got {batch!r}")
        runs.append((model, int(batch) if sep else 1))
    args.runs = runs
    if args.lora and len({lora_modules(MODELS[m]) for m, _ in runs}) > 1:
        ap.error("--runs mixes mixture-of-experts and dense models, whose LoRA runs adapt different projections "
                 "(bench_train.lora_modules): run them in separate calls")
    if args.max_batch and not all(1 <= b <= args.max_batch_limit for _, b in runs):
        ap.error(f"--runs: with --max-batch each first batch must be at most --max-batch-limit {args.max_batch_limit}")
    words = args.doc_words.split(",")
    if len(words) != 2 or not all(w.isdigit() for w in words) or not 1 <= int(words[0]) <= int(words[1]):
        ap.error(f"--doc-words must be LOW,HIGH with 1 <= LOW <= HIGH, got {args.doc_words!r}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker == "base":
        import torch

        write_base(args.model_dir, args.out, "cuda" if torch.cuda.is_available() else "cpu")
        return
    if args.worker:
        if args.max_batch:
            row = max_batch_worker(args)
        elif args.worker in HF_IMPLS + HF_LORA_IMPLS:
            row = hf_worker(args)
        else:
            row = bare_worker(args)
        print(json.dumps(row))
        return
    env = environment()
    low, high = (int(v) for v in args.doc_words.split(","))
    work = os.path.abspath(args.out)
    rows, checks, fits = [], {}, []
    for model, batch in args.runs:
        # --max-batch reads rows 0 .. 2 * batch - 1 of an endless stream (it wraps around the data): any data does
        tokens = 16 * args.seq if args.max_batch else int(args.steps * batch * args.seq * 1.1) + args.seq
        model_dir, data = write_inputs(work, model, tokens, (low, high))
        base = ensure_base(work, model, args.timeout) if args.lora else None
        if args.max_batch:
            for impl in args.impls:
                print(f"=== max batch {impl} {model} x {args.seq} from {batch} ({time.strftime('%T')})", flush=True)
                out = os.path.join(work, model, f"{impl}-max-batch")
                found = run_worker(args, impl, model, batch, base, data, out)
                fits.append({"impl": impl, "model": model, "seq": args.seq, "ac": args.ac,
                             "steps_per_try": MAX_BATCH_STEPS, **found,
                             **({"memory_cap_gb": args.memory_cap} if args.memory_cap else {})})
                print({k: v for k, v in fits[-1].items() if k != "error"}, found.get("error", "")[-600:], flush=True)
                write_lora(args, env, [], fits, low, high)
            continue
        shape_rows = []
        for impl in args.impls:
            out = os.path.join(work, model, f"{impl}-b{batch}")
            print(f"=== {impl} {model} b{batch} x {args.seq} ({time.strftime('%T')})", flush=True)
            profile = args.profile and impl.startswith("ligermodels")
            if impl.startswith("ligermodels"):
                row = run_ligermodels(args, impl, base or model_dir, data, batch, out, profile)
            else:
                row = run_worker(args, impl, model, batch, base or model_dir, data, out)
            row = {"impl": impl, "model": model, "batch": batch, "seq": args.seq, "ac": args.ac, **row}
            profile = row.pop("profile", None)
            if profile:
                variant = "" if impl in ("ligermodels", "ligermodels-lora") else "-" + impl.split("-", 1)[1]
                name = f"{'lora' if args.lora else 'train'}-profile-{model}-b{batch}{variant}.txt"
                os.makedirs(os.path.join(args.results, "profiles"), exist_ok=True)
                with open(os.path.join(args.results, "profiles", name), "w") as f:
                    f.write(profile)
                row["profile_file"] = f"profiles/{name}"
            print({k: v for k, v in row.items() if k not in ("losses", "error")}, row.get("error", "")[-600:],
                  flush=True)
            shape_rows.append(row)
            # written after every run: a later one that runs out of time loses nothing
            if args.lora:
                write_lora(args, env, rows + shape_rows, [], low, high)
            else:
                checks[f"{model}:b{batch}"] = targets(shape_rows)
                write(args, env, rows + shape_rows, checks, low, high)
        rows += shape_rows
        if args.lora:  # the checks of the file's rows of this shape (other calls may have run other impls)
            print(json.dumps(write_lora(args, env, rows, [], low, high)[f"{model}:b{batch}"]), flush=True)
        else:
            print(json.dumps(checks[f"{model}:b{batch}"]), flush=True)


def write(args, env: dict, rows: list[dict], checks: dict, low: int, high: int) -> None:
    payload = {"benchmark": "training loops users run: ligermodels.train vs transformers.Trainer",
               "settings": {"seq": args.seq, "steps": args.steps, "warmup_steps_dropped": args.warmup,
                            "ac": args.ac, "doc_words": [low, high], "lr": LR, "lr_schedule": "constant",
                            "precision": "fp32 master weights, bf16 compute", "grad_clip": 1.0},
               "targets": goals_of({r["model"] for r in rows}), "checks": checks, "rows": rows}
    gpu = (env.get("gpu") or "cpu").replace(" ", "_")
    path = write_results(f"train-{gpu}-{env['date']}{args.tag}", payload, out_dir=args.results)
    print(f"wrote {path}")


def lora_settings(args, low: int, high: int) -> dict:
    """The settings a LoRA results file records for its rows."""
    return {"seq": args.seq, "steps": args.steps, "warmup_steps_dropped": args.warmup, "ac": args.ac,
            "doc_words": [low, high], "lr": LORA_LR, "lr_schedule": "constant", "grad_clip": 1.0,
            "lora": {**LORA, "targets": list(lora_modules(MODELS[args.runs[0][0]]))},
            "precision": ("frozen NF4 base (QLoRA: block 64, double-quantised maxima; embeddings, norms and head bf16)"
                          if any(i.startswith("ligermodels-qlora") or i in HF_QLORA_IMPLS for i in args.impls)
                          else "frozen bf16 base") + ", fp32 adapters (AdamW, weight decay 0.1), bf16 compute",
            "base": f"random init, seed {SEED}, bf16, written once"}


def merge_lora_results(old: dict, rows: list[dict], fits: list[dict], settings: dict, where: str) -> dict:
    """``old`` (a LoRA results file's content, or {}) with ``rows`` replacing its rows of the same (impl,
    model, batch, ac) and ``fits`` its max-batch entries of the same (impl, model, seq, ac); the checks
    (:func:`lora_targets`) computed again for every shape from the merged rows, so one shape's impls may be
    run by several calls into one file. Rows measured under other ``settings`` than the file's are refused
    (naming ``where``): one file's rows are one comparison."""
    out = dict(old)
    if rows:
        if old.get("rows") and old.get("settings") != settings:
            raise ValueError(f"{where} holds runs with other settings ({old.get('settings')}; these: {settings}): "
                             "pass another --tag")

        def shape(r: dict) -> tuple:
            return r["impl"], r["model"], r["batch"], r.get("ac")

        out["rows"] = [r for r in old.get("rows", []) if shape(r) not in {shape(n) for n in rows}] + rows
        out["settings"] = settings
        shapes = dict.fromkeys(f"{r['model']}:b{r['batch']}" for r in out["rows"])
        out["checks"] = {s: lora_targets([r for r in out["rows"] if f"{r['model']}:b{r['batch']}" == s])
                         for s in shapes}
    if fits:
        def key(f: dict) -> tuple:
            return f["impl"], f["model"], f["seq"], f["ac"]

        out["max_batch"] = [f for f in old.get("max_batch", []) if key(f) not in {key(n) for n in fits}] + fits
    out.setdefault("rows", [])
    out["benchmark"] = "LoRA training loops users run: ligermodels.train --lora-rank vs transformers.Trainer + PEFT"
    qlora = any(r["impl"].startswith("ligermodels-qlora") or r["impl"] in HF_QLORA_IMPLS for r in out["rows"])
    out["targets"] = {**LORA_TARGETS, **(QLORA_TARGETS if qlora else {})}
    return out


def write_lora(args, env: dict, rows: list[dict], fits: list[dict], low: int, high: int) -> dict:
    """Merge into ``results/lora-<gpu>-<date><tag>.json`` (:func:`merge_lora_results`), ``qlora-lora-...`` when the
    run compares the 4-bit impls (docs/qlora.md shows them), or ``fp8-lora-...`` when it compares
    ``ligermodels-lora-fp8`` (docs/fp8.md shows it; the LoRA tables keep their bf16 comparisons); its checks."""
    gpu = (env.get("gpu") or "cpu").replace(" ", "_")
    prefix = ("qlora-" if any(i.startswith("ligermodels-qlora") or i in HF_QLORA_IMPLS for i in args.impls)
              else "fp8-" if "ligermodels-lora-fp8" in args.impls else "")
    name = f"{prefix}lora-{gpu}-{env['date']}{args.tag}"
    path = os.path.join(args.results, name + ".json")
    old = {}
    if os.path.isfile(path):
        with open(path) as f:
            old = {k: v for k, v in json.load(f).items() if k not in env}
    payload = merge_lora_results(old, rows, fits, lora_settings(args, low, high), path)
    print(f"wrote {write_results(name, payload, out_dir=args.results)}")
    return payload["checks"] if rows else {}


if __name__ == "__main__":
    main()
