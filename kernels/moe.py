"""Mixture-of-experts MLP: top-k routing, the experts' gated MLPs, the weighted combine; and the load-balancing loss.

Shapes: x (T, H) tokens; router weight (E, H); experts' gate_up (E, 2*I, H) (each expert's gate rows, then its up
rows, as ``nn.Linear`` weights) and down (E, H, I). M = T*k (token, expert) pairs.

Per token (as transformers' Qwen3-MoE / Mixtral blocks compute it, except that the logits are not rounded to x's
dtype): router logits ``x @ Wr.T`` accumulated and returned in fp32 (float64 for float64 inputs; transformers
rounds them to bf16 under bf16, which ties experts a fp32 logit tells apart); probabilities ``softmax`` in fp32;
the ``top_k`` largest, renormalised to sum 1 when ``norm_topk``; the token's output
``sum_j p_j * down_e(act(gate_e(x)) * up_e(x))`` over its k experts e_j. Every token reaches its k experts: no
capacity, nothing dropped.

The kernel path (:func:`moe_mlp` on CUDA, or through the interpreter), with no host synchronisation and no loop over
experts in Python:

1. ``route``: one Triton kernel takes the (T, E) logits to fp32 softmax, top-k (ties to the lower expert id) and the
   renormalisation: (T, k) fp32 weights and int32 expert ids. Its backward needs only the weights and ids when
   ``norm_topk`` (the renormalised weights are the softmax of the k picked logits), the logits otherwise.
2. ``place``: the M pairs' rows in their stable sort by expert, from two Triton kernels over chunks of picks:
   a histogram of each chunk's experts, then each chunk sorted by (expert, pick) in registers, a pick's row being
   its place there shifted by its expert's rows in the other chunks and experts (from the histograms). ``pos[t,
   j]`` is pair (t, j)'s row, ``offs[e]`` the end of expert e's rows, and the weights are written in row order
   (their gradient is a gather back): device tensors, never read on the host (``sort_picks``, ``torch.sort``, is
   the reference).
3. ``expand``: x's rows copied to their k sorted rows (one read of x, k writes), the permutation.
4. Grouped GEMMs (``torch._grouped_mm``, CUTLASS on sm90) for gate/up and down over the sorted rows.
5. ``scaled_glu``: ``act(gate) * up * p`` in fp32, rounded once: the routing weight is applied here, to the down
   projection's input, not to its output. Its backward kernel returns the weight's gradient (the row's dot product
   of the incoming gradient with ``act(gate) * up``) from values it has in registers, and writes the activation
   again for the down projection's weight gradient, so neither the activation nor the down projection's output is
   kept for backward (transformers scales the output: the same sum, rounded at another point in bf16).
6. ``combine``: each token's k rows summed in fp32 and rounded once, the un-permutation; its backward is
   ``expand``, and ``expand``'s is ``combine``: a gather each, with no atomics, so gradients are deterministic.

Saved for backward: x (which the router keeps anyway), the sorted weights and indices, and the (M, 2*I) gate/up
output; the expanded rows are copied again in backward. Grouped GEMMs need 16-byte-aligned rows (H and I multiples of
8 in bf16) and bf16 on CUDA (fp32 or bf16 on the CPU); other cases (float64 tests, odd sizes) loop over the experts
with their row counts read on the host.

:func:`moe_mlp_reference` is the PyTorch reference (CPU path and test oracle, float64-capable): tokens sorted by
expert, each expert's rows one matmul, the weighted sum in fp32 (transformers' Qwen3-MoE rounds the weights to x's
dtype first; Mixtral's keeps them in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kernels._common import LIB, check_floating, check_same_device, compute_dtype, eager_op, row_block, use_triton
from kernels.glu import GELU_ERF, GELU_TANH, SILU, _activation

_ACT = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


class RouterLogitsFunction(torch.autograd.Function):
    """``forward(x (T, H), weight (E, H))`` -> ``x @ weight.T`` (T, E) in fp32 (float64 for float64 x), from a
    bf16/fp16 GEMM that accumulates in fp32 and writes fp32 (``torch.mm(..., out_dtype=)`` on CUDA, an fp32 GEMM on
    casts elsewhere). Backward: the (T, E) fp32 gradient against fp32 casts of the weight and x, rounded once to
    their dtypes; the casts live only inside backward (x is saved in its own dtype)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        cd = compute_dtype(x.dtype)
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
            return torch.mm(x, weight.t(), out_dtype=cd)
        return F.linear(x.to(cd), weight.to(cd))

    @staticmethod
    def backward(ctx, dlogits):
        x, weight = ctx.saved_tensors
        dx = dlogits.mm(weight.to(dlogits.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = dlogits.t().mm(x.to(dlogits.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw


def router_logits(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """Router logits ``x @ router_weight.T`` (T, E) in fp32 (float64 for float64 x) from x (T, H) in any dtype
    (:class:`RouterLogitsFunction`); differentiable in both."""
    return RouterLogitsFunction.apply(x, router_weight)


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, norm_topk: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(router logits (T, E) fp32 (float64 for float64 x), top-k weights (T, k) in the logits' dtype, top-k expert
    ids (T, k) int64)."""
    logits = router_logits(x, router_weight)
    probs = torch.softmax(logits, dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights, experts


def moe_mlp_reference(x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                      top_k: int, norm_topk: bool, activation: str = "silu"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (T, H) in x's dtype, router logits (T, E)) of the MoE MLP on tokens ``x`` (T, H).

    The (token, expert) pairs are sorted by expert (a stable sort of the flattened top-k ids), each expert's
    contiguous rows go through its gate_up, GLU and down as one matmul each, and the rows, scaled by their
    routing weight in fp32, are summed back per token. Differentiable in x, the router and the experts."""
    t, h = x.shape
    e_count = gate_up.shape[0]
    logits, weights, experts = route(x, router_weight, top_k, norm_topk)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // top_k  # the token each sorted row comes from
    counts = torch.bincount(flat, minlength=e_count).tolist()
    rows = x[token]
    act = _ACT[activation]
    outs = []
    start = 0
    for e, n in enumerate(counts):
        if n:
            g, u = F.linear(rows[start:start + n], gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(act(g) * u, down[e]))
        start += n
    y = torch.cat(outs) if outs else rows.new_zeros(0, h)
    scaled = y.to(weights.dtype) * weights.reshape(-1)[order, None]
    out = torch.zeros(t, h, dtype=weights.dtype, device=x.device).index_add_(0, token, scaled)
    return out.to(x.dtype), logits


# --------------------------------------------------------------------------------------- kernels
_ACT_IDS = {"silu": SILU, "gelu_tanh": GELU_TANH, "gelu": GELU_ERF}


@triton.jit
def _route_fwd_kernel(l_ptr, w_ptr, id_ptr, n_tokens, n_experts, K: tl.constexpr, KP: tl.constexpr,
                      NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Softmax over each row of logits, its K largest probabilities (first the lower id on ties), renormalised when
    NORM: weights (T, K) in w's dtype, ids (T, K) int32."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < n_tokens
    cmask = cols[None, :] < n_experts
    z = tl.load(l_ptr + rows[:, None] * n_experts + cols[None, :], mask=rmask[:, None] & cmask, other=0.0)
    z = tl.where(cmask, z.to(w_ptr.dtype.element_ty), float("-inf"))
    p = tl.exp(z - tl.max(z, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    p = tl.where(cmask, p, -1.0)  # padding columns are never picked
    kc = tl.arange(0, KP)[None, :]
    wk = tl.zeros([BLOCK_T, KP], dtype=p.dtype)
    ik = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
    for j in tl.static_range(K):
        pj = tl.max(p, axis=1)
        ij = tl.min(tl.where(p == pj[:, None], cols[None, :], BLOCK_E), axis=1)
        wk = tl.where(kc == j, pj[:, None], wk)
        ik = tl.where(kc == j, ij[:, None], ik)
        p = tl.where(cols[None, :] == ij[:, None], -1.0, p)
    if NORM:
        wk = wk / tl.sum(wk, axis=1)[:, None]
    kmask = rmask[:, None] & (kc < K)
    tl.store(w_ptr + rows[:, None] * K + kc, wk, mask=kmask)
    tl.store(id_ptr + rows[:, None] * K + kc, ik, mask=kmask)


@triton.jit
def _route_bwd_kernel(dw_ptr, w_ptr, id_ptr, l_ptr, dl_ptr, n_tokens, n_experts, K: tl.constexpr, KP: tl.constexpr,
                      NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """d logits from d weights. With s = sum_j g_j w_j: NORM, dl = w_j (g_j - s) at the picked expert e_j and 0
    elsewhere (the renormalised weights are the softmax of the picked logits); else dl = p * (g at the picks - s)."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)[None, :]
    rmask = rows < n_tokens
    kc = tl.arange(0, KP)[None, :]
    kmask = rmask[:, None] & (kc < K)
    g = tl.load(dw_ptr + rows[:, None] * K + kc, mask=kmask, other=0.0).to(w_ptr.dtype.element_ty)
    w = tl.load(w_ptr + rows[:, None] * K + kc, mask=kmask, other=0.0)
    ids = tl.load(id_ptr + rows[:, None] * K + kc, mask=kmask, other=-1)
    s = tl.sum(g * w, axis=1)[:, None]
    val = w * (g - s) if NORM else g
    dense = tl.zeros([BLOCK_T, BLOCK_E], dtype=w.dtype)
    for j in tl.static_range(K):
        vj = tl.sum(tl.where(kc == j, val, 0.0), axis=1)[:, None]
        ij = tl.sum(tl.where(kc == j, ids, 0), axis=1)[:, None]
        dense = tl.where(cols == ij, vj, dense)
    mask = rmask[:, None] & (cols < n_experts)
    if not NORM:
        z = tl.load(l_ptr + rows[:, None] * n_experts + cols, mask=mask, other=0.0).to(w.dtype)
        z = tl.where(cols < n_experts, z, float("-inf"))
        p = tl.exp(z - tl.max(z, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        dense = p * (dense - s)
    tl.store(dl_ptr + rows[:, None] * n_experts + cols, dense.to(dl_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _count_kernel(id_ptr, cnt_ptr, n_picks, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """cnt[s, e]: how many of the picks s * BLOCK ... (s + 1) * BLOCK - 1 (flat (T*k,) ids) go to expert e."""
    s = tl.program_id(0)
    m = s * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(id_ptr + m, mask=m < n_picks, other=0)
    pad = tl.maximum(s * BLOCK + BLOCK - n_picks, 0)  # past the end: counted as expert 0, taken off again
    cols = tl.arange(0, BLOCK_E)
    tl.store(cnt_ptr + s * BLOCK_E + cols, tl.histogram(e, BLOCK_E) - tl.where(cols == 0, pad, 0))


@triton.jit
def _place_kernel(id_ptr, w_ptr, cnt_ptr, pos_ptr, ws_ptr, offs_ptr, n_picks, n_chunks, n_experts,
                  BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr):
    """Each pick's row in the stable sort by expert, for program s's chunk of BLOCK picks: the chunk sorted by
    (expert, pick), a pick's place in that order, plus, for its expert, the rows of lower experts and its picks in
    earlier chunks less the chunk's picks of lower experts (all from ``cnt``). Writes pos[m] = row, ws[row] = w[m],
    and (program 0) offs[e] = expert e's end row."""
    s = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s0 in range(0, n_chunks, BLOCK_S):
        rows = s0 + tl.arange(0, BLOCK_S)[:, None]
        c = tl.load(cnt_ptr + rows * BLOCK_E + cols[None, :], mask=rows < n_chunks, other=0)
        total += tl.sum(c, axis=0)
        before += tl.sum(tl.where(rows < s, c, 0), axis=0)
    ends = tl.cumsum(total, axis=0)  # each expert's end row
    if s == 0:
        tl.store(offs_ptr + cols, ends, mask=cols < n_experts)
    mine = tl.load(cnt_ptr + s * BLOCK_E + cols)
    shift = ends - total + before - (tl.cumsum(mine, axis=0) - mine)
    i = tl.arange(0, BLOCK)
    m = s * BLOCK + i
    e = tl.load(id_ptr + m, mask=m < n_picks, other=BLOCK_E)  # past the end: sorted last, not stored
    key = tl.sort(e * BLOCK + i)
    e = key // BLOCK
    m = s * BLOCK + key % BLOCK
    row = i + tl.gather(shift, tl.minimum(e, BLOCK_E - 1), axis=0)
    keep = e < BLOCK_E
    tl.store(pos_ptr + m, row, mask=keep)
    tl.store(ws_ptr + row, tl.load(w_ptr + m, mask=keep), mask=keep)


@triton.jit
def _expand_kernel(x_ptr, pos_ptr, o_ptr, n_cols, K: tl.constexpr, BLOCK: tl.constexpr):
    """o[pos[t, j]] = x[t] for each of token t's K rows (rows of n_cols, contiguous)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    v = tl.load(x_ptr + t * n_cols + cols, mask=mask)
    for j in tl.static_range(K):
        r = tl.load(pos_ptr + t * K + j).to(tl.int64)
        tl.store(o_ptr + r * n_cols + cols, v, mask=mask)


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, o_ptr, n_cols, K: tl.constexpr, BLOCK: tl.constexpr):
    """o[t] = sum_j y[pos[t, j]], summed in fp32 (float64 for float64) and rounded once."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    acc = tl.zeros([BLOCK], dtype=tl.float32) + tl.zeros([BLOCK], dtype=o_ptr.dtype.element_ty)
    for j in tl.static_range(K):
        r = tl.load(pos_ptr + t * K + j).to(tl.int64)
        acc += tl.load(y_ptr + r * n_cols + cols, mask=mask, other=0.0).to(acc.dtype)
    tl.store(o_ptr + t * n_cols + cols, acc.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scaled_glu_fwd_kernel(h_ptr, w_ptr, a_ptr, n_rows, n_cols, ACT: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_C: tl.constexpr):
    """a = act(gate) * up * w over a tile; h rows are [gate | up] (2 * n_cols), w one weight a row."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    w = tl.load(w_ptr + rows, mask=rows < n_rows, other=0.0)
    g = tl.load(h_ptr + rows * 2 * n_cols + cols, mask=mask, other=0.0).to(w.dtype)
    u = tl.load(h_ptr + rows * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(w.dtype)
    a, _ = _activation(g, ACT)
    tl.store(a_ptr + rows * n_cols + cols, (a * u * w).to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scaled_glu_bwd_kernel(da_ptr, h_ptr, w_ptr, dh_ptr, a_ptr, dw_ptr, n_rows, n_cols, ACT: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """For a = act(g) * u * w: dg, du into dh's [gate | up] rows, dw = sum over the row of da * act(g) * u, and a
    written again (the down projection's weight gradient needs it). Each program walks its rows' columns."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    rmask = rows < n_rows
    w = tl.load(w_ptr + rows, mask=rmask, other=0.0)
    dw = tl.zeros([BLOCK_R, 1], dtype=w.dtype)
    for c0 in range(0, n_cols, BLOCK_C):
        cols = (c0 + tl.arange(0, BLOCK_C))[None, :]
        mask = rmask & (cols < n_cols)
        d = tl.load(da_ptr + rows * n_cols + cols, mask=mask, other=0.0).to(w.dtype)
        g = tl.load(h_ptr + rows * 2 * n_cols + cols, mask=mask, other=0.0).to(w.dtype)
        u = tl.load(h_ptr + rows * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(w.dtype)
        a, da = _activation(g, ACT)
        dw += tl.sum(d * a * u, axis=1)[:, None]
        tl.store(dh_ptr + rows * 2 * n_cols + cols, (d * w * u * da).to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptr + rows * 2 * n_cols + n_cols + cols, (d * w * a).to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(a_ptr + rows * n_cols + cols, (a * u * w).to(a_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + rows, dw, mask=rmask)


# ------------------------------------------------------------------------------------ custom ops
def _route_tile(experts: int) -> dict:
    block_e = row_block(experts)
    return {"BLOCK_E": block_e, "BLOCK_T": max(1, 2048 // block_e), "num_warps": 4}


@eager_op
@triton_op(f"{LIB}::moe_route_fwd", mutates_args={})
def _route_fwd(logits: torch.Tensor, top_k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) fp32 / float64, expert ids (T, k) int32) of contiguous (T, E) logits."""
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=compute_dtype(logits.dtype), device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t:
        tile = _route_tile(e)
        wrap_triton(_route_fwd_kernel)[(triton.cdiv(t, tile["BLOCK_T"]),)](
            logits, weights, ids, t, e, K=top_k, KP=row_block(top_k), NORM=norm_topk, **tile)
    return weights, ids


@eager_op
@triton_op(f"{LIB}::moe_route_bwd", mutates_args={})
def _route_bwd(dweights: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor,
               norm_topk: bool) -> torch.Tensor:
    """d logits (T, E) in the logits' dtype."""
    t, e = logits.shape
    dlogits = torch.empty_like(logits)
    if t:
        tile = _route_tile(e)
        wrap_triton(_route_bwd_kernel)[(triton.cdiv(t, tile["BLOCK_T"]),)](
            dweights.contiguous(), weights, ids, logits, dlogits, t, e, K=ids.shape[1], KP=row_block(ids.shape[1]),
            NORM=norm_topk, **tile)
    return dlogits


def _row_tile(cols: int) -> tuple[int, int]:
    block = min(row_block(cols), 4096)
    return block, max(1, min(8, block // 256))


def _place_tile(picks: int, experts: int) -> dict:
    """Chunks of the placement kernels: 256 to 1024 picks (fewer if there are fewer), as many as keep the chunks'
    counts (chunks x E, which every program sums) near 16K values; 4 warps. The register sort costs more per pick as
    the chunk grows, the programs' sums grow with chunks^2 x E: this picks the fastest of 256, 512 and 1024 measured
    at both benchmark shapes (docs/moe.md, ``benchmarks/bench_moe.py``)."""
    block_e = row_block(experts)
    block = min(1024, max(256, row_block(triton.cdiv(picks * block_e, 16384))), row_block(picks))
    return {"BLOCK": block, "BLOCK_E": block_e, "BLOCK_S": max(1, 4096 // block_e), "num_warps": 4}


@eager_op
@triton_op(f"{LIB}::moe_place", mutates_args={})
def _place(ids: torch.Tensor, weights: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stable sort of the (T, k) int32 expert ids by expert, as placements: (pos (T, k) int32, each pick's
    row; w_sorted (T*k,), the weights in row order; offs (E,) int32, each expert's end row). ids and weights are
    contiguous, as ``_route_fwd`` writes them."""
    m = ids.numel()
    pos = torch.empty(ids.shape, dtype=torch.int32, device=ids.device)
    w_sorted = torch.empty(m, dtype=weights.dtype, device=weights.device)
    offs = (torch.empty if m else torch.zeros)(experts, dtype=torch.int32, device=ids.device)
    if m:
        tile = _place_tile(m, experts)
        chunks = triton.cdiv(m, tile["BLOCK"])
        counts = torch.empty(chunks, tile["BLOCK_E"], dtype=torch.int32, device=ids.device)
        wrap_triton(_count_kernel)[(chunks,)](ids, counts, m, BLOCK=tile["BLOCK"], BLOCK_E=tile["BLOCK_E"],
                                              num_warps=tile["num_warps"])
        wrap_triton(_place_kernel)[(chunks,)](ids, weights, counts, pos, w_sorted, offs, m, chunks, experts, **tile)
    return pos, w_sorted, offs


@eager_op
@triton_op(f"{LIB}::moe_expand", mutates_args={})
def _expand(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(T*k, H): row pos[t, j] holds x[t]. x (T, H) contiguous, pos (T, k) int64 or int32, a permutation."""
    t, h = x.shape
    out = torch.empty(pos.numel(), h, dtype=x.dtype, device=x.device)
    if out.numel():
        block, warps = _row_tile(h)
        wrap_triton(_expand_kernel)[(t, triton.cdiv(h, block))](x, pos, out, h, K=pos.shape[1], BLOCK=block,
                                                                 num_warps=warps)
    return out


@eager_op
@triton_op(f"{LIB}::moe_combine", mutates_args={})
def _combine(y: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(T, H): row t the sum of y's rows pos[t, :]. y (T*k, H) contiguous."""
    t, h = pos.shape[0], y.shape[1]
    out = torch.empty(t, h, dtype=y.dtype, device=y.device)
    if out.numel():
        block, warps = _row_tile(h)
        wrap_triton(_combine_kernel)[(t, triton.cdiv(h, block))](y, pos, out, h, K=pos.shape[1], BLOCK=block,
                                                                  num_warps=warps)
    return out


def _glu_tile(rows: int, cols: int) -> tuple[int, int, int]:
    block_c = min(row_block(cols), 1024)
    block_r = max(1, min(4096 // block_c, row_block(rows)))
    return block_r, block_c, max(1, min(8, block_r * block_c // 512))


@eager_op
@triton_op(f"{LIB}::moe_scaled_glu_fwd", mutates_args={})
def _scaled_glu_fwd(h: torch.Tensor, w: torch.Tensor, act: int) -> torch.Tensor:
    """(M, I) act(gate) * up * w of packed (M, 2*I) ``h`` and (M,) weights ``w``."""
    m, cols = h.shape[0], h.shape[1] // 2
    out = torch.empty(m, cols, dtype=h.dtype, device=h.device)
    if out.numel():
        br, bc, warps = _glu_tile(m, cols)
        wrap_triton(_scaled_glu_fwd_kernel)[(triton.cdiv(m, br), triton.cdiv(cols, bc))](
            h, w, out, m, cols, ACT=act, BLOCK_R=br, BLOCK_C=bc, num_warps=warps)
    return out


@eager_op
@triton_op(f"{LIB}::moe_scaled_glu_bwd", mutates_args={})
def _scaled_glu_bwd(da: torch.Tensor, h: torch.Tensor, w: torch.Tensor, act: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh (M, 2*I), dw (M,) in w's dtype, the forward output again (M, I))."""
    m, cols = h.shape[0], h.shape[1] // 2
    dh, dw = torch.empty_like(h), torch.empty_like(w)
    a = torch.empty(m, cols, dtype=h.dtype, device=h.device)
    if m:
        br, bc, warps = _glu_tile(m, cols)
        br = min(br, 16)
        wrap_triton(_scaled_glu_bwd_kernel)[(triton.cdiv(m, br),)](
            da.contiguous(), h, w, dh, a, dw, m, cols, ACT=act, BLOCK_R=br, BLOCK_C=bc, num_warps=warps)
    return dh, dw, a


# ---------------------------------------------------------------------------------- grouped GEMMs
def grouped_gemm_device(device: torch.device) -> bool:
    """Whether bf16 grouped GEMMs run on ``device`` through ``torch._grouped_mm`` (an sm90+ GPU), so that the kernel
    path never reads the per-expert counts on the host (what CUDA-graph capture needs)."""
    return (hasattr(torch, "_grouped_mm") and device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= (9, 0))


def _grouped_mm_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: bf16 on an sm90+ GPU, fp32 or bf16 on the CPU, each
    operand unit-strided in one of its last two dims with the other stride (its rows or columns) 16-byte aligned, and
    the output's rows too."""
    if not hasattr(torch, "_grouped_mm") or a.dtype != b.dtype:
        return False
    if a.device.type == "cuda":
        if a.dtype != torch.bfloat16 or not grouped_gemm_device(a.device):
            return False
    elif a.device.type != "cpu" or a.dtype not in (torch.float32, torch.bfloat16):
        return False

    def aligned(t: torch.Tensor) -> bool:
        s = t.stride()[-2:]
        return 1 in s and max(s) * t.element_size() % 16 == 0

    return aligned(a) and aligned(b) and b.shape[-1] * b.element_size() % 16 == 0


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` where it takes the operands, else the same product per expert with the
    group ends read on the host: ``b`` (E, K, N): rows ``offs[e-1]:offs[e]`` of ``a`` (M, K) times ``b[e]`` -> (M,
    N); ``b`` (M, N): columns of ``a`` (K, M) times rows of ``b`` in each group -> (E, K, N)."""
    if _grouped_mm_ok(a, b):
        return torch._grouped_mm(a, b, offs=offs)
    ends = offs.tolist()
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[2])
        for e, (s, n) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
            out[s:n] = a[s:n] @ b[e]
    else:
        out = a.new_zeros(len(ends), a.shape[0], b.shape[1])
        for e, (s, n) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
            out[e] = a[:, s:n] @ b[s:n]
    return out


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(M, N): the rows of expert e (``offs[e-1]:offs[e]``) of ``x`` (M, K) times ``weight[e].T``, weight (E, N, K)."""
    return _grouped_mm(x, weight.transpose(1, 2), offs)


def grouped_linear_input_grad(dy: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(M, K): the rows of expert e of ``dy`` (M, N) times ``weight[e]`` (N, K)."""
    return _grouped_mm(dy, weight, offs)


def grouped_linear_weight_grad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(E, N, K): ``dy[rows of e].T @ x[rows of e]`` for each expert (zeros for an expert with no rows)."""
    return _grouped_mm(dy.t(), x, offs)


def sort_picks(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The permutation of the (T, k) expert ids ``ids`` by ``torch.sort`` (stable), the reference of the placement
    kernels: (order (T*k,): the pick t * k + j of each sorted row, pos (T, k): each pick's row, offs (E,) int32:
    each expert's end row)."""
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=ids.device))
    offs = torch.searchsorted(sorted_ids, torch.arange(experts, device=ids.device, dtype=sorted_ids.dtype),
                              right=True)
    return order, pos.view(ids.shape), offs.to(torch.int32)


# ------------------------------------------------------------------------------------- autograd
class RouteFunction(torch.autograd.Function):
    """``forward(logits (T, E), top_k, norm_topk)`` -> (weights (T, k), ids (T, k) int32, not differentiable)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, top_k: int, norm_topk: bool):
        weights, ids = _route_fwd(logits, top_k, norm_topk)
        ctx.mark_non_differentiable(ids)
        ctx.save_for_backward(weights, ids, logits)
        ctx.norm_topk = norm_topk
        return weights, ids

    @staticmethod
    def backward(ctx, dweights: torch.Tensor, _dids):
        weights, ids, logits = ctx.saved_tensors
        return _route_bwd(dweights, weights, ids, logits, ctx.norm_topk), None, None


class PlaceFunction(torch.autograd.Function):
    """``forward(ids (T, k) int32, weights (T, k), both contiguous, experts)`` -> (pos (T, k) int32, w_sorted
    (T*k,), offs (E,) int32): the placement kernels (module docstring, step 2). Only w_sorted is differentiable:
    the gradient of weights[t, j] is that of w_sorted[pos[t, j]], a gather."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weights: torch.Tensor, experts: int):
        pos, w_sorted, offs = _place(ids, weights, experts)
        ctx.mark_non_differentiable(pos, offs)
        ctx.save_for_backward(pos)
        return pos, w_sorted, offs

    @staticmethod
    def backward(ctx, _dpos, dw_sorted: torch.Tensor, _doffs):
        (pos,) = ctx.saved_tensors
        return None, dw_sorted.index_select(0, pos.view(-1)).view(pos.shape), None


class ExpertsFunction(torch.autograd.Function):
    """The experts' half of the MoE MLP on routed tokens: expand, grouped gate/up, scaled GLU, grouped down,
    combine (module docstring, steps 3-6). ``forward(x (T, H), w_sorted (M,), pos (T, k), offs (E,) int32,
    gate_up (E, 2I, H), down (E, H, I), act)`` -> (T, H)."""

    @staticmethod
    def forward(ctx, x, w_sorted, pos, offs, gate_up, down, act):
        h = grouped_linear(_expand(x, pos), gate_up, offs)
        y = grouped_linear(_scaled_glu_fwd(h, w_sorted, act), down, offs)
        ctx.save_for_backward(x, w_sorted, pos, offs, gate_up, down, h)
        ctx.act = act
        return _combine(y, pos)

    @staticmethod
    def backward(ctx, dout):
        x, w_sorted, pos, offs, gate_up, down, h = ctx.saved_tensors
        dy = _expand(dout.contiguous(), pos)
        dh, dw, a = _scaled_glu_bwd(grouped_linear_input_grad(dy, down, offs), h, w_sorted, ctx.act)
        d_down = grouped_linear_weight_grad(dy, a, offs) if ctx.needs_input_grad[5] else None
        del dy, a
        d_gate_up = (grouped_linear_weight_grad(dh, _expand(x, pos), offs) if ctx.needs_input_grad[4] else None)
        dx = _combine(grouped_linear_input_grad(dh, gate_up, offs), pos)
        return dx, dw, None, None, d_gate_up, d_down, None


def moe_mlp(x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
            norm_topk: bool, activation: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """(output (T, H) in x's dtype, router logits (T, E) fp32) of the MoE MLP on tokens ``x`` (T, H).

    Args:
        x: (T, H) tokens; router_weight: (E, H); gate_up: (E, 2*I, H); down: (E, H, I).
        top_k: experts per token; norm_topk: renormalise the k weights to sum 1.
        activation: "silu" (SwiGLU), "gelu_tanh" or "gelu".
    The kernel path on CUDA (and through the interpreter), :func:`moe_mlp_reference` elsewhere; both differentiable
    in x, the router and the experts."""
    if activation not in _ACT_IDS:
        raise ValueError(f"moe_mlp: activation must be one of {sorted(_ACT_IDS)}, got {activation!r}")
    check_floating("moe_mlp", x=x, router_weight=router_weight, gate_up=gate_up, down=down)
    check_same_device(x, router_weight, gate_up, down)
    e, h = router_weight.shape
    if x.dim() != 2 or x.shape[1] != h or gate_up.shape[::2] != (e, h) or down.shape[:2] != (e, h) \
            or gate_up.shape[1] != 2 * down.shape[2] or not 0 < top_k <= e:
        raise ValueError(f"moe_mlp: x {tuple(x.shape)}, router {tuple(router_weight.shape)}, gate_up "
                         f"{tuple(gate_up.shape)}, down {tuple(down.shape)} and top_k {top_k} do not fit "
                         "(T, H), (E, H), (E, 2I, H), (E, H, I), 0 < k <= E")
    if not use_triton(x):
        return moe_mlp_reference(x, router_weight, gate_up, down, top_k, norm_topk, activation)
    x = x.contiguous()
    logits = router_logits(x, router_weight)
    weights, ids = RouteFunction.apply(logits, top_k, norm_topk)
    pos, w_sorted, offs = PlaceFunction.apply(ids, weights, e)
    out = ExpertsFunction.apply(x, w_sorted, pos, offs, gate_up, down, _ACT_IDS[activation])
    return out, logits


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss over the sparse layers, as transformers' ``load_balancing_loss_func``
    without an attention mask: ``E * sum_e f_e * P_e``, with f_e the share of (token, layer) top-k picks that go to
    expert e and P_e its mean routing probability, both over every token of every layer. Gradients flow through the
    probabilities. ``router_logits``: one (T, E) tensor per sparse layer."""
    counts = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    prob_sum = torch.zeros_like(counts)
    rows = 0
    for logits in router_logits:
        probs = torch.softmax(logits, dim=-1)
        picks = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        counts = counts.index_add(0, picks, torch.ones_like(picks, dtype=counts.dtype))
        prob_sum = prob_sum + probs.float().sum(dim=0)
        rows += logits.shape[0]
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))




__all__ = ["route", "moe_mlp", "moe_mlp_reference", "sort_picks", "grouped_linear", "grouped_gemm_device",
           "load_balancing_loss"]
