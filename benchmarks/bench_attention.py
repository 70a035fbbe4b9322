"""Attention within packed documents, per layer, against plain causal attention over whole rows.

At each training shape of ``benchmarks.bench_train`` (batch x 2048 tokens, the model's heads), rows are
packed from documents of 200-3000 tokens as ``bench_train``'s data (plus BOS and EOS), cut at row ends;
each implementation runs one layer's attention forward and backward on the same random q/k/v, strided
views of one packed projection buffer as the decoder layer passes them:

* ``cudnn-causal``: ``causal_attention`` without documents: SDPA ``is_causal`` (cuDNN), across whole rows,
  the step's attention when documents are ignored (``ligermodels.train --attention causal``);
* ``triton-documents``: ``causal_attention`` with :class:`ligermodels.Documents` through this package's kernel
  (:func:`kernels.document_attention`, the default on CUDA in bf16 at head dims 64 and 128), and
  ``triton-documents <tiles>`` with other tiles (``--triton-configs``);
* ``flash-documents``: the same through FlashAttention-2's variable-length kernel (the default at other head
  dims);
* ``flex-documents``: the same through FlexAttention with the block mask built from the document bounds
  (``LIGERMODELS_MASKED_ATTENTION=flex``, and what fp32 uses), mask built once outside the timing (in a
  training forward it is built once and shared by every layer: its build time is a separate row);
* ``flex-documents <options>``: the same with FlexAttention ``kernel_options`` (``--flex-options``), to
  tune the backward at head_dim 256;
* ``softcap`` shapes (Gemma 2): attention-logit soft-capping. ``flex-causal`` / ``flex-documents``:
  FlexAttention's ``score_mod`` over whole rows / within documents (``LIGERMODELS_SOFTCAP_ATTENTION=flex``);
  ``triton-causal`` / ``triton-documents`` (and ``triton-documents <tiles>``): this package's kernel with
  ``softcap`` (the default at head dims 64, 128 and 256).

Each row: kernel time of forward + backward (``benchmarks.common.kernel_ms``: device time, L2 flushed),
the useful flops (4 * D * Hq per allowed (query, key) pair forward, 2.5 x that backward) and their rate,
and the relative error of the output and of the q/k/v gradient against float64 dense attention on the same
inputs (the first batch row only, to bound the reference's memory).

    python -m benchmarks.bench_attention [--shapes qwen2-1.5b:4 gemma-2b:4] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch

from benchmarks.common import environment, kernel_ms, write_results
from ligermodels import attention
from ligermodels.attention import AttentionMask, Documents, causal_attention

#: name: (batch, q heads, kv heads, head_dim, soft-cap) at seq 2048, the bench_train shapes' attention.
SHAPES = {
    "qwen2-1.5b:4": (4, 12, 2, 128, None),
    "qwen2-1.5b:8": (8, 12, 2, 128, None),
    "llama-1b:8": (8, 32, 8, 64, None),
    "gemma-2b:4": (4, 8, 1, 256, None),
    "qwen3-1.7b:4": (4, 16, 8, 128, None),
    "qwen2-7b:4": (4, 28, 4, 128, None),
    "gemma2-2b:4": (4, 8, 4, 256, 50.0),
}
SEQ = 2048


def packed_positions(batch: int, seq: int, low: int = 202, high: int = 3002, seed: int = 0) -> torch.Tensor:
    """(batch, seq) positions of documents of ``low..high`` tokens packed end to end and cut at row ends;
    every row starts a (possibly continued) document at position 0, as ``ligermodels.train.data.PackedRows``."""
    rng = random.Random(seed)
    starts: list[bool] = []
    while len(starts) < batch * seq:
        starts += [True] + [False] * (rng.randint(low, high) - 1)
    start = torch.tensor(starts[:batch * seq]).view(batch, seq)
    start[:, 0] = True
    col = torch.arange(seq).expand(batch, seq)
    return col - torch.cummax(torch.where(start, col, 0), dim=1).values


def allowed_pairs(documents: Documents) -> int:
    """(query, key) pairs causal attention within documents computes: sum of n (n + 1) / 2 per sequence."""
    n = documents.cu_seqlens.diff().double().cpu()
    return int((n * (n + 1) / 2).sum())


def reference(q, k, v, doc, softcap, scale):
    """float64 dense attention within documents (doc (1, S) ids or None: whole row), repeated k/v."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q.shape[2]
    pos = torch.arange(s, device=q.device)
    ok = (pos[None, :] <= pos[:, None])[None, None]
    if doc is not None:
        ok = ok & (doc[:, None, :, None] == doc[:, None, None, :])
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    return (scores.masked_fill(~ok, float("-inf")).softmax(-1) @ v).transpose(1, 2)


def cudnn_varlen(q, k, v, cu_seqlens, max_len, scale):
    """An experiment, not a library path: cuDNN's fused attention over ragged sequences
    (``aten._cudnn_attention_forward`` with cumulative lengths, what PyTorch's nested tensors use), on
    contiguous (T, H, D) copies with k / v repeated to the query heads (copies inside the timing)."""
    b, s, hq, d = q.shape
    g = hq // k.shape[2]
    q2, k2, v2 = (t.flatten(0, 1).contiguous() for t in (q, k, v))
    if g > 1:
        k2, v2 = k2.repeat_interleave(g, 1), v2.repeat_interleave(g, 1)
    o = torch.ops.aten._cudnn_attention_forward(q2, k2, v2, None, cu_seqlens, cu_seqlens, max_len, max_len, True,
                                                0.0, True, False, scale=scale)[0]
    return o.view(b, s, hq, d)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def implementations(softcap: float | None, triton_configs: list[dict] = (), flex_options: list[dict] = ()
                    ) -> list[tuple[str, str, dict | None, str, bool]]:
    """(impl, masked-attention setting, tiles or FlexAttention options, attention, within documents?) of every row
    of a shape: the attention is "whole_rows", "within_documents" or "cudnn_documents". The setting also picks
    soft-capped attention's path: "triton" this package's kernel, any other FlexAttention."""
    def tiles(c):
        return f"triton-documents {json.dumps(c, separators=(',', ':'))}"

    if softcap is None:
        impls = [("cudnn-causal", "flash", None, "whole_rows", False),
                 ("triton-documents", "triton", None, "within_documents", True)]
        impls += [(tiles(c), "triton", c, "within_documents", True) for c in triton_configs]
        impls += [("flash-documents", "flash", None, "within_documents", True),
                  ("cudnn-documents (experiment)", "flash", None, "cudnn_documents", True)]
    else:  # no cuDNN or FlashAttention: SDPA has no soft-capping
        impls = [("flex-causal", "flex", None, "whole_rows", False),
                 ("triton-causal", "triton", None, "whole_rows", False),
                 ("triton-documents", "triton", None, "within_documents", True)]
        impls += [(tiles(c), "triton", c, "within_documents", True) for c in triton_configs]
    impls.append(("flex-documents", "flex", None, "within_documents", True))
    impls += [(f"flex-documents {json.dumps(o, separators=(',', ':'))}", "flex", o, "within_documents", True)
              for o in flex_options]
    return impls


def run_shape(name: str, flex_options: list[dict], check: bool, triton_configs: list[dict] = ()) -> list[dict]:
    """Every implementation at one shape: result rows (and the block-mask build time)."""
    b, hq, hkv, d, softcap = SHAPES[name]
    scale = d ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(b, SEQ, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16, generator=gen)
    qkv.requires_grad_()
    grad = torch.randn(b, SEQ, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    documents = Documents.from_positions(packed_positions(b, SEQ)).to("cuda")
    pairs_doc, pairs_row = allowed_pairs(documents), b * SEQ * (SEQ + 1) // 2
    lengths = documents.cu_seqlens.diff().tolist()

    def split(t):
        q, k, v = t.split([hq * d, hkv * d, hkv * d], dim=-1)
        return (x.unflatten(-1, (-1, d)) for x in (q, k, v))

    def timed(attend):
        def fn():
            qkv.grad = None
            out = attend(*split(qkv))
            out.backward(grad)
            return out
        return fn

    doc_mask = AttentionMask(SEQ, documents)

    def whole_rows(q, k, v):
        return causal_attention(q, k, v, scale=scale, softcap=softcap)

    def within_documents(q, k, v):
        return causal_attention(q, k, v, mask=doc_mask, scale=scale, softcap=softcap)

    def cudnn_documents(q, k, v):
        return cudnn_varlen(q, k, v, documents.cu_seqlens, documents.max_len, scale)

    attends = {"whole_rows": whole_rows, "within_documents": within_documents, "cudnn_documents": cudnn_documents}
    impls = [(impl, masked, opts, attends[attend], documents_on)
             for impl, masked, opts, attend, documents_on in implementations(softcap, triton_configs, flex_options)]

    ref = None
    rows = []
    defaults = dict(attention.FLEX_KERNEL_OPTIONS)
    masked_default, softcap_default = attention.MASKED_ATTENTION, attention.SOFTCAP_ATTENTION
    head_dims = attention.TRITON_HEAD_DIMS
    for impl, masked, opts, attend, documents_on in impls:
        attention.MASKED_ATTENTION = masked
        attention.SOFTCAP_ATTENTION = "triton" if masked == "triton" else "flex"  # at every head dim
        attention.TRITON_HEAD_DIMS = (d,) if masked == "triton" else head_dims  # measured at every head dim
        if masked == "triton" and opts:
            os.environ["LIGERMODELS_DOC_ATTENTION_CONFIG"] = json.dumps(opts)
        else:
            os.environ.pop("LIGERMODELS_DOC_ATTENTION_CONFIG", None)
        attention.FLEX_KERNEL_OPTIONS = {**defaults, d: opts} if opts and masked == "flex" else defaults
        attention.reset_flex_compile()  # a fresh compile per option set
        row = {"shape": name, "impl": impl, "batch": b, "seq": SEQ, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
               "softcap": softcap, "documents": len(lengths), "mean_document": round(sum(lengths) / len(lengths), 1)}
        pairs = pairs_doc if documents_on else pairs_row
        try:
            fn = timed(attend)
            out = fn()
            if check:
                if ref is None or documents_on != ref[0]:
                    q, k, v = (t.detach()[:1].requires_grad_() for t in split(qkv.detach()))
                    r = reference(q, k, v, documents.ids[:1] if documents_on else None, softcap, scale)
                    r.backward(grad[:1].double())
                    ref = (documents_on, r.detach(), torch.cat([t.grad.flatten(-2) for t in (q, k, v)], -1))
                row["out_rel_err"] = round(rel(out[:1], ref[1]), 6)
                row["dqkv_rel_err"] = round(rel(qkv.grad[:1], ref[2]), 6)
            ms = kernel_ms(fn, reps=20, warmup=3)
            with torch.no_grad():
                fwd_ms = kernel_ms(lambda attend=attend: attend(*split(qkv)), reps=20, warmup=3)
            flops = 14 * d * hq * pairs
            row |= {"fwd_bwd_ms": round(ms, 4), "fwd_ms": round(fwd_ms, 4),
                    "useful_tflops": round(flops / ms / 1e9, 1),
                    "fwd_tflops": round(4 * d * hq * pairs / fwd_ms / 1e9, 1), "pairs": pairs}
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result row too
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    attention.MASKED_ATTENTION, attention.FLEX_KERNEL_OPTIONS = masked_default, defaults
    attention.reset_flex_compile()
    attention.SOFTCAP_ATTENTION = softcap_default
    attention.TRITON_HEAD_DIMS = head_dims
    os.environ.pop("LIGERMODELS_DOC_ATTENTION_CONFIG", None)

    from ligermodels.attention import document_block_mask
    build = kernel_ms(lambda: document_block_mask(documents.ids, None, SEQ, b, torch.device("cuda")), reps=20)
    rows.append({"shape": name, "impl": "flex block mask build (once per forward)", "ms": round(build, 4)})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--flex-options", default="[]",
                    help='JSON list of FlexAttention kernel_options dicts to try, e.g. \'[{"bwd_num_warps": 8}]\'')
    ap.add_argument("--flex-shapes", nargs="+", default=["gemma2-2b:4"], choices=list(SHAPES),
                    help="the shapes --flex-options are tried at")
    ap.add_argument("--triton-configs", default="[]",
                    help='JSON list of kernels.attention tile sets to try at every shape, e.g. '
                         '\'[{"fwd": [128, 64, 8, 3], "kv": [64, 128, 8, 3], "q": [128, 64, 8, 3]}]\'')
    ap.add_argument("--no-check", action="store_true", help="skip the float64 comparison")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    env = environment()
    torch._dynamo.config.recompile_limit = 64  # one FlexAttention compile per shape and option set
    rows = []
    for name in args.shapes:
        options = json.loads(args.flex_options) if name in args.flex_shapes else []
        rows += run_shape(name, options, not args.no_check, json.loads(args.triton_configs))
        gpu = (env.get("gpu") or "cpu").replace(" ", "_")
        path = write_results(f"attention-{gpu}-{env['date']}{args.tag}",
                             {"benchmark": "attention within packed documents vs causal over whole rows, per layer",
                              "rows": rows}, out_dir=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
