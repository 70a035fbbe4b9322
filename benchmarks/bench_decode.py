"""Decode benchmark: ligermodels' ``generate`` (static KV cache; eager, and compiled with CUDA graphs) against
transformers' ``generate(cache_implementation="static")`` on the same random weights.

Model: Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads / 8 kv heads, intermediate 8192, vocab
128256, tied embeddings, llama3 rope), random init, bf16. The transformers model is built from the config,
saved with ``save_pretrained`` and loaded with ``LigerLlama.from_hf``, so both hold identical weights.

Run on a GPU:  python -m benchmarks.bench_decode [--batches 1 16] [--prompt 128] [--new 256] [--out DIR]

Each (impl, batch) generates ``--new`` tokens greedily after a random ``--prompt``-token prompt, no EOS,
after a warm-up call (compilation). Times are medians over ``--reps`` calls, synchronised with the GPU:

* ``e2e_tokens_per_s``  = batch * new / (time of the whole generate call),
* ``tokens_per_s``      = batch * (new - 1) / (generate time - prefill time): decode only, the prefill
  being the same call with ``max_new_tokens=1``,
* ``match_prefix``      = how many leading generated tokens of row 0 equal transformers' (static, eager);
  bf16 greedy paths drift apart once two logits come within rounding, so a short prefix is no error.

Impls: ``transformers-static`` (HF compiles its decode step by itself with a static cache),
``transformers-static-nocompile`` (``disable_compile=True``), ``ligermodels-eager`` and
``ligermodels-compiled`` (``generate(compile=True)``: the one-token step under ``torch.compile``,
mode "reduce-overhead"). Writes ``decode-<gpu>-<date>.json`` with the rows.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from benchmarks.common import environment, write_results

LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                    pad_token_id=None,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192})


def build_models(seed: int = 0):
    """(transformers model, ligermodels model): the same random bf16 weights on the GPU."""
    import transformers

    from ligermodels import LigerLlama

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**LLAMA_3_2_1B)
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM(config)
    hf = hf.to(torch.bfloat16).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = LigerLlama.from_hf(tmp, dtype=torch.bfloat16, device="cuda")
    return hf, ours


def timed(fn: Callable[[], torch.Tensor], reps: int) -> tuple[float, torch.Tensor]:
    """(median seconds of ``fn()`` over ``reps`` calls, the last output), GPU-synchronised."""
    times, out = [], None
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=None, help="impl names to run (default all)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()

    hf, ours = build_models()
    new = args.new

    def hf_gen(ids, n, compile_):
        return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                           cache_implementation="static", disable_compile=not compile_,
                           eos_token_id=None, pad_token_id=0)

    impls: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
        "transformers-static": lambda ids, n: hf_gen(ids, n, True),
        "transformers-static-nocompile": lambda ids, n: hf_gen(ids, n, False),
        "ligermodels-eager": lambda ids, n: ours.generate(ids, n),
        "ligermodels-compiled": lambda ids, n: ours.generate(ids, n, compile=True),
    }
    prefill_impls = {  # the prefill is eager in both ligermodels impls; max_new_tokens=1 runs no decode step
        "ligermodels-compiled": lambda ids, n: ours.generate(ids, n),
    }
    names = [n for n in impls if args.only is None or n in args.only]

    env = environment()
    config = {"model": "Llama-3.2-1B shape, random bf16", **LLAMA_3_2_1B}
    rows = []
    for batch in args.batches:
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, LLAMA_3_2_1B["vocab_size"], (batch, args.prompt), generator=g).cuda()
        outs, batch_rows = {}, []
        for name in names:
            fn, pre = impls[name], prefill_impls.get(name, impls[name])
            try:
                fn(ids, new)  # warm-up: compilation, CUDA graph capture, cache allocation
                pre(ids, 1)
                t_pre, _ = timed(functools.partial(pre, ids, 1), args.reps)
                t_all, out = timed(functools.partial(fn, ids, new), args.reps)
            except Exception as e:  # a failing impl is reported, not hidden
                rows.append({"impl": name, "batch": batch, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"{name:>30} batch {batch:>3}  ERROR {rows[-1]['error']}")
                continue
            outs[name] = out[0, args.prompt:].tolist()
            batch_rows.append({
                "impl": name, "batch": batch, "prompt": args.prompt, "new_tokens": new,
                "generated": out.shape[1] - args.prompt,
                "tokens_per_s": round(batch * (new - 1) / max(t_all - t_pre, 1e-9), 1),
                "e2e_tokens_per_s": round(batch * new / t_all, 1),
                "ms_per_step": round(1e3 * (t_all - t_pre) / max(new - 1, 1), 3),
                "prefill_ms": round(1e3 * t_pre, 2)})
            torch.cuda.empty_cache()
        ref = outs.get("transformers-static-nocompile") or outs.get("transformers-static")
        for row in batch_rows:
            gen = outs[row["impl"]]
            if ref is not None:
                diff = [i for i, (a, b) in enumerate(zip(gen, ref, strict=False)) if a != b]
                row["match_prefix"] = diff[0] if diff else min(len(gen), len(ref))
            print(f"{row['impl']:>30} batch {batch:>3}  decode {row['tokens_per_s']:>9.1f} tok/s  "
                  f"({row['ms_per_step']:.2f} ms/step)  e2e {row['e2e_tokens_per_s']:>9.1f} tok/s  "
                  f"prefill {row['prefill_ms']:.1f} ms  match {row.get('match_prefix')}/{len(gen)}")
        rows += batch_rows
        # written after every batch, so a run stopped at its time limit keeps the batches it finished
        notes = [f"Llama-3.2-1B shape, random bf16 weights, prompt {args.prompt} tokens, {new} new tokens, greedy, "
                 "static KV cache; ligermodels-compiled is generate(compile=True), ligermodels-eager generate()."]
        path = write_results(f"decode-{env['gpu'].replace(' ', '_')}-{env['date']}",
                             {"config": config, "rows": rows, "notes": notes}, args.out)
        print("wrote", path)


if __name__ == "__main__":
    main()
