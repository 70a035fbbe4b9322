"""Causal attention within packed documents (and a sliding window), FlashAttention's algorithm in Triton, on
the (B, S, H, D) layout of a packed q/k/v projection.

Query ``i`` of row ``b`` sees key ``j`` of the same row when ``starts[b, i] <= j <= i`` and ``i - j < window``:
``starts[b, i]`` is the position where i's document begins. Documents are contiguous runs of a row (their ids
never decrease along it), so ``starts`` and ``ends`` (the exclusive end of each token's document) describe them
completely; :func:`document_bounds` derives both from (B, S) document ids on the device (no host sync), once
per forward for every layer.

Why a kernel of our own: PyTorch's FlashAttention-2 variable-length kernel (the path for packed documents
before this one) ran at 160 useful TFLOP/s on an H100 at Qwen2-1.5B's heads against cuDNN's 340 for
plain causal attention, so attending within documents cost 3-4.5% of a training step although it
computes a third fewer pairs (``benchmarks/results/attention-*.json``, ``experiments/train-*-26d1.json``);
cuDNN's own ragged path returns wrong gradients in torch 2.11. Measured (``attention-*-26t4.json``): 0.58 ms a
layer at Qwen2-1.5B b4 against FlashAttention-2's 0.71, about 200 useful TFLOP/s (20% of the bf16 peak; cuDNN's
causal kernel reaches 35%), the dK/dV kernel taking two thirds of it; at head dim 256 it is twice as slow as
FlashAttention-2, which the model keeps there.

Forward, per (query block, batch x q head) program: online softmax over the key blocks that hold an
allowed pair, in base 2 (the softmax scale times log2(e) folded into the logits); it writes O (B, S, Hq, D)
and the log-sum-exp (B, Hq, S) fp32 for backward. The key blocks split into three runs: masked ones at the
documents' starts (and the window's edge), unmasked ones in the middle, masked ones on the diagonal.

Backward, FlashAttention-2's: ``delta = rowsum(dO * O)``; one kernel per (key block, batch x kv head) walks
the query blocks that see it, for every q head of its group (grouped-query attention without atomics or
repeated k/v), accumulating dK and dV (when that gives too few programs to fill the GPU, the group's heads
are split over several programs, whose fp32 partial sums one more kernel adds); one kernel per (query block,
batch x q head) accumulates dQ.
With ``P = softmax(scale * Q K^T)`` and ``dS = P * (dO V^T - delta)``:
``dV = P^T dO``, ``dK = scale * dS^T Q``, ``dQ = scale * dS K``.

Soft-capping (Gemma 2, ``softcap=cap``): the logits are ``cap * T`` with ``T = tanh(scale * Q K^T / cap)``
(before the mask); in base 2 ``cap * log2(e) * T``, ``tanh`` computed from one ``exp2``. The backward
recomputes ``T`` and ``P`` the same way and goes through the cap with ``dS = P * (dO V^T - delta) * (1 - T^2)``,
the formulas above unchanged otherwise. Off, the kernels compile without it (a constexpr).

Flops (useful: allowed pairs only): forward 4 * D * Hq per pair, backward 10 * D * Hq (two more matmuls and
the recomputed QK^T). Bytes are small against them (q, k, v, o and their gradients once each, plus
re-reads of q/dO per key block and k/v per query block, mostly from L2).
"""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kernels._common import INTERPRET, LIB, check_same_device, compute_dtype, eager_op, unit_last, use_triton

_LOG2E = 1.4426950408889634


@triton.jit
def _allowed(q_idx, k_idx, starts_q, window, HAS_WINDOW: tl.constexpr):
    """Whether query ``q_idx`` may see key ``k_idx`` (broadcast shapes, queries as rows or as columns):
    ``starts_q <= k <= q`` and, with a window, ``q - k < window``."""
    ok = (k_idx <= q_idx) & (k_idx >= starts_q)
    if HAS_WINDOW:
        ok = ok & (q_idx - k_idx < window)
    return ok


@triton.jit
def _tanh_exp2(x2):
    """tanh(x) given ``x2 = 2 * x * log2(e)``: ``1 - 2 / (2^x2 + 1)``, fp32. exp2 rather than libdevice's tanh, so
    the interpreter runs it too; it saturates to exactly +-1 (2^x2 overflows to inf, or underflows to 0), and
    its error is a few ulp of 1 (absolute, so a logit ``cap * tanh`` is off by about cap * 1e-7)."""
    return 1.0 - 2.0 / (tl.math.exp2(x2) + 1.0)


@triton.jit
def _fwd_run(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, starts_m, lo, hi, S, window,
             qk_scale, cap_log2, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
             MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """Online softmax of one query block over the key blocks [lo, hi): (acc, l, m) updated. Base-2 logits:
    ``q.k * qk_scale``, or with SOFTCAP ``cap_log2 * tanh`` of ``q.k * qk_scale`` (see :func:`_scales`)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_ok = (offs_n < S)[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_ok, other=0.0)
        if SOFTCAP:
            s = cap_log2 * _tanh_exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale)
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if MASKED:
            ok = _allowed(offs_m[:, None], offs_n[None, :], starts_m[:, None], window, HAS_WINDOW)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=kv_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _key_runs(STARTS_row, m0, m_last, window, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key-block runs of the query block [m0, m_last]: masked [lo, mid), unmasked [mid, diag), masked
    [diag, m_last + 1). Starts never decrease along a row, so the block's first and last queries bound them."""
    lo = tl.load(STARTS_row + m0)
    full_from = tl.load(STARTS_row + m_last)  # keys from here are in every query's document
    if HAS_WINDOW:
        lo = tl.maximum(lo, m0 - window + 1)
        full_from = tl.maximum(full_from, m_last - window + 1)
    lo = (lo // BLOCK_N) * BLOCK_N
    diag = (m0 // BLOCK_N) * BLOCK_N  # key blocks from here may pass a query's own position
    mid = tl.minimum(tl.maximum(tl.cdiv(full_from, BLOCK_N) * BLOCK_N, lo), diag)
    return lo, mid, diag


@triton.jit
def _query_block(Q, K, V, STARTS, sq_b, sq_s, sq_h, sk_b, sk_h, sv_b, sv_h, S, HQ, G, window,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_WINDOW: tl.constexpr):
    """What the forward and the dQ kernel set up for their (query block, batch x q head) program: the batch
    and head, the block's last row, its offsets and masks, its q tile, its queries' document starts, the
    key-block runs (:func:`_key_runs`) and the k / v bases of its kv head."""
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    m0 = tl.program_id(0) * BLOCK_M
    m_last = tl.minimum(m0 + BLOCK_M, S) - 1
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < S
    io_ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :], mask=io_ok, other=0.0)
    STARTS_row = STARTS + b * S
    starts_m = tl.load(STARTS_row + offs_m, mask=row_ok, other=0)
    lo, mid, diag = _key_runs(STARTS_row, m0, m_last, window, HAS_WINDOW, BLOCK_N)
    k_base = K + b * sk_b + (h // G) * sk_h
    v_base = V + b * sv_b + (h // G) * sv_h
    return b, h, m_last, offs_m, offs_d, row_ok, io_ok, q, starts_m, lo, mid, diag, k_base, v_base


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE, STARTS, sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h,
                     so_b, so_s, so_h, S, HQ, G, window, qk_scale, cap_log2, HEAD_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    qk_scale = tl.cast(qk_scale, tl.float32)  # a float under Inductor is fp64: keep the loops in fp32
    cap_log2 = tl.cast(cap_log2, tl.float32)
    bh = tl.program_id(1)
    b, h, m_last, offs_m, offs_d, row_ok, io_ok, q, starts_m, lo, mid, diag, k_base, v_base = _query_block(
        Q, K, V, STARTS, sq_b, sq_s, sq_h, sk_b, sk_h, sv_b, sv_h, S, HQ, G, window, HEAD_DIM, BLOCK_D, BLOCK_M,
        BLOCK_N, HAS_WINDOW)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _fwd_run(acc, l_i, m_i, q, k_base, v_base, sk_s, sv_s, offs_m, starts_m, lo, mid, S, window,
                             qk_scale, cap_log2, HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_WINDOW, PRECISION, SOFTCAP)
    acc, l_i, m_i = _fwd_run(acc, l_i, m_i, q, k_base, v_base, sk_s, sv_s, offs_m, starts_m, mid, diag, S, window,
                             qk_scale, cap_log2, HEAD_DIM, BLOCK_D, BLOCK_N, False, HAS_WINDOW, PRECISION, SOFTCAP)
    acc, l_i, m_i = _fwd_run(acc, l_i, m_i, q, k_base, v_base, sk_s, sv_s, offs_m, starts_m, diag, m_last + 1, S,
                             window, qk_scale, cap_log2, HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_WINDOW, PRECISION,
                             SOFTCAP)
    l_i = tl.where(row_ok, l_i, 1.0)
    o = acc / l_i[:, None]
    tl.store(O + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :], o.to(O.dtype.element_ty), mask=io_ok)
    tl.store(LSE + bh * S + offs_m, m_i + tl.math.log2(l_i), mask=row_ok)


@triton.jit
def _attn_delta_kernel(O, DO, DELTA, so_b, so_s, so_h, sd_b, sd_s, sd_h, S, HQ, HEAD_DIM: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta[b, h, i] = sum_d O * dO, fp32 (B, Hq, S)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_m < S)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(O + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(DO + b * sd_b + h * sd_h + offs_m[:, None] * sd_s + offs_d[None, :], mask=ok, other=0.0)
    tl.store(DELTA + bh * S + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=offs_m < S)


@triton.jit
def _bwd_kv_run(dk, dv, k, v, q_base, do_base, lse_base, delta_base, STARTS_row, sq_s, sd_s, offs_n, lo, hi, S,
                window, qk_scale, cap_log2, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """dK, dV of one key block from the query blocks [lo, hi) of one q head (transposed: keys are rows)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < S
        io_ok = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_base + offs_m[:, None] * sq_s + offs_d[None, :], mask=io_ok, other=0.0)
        lse = tl.load(lse_base + offs_m, mask=row_ok, other=0.0)
        # transposed, keys as rows: (BLOCK_N, BLOCK_M)
        if SOFTCAP:
            t_t = _tanh_exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale)
            p_t = tl.math.exp2(cap_log2 * t_t - lse[None, :])
        else:
            p_t = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse[None, :])
        if MASKED:
            starts_m = tl.load(STARTS_row + offs_m, mask=row_ok, other=0)
            ok = _allowed(offs_m[None, :], offs_n[:, None], starts_m[None, :], window, HAS_WINDOW) & row_ok[None, :]
            p_t = tl.where(ok, p_t, 0.0)
        do = tl.load(do_base + offs_m[:, None] * sd_s + offs_d[None, :], mask=io_ok, other=0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        ds_t = p_t * (tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :])
        if SOFTCAP:  # through the cap: d(cap * tanh(x)) / dx = 1 - tanh(x)^2
            ds_t = ds_t * (1.0 - t_t * t_t)
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_kv_kernel(Q, K, V, DO, LSE, DELTA, STARTS, ENDS, DK, DV, sq_b, sq_s, sq_h, sk_b, sk_s, sk_h,
                        sv_b, sv_s, sv_h, sd_b, sd_s, sd_h, s_part, so_b, so_s, so_h, S, HQ, HKV, G, SPLIT,
                        window, qk_scale, cap_log2, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                        PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """dK, dV of one key block of one kv head, from the G / SPLIT q heads of its group this program takes:
    into DK / DV (SPLIT 1), or into part ``part`` of fp32 partial sums (``s_part`` elements apart)."""
    qk_scale = tl.cast(qk_scale, tl.float32)  # a float under Inductor is fp64: keep the loops in fp32
    cap_log2 = tl.cast(cap_log2, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1) // SPLIT
    part = tl.program_id(1) % SPLIT
    b = bhk // HKV
    hk = bhk % HKV
    n0 = pid_n * BLOCK_N
    n_last = tl.minimum(n0 + BLOCK_N, S) - 1
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_ok = (offs_n < S)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + b * sk_b + hk * sk_h + offs_n[:, None] * sk_s + offs_d[None, :], mask=kv_ok, other=0.0)
    v = tl.load(V + b * sv_b + hk * sv_h + offs_n[:, None] * sv_s + offs_d[None, :], mask=kv_ok, other=0.0)
    # The queries that see a key of this block: [n0, end of the last key's document) (and its window).
    q_end = tl.load(ENDS + b * S + n_last)
    full_hi = tl.load(ENDS + b * S + n0)  # queries before it share the first key's document
    if HAS_WINDOW:
        q_end = tl.minimum(q_end, n_last + window)
        full_hi = tl.minimum(full_hi, n0 + window)
    q_end = tl.cdiv(q_end, BLOCK_M) * BLOCK_M
    q_lo = (n0 // BLOCK_M) * BLOCK_M
    # query blocks wholly after every key and in the first key's document see the whole block: unmasked
    a = tl.minimum(tl.cdiv(n_last + 1, BLOCK_M) * BLOCK_M, q_end)
    c = tl.maximum(a, tl.minimum((full_hi // BLOCK_M) * BLOCK_M, q_end))
    STARTS_row = STARTS + b * S
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    heads = G // SPLIT
    for g in range(heads):
        h = hk * G + part * heads + g
        q_base = Q + b * sq_b + h * sq_h
        do_base = DO + b * sd_b + h * sd_h
        lse_base = LSE + (b * HQ + h) * S
        delta_base = DELTA + (b * HQ + h) * S
        dk, dv = _bwd_kv_run(dk, dv, k, v, q_base, do_base, lse_base, delta_base, STARTS_row, sq_s, sd_s, offs_n,
                             q_lo, a, S, window, qk_scale, cap_log2, HEAD_DIM, BLOCK_D, BLOCK_M, True, HAS_WINDOW,
                             PRECISION, SOFTCAP)
        dk, dv = _bwd_kv_run(dk, dv, k, v, q_base, do_base, lse_base, delta_base, STARTS_row, sq_s, sd_s, offs_n,
                             a, c, S, window, qk_scale, cap_log2, HEAD_DIM, BLOCK_D, BLOCK_M, False, HAS_WINDOW,
                             PRECISION, SOFTCAP)
        dk, dv = _bwd_kv_run(dk, dv, k, v, q_base, do_base, lse_base, delta_base, STARTS_row, sq_s, sd_s, offs_n,
                             c, q_end, S, window, qk_scale, cap_log2, HEAD_DIM, BLOCK_D, BLOCK_M, True, HAS_WINDOW,
                             PRECISION, SOFTCAP)
    dk = dk * sm_scale
    out = part * s_part + b * so_b + hk * so_h + offs_n[:, None] * so_s + offs_d[None, :]
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _attn_sum_parts_kernel(DKP, DVP, DK, DV, n, SPLIT, BLOCK: tl.constexpr):
    """DK / DV (n elements, contiguous) = the sums of their SPLIT fp32 partials (SPLIT x n each)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    dk = tl.zeros((BLOCK,), dtype=tl.float32)
    dv = tl.zeros((BLOCK,), dtype=tl.float32)
    for p in range(SPLIT):
        dk += tl.load(DKP + p * n + offs, mask=ok, other=0.0)
        dv += tl.load(DVP + p * n + offs, mask=ok, other=0.0)
    tl.store(DK + offs, dk.to(DK.dtype.element_ty), mask=ok)
    tl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=ok)


@triton.jit
def _bwd_q_run(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, offs_m, starts_m, lo, hi, S, window,
               qk_scale, cap_log2, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """dQ of one query block from the key blocks [lo, hi)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_ok = (offs_n < S)[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=kv_ok, other=0.0)
        if SOFTCAP:
            t = _tanh_exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale)
            p = tl.math.exp2(cap_log2 * t - lse[:, None])
        else:
            p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale - lse[:, None])
        if MASKED:
            ok = _allowed(offs_m[:, None], offs_n[None, :], starts_m[:, None], window, HAS_WINDOW)
            p = tl.where(ok, p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
        if SOFTCAP:  # through the cap: d(cap * tanh(x)) / dx = 1 - tanh(x)^2
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _attn_bwd_q_kernel(Q, K, V, DO, LSE, DELTA, STARTS, DQ, sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s,
                       sv_h, sd_b, sd_s, sd_h, sdq_b, sdq_s, sdq_h, S, HQ, G, window, qk_scale, cap_log2, sm_scale,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
                       SOFTCAP: tl.constexpr):
    qk_scale = tl.cast(qk_scale, tl.float32)  # a float under Inductor is fp64: keep the loops in fp32
    cap_log2 = tl.cast(cap_log2, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    bh = tl.program_id(1)
    b, h, m_last, offs_m, offs_d, row_ok, io_ok, q, starts_m, lo, mid, diag, k_base, v_base = _query_block(
        Q, K, V, STARTS, sq_b, sq_s, sq_h, sk_b, sk_h, sv_b, sv_h, S, HQ, G, window, HEAD_DIM, BLOCK_D, BLOCK_M,
        BLOCK_N, HAS_WINDOW)
    do = tl.load(DO + b * sd_b + h * sd_h + offs_m[:, None] * sd_s + offs_d[None, :], mask=io_ok, other=0.0)
    lse = tl.load(LSE + bh * S + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh * S + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    dq = _bwd_q_run(dq, q, do, lse, delta, k_base, v_base, sk_s, sv_s, offs_m, starts_m, lo, mid, S, window,
                    qk_scale, cap_log2, HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_WINDOW, PRECISION, SOFTCAP)
    dq = _bwd_q_run(dq, q, do, lse, delta, k_base, v_base, sk_s, sv_s, offs_m, starts_m, mid, diag, S, window,
                    qk_scale, cap_log2, HEAD_DIM, BLOCK_D, BLOCK_N, False, HAS_WINDOW, PRECISION, SOFTCAP)
    dq = _bwd_q_run(dq, q, do, lse, delta, k_base, v_base, sk_s, sv_s, offs_m, starts_m, diag, m_last + 1, S,
                    window, qk_scale, cap_log2, HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_WINDOW, PRECISION, SOFTCAP)
    dq = dq * sm_scale
    tl.store(DQ + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_s + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=io_ok)


# ---------------------------------------------------------------------------------------- launch
#: Tiles per kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages) for the forward, the dK/dV kernel and the dQ
#: kernel, by head dim (the smallest key >= D). ``LIGERMODELS_DOC_ATTENTION_CONFIG`` (JSON, the same form
#: for one head dim: {"fwd": [...], "kv": [...], "q": [...]}) overrides them, for tuning.
CONFIGS = {
    64: {"fwd": (64, 64, 4, 3), "kv": (32, 64, 4, 3), "q": (64, 32, 4, 3)},
    128: {"fwd": (64, 64, 4, 3), "kv": (32, 64, 4, 3), "q": (64, 32, 4, 3)},
    # 256 (Gemma 2, soft-capped): a sweep of one kernel's tiles at a time on an H100 at Gemma-2-2B batch 4
    # (benchmarks/results/experiments/attention-NVIDIA_H100_80GB_HBM3-2026-11-26-softcap-sweep.json): 1.21 ms
    # against 1.60 with the earlier (64, 64, 8, 2) / (32, 64, 8, 2) / (64, 32, 8, 2); 64-key dK/dV tiles were
    # 1.5-2.5x slower.
    256: {"fwd": (64, 32, 4, 2), "kv": (32, 32, 4, 2), "q": (64, 16, 4, 2)},
}
_INTERPRET_CONFIG = {"fwd": (16, 16, 1, 1), "kv": (16, 32, 1, 1), "q": (32, 16, 1, 1)}
#: The dK/dV kernel runs one program per (key block, batch, kv head); when that is fewer than this many, a
#: group's q heads are split over several programs (fp32 partial sums, added by one more kernel). Qwen2-1.5B
#: at batch 4 (2 kv heads of 6 q heads) has 256 programs: too few for 132 SMs of 4 warps. On an H100
#: (benchmarks/results/attention-*-26t4.json) 1024 beat 512, one program per q head and no split.
_KV_PROGRAMS = 1024


def _head_split(group: int, programs: int, target: int) -> int:
    """The fewest parts (a divisor of the group size) that give at least ``target`` programs, or the group."""
    return next((p for p in range(1, group + 1) if group % p == 0 and programs * p >= target), group)


def _config(head_dim: int) -> dict:
    """The tiles for this head dim: the env override, the interpreter's small tiles, or :data:`CONFIGS`."""
    override = os.environ.get("LIGERMODELS_DOC_ATTENTION_CONFIG")
    if override:
        return {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(override).items()}
    if INTERPRET:
        return _INTERPRET_CONFIG
    return CONFIGS[next((d for d in sorted(CONFIGS) if d >= head_dim), max(CONFIGS))]


def _precision(q: torch.Tensor) -> str:
    """tl.dot's input precision: exact fp32 products for fp32 inputs (not TF32), the default otherwise."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _scales(scale: float, softcap: float) -> tuple[float, float]:
    """The kernels' (qk_scale, cap_log2): base-2 logits are ``q.k * qk_scale`` with ``qk_scale = scale * log2(e)``;
    soft-capped (``softcap`` > 0), ``cap_log2 * tanh(scale * q.k / cap)`` with ``cap_log2 = cap * log2(e)`` and
    ``qk_scale = 2 * scale * log2(e) / cap``, the exp2 argument of :func:`_tanh_exp2`."""
    if softcap > 0.0:
        return 2.0 * scale * _LOG2E / softcap, softcap * _LOG2E
    return scale * _LOG2E, 0.0


def _bhs(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a (B, S, H, D) tensor with a unit last stride."""
    return t.stride(0), t.stride(1), t.stride(2)


@eager_op
@triton_op(f"{LIB}::doc_attention_fwd", mutates_args={})
def _doc_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, window: int,
                       scale: float, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(O (B, S, Hq, D) in q's dtype, LSE (B, Hq, S) fp32 in base 2) of q (B, S, Hq, D), k / v (B, S, Hkv, D);
    ``softcap`` > 0 soft-caps the logits at it (0: not capped)."""
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    o = torch.empty((b, s, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, s), dtype=torch.float32, device=q.device)
    if b * s * hq == 0:
        return o, lse
    bm, bn, warps, stages = _config(d)["fwd"]
    wrap_triton(_attn_fwd_kernel)[(triton.cdiv(s, bm), b * hq)](
        q, k, v, o, lse, starts, *_bhs(q), *_bhs(k), *_bhs(v), *_bhs(o), s, hq, hq // hkv, window,
        *_scales(scale, softcap), HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_M=bm, BLOCK_N=bn,
        HAS_WINDOW=window > 0, PRECISION=_precision(q), SOFTCAP=softcap > 0.0, num_warps=warps, num_stages=stages)
    return o, lse


@eager_op
@triton_op(f"{LIB}::doc_attention_bwd", mutates_args={})
def _doc_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, window: int, scale: float,
                       softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), fresh (B, S, H, D) tensors in the inputs' dtype (``softcap`` as the forward's)."""
    do = unit_last(do)
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    dq = torch.empty((b, s, hq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, s, hkv, d), dtype=k.dtype, device=k.device)
    dv = torch.empty((b, s, hkv, d), dtype=v.dtype, device=v.device)
    if b * s * hq == 0:
        return dq, dk, dv
    cfg, block_d, has_window, capped = _config(d), triton.next_power_of_2(d), window > 0, softcap > 0.0
    qk_scale, cap_log2 = _scales(scale, softcap)
    delta = torch.empty((b, hq, s), dtype=torch.float32, device=q.device)
    wrap_triton(_attn_delta_kernel)[(triton.cdiv(s, 64), b * hq)](
        o, do, delta, *_bhs(o), *_bhs(do), s, hq, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=64,
        num_warps=4 if not INTERPRET else 1)
    bm, bn, warps, stages = cfg["kv"]
    programs = triton.cdiv(s, bn) * b * hkv
    split = _head_split(hq // hkv, programs, cfg.get("kv_programs", _KV_PROGRAMS))
    if split == 1:
        dkp, dvp = dk, dv
    else:  # fp32 partial sums of the group's q heads, split over programs, added below
        dkp = torch.empty((split, b, s, hkv, d), dtype=torch.float32, device=q.device)
        dvp = torch.empty_like(dkp)
    wrap_triton(_attn_bwd_kv_kernel)[(triton.cdiv(s, bn), b * hkv * split)](
        q, k, v, do, lse, delta, starts, ends, dkp, dvp, *_bhs(q), *_bhs(k), *_bhs(v), *_bhs(do),
        b * s * hkv * d, *_bhs(dk), s, hq, hkv, hq // hkv, split, window, qk_scale, cap_log2, scale, HEAD_DIM=d,
        BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn, HAS_WINDOW=has_window, PRECISION=_precision(q), SOFTCAP=capped,
        num_warps=warps, num_stages=stages)
    if split > 1:
        n = dk.numel()
        wrap_triton(_attn_sum_parts_kernel)[(triton.cdiv(n, 1024),)](dkp, dvp, dk, dv, n, split, BLOCK=1024,
                                                                      num_warps=4 if not INTERPRET else 1)
    bm, bn, warps, stages = cfg["q"]
    wrap_triton(_attn_bwd_q_kernel)[(triton.cdiv(s, bm), b * hq)](
        q, k, v, do, lse, delta, starts, dq, *_bhs(q), *_bhs(k), *_bhs(v), *_bhs(do), *_bhs(dq), s, hq, hq // hkv,
        window, qk_scale, cap_log2, scale, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn,
        HAS_WINDOW=has_window, PRECISION=_precision(q), SOFTCAP=capped, num_warps=warps, num_stages=stages)
    return dq, dk, dv


class DocumentAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: ``forward(q, k, v, starts, ends, window, scale, softcap=0.0) -> o`` (``softcap`` 0: no
    soft-capping); no gradient for the bounds."""

    @staticmethod
    def forward(ctx, q, k, v, starts, ends, window: int, scale: float, softcap: float = 0.0):
        o, lse = _doc_attention_fwd(q, k, v, starts, window, scale, softcap)
        ctx.save_for_backward(q, k, v, o, lse, starts, ends)
        ctx.args = (window, scale, softcap)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, starts, ends = ctx.saved_tensors
        dq, dk, dv = _doc_attention_bwd(do, q, k, v, o, lse, starts, ends, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


# ------------------------------------------------------------------------------------- reference
def allowed_pairs(starts: torch.Tensor, window: int | None) -> torch.Tensor:
    """(B, 1, S, S) bool: query i may see key j (``starts[b, i] <= j <= i``, ``i - j < window``)."""
    s = starts.shape[-1]
    i = torch.arange(s, device=starts.device)
    ok = (i[None, :] <= i[:, None])[None] & (i[None, None, :] >= starts[:, :, None].long())
    if window is not None:
        ok = ok & ((i[:, None] - i[None, :]) < window)[None]
    return ok[:, None]


def document_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                                 window: int | None = None, scale: float | None = None,
                                 softcap: float | None = None) -> torch.Tensor:
    """Dense attention in the compute dtype (fp32, or fp64 for fp64 inputs): the test oracle and CPU path.
    Shapes and arguments as :func:`document_attention` (``softcap * tanh(scores / softcap)`` after the scale,
    before the mask)."""
    dt = compute_dtype(q.dtype)
    g = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.to(dt).transpose(1, 2) for t in (q, k, v))
    kt, vt = kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1)
    scores = qt @ kt.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed_pairs(starts, window), float("-inf"))
    return (scores.softmax(-1) @ vt).transpose(1, 2).to(q.dtype)


# ----------------------------------------------------------------------------------------- public
def document_bounds(document_ids: torch.Tensor | None, batch: int, seq_len: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, ends), each (B, S) int32: where each token's document begins and (exclusive) ends in its row.

    ``document_ids`` (B, S), never decreasing along a row (None: each row is one document). Computed on the
    ids' device by a batched binary search (no host sync)."""
    if document_ids is None:
        starts = torch.zeros((batch, seq_len), dtype=torch.int32, device=device)
        return starts, torch.full((batch, seq_len), seq_len, dtype=torch.int32, device=device)
    ids = document_ids.contiguous()
    starts = torch.searchsorted(ids, ids, side="left", out_int32=True)
    ends = torch.searchsorted(ids, ids, side="right", out_int32=True)
    return starts, ends


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                       ends: torch.Tensor, window: int | None = None, scale: float | None = None,
                       softcap: float | None = None) -> torch.Tensor:
    """Causal grouped-query attention within each token's document (and window), differentiable in q, k, v.

    Args:
        q: (B, S, Hq, D); k, v: (B, S, Hkv, D), Hq a multiple of Hkv; strided views are fine (the last dim
            must be contiguous; otherwise it is copied).
        starts, ends: (B, S) int32 from :func:`document_bounds`.
        window: a key at most ``window - 1`` positions before its query (HF's convention), or None.
        scale: softmax scale, default D ** -0.5.
        softcap: attention-logit soft-capping (Gemma 2's ``attn_logit_softcapping``), a float > 0, or None: the
            logits are ``softcap * tanh(scale * q.k / softcap)`` (elementwise over the (B, Hq, S, S) scores,
            before the mask and the softmax), which bounds them to (-softcap, softcap) so that no logit grows
            without limit in training; the gradients go through the tanh. Computed inside the kernels (no
            (S, S) scores in memory, as without it).
    Returns:
        (B, S, Hq, D) contiguous, in q's dtype.
    """
    check_same_device(q, k, v, starts, ends)
    if q.dim() != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"document_attention: q (B, S, Hq, D) and k, v (B, S, Hkv, D), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"document_attention: {q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads")
    if starts.shape != q.shape[:2] or ends.shape != q.shape[:2] or starts.dtype != torch.int32:
        raise ValueError(f"document_attention: starts / ends must be int32 (B, S) = {tuple(q.shape[:2])}, got "
                         f"{tuple(starts.shape)} {starts.dtype}, {tuple(ends.shape)}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"document_attention: softcap must be a float > 0 or None, got {softcap!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    softcap = None if softcap is None else float(softcap)
    if window is not None and window >= q.shape[1]:
        window = None
    if not use_triton(q):
        return document_attention_reference(q, k, v, starts, window, scale, softcap)
    q, k, v = (unit_last(t) for t in (q, k, v))
    return DocumentAttentionFunction.apply(q, k, v, starts, ends, 0 if window is None else int(window), scale,
                                           0.0 if softcap is None else softcap)


def document_attention_flops(starts: torch.Tensor, window: int | None, q_heads: int, head_dim: int) -> tuple[int, int]:
    """(forward, backward) useful flops: 4 * D * Hq and 10 * D * Hq per allowed (query, key) pair."""
    s = starts.shape[-1]
    i = torch.arange(s, device=starts.device)
    lo = starts.long() if window is None else torch.maximum(starts.long(), i - window + 1)
    pairs = int((i - lo + 1).sum())
    return 4 * head_dim * q_heads * pairs, 10 * head_dim * q_heads * pairs


__all__ = ["document_attention", "document_bounds", "document_attention_reference", "allowed_pairs",
           "document_attention_flops", "DocumentAttentionFunction", "CONFIGS"]
