"""The DPO loss head alone: ligermodels' log-prob kernel and DPO terms against Liger-Kernel's
``LigerFusedLinearDPOLoss``, time and memory, forward and backward.

Both compute the same thing from the last hidden states of a micro-batch of P pairs: each completion's summed token
log-probabilities under the output head (V, H), for the policy (with gradients for the hidden states and the head)
and for a reference (no gradients), then the sigmoid DPO loss (beta 0.1) averaged over the pairs. Shapes: the
preference benchmark's micro-batch (4 pairs; each sequence a 256-token prompt and a 768-token completion: 8,192
tokens) at the heads of Qwen2-1.5B (V 151,936, H 1,536) and Llama-3.2-1B (V 128,256, H 2,048), bf16.

* ``ligermodels``: what ``python -m ligermodels.train --objective dpo`` runs on a packed row: the tokens of all
  sequences in one (N, H) tensor, each pair's two sequences side by side (a gather of the hidden states here, whose
  cost is in the row), ``kernels.logprobs.fused_linear_logprob_loss`` for the policy (the chunked fused-linear loop,
  no (N, V) logits, chunks of whole pairs whose DPO gradient is taken in the forward: 3 GEMMs of the head) and
  ``fused_linear_logprobs`` without gradients for the reference; per-sequence sums over completion tokens
  (``sequence_sums``); ``ligermodels.train.objectives.dpo_terms``.
* ``ligermodels-per-token``: the same with the policy's log-probs from ``fused_linear_logprobs`` and autograd
  through the loss (the logits recomputed in backward: 4 GEMMs), the head a loss of any form takes.
* ``liger-kernel``: ``LigerFusedLinearDPOLoss(beta=0.1, use_ref_model=True)`` (its default chunking and
  ``torch.compile``d chunk function) on the same tokens laid out as it takes them: (2P, S, H) hidden states, chosen
  rows first, prompt positions labelled -100.

Per row: ``ms`` (wall time of forward + backward, the median of ``bench_ms``: host included, as a training step
sees it), ``kernel_ms`` (the GPU time of the same call), ``peak_extra_gb`` (peak allocated during one forward +
backward beyond the inputs and the weight's gradient buffer), and ``loss`` (the two agree to bf16 rounding).

    python -m benchmarks.bench_dpo_head [--out DIR]

Writes ``results/dpo-head-<gpu>-<date>.json``.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from types import SimpleNamespace

import torch

from benchmarks.common import environment, timed_pass, write_results

HEADS = {"qwen2-1.5b": (151936, 1536), "llama-1b": (128256, 2048)}
PAIRS, PROMPT, COMPLETION, BETA = 4, 256, 768, 0.1


def make_inputs(vocab: int, hidden: int, device: str = "cuda", pairs: int = PAIRS, prompt: int = PROMPT,
                completion: int = COMPLETION, dtype=torch.bfloat16, seed: int = 0) -> dict:
    """Policy and reference hidden states (2P, S, H), the head (V, H) and its reference copy, next-token targets
    (2P, S) with -100 on the prompt: sequences 0..P-1 chosen, P..2P-1 rejected."""
    g = torch.Generator().manual_seed(seed)
    seqs, seq = 2 * pairs, prompt + completion
    hid = torch.randn(seqs, seq, hidden, generator=g) * 0.5
    ref = hid + 0.01 * torch.randn(seqs, seq, hidden, generator=g)
    weight = torch.randn(vocab, hidden, generator=g) * hidden ** -0.5
    target = torch.randint(0, vocab, (seqs, seq), generator=g)
    target[:, :prompt] = -100
    return {"hidden": hid.to(device, dtype), "ref_hidden": ref.to(device, dtype), "weight": weight.to(device, dtype),
            "ref_weight": weight.to(device, dtype), "target": target.to(device)}


def _packed(inp: dict, side_by_side: bool) -> SimpleNamespace:
    """The micro-batch as the trainer packs it: tokens (N,) of every sequence in one row, chosen sequences first
    (``side_by_side`` False) or each pair's two side by side (chosen 0, rejected 0, chosen 1, ...); chosen and
    rejected sequence indices, the sequences' segments and completion tokens, DPO's settings."""
    seqs, seq, hidden = inp["hidden"].shape
    pairs, dev = seqs // 2, inp["target"].device
    order = torch.arange(seqs, device=dev)
    if side_by_side:
        order = order.view(2, pairs).t().reshape(-1)
    target = inp["target"][order].reshape(-1)
    completion = target != -100
    chosen = torch.arange(0, seqs, 2) if side_by_side else torch.arange(pairs)
    return SimpleNamespace(
        order=order, target=target, completion=completion, seqs=seqs, seq=seq, pairs=pairs, hidden=hidden,
        chosen=chosen.to(dev), rejected=(chosen + (1 if side_by_side else pairs)).to(dev),
        segments=torch.arange(seqs, device=dev).repeat_interleave(seq),
        lens=torch.full((seqs,), float(completion.sum() / seqs), device=dev),
        config=SimpleNamespace(beta=BETA, label_smoothing=0.0, dpo_loss="sigmoid"))


def _dpo(p: SimpleNamespace, pol: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The mean sigmoid DPO loss of the sequences' policy and reference log-probs (seqs,)."""
    from ligermodels.train.objectives import dpo_terms

    c, r = p.chosen, p.rejected
    return dpo_terms(p.config, pol[c], pol[r], ref[c], ref[r], p.lens[c], p.lens[r])[0].mean()


def ours(inp: dict) -> torch.Tensor:
    """The per-token head on the packed (N, H) tokens, autograd through the loss."""
    from kernels.logprobs import fused_linear_logprobs, sequence_sums

    p = _packed(inp, side_by_side=False)

    def logps(h, w):
        return sequence_sums(fused_linear_logprobs(h.reshape(-1, p.hidden), w, p.target), p.segments, p.seqs,
                             p.completion)

    with torch.no_grad():
        ref = logps(inp["ref_hidden"], inp["ref_weight"])
    return _dpo(p, logps(inp["hidden"], inp["weight"]), ref)


def ours_fused(inp: dict) -> torch.Tensor:
    """The trainer's DPO head: pairs side by side, the gradient taken in the forward."""
    from kernels.logprobs import fused_linear_logprob_loss, fused_linear_logprobs, sequence_sums
    from ligermodels.train.preference import slot_ends

    p = _packed(inp, side_by_side=True)
    with torch.no_grad():
        ref_tok = fused_linear_logprobs(inp["ref_hidden"][p.order].reshape(-1, p.hidden), inp["ref_weight"], p.target)
        ref = sequence_sums(ref_tok, p.segments, p.seqs, p.completion)
    ends = slot_ends(2 * p.seq, p.pairs)  # each pair's two sequences: a slot of 2 x seq tokens
    return fused_linear_logprob_loss(inp["hidden"][p.order].reshape(-1, p.hidden), inp["weight"], p.target,
                                     lambda tok: _dpo(p, sequence_sums(tok, p.segments, p.seqs, p.completion), ref),
                                     ends)[0]


def liger(inp: dict, module) -> torch.Tensor:
    out = module(inp["weight"], inp["hidden"], inp["target"], ref_input=inp["ref_hidden"],
                 ref_weight=inp["ref_weight"])
    return out[0] if isinstance(out, tuple) else out


def measure(name: str, impl: str, fn) -> dict:
    """Time and memory of forward + backward of ``fn(inputs)`` on fresh inputs requiring grad."""
    vocab, hidden = HEADS[name]
    inp = make_inputs(vocab, hidden)
    inp["hidden"].requires_grad_()
    inp["weight"].requires_grad_()

    def step():
        inp["hidden"].grad = inp["weight"].grad = None
        loss = fn(inp)
        loss.backward()
        return loss

    loss = step()  # warm-up (compiles Liger's chunk function)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # inputs and the gradient buffers of the warm-up
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    t = timed_pass(step)
    return {"head": name, "vocab": vocab, "hidden": hidden, "tokens": inp["target"].numel(), "impl": impl,
            "loss": round(float(loss), 6), "ms": round(t.wall_ms, 3), "kernel_ms": round(t.ms, 3),
            "peak_extra_gb": round(peak / 1e9, 3)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for name in HEADS:
        impls = {"ligermodels": ours_fused, "ligermodels-per-token": ours}
        try:
            from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

            module = LigerFusedLinearDPOLoss(beta=BETA, use_ref_model=True)
            impls["liger-kernel"] = lambda inp, m=module: liger(inp, m)
        except ImportError as e:
            rows.append({"head": name, "impl": "liger-kernel", "error": f"ImportError: {e}"})
        for impl, fn in impls.items():
            try:
                row = measure(name, impl, fn)
            except Exception as e:  # a failing side is reported, not hidden
                row = {"head": name, "impl": impl, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(row, flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    env = environment()
    name = f"dpo-head-{(env.get('gpu') or 'cpu').replace(' ', '_')}-{env['date']}"
    try:
        liger_version = metadata.version("liger-kernel")
    except metadata.PackageNotFoundError:
        liger_version = None
    payload = {"benchmark": "DPO loss head alone: ligermodels vs LigerFusedLinearDPOLoss",
               "liger_kernel": liger_version,
               "settings": {"pairs": PAIRS, "prompt_tokens": PROMPT, "completion_tokens": COMPLETION, "beta": BETA,
                            "dtype": "bfloat16", "reference": "hidden states and head given, no gradients"},
               "rows": rows}
    print("wrote", write_results(name, payload, args.out or None))


if __name__ == "__main__":
    sys.exit(main())
