"""Mixture-of-experts kernels, piece by piece, and one MoE layer whole, against what they replace.

Shapes (:data:`SHAPES`): one micro-batch of ``--tokens`` tokens (default 8192: 4 rows of 2048) through one sparse
layer of Qwen3-30B-A3B (H 2048, 128 experts of I 768, top 8) and of Mixtral-8x7B (H 4096, 8 experts of I 14336, top
2), bf16, router logits from random tokens and a random router (so the experts' loads are near uniform).

Rows (``ms`` is kernel time, as in ``benchmarks.common``; ``frac_copy_bw`` against the copy bandwidth measured in the
same run, for the fewest bytes each op must move):

* ``route``: ``kernels.moe``'s fused softmax + top-k + renormalisation on the (T, E) logits, against the same in
  eager PyTorch (what transformers runs). Bytes: the logits read, fp32 weights and int32 ids written.
* ``permute``: the T*k picks' rows in their sort by expert, the group ends and the weights in row order (the
  placement kernels), and ``expand`` writing each token's k rows: everything between the routing and the first
  grouped GEMM. Bytes: x read once, T*k rows written, the ids read. Against the same with ``torch.sort`` for the
  placement (``kernels.moe.sort_picks`` and a gather of the weights, impl ``ligermodels-torch-sort``) and eager
  PyTorch's ``argsort`` + ``index_select``.
* ``place`` alone: the placement kernels (positions, weights in row order, group ends) at the chunk size
  ``kernels.moe`` picks and at 256, 512 and 1024 picks a chunk (``chunk``), against ``sort_picks`` and a gather of
  the weights (``ligermodels-torch-sort``). Bytes: the ids read twice and the weights once, positions and weights
  written.
* ``expand`` alone: the permutation's copy without the sort. Bytes: x read once, T*k rows written.
* ``combine``: each token's k rows summed (fp32) into its output row. Bytes: T*k rows read, T rows written. Against
  eager ``index_add_`` in fp32 and a cast.
* ``grouped_gemm``: gate/up and down of the sorted rows, forward (``fwd``), input gradient (``dgrad``) and weight
  gradient (``wgrad``), ``torch._grouped_mm`` against one dense ``torch.mm`` of the same flops (M x K by K x N with
  M = T*k): ``tflops`` and ``frac_dense``.
* ``moe_layer``: ``kernels.moe.moe_mlp`` forward and backward against transformers' sparse MoE block (its
  ``grouped_mm`` and ``batched_mm`` experts implementations where the installed transformers has them), with
  the router, on the same weights.

    python -m benchmarks.bench_moe [--tokens 8192] [--out DIR]

Writes ``results/moe-<gpu>-<date>.json``.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

import kernels.moe
from benchmarks.common import copy_bandwidth_gbs, environment, time_fwd_bwd, timed_pass, timing_row, write_results
from kernels._common import row_block

#: name: (hidden, experts, intermediate, top_k, norm_topk, transformers model_type)
SHAPES = {"qwen3-30b-a3b": (2048, 128, 768, 8, True, "qwen3_moe"),
          "mixtral-8x7b": (4096, 8, 14336, 2, True, "mixtral")}


def _routed(tokens: int, hidden: int, experts: int, k: int, norm: bool):
    """(x, logits, weights, ids, pos, offs) of random tokens through a random router."""
    from kernels.moe import PlaceFunction, RouteFunction

    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    router = torch.randn(experts, hidden, device="cuda", dtype=torch.bfloat16) * hidden ** -0.5
    logits = F.linear(x, router)
    weights, ids = RouteFunction.apply(logits, k, norm)
    pos, _, offs = PlaceFunction.apply(ids, weights, experts)
    return x, router, logits, weights, ids, pos, offs


@contextlib.contextmanager
def _place_chunk(block: int):
    """``kernels.moe._place`` with chunks of ``block`` picks inside the block."""
    pick = kernels.moe._place_tile
    kernels.moe._place_tile = lambda picks, experts: dict(pick(picks, experts), BLOCK=min(block, row_block(picks)))
    try:
        yield
    finally:
        kernels.moe._place_tile = pick


def _row(base: dict, pas: str, fn, nbytes: int, copy_gbs: float) -> dict:
    return timing_row(base, pas, timed_pass(fn), nbytes, copy_gbs)


def data_movement_rows(name: str, tokens: int, copy_gbs: float) -> list[dict]:
    from kernels.moe import _combine, _expand, _place, _route_fwd, sort_picks

    hidden, experts, inter, k, norm, _ = SHAPES[name]
    x, _, logits, weights, ids, pos, _ = _routed(tokens, hidden, experts, k, norm)
    weights = weights.detach()
    shape = f"{name}: T {tokens}, H {hidden}, E {experts}, k {k}"
    rows = []

    def eager_route():
        p = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, i = torch.topk(p, k, dim=-1)
        return (w / w.sum(-1, keepdim=True) if norm else w), i

    route_bytes = tokens * experts * 2 + tokens * k * 8
    for impl, fn in (("ligermodels", lambda: _route_fwd(logits, k, norm)), ("torch-eager", eager_route)):
        rows.append(_row({"op": "route", "shape": shape, "dtype": "bfloat16", "impl": impl}, "fwd", fn,
                         route_bytes, copy_gbs))

    def ours_permute():
        p, w_sorted, offs = _place(ids, weights, experts)
        return _expand(x, p), w_sorted, offs

    def torch_sort_permute():
        order, p, offs = sort_picks(ids, experts)
        return _expand(x, p), weights.reshape(-1)[order], offs

    place_bytes = tokens * k * 4 * 5  # ids read twice, weights read, positions and weights written
    tile = kernels.moe._place_tile(ids.numel(), experts)
    for impl, block in (("ligermodels", tile["BLOCK"]), *((f"ligermodels-chunk-{b}", b) for b in (256, 512, 1024))):
        with _place_chunk(block):
            rows.append(_row({"op": "place", "shape": shape, "dtype": "bfloat16", "impl": impl, "chunk": block}, "fwd",
                             lambda: _place(ids, weights, experts), place_bytes, copy_gbs))
    rows.append(_row({"op": "place", "shape": shape, "dtype": "bfloat16", "impl": "ligermodels-torch-sort"}, "fwd",
                     lambda: (lambda o, p, offs: (p, weights.reshape(-1)[o], offs))(*sort_picks(ids, experts)),
                     place_bytes, copy_gbs))
    rows.append(_row({"op": "expand", "shape": shape, "dtype": "bfloat16", "impl": "ligermodels"}, "fwd",
                     lambda: _expand(x, pos), tokens * hidden * 2 * (1 + k), copy_gbs))

    def eager_permute():
        order = torch.argsort(ids.reshape(-1), stable=True)
        return x.index_select(0, order // k)

    permute_bytes = tokens * hidden * 2 * (1 + k) + tokens * k * 4
    for impl, fn in (("ligermodels", ours_permute), ("ligermodels-torch-sort", torch_sort_permute),
                     ("torch-eager", eager_permute)):
        rows.append(_row({"op": "permute", "shape": shape, "dtype": "bfloat16", "impl": impl}, "fwd", fn,
                         permute_bytes, copy_gbs))

    y = torch.randn(tokens * k, hidden, device="cuda", dtype=torch.bfloat16)
    token = torch.empty(tokens * k, dtype=torch.long, device="cuda").scatter_(
        0, pos.view(-1).long(), torch.arange(tokens, device="cuda").repeat_interleave(k))

    def eager_combine():
        out = torch.zeros(tokens, hidden, device="cuda", dtype=torch.float32)
        return out.index_add_(0, token, y.float()).to(torch.bfloat16)

    combine_bytes = tokens * hidden * 2 * (1 + k)
    for impl, fn in (("ligermodels", lambda: _combine(y, pos)), ("torch-eager", eager_combine)):
        rows.append(_row({"op": "combine", "shape": shape, "dtype": "bfloat16", "impl": impl}, "fwd", fn,
                         combine_bytes, copy_gbs))
    return rows


def _gemm_passes(m: int, n: int, kk: int, experts: int, offs: torch.Tensor) -> dict:
    """{pass: (grouped call, dense call of the same flops)} for the sorted rows (M, K) and experts (E, N, K)."""
    w = torch.randn(experts, n, kk, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(m, kk, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    dense_w = torch.randn(n, kk, device="cuda", dtype=torch.bfloat16)
    return {"fwd": (lambda: torch._grouped_mm(a, w.transpose(1, 2), offs=offs), lambda: a @ dense_w.T),
            "dgrad": (lambda: torch._grouped_mm(dy, w, offs=offs), lambda: dy @ dense_w),
            "wgrad": (lambda: torch._grouped_mm(dy.t(), a, offs=offs), lambda: dy.t() @ a)}


def gemm_rows(name: str, tokens: int) -> list[dict]:
    hidden, experts, inter, k, norm, _ = SHAPES[name]
    _, _, _, _, _, _, offs = _routed(tokens, hidden, experts, k, norm)
    m = tokens * k
    rows = []
    for proj, n, kk in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
        passes = _gemm_passes(m, n, kk, experts, offs)
        flops = 2 * m * n * kk
        for pas, (grouped, dense) in passes.items():
            tg, td = timed_pass(grouped), timed_pass(dense)
            rows.append({"op": "grouped_gemm", "shape": f"{name} {proj}: M {m}, N {n}, K {kk}, E {experts}",
                         "dtype": "bfloat16", "impl": "torch._grouped_mm", "pass": pas, "ms": round(tg.ms, 5),
                         "wall_ms": round(tg.wall_ms, 5), "timing": "cuda-kernels", "flops": flops,
                         "tflops": round(flops / tg.ms / 1e9, 1), "dense_ms": round(td.ms, 5),
                         "dense_tflops": round(flops / td.ms / 1e9, 1), "frac_dense": round(td.ms / tg.ms, 3)})
        del passes
        torch.cuda.empty_cache()
    return rows


def layer_rows(name: str, tokens: int, copy_gbs: float) -> list[dict]:
    """moe_mlp against transformers' sparse MoE block on the same weights, forward and backward."""
    import transformers

    from kernels.moe import moe_mlp

    hidden, experts, inter, k, norm, model_type = SHAPES[name]
    cfg = dict(hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=inter, num_experts=experts,
               num_local_experts=experts, num_experts_per_tok=k, norm_topk_prob=norm, num_hidden_layers=1,
               num_attention_heads=8, num_key_value_heads=8, vocab_size=128)
    torch.manual_seed(0)
    block_cls = (transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock if model_type == "qwen3_moe"
                 else transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock)
    router = torch.randn(experts, hidden, device="cuda", dtype=torch.bfloat16) * hidden ** -0.5
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * hidden ** -0.5
    down = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * inter ** -0.5
    shape = f"{name}: T {tokens}, H {hidden}, E {experts} x I {inter}, k {k}"
    rows = []

    def make(params=None):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        if params is not None:  # transformers' block: its own parameters, which hold the same weights
            return [x, *params]
        return [x, router.clone().requires_grad_(), gate_up.clone().requires_grad_(), down.clone().requires_grad_()]

    impls = {"ligermodels": (lambda x, r, gu, d: moe_mlp(x, r, gu, d, k, norm)[0], make)}
    for experts_impl in ("grouped_mm", "batched_mm", "eager"):
        try:
            config = transformers.AutoConfig.for_model(model_type, **cfg)  # one each: the block reads it per call
            config._experts_implementation = experts_impl
            block = block_cls(config).to("cuda", torch.bfloat16)
        except Exception as e:  # this transformers lacks it
            rows.append({"op": "moe_layer", "shape": shape, "impl": f"transformers-{experts_impl}",
                         "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        params = dict(block.named_parameters())
        with torch.no_grad():  # the same weights, in transformers' stacked layout
            next(p for n, p in params.items() if n.endswith("gate.weight")).copy_(router)
            next(p for n, p in params.items() if "gate_up_proj" in n).copy_(gate_up)
            next(p for n, p in params.items() if "down_proj" in n).copy_(down)
        impls[f"transformers-{experts_impl}"] = ((lambda b: lambda x, *_: _first(b(x[None]))[0])(block),
                                                 (lambda ps: lambda: make(ps))(list(params.values())))
    for impl, (fn, make_inputs) in impls.items():
        base = {"op": "moe_layer", "shape": shape, "dtype": "bfloat16", "impl": impl}
        try:
            fwd, bwd = time_fwd_bwd(fn, make_inputs())
        except Exception as e:
            rows.append({**base, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        for pas, t in (("fwd", fwd), ("bwd", bwd)):
            row = timing_row(base, pas, t, 0, copy_gbs)
            rows.append({k: v for k, v in row.items() if k not in ("bytes", "gbs", "frac_copy_bw", "same_size_copy_ms",
                                                                   "frac_same_size_copy")})
        torch.cuda.empty_cache()
    return rows


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for name in args.shapes:
        for part in (data_movement_rows, gemm_rows, layer_rows):
            got = part(name, args.tokens, copy_gbs) if part is not gemm_rows else part(name, args.tokens)
            for r in got:
                print(r)
            rows += got
            torch.cuda.empty_cache()
    env = environment()
    name = f"moe-{(env.get('gpu') or 'cpu').replace(' ', '_')}-{env['date']}"
    payload = {"benchmark": "mixture-of-experts kernels and one MoE layer", "copy_gbs": round(copy_gbs, 1),
               "tokens": args.tokens, "rows": rows}
    path = write_results(name, payload, args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
