"""FP8 training against bf16, both through ``python -m ligermodels.train`` on one GPU: speed, and the loss curve.

``speed``: Llama-3.1-8B's shape (``benchmarks.bench_scale.LLAMA_3_1_8B``) with ``--layers`` decoder layers (cut to fit
one GPU with fp32 master weights and AdamW), random init, random-word documents, seq ``--seq``, micro-batch
``--batch``; one run per mode (``--modes``: ``bf16`` and the ``--fp8`` modes), ``--steps`` steps, tokens/s the median
after ``--warmup``. Target (:data:`TARGETS`): ``--fp8 rowwise`` at >= 1.3x bf16's tokens/s.

``curve``: the numerics. The built-in demo's corpus (additions and templated sentences: structure a model learns,
``ligermodels.train.demo.corpus``), its character tokenizer, and a Llama of :data:`CURVE_MODEL`'s shape (~85M
parameters) trained from the same init for ``--curve-steps`` steps in bf16 and in each FP8 mode, same rows. The
final loss is the mean of the last 50 steps' losses; target: FP8's within 1% of bf16's (torchtitan's criterion).

Written to ``results/fp8-<gpu>-<date><tag>.json``; docs/fp8.md shows it (``python -m benchmarks.report``).

    python -m benchmarks.bench_fp8 --out /tmp/bf --layers 8 --batch 2
    python -m benchmarks.bench_fp8 --out /tmp/bf --only curve --curve-steps 600
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks.bench_scale import LLAMA_3_1_8B
from benchmarks.bench_train import run_child, summarize
from benchmarks.common import environment, write_data, write_model_dir, write_results
from ligermodels.train.config import AC_MODES

#: Speed target: FP8 tokens/s over bf16's; curve target: |final loss FP8 - bf16| / bf16's.
TARGETS = {"speed_vs_bf16": 1.3, "final_loss_rel": 0.01}
MODES = ("bf16", "rowwise", "rowwise-e5m2", "rowwise-gw-bf16")
#: The curve's model: a small Llama over the demo's character vocabulary.
CURVE_MODEL = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=768, intermediate_size=2048,
                   num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                   max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
#: Steps averaged into the curve's final loss.
TAIL = 50


def train_cmd(model_dir: str, data: str, out: str, mode: str, seq: int, batch: int, steps: int, lr: float,
              warmup: int, schedule: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "ligermodels.train", "--model", model_dir, "--from-scratch", "--data", data,
            "--out", out, "--overwrite", "--seq-len", str(seq), "--batch-size", str(batch), "--steps", str(steps),
            "--save-every", "0", "--log-every", "50", "--lr", str(lr), "--lr-schedule", schedule, "--warmup-steps",
            str(warmup), "--seed", "0", *([] if mode == "bf16" else ["--fp8", mode]), *extra]


def run(cmd: list[str], out: str, timeout: float) -> tuple[list[dict], float, str | None]:
    """(metrics lines, wall seconds, error tail or None) of one training command."""
    t0 = time.perf_counter()
    res = run_child(cmd, timeout)
    wall = time.perf_counter() - t0
    sys.stdout.write(res.stdout[-1500:])
    if res.returncode != 0:
        return [], wall, res.stderr[-2000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()], wall, None


def speed(args) -> dict:
    config = {**LLAMA_3_1_8B, "num_hidden_layers": args.layers}
    model_dir, data = os.path.join(args.out, "speed", "model"), os.path.join(args.out, "speed", "data.jsonl")
    write_model_dir(model_dir, config)
    write_data(data, args.batch * args.seq * (args.steps + 2), config["vocab_size"], 1000)
    rows = []
    for mode in args.modes:
        out = os.path.join(args.out, "speed", mode)
        cmd = train_cmd(model_dir, data, out, mode, args.seq, args.batch, args.steps, 1e-5, 0, "constant",
                        ["--ac", args.ac, *(["--profile"] if args.profile else [])])
        metrics, wall, error = run(cmd, out, args.timeout)
        row = {"mode": mode, "command": " ".join(cmd[1:]), "wall_s": round(wall, 1)}
        if error:
            row["error"] = error
        else:
            row.update(summarize([args.batch * args.seq / m["tokens_per_s"] for m in metrics],
                                 [m["loss"] for m in metrics], max(m["peak_mem_gb"] for m in metrics),
                                 args.batch * args.seq, args.warmup))
            row["mfu_bf16_peak"] = statistics.median(m.get("mfu") or 0.0 for m in metrics[args.warmup:])
        if args.profile and os.path.isfile(os.path.join(out, "profile.txt")):
            with open(os.path.join(out, "profile.txt")) as f:
                row["profile"] = f.read()
            print(row["profile"], flush=True)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "command", "profile")}), flush=True)
    by = {r["mode"]: r for r in rows if "tokens_per_s" in r}
    checks = {}
    if "bf16" in by:
        for mode in by:
            if mode != "bf16":
                ratio = by[mode]["tokens_per_s"] / by["bf16"]["tokens_per_s"]
                checks[f"speed_vs_bf16[{mode}]"] = {"value": round(ratio, 3), "target": TARGETS["speed_vs_bf16"],
                                                    "holds": ratio >= TARGETS["speed_vs_bf16"]}
    return {"shape": f"Llama-3.1-8B, {args.layers} layers", "seq": args.seq, "batch": args.batch, "ac": args.ac,
            "rows": rows, "checks": checks}


def curve(args) -> dict:
    from ligermodels.train.demo import build_tokenizer, corpus, save_tokenizer

    model_dir, data = os.path.join(args.out, "curve", "model"), os.path.join(args.out, "curve", "data.jsonl")
    tok = build_tokenizer()
    save_tokenizer(tok, model_dir)
    write_model_dir_config(model_dir, {**CURVE_MODEL, "vocab_size": tok.get_vocab_size()})
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in corpus(args.curve_docs, 0))
    runs = []
    for mode in args.curve_modes:
        out = os.path.join(args.out, "curve", mode)
        cmd = train_cmd(model_dir, data, out, mode, 512, 16, args.curve_steps, 1e-3, 50, "cosine", [])
        metrics, wall, error = run(cmd, out, args.timeout)
        entry = {"mode": mode, "command": " ".join(cmd[1:]), "wall_s": round(wall, 1)}
        if error:
            entry["error"] = error
        else:
            losses = [m["loss"] for m in metrics]
            entry.update(losses=[round(v, 5) for v in losses], final_loss=round(statistics.fmean(losses[-TAIL:]), 5))
        runs.append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k != "losses"}), flush=True)
    by = {r["mode"]: r for r in runs if "final_loss" in r}
    checks = {}
    if "bf16" in by:
        for mode in by:
            if mode != "bf16":
                rel = abs(by[mode]["final_loss"] - by["bf16"]["final_loss"]) / by["bf16"]["final_loss"]
                checks[f"final_loss_rel[{mode}]"] = {"value": round(rel, 4), "target": TARGETS["final_loss_rel"],
                                                     "holds": rel <= TARGETS["final_loss_rel"]}
    return {"model": {k: v for k, v in CURVE_MODEL.items() if k != "architectures"}, "seq": 512, "batch": 16,
            "steps": args.curve_steps, "lr": "1e-3 cosine, 50 warm-up steps", "tail": TAIL, "runs": runs,
            "checks": checks}


def write_model_dir_config(model_dir: str, config: dict) -> None:
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def kernels_breakdown(args) -> dict:
    """Kernel times of the FP8 pieces at one Llama-3.1-8B layer (M = batch x seq tokens), against their bf16
    counterparts: each projection's GEMMs (bf16 ``mm`` vs ``torch._scaled_mm`` rowwise, operands pre-quantised) and
    the quantisation passes (weight by rows, weight transposed, output gradient, GLU and norm with FP8 output),
    with the bytes each pass must move and its rate against the device's copy bandwidth."""
    import torch

    import kernels.fp8 as fp8
    from benchmarks.common import copy_bandwidth_gbs, kernel_ms
    from kernels.glu import _glu_fwd, _glu_fwd_fp8
    from kernels.rms_norm import _fused_add_rms_norm_fwd, _fused_add_rms_norm_fwd_fp8

    c, m = LLAMA_3_1_8B, args.batch * args.seq
    h, i = c["hidden_size"], c["intermediate_size"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * c["head_dim"]
    copy_gbs = copy_bandwidth_gbs()
    dev, bf = "cuda", torch.bfloat16
    rows = []

    def row(name, ms, nbytes=None, flops=None):
        r = {"piece": name, "ms": round(ms, 4)}
        if nbytes:
            r.update(bytes=nbytes, copy_fraction=round(nbytes / (ms * 1e6) / copy_gbs, 3))
        if flops:
            r["tflops"] = round(flops / ms / 1e9, 1)
        rows.append(r)
        print(json.dumps(r), flush=True)

    def projection(name: str, n: int, k: int) -> None:
        x, w, d = (torch.randn(m, k, device=dev, dtype=bf), torch.randn(n, k, device=dev, dtype=bf),
                   torch.randn(m, n, device=dev, dtype=bf))
        xq, xs = fp8.quantize_rows(x)
        wq, ws = fp8.quantize_rows(w)
        dq, ds = fp8.quantize_rows(d)
        wtq, wts = fp8.quantize_cols_t(w)
        dtq, dts = fp8.quantize_cols_t(d)
        xtq, xts = fp8.quantize_cols_t(x)
        flops = 2 * m * n * k
        row(f"{name} fwd bf16", kernel_ms(lambda: x @ w.t()), flops=flops)
        row(f"{name} fwd fp8", kernel_ms(lambda: fp8.scaled_mm(xq, xs, wq, ws, bf)), flops=flops)
        row(f"{name} dgrad bf16", kernel_ms(lambda: d @ w), flops=flops)
        row(f"{name} dgrad fp8", kernel_ms(lambda: fp8.scaled_mm(dq, ds, wtq, wts, bf)), flops=flops)
        row(f"{name} wgrad bf16", kernel_ms(lambda: d.t() @ x), flops=flops)
        row(f"{name} wgrad fp8", kernel_ms(lambda: fp8.scaled_mm(dtq, dts, xtq, xts, bf)), flops=flops)
        row(f"{name} quantize weight rows", kernel_ms(lambda: fp8.quantize_rows(w)), nbytes=3 * n * k)
        row(f"{name} quantize weight columns (transposed)", kernel_ms(lambda: fp8.quantize_cols_t(w)),
            nbytes=5 * n * k)
        row(f"{name} quantize output gradient rows", kernel_ms(lambda: fp8.quantize_rows(d)), nbytes=3 * m * n)
        row(f"{name} quantize output gradient columns (transposed)", kernel_ms(lambda: fp8.quantize_cols_t(d)),
            nbytes=5 * m * n)
        row(f"{name} quantize input columns (transposed)", kernel_ms(lambda: fp8.quantize_cols_t(x)),
            nbytes=5 * m * k)

    for name, n, k in (("qkv", qkv, h), ("o", h, h), ("gate_up", 2 * i, h), ("down", h, i)):
        projection(name, n, k)
    g = torch.randn(m, 2 * i, device=dev, dtype=bf)
    row("glu bf16", kernel_ms(lambda: _glu_fwd(g, None, 0)), nbytes=6 * m * i)
    row("glu fp8 out", kernel_ms(lambda: _glu_fwd_fp8(g, 0)), nbytes=5 * m * i)
    x, r, wn = (torch.randn(m, h, device=dev, dtype=bf), torch.randn(m, h, device=dev, dtype=bf),
                torch.ones(h, device=dev, dtype=bf))
    row("add+norm bf16", kernel_ms(lambda: _fused_add_rms_norm_fwd(x, r, wn, 1e-5, 0.0, 0)), nbytes=8 * m * h)
    row("add+norm fp8 out", kernel_ms(lambda: _fused_add_rms_norm_fwd_fp8(x, r, wn, 1e-5, 0.0, 0)),
        nbytes=7 * m * h)
    return {"tokens": m, "copy_gbs": round(copy_gbs, 1), "rows": rows}


def logits_distance(args) -> dict:
    """How far FP8 projections move a trained model's output: the curve's bf16 run's final checkpoint
    (``--logits-model``, default ``OUT/curve/bf16/final``) in bf16 on held-out text of the demo's corpus (a seed
    the training data did not use; its records joined into one stream under one BOS, with no EOS between them,
    unlike the training rows), logits with ``use_fp8(mode)`` against the same model without, as
    ||fp8 - bf16|| / ||bf16||, and the next-token loss of each."""
    import torch

    from ligermodels import AutoLigerModel
    from ligermodels.train.demo import build_tokenizer, corpus

    src = args.logits_model or os.path.join(args.out, "curve", "bf16", "final")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoLigerModel.from_hf(src, dtype=torch.bfloat16, device=device).eval()
    tok = build_tokenizer()
    text = "".join(r.get("text") or r["prompt"] + r["completion"] for r in corpus(2000, 12345))
    ids = torch.tensor(tok.encode(text).ids[:8 * 512], device=device).view(8, 512)
    rows = []
    with torch.no_grad():
        ref = model(ids).float()
        ref_loss = model.loss(ids, ids).item()
        for mode in [m for m in args.modes if m != "bf16"]:
            out = model.use_fp8(mode)(ids).float()
            loss = model.loss(ids, ids).item()
            model.use_fp8(None)
            rows.append({"mode": mode, "logits_rel": round(((out - ref).norm() / ref.norm()).item(), 5),
                         "loss": round(loss, 5), "loss_bf16": round(ref_loss, 5)})
            print(json.dumps(rows[-1]), flush=True)
    return {"shape": f"the loss-curve model after its bf16 run ({src})", "tokens": ids.numel(), "rows": rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="work directory")
    ap.add_argument("--only", choices=("speed", "curve", "kernels", "logits"),
                    help="run one part (default speed and curve)")
    ap.add_argument("--modes", nargs="+", default=list(MODES[:2]), choices=MODES)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--ac", default="none", choices=AC_MODES)
    ap.add_argument("--profile", action="store_true", help="speed: ligermodels.train's --profile table per mode")
    ap.add_argument("--curve-steps", type=int, default=600)
    ap.add_argument("--curve-modes", nargs="+", default=list(MODES[:2]), choices=MODES)
    ap.add_argument("--curve-docs", type=int, default=200000)
    ap.add_argument("--logits-model", help="logits: the checkpoint compared (default OUT/curve/bf16/final)")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--tag", default="")
    ap.add_argument("--results", help="results directory (default benchmarks/results)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    payload = {"targets": TARGETS}
    if args.only in (None, "speed"):
        payload["speed"] = speed(args)
    if args.only in (None, "curve"):
        payload["curve"] = curve(args)
    if args.only == "kernels":
        payload["kernels"] = kernels_breakdown(args)
    if args.only == "logits":
        payload["logits"] = logits_distance(args)
    env = environment()
    path = write_results(f"fp8-{env['gpu'].replace(' ', '_')}-{env['date']}{args.tag}", payload, args.results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
