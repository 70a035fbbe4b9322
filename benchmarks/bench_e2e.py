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
through SDPA, except where SDPA would skip part of the model's math (``HF_ATTENTION``: Gemma 2's attention
soft-capping runs in transformers' eager attention).

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
import functools
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.harness import RESULTS, environment

PEAK_BF16_TFLOPS = 989.0
#: Liger-Kernel's patch per ``model_type`` (liger-kernel 0.8.5 names), applied to the transformers classes
#: before the model is built.
LIGER_PATCH = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2",
               "gemma": "apply_liger_kernel_to_gemma", "mistral": "apply_liger_kernel_to_mistral",
               "qwen3": "apply_liger_kernel_to_qwen3", "gemma2": "apply_liger_kernel_to_gemma2"}

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


# Public config.json shapes (no network on the GPU machine); transformers 5 field names.
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
}


#: Set in a worker from ``--flce-strategy``: the strategy ligermodels' loss head uses (None: the model's default).
FLCE_STRATEGY: str | None = None


# ------------------------------------------------------------------------------------------ flops
def attended_pairs(seq: int, window: int | None) -> float:
    """(query, key) pairs one causal attention computes per sequence: seq^2 / 2, or with a sliding window
    shorter than the sequence seq * window - window^2 / 2 (the same at window = seq)."""
    if window is None or window >= seq:
        return seq * seq / 2
    return seq * window - window * window / 2


def step_flops(model: str, batch: int, seq: int) -> float:
    """Flops of one training step: 6 x matmul parameters x tokens + causal attention (fwd + bwd).

    Attention is 4 * D flops per (query, key) pair and head forward (scores and the value product), three
    times that forward + backward, over each layer's attended pairs (its sliding window, if any, from the
    ligermodels config of the model: Gemma 2's alternate layers, Qwen layers marked sliding). The q/k head
    norms, soft-capping and the other elementwise work are not counted."""
    from ligermodels.families import config_from_hf

    d = MODELS[model]
    h, layers, v = d["hidden_size"], d["num_hidden_layers"], d["vocab_size"]
    hq, hkv = d["num_attention_heads"], d["num_key_value_heads"]
    hd = d.get("head_dim", h // hq)
    per_layer = h * (hq + 2 * hkv) * hd + hq * hd * h + 3 * h * d["intermediate_size"]
    matmul_params = layers * per_layer + v * h  # the output head is a matmul, tied or not
    tokens = batch * seq
    windows = config_from_hf(d).layer_windows  # one entry per layer, None = full attention
    attention = 3 * 4 * batch * hq * hd * sum(attended_pairs(seq, w) for w in windows)
    return 6 * matmul_params * tokens + attention


# ------------------------------------------------------------------------------------ one worker
def base_row(impl: str, model: str, batch: int, seq: int, ac: bool) -> dict:
    """The identifying fields of a result row. ``ligermodels+compile`` is impl "ligermodels", variant "compile"
    (our model under ``torch.compile``); ``ligermodels+graph`` is variant "graph" (the whole step replayed
    from a CUDA graph, :class:`ligermodels.train.cuda_graph.CUDAGraphStep`); ``ligermodels+master`` is variant
    "master" (fp32 master weights in the optimiser, bf16 parameters: the precision of ligermodels.train);
    the transformers impls keep the issue's names."""
    variant = impl.split("+", 1)[1] if impl.startswith("ligermodels+") or impl.endswith("+compile") else "eager"
    name = "ligermodels" if impl.startswith("ligermodels") else impl
    return {"impl": name, "variant": variant, "model": model, "batch": batch, "seq": seq,
            "activation_checkpointing": ac}


def build(impl: str, model: str, activation_checkpointing: bool):
    """(step-loss callable (ids, labels) -> loss, parameters) for one implementation, on the GPU in bf16."""
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
        fn = functools.partial(m.loss, strategy=FLCE_STRATEGY) if FLCE_STRATEGY else m.loss
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


def measure(impl: str, model: str, batch: int, seq: int, steps: int, warmup: int, ac: bool, profile: str | None
            ) -> dict:
    """Time ``steps`` training steps of one implementation; returns the result row."""
    from benchmarks.harness import matmul_tflops

    row = base_row(impl, model, batch, seq, ac)
    attention = hf_attention(MODELS[model]["model_type"])
    if not impl.startswith("ligermodels") and attention != "sdpa":  # shown with the row (report._e2e_variant)
        row["hf_attention"] = attention
    tflops = matmul_tflops()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fn, params = build(impl, model, ac)
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


# Kernel-name patterns -> category, first match wins.
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
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    per_cat: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if (t <= 0 or e.key.startswith(("ProfilerStep", "Optimizer.")) or "#" in e.key
                or e.device_type != torch.autograd.DeviceType.CUDA):
            continue  # user annotations (Optimizer.step#AdamW.step) span kernels counted on their own
        t = t / 2 / 1e3  # ms per step
        cat = next((c for c, pat in CATEGORIES if re.search(pat, e.key, re.I)), "other elementwise/reductions")
        per_cat[cat] = per_cat.get(cat, 0.0) + t
        kernels[e.key] = kernels.get(e.key, 0.0) + t
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
        global FLCE_STRATEGY
        FLCE_STRATEGY = args.flce_strategy
        impl, model, batch = args.worker
        row = measure(impl, model, int(batch), args.seq, args.steps, args.warmup, args.ac, args.profile_to)
        if FLCE_STRATEGY and impl.startswith("ligermodels"):
            row["flce_strategy"] = FLCE_STRATEGY
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
