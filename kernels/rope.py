"""Rotary position embedding applied to q and k in one launch: rotate-half (Hugging Face) or interleaved
(GPT-J / GLM) pairs, on the whole head or its first R channels (partial rotary), optionally fused with
an RMSNorm over each q and k head (Qwen3, Gemma 3).

``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)`` over the two halves
of the rotary dim R = ``cos.shape[-1]`` (<= head_dim D; channels R..D pass unchanged, as HF's
``q_pass``). Written per pair (``c1, c2, s1, s2`` the cos / sin entries of its two members)::

    out1 = x1 * c1 - x2 * s1          out2 = x2 * c2 + x1 * s2

Rotate-half pairs are channels (i, i + R/2) with cos entries (i, i + R/2); interleaved pairs are
(2i, 2i + 1), both with cos entry i (HF GLM: ``cos[..., :R/2].repeat_interleave(2)``). The kernels only
change the offsets.

The backward pass is the transpose, ``dx = dy * cos + rotate_half^T(dy * sin)`` with
``rotate_half^T(v) = cat(v2, -v1)``::

    dx1 = dy1 * c1 + dy2 * s2         dx2 = dy2 * c2 - dy1 * s1

which is the forward formula with the sine halves swapped and negated (``s1 -> -s2``, ``s2 -> -s1``),
so one kernel serves both passes (a compile-time switch). cos and sin are buffers: no gradient.

Layout: q (B, S, Hq, D) and k (B, S, Hkv, D), as a projection produces them. They may be strided
views (e.g. slices of one fused qkv projection viewed as (B, S, Hq + 2*Hkv, D)); the kernel takes
their batch / seq / head strides and only the last dim must be unit-stride. cos / sin are
(B, S, R) (per-token positions, e.g. packed sequences), (1, S, R) or (S, R) (shared by the batch),
fp32 or the model dtype. R must be even; neither R/2 nor D need be a power of two (Phi-3: 96), the
tiles are masked. Outputs are fresh contiguous tensors in q's dtype; the math runs in fp32.

``apply_rope_qkv_`` is the in-place form for blocks that own a packed (B, S, (Hq + 2*Hkv) * D)
projection output: the kernel writes the rotated q and k heads back where they were read (each
tile is loaded whole before it is stored), so no rotated copies exist; its backward writes a new
gradient buffer with the q / k heads rotated back and the v heads copied, or (``reuse_grad``, what the
attention block asks for) rotates the incoming gradient's q / k heads back where they are: no new buffer,
no copy of the v heads or of the channels past R.

``apply_qk_norm_rope_qkv_`` is the same in-place pass with an RMSNorm over each q head (weight wq (D,))
and k head (wk) before the rotation: ``y = x * rstd * (offset + w)`` with ``kernels.rms_norm``'s rounding
(``casting``), rounded to the dtype, then rotated. The forward also writes the q / k heads as read
(xs, (B, S, Hq + Hkv, D)) and one fp32 rstd per head: the in-place output cannot give x back (that
would divide by w). Backward, per head, with ``g`` the un-rotated output gradient and ``n = x * rstd``::

    dx = rstd * (g*(offset+w) - n * mean(g*(offset+w) * n))      dw = sum over tokens and heads of g * n

each program (8 tokens, ``_NORM_BWD_TOKENS``) writes its fp32 (D,) partial dw (summed over its tokens
and heads), summed over the programs by one more launch; the v heads are copied in the same launch, or with
``reuse_grad`` dx is written over dy (the v heads' gradient already in place). In place with whole-head
rotate-half rotary at a power-of-two head dim (Qwen3, Gemma 3) a persistent kernel does the same
(:func:`_norm_rope_qkv_bwd_persistent`, one partial row per program).

One program handles one token: it loads that token's cos / sin once, then rotates all q heads and
then all kv heads, in tiles of up to ``_TILE`` elements (whole-head and interleaved rotary: pair
tiles, ``_TILE`` per half). Partial rotate-half rotary (R < D) loads each head's row as one contiguous
tile of ``next_power_of_2(D)`` channels (in place: of R) plus a second load of the pair partners
(f +- R/2, cached), and stores the row whole (in place: its R rotary channels), so its accesses are
aligned row reads and writes instead of half-width ones starting mid-row (see ``_rotate_heads``).

Bytes moved (the fewest each pass must move), for T = B*S tokens, P distinct cos rows (B*S, or S
when shared), element size s of q/k and c of cos/sin:
forward  2*T*(Hq + Hkv)*D*s + 2*P*R*c   (read q, k; write q_rot, k_rot; read cos, sin once per row),
backward 2*T*(Hq + Hkv)*D*s + 2*P*R*c   (read dq_rot, dk_rot; write dq, dk; read cos, sin)
(in place, the forward, and the backward with ``reuse_grad``, move only the R rotary channels; partial
rotary's partner loads re-read the row from cache, not memory). The fused norm adds one write of the
q / k heads (xs) in the forward and one read of them in the backward, 3*T*(Hq + Hkv)*D*s each way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kernels._common import LIB, check_same_device, compute_dtype, eager_op, sm_count, unit_last, use_triton
from kernels.rms_norm import _dw_tiling, _rms_norm_dw_kernel, rms_norm_reference

#: Elements per half-tile of one program (16 heads x 64 at head_dim 128), and warps. Measured on an
#: H100 (kernel time, 32/8 heads of 128, bf16): 2048 x 4 warps ran at 83-92% of copy bandwidth,
#: 1024 x 4 at 85-95%; 8 warps or larger tiles were slower.
_TILE = 1024
_WARPS = 4
#: :func:`_rope_kernel` (one token a program) where a token's q and k heads store at most this many elements:
#: one warp and tiles of 2048 elements. Per-SM residency is capped at 32 programs, so with 4-warp programs
#: (16 resident) a small token kept too few bytes in flight. H100 sweep (experiments/rope-launch-sweep-*.json),
#: in place at 4 x 2048 / 4 x 8192: Qwen2-1.5B's 12 + 2 heads of 128 (1792 elements) 75% / 82% of copy
#: bandwidth with one warp against 61% / 66% with four; Phi-4-mini's 24 + 8 heads of 96 rotary channels
#: (3072) 81% / 89% against 74% / 81%; Llama's 32 + 8 heads of 128 (5120) 89% / 94% against 91% / 94%,
#: so larger tokens keep 4 warps and 1024-element tiles. The q/k-norm forward takes the warp count and keeps its
#: 1024-element tiles (2048 with one warp ran at 76% at Qwen3's 16 + 8 heads of 128): 83% / 90% at Qwen3's heads
#: (85% / 89% with 4 warps), 89% / 93% at Gemma 3's 8 + 4 heads of 256 (78% / 82% with 4 warps).
_SMALL_TOKEN = 4096
#: Tokens per program of the q/k-norm backward: its weight gradients are summed over them in registers,
#: so the fp32 partials it writes are (B*S / 8, D). Kernel time on an H100 (experiments/qknorm-bwd-sweep-*):
#: 2, 4, 8 tokens within 4% at head dim 128, 8 the fastest at 256; 8 warps or half the head tile slower.
_NORM_BWD_TOKENS = 8
#: Programs per multiprocessor of the persistent in-place q/k-norm backward (whole-head rotary,
#: :func:`_norm_rope_qkv_bwd_persistent`): 3 of 4 warps (168 registers each) ran fastest on an H200, 2 and
#: one of 8 warps slower (benchmarks/results/experiments/qknorm-bwd-variants-NVIDIA_H200-2026-11-26.json).
_NORM_BWD_PROGRAMS_PER_SM = 3


# --------------------------------------------------------------------------------------- kernels
@triton.jit
def _pair_offsets(d, half, INTERLEAVED: tl.constexpr):
    """Element offsets of the two members of rotary pair ``d`` and of the cos/sin entries for the second:
    rotate-half pairs (d, d + half) with cos entries (d, d + half); interleaved pairs (2d, 2d + 1) with
    cos entry d for both (HF's ``cos[..., :rotary_dim // 2].repeat_interleave(2)``)."""
    if INTERLEAVED:
        o1 = 2 * d
        o2 = 2 * d + 1
        oc2 = d
    else:
        o1 = d
        o2 = d + half
        oc2 = d + half
    return o1, o2, oc2


@triton.jit
def _rotate_heads(x_ptr, o_ptr, n_heads, stride_h, stride_oh, half, n_rest, c1, c2, s1, s2, o1, o2,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, COPY_REST: tl.constexpr, BLOCK_R: tl.constexpr,
                  INTERLEAVED: tl.constexpr):
    """Rotate the ``n_heads`` rows of one token: x at ``x_ptr`` (head stride ``stride_h``) -> o at
    ``o_ptr`` (head stride ``stride_oh``), pairs at offsets ``o1`` / ``o2``. With COPY_REST the
    ``n_rest`` channels after the rotary ones are copied (out of place); otherwise they are left as they
    are (in place). Each tile is loaded whole before it is stored, so o may be x.

    Interleaved pairs (2d, 2d + 1) are loaded as one contiguous (heads, 2 * half) tile and split into
    even and odd channels in registers: loading each member with a stride of 2 kept the loads from being
    vectorized, and the kernel ran at 8-15% of copy bandwidth on an H100 (benchmarks, GLM-4-9B's shape).

    Partial rotate-half rotary (R < D, not interleaved) does not come here: :func:`_rope_kernel` sends it
    to :func:`_rotate_rows`. Here its pair members would be half-width loads at o1 = d and o2 = d + R/2
    (Phi-4-mini: 48 channels each in a 64-wide, 25%-masked tile, the second starting mid-row), plus the
    D - R rest channels in a third load: misaligned, partly masked accesses that ran at only 59-77% of
    copy bandwidth on an H100 (whole-head rotary, R = D = 128, runs at ~95% here). The row path loads
    each head's row as one contiguous tile instead: 89-96% out of place on the same H100 (in place 81-89%,
    both passes, with the one-warp launch of :data:`_SMALL_TOKEN`; kernels-NVIDIA_H100_80GB_HBM3-2026-11-26.json)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    r = tl.arange(0, BLOCK_R)
    dmask = d < half
    d2 = tl.arange(0, 2 * BLOCK_D)
    d2mask = d2 < 2 * half
    for h0 in range(0, n_heads, BLOCK_H):
        hh = h0 + h
        x_row = x_ptr + hh[:, None] * stride_h
        o_row = o_ptr + hh[:, None] * stride_oh
        if INTERLEAVED:
            mask2 = (hh < n_heads)[:, None] & d2mask[None, :]
            x = tl.load(x_row + d2[None, :], mask=mask2, other=0.0).to(tl.float32)
            x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_D, 2)))
            y = tl.reshape(tl.join(x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), (BLOCK_H, 2 * BLOCK_D))
            tl.store(o_row + d2[None, :], y.to(o_ptr.dtype.element_ty), mask=mask2)
        else:
            mask = (hh < n_heads)[:, None] & dmask[None, :]
            x1 = tl.load(x_row + o1[None, :], mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_row + o2[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(o_row + o1[None, :], (x1 * c1 - x2 * s1).to(o_ptr.dtype.element_ty), mask=mask)
            tl.store(o_row + o2[None, :], (x2 * c2 + x1 * s2).to(o_ptr.dtype.element_ty), mask=mask)
        if COPY_REST:
            rmask = (hh < n_heads)[:, None] & (r < n_rest)[None, :]
            xr = tl.load(x_row + 2 * half + r[None, :], mask=rmask, other=0.0)
            tl.store(o_row + 2 * half + r[None, :], xr.to(o_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _row_cos_sin(cos_ptr, sin_ptr, b, s, sc_b, sc_s, ss_b, ss_s, half, BACKWARD: tl.constexpr,
                 BLOCK_F: tl.constexpr):
    """One token's rotation as whole-row factors for :func:`_rotate_rows`, (1, BLOCK_F) fp32 rows over
    the channels f of a head: ``y[f] = x[f] * C[f] + x[p(f)] * S[f]`` with the partner ``p(f)`` (also
    returned, (1, BLOCK_F)) = f + half for f < half, f - half for half <= f < 2 * half, f past them.

    Forward C = cos and S = (-sin, +sin) over the two halves, i.e. ``y1 = x1*c1 - x2*s1``,
    ``y2 = x2*c2 + x1*s2`` as :func:`_load_cos_sin` gives them; BACKWARD the transpose (s1 -> -s2,
    s2 -> -s1): S[f] = sin[p(f)] on the first half, -sin[p(f)] on the second. Past the rotary channels
    C = 1, S = 0 (:func:`_rotate_rows` passes those channels through as they are)."""
    f = tl.arange(0, BLOCK_F)
    rot = f < 2 * half
    lo = f < half
    p = tl.where(lo, f + half, tl.where(rot, f - half, f))
    c_row = cos_ptr + b * sc_b + s * sc_s
    s_row = sin_ptr + b * ss_b + s * ss_s
    c = tl.load(c_row + f, mask=rot, other=1.0).to(tl.float32)
    if BACKWARD:  # transpose of the rotation: the sine halves swapped and negated
        sv = tl.load(s_row + p, mask=rot, other=0.0).to(tl.float32)
        sn = tl.where(lo, sv, -sv)
    else:
        sv = tl.load(s_row + f, mask=rot, other=0.0).to(tl.float32)
        sn = tl.where(lo, -sv, sv)
    return c[None, :], sn[None, :], p[None, :]


@triton.jit
def _rotate_rows(x_ptr, o_ptr, n_heads, stride_h, stride_oh, half, head_dim, cf, sf, p,
                 BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, COPY_REST: tl.constexpr):
    """The row path of :func:`_rotate_heads` (partial rotate-half rotary): rotate the ``n_heads`` rows of
    one token, x at ``x_ptr`` -> o at ``o_ptr`` (head strides ``stride_h`` / ``stride_oh``), each head's
    row as one contiguous (heads, BLOCK_F) tile over channels f < ``head_dim``, with factors (cf, sf) and
    partners p from :func:`_row_cos_sin`: ``y[f] = x[f] * cf[f] + x[p(f)] * sf[f]`` in fp32 for the
    2 * ``half`` rotary channels (the partner load re-reads the row just loaded: L1 / L2 hits); the
    channels past them pass as loaded. With COPY_REST the whole row is stored (out of place); otherwise
    only the rotary channels are read and written, the rest left as they are (in place). Both loads of a
    tile come before its store, so o may be x."""
    h = tl.arange(0, BLOCK_H)
    f = tl.arange(0, BLOCK_F)[None, :]
    rot = f < 2 * half
    if COPY_REST:
        fmask = f < head_dim
    else:
        fmask = rot
    for h0 in range(0, n_heads, BLOCK_H):
        hh = (h0 + h)[:, None]
        hm = hh < n_heads
        x_row = x_ptr + hh * stride_h
        x = tl.load(x_row + f, mask=hm & fmask, other=0.0)
        xp = tl.load(x_row + p, mask=hm & rot, other=0.0).to(tl.float32)
        y = tl.fma(x.to(tl.float32), cf, xp * sf)  # explicit: the same rounding at every tile width
        y = tl.where(rot, y.to(o_ptr.dtype.element_ty), x.to(o_ptr.dtype.element_ty))
        tl.store(o_ptr + hh * stride_oh + f, y, mask=hm & fmask)


@triton.jit
def _copy_span(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """Copy ``n`` contiguous elements (a token's v heads in a packed buffer), ``BLOCK`` at a time."""
    offs = tl.arange(0, BLOCK)
    for i in range(0, n, BLOCK):
        m = i + offs < n
        tl.store(dst_ptr + i + offs, tl.load(src_ptr + i + offs, mask=m), mask=m)


@triton.jit
def _load_cos_sin(cos_ptr, sin_ptr, b, s, sc_b, sc_s, ss_b, ss_s, half, BACKWARD: tl.constexpr,
                  INTERLEAVED: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token's (c1, c2, s1, s2) as (1, BLOCK_D) fp32 rows, with the pair offsets (o1, o2). BACKWARD
    gives the transpose of the rotation: the sine halves swapped and negated."""
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    o1, o2, oc2 = _pair_offsets(d, half, INTERLEAVED)
    c_row = cos_ptr + b * sc_b + s * sc_s
    s_row = sin_ptr + b * ss_b + s * ss_s
    c1 = tl.load(c_row + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c_row + oc2, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s_row + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s_row + oc2, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if BACKWARD:  # transpose of the rotation: swap the sine halves and negate them
        s1_fwd = s1
        s1 = -s2
        s2 = -s1_fwd
    return c1, c2, s1, s2, o1, o2


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, v_ptr, vo_ptr, seq_len, n_qh, n_kh,
                 sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sqo_b, sqo_s, sqo_h, sko_b, sko_s, sko_h,
                 sv_b, sv_s, svo_b, svo_s, n_v, sc_b, sc_s, ss_b, ss_s, half, n_rest,
                 BACKWARD: tl.constexpr, INTERLEAVED: tl.constexpr, COPY_REST: tl.constexpr,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_V: tl.constexpr, ROW: tl.constexpr, BLOCK_F: tl.constexpr):
    """One token: q / k heads rotated (out of place, or in place when the outputs alias the inputs); with
    BLOCK_V > 0 its ``n_v`` contiguous elements at ``v_ptr`` (the v heads of a packed buffer) copied too.
    ROW (partial rotate-half rotary): whole-row tiles of BLOCK_F channels (:func:`_rotate_rows`) instead
    of the pair tiles of :func:`_rotate_heads`."""
    tok = tl.program_id(0).to(tl.int64)
    b = tok // seq_len
    s = tok - b * seq_len
    if ROW:
        cf, sf, p = _row_cos_sin(cos_ptr, sin_ptr, b, s, sc_b, sc_s, ss_b, ss_s, half, BACKWARD, BLOCK_F)
        head_dim = 2 * half + n_rest
        _rotate_rows(q_ptr + b * sq_b + s * sq_s, qo_ptr + b * sqo_b + s * sqo_s, n_qh, sq_h, sqo_h, half,
                     head_dim, cf, sf, p, BLOCK_HQ, BLOCK_F, COPY_REST)
        _rotate_rows(k_ptr + b * sk_b + s * sk_s, ko_ptr + b * sko_b + s * sko_s, n_kh, sk_h, sko_h, half,
                     head_dim, cf, sf, p, BLOCK_HK, BLOCK_F, COPY_REST)
    else:
        c1, c2, s1, s2, o1, o2 = _load_cos_sin(cos_ptr, sin_ptr, b, s, sc_b, sc_s, ss_b, ss_s, half, BACKWARD,
                                               INTERLEAVED, BLOCK_D)
        _rotate_heads(q_ptr + b * sq_b + s * sq_s, qo_ptr + b * sqo_b + s * sqo_s, n_qh, sq_h, sqo_h, half,
                      n_rest, c1, c2, s1, s2, o1, o2, BLOCK_HQ, BLOCK_D, COPY_REST, BLOCK_R, INTERLEAVED)
        _rotate_heads(k_ptr + b * sk_b + s * sk_s, ko_ptr + b * sko_b + s * sko_s, n_kh, sk_h, sko_h, half,
                      n_rest, c1, c2, s1, s2, o1, o2, BLOCK_HK, BLOCK_D, COPY_REST, BLOCK_R, INTERLEAVED)
    if BLOCK_V > 0:
        _copy_span(v_ptr + b * sv_b + s * sv_s, vo_ptr + b * svo_b + s * svo_s, n_v, BLOCK_V)


@triton.jit
def _norm_rope_heads(x_ptr, xs_ptr, rs_ptr, w_ptr, n_heads, stride_h, stride_xs_h, head_dim, half, n_rest, eps,
                     offset, c1, c2, s1, s2, o1, o2, CASTING: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """RMSNorm over each of the ``n_heads`` heads of one token (weight ``w_ptr`` (D,)), then rotate, in
    place at ``x_ptr``. The heads as read are copied to ``xs_ptr`` and their rstd to ``rs_ptr`` (for
    backward). Rounding as ``kernels.rms_norm`` (CASTING 0 llama, 1 gemma), then the rotation in fp32
    on the normed values rounded to x's dtype (HF normalises, then rotates the rounded result)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    r = tl.arange(0, BLOCK_R)
    dmask = d < half
    rmask = r < n_rest
    dt = x_ptr.dtype.element_ty
    w1 = tl.load(w_ptr + o1, mask=dmask, other=0.0).to(tl.float32)[None, :] + offset
    w2 = tl.load(w_ptr + o2, mask=dmask, other=0.0).to(tl.float32)[None, :] + offset
    wr = tl.load(w_ptr + 2 * half + r, mask=rmask, other=0.0).to(tl.float32)[None, :] + offset
    for h0 in range(0, n_heads, BLOCK_H):
        hh = h0 + h
        hm = hh < n_heads
        m = hm[:, None] & dmask[None, :]
        mr = hm[:, None] & rmask[None, :]
        x_row = x_ptr + hh[:, None] * stride_h
        xs_row = xs_ptr + hh[:, None] * stride_xs_h
        x1 = tl.load(x_row + o1[None, :], mask=m, other=0.0)
        x2 = tl.load(x_row + o2[None, :], mask=m, other=0.0)
        xr = tl.load(x_row + 2 * half + r[None, :], mask=mr, other=0.0)
        tl.store(xs_row + o1[None, :], x1, mask=m)
        tl.store(xs_row + o2[None, :], x2, mask=m)
        tl.store(xs_row + 2 * half + r[None, :], xr, mask=mr)
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        xr = xr.to(tl.float32)
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xr * xr, axis=1)
        rstd = tl.rsqrt(ss / head_dim + eps)
        tl.store(rs_ptr + hh, rstd, mask=hm)
        n1 = x1 * rstd[:, None]
        n2 = x2 * rstd[:, None]
        nr = xr * rstd[:, None]
        if CASTING == 0:  # llama: round the normalised head to x's dtype before the weight
            n1 = n1.to(dt).to(tl.float32)
            n2 = n2.to(dt).to(tl.float32)
            nr = nr.to(dt).to(tl.float32)
        y1 = (n1 * w1).to(dt).to(tl.float32)
        y2 = (n2 * w2).to(dt).to(tl.float32)
        tl.store(x_row + o1[None, :], (y1 * c1 - y2 * s1).to(dt), mask=m)
        tl.store(x_row + o2[None, :], (y2 * c2 + y1 * s2).to(dt), mask=m)
        tl.store(x_row + 2 * half + r[None, :], (nr * wr).to(dt), mask=mr)


@triton.jit
def _norm_rope_heads_bwd(dy_ptr, dx_ptr, xs_ptr, rs_ptr, w_ptr, n_heads, stride_h, stride_xs_h, head_dim,
                         half, n_rest, offset, c1, c2, s1, s2, o1, o2, dw1, dw2, dwr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Backward of :func:`_norm_rope_heads` for one token's heads: dy (rotated-output gradient, head
    stride ``stride_h``) -> dx (same layout); adds this token's fp32 weight-gradient terms to the
    (BLOCK_H, BLOCK_D / BLOCK_R) accumulators (dw1, dw2, dwr) of the pair members and the rest, and returns
    them: summed over heads only once, by the caller (a sum across the heads at every tile cost a
    cross-warp reduction each). (c1, c2, s1, s2) are the transposed rotation's (BACKWARD) factors."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    r = tl.arange(0, BLOCK_R)
    dmask = d < half
    rmask = r < n_rest
    w1 = tl.load(w_ptr + o1, mask=dmask, other=0.0).to(tl.float32)[None, :] + offset
    w2 = tl.load(w_ptr + o2, mask=dmask, other=0.0).to(tl.float32)[None, :] + offset
    wr = tl.load(w_ptr + 2 * half + r, mask=rmask, other=0.0).to(tl.float32)[None, :] + offset
    for h0 in range(0, n_heads, BLOCK_H):
        hh = h0 + h
        hm = hh < n_heads
        m = hm[:, None] & dmask[None, :]
        mr = hm[:, None] & rmask[None, :]
        dy_row = dy_ptr + hh[:, None] * stride_h
        xs_row = xs_ptr + hh[:, None] * stride_xs_h
        dy1 = tl.load(dy_row + o1[None, :], mask=m, other=0.0).to(tl.float32)
        dy2 = tl.load(dy_row + o2[None, :], mask=m, other=0.0).to(tl.float32)
        g_r = tl.load(dy_row + 2 * half + r[None, :], mask=mr, other=0.0).to(tl.float32)
        g1 = dy1 * c1 - dy2 * s1  # the rotation's transpose: gradient of the normed head
        g2 = dy2 * c2 + dy1 * s2
        rstd = tl.load(rs_ptr + hh, mask=hm, other=0.0)
        n1 = tl.load(xs_row + o1[None, :], mask=m, other=0.0).to(tl.float32) * rstd[:, None]
        n2 = tl.load(xs_row + o2[None, :], mask=m, other=0.0).to(tl.float32) * rstd[:, None]
        nr = tl.load(xs_row + 2 * half + r[None, :], mask=mr, other=0.0).to(tl.float32) * rstd[:, None]
        dn1 = g1 * w1
        dn2 = g2 * w2
        dnr = g_r * wr
        mean = (tl.sum(dn1 * n1, axis=1) + tl.sum(dn2 * n2, axis=1) + tl.sum(dnr * nr, axis=1)) / head_dim
        dx_row = dx_ptr + hh[:, None] * stride_h
        dt = dx_ptr.dtype.element_ty
        tl.store(dx_row + o1[None, :], ((dn1 - n1 * mean[:, None]) * rstd[:, None]).to(dt), mask=m)
        tl.store(dx_row + o2[None, :], ((dn2 - n2 * mean[:, None]) * rstd[:, None]).to(dt), mask=m)
        tl.store(dx_row + 2 * half + r[None, :], ((dnr - nr * mean[:, None]) * rstd[:, None]).to(dt), mask=mr)
        dw1 += g1 * n1
        dw2 += g2 * n2
        dwr += g_r * nr
    return dw1, dw2, dwr


@triton.jit
def _norm_rope_qkv_kernel(x_ptr, xs_ptr, rs_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, seq_len, n_qh, n_kh,
                          sx_b, sx_s, sc_b, sc_s, ss_b, ss_s, head_dim, half, n_rest, eps, offset,
                          CASTING: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_HQ: tl.constexpr,
                          BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """One token of a packed (B, S, (Hq + 2*Hkv) * D) buffer: q heads normed by wq and rotated, k heads by
    wk, in place. xs: (B*S, Hq + Hkv, D) copy of the heads as read; rs: (B*S, Hq + Hkv) fp32 rstd."""
    tok = tl.program_id(0).to(tl.int64)
    b = tok // seq_len
    s = tok - b * seq_len
    c1, c2, s1, s2, o1, o2 = _load_cos_sin(cos_ptr, sin_ptr, b, s, sc_b, sc_s, ss_b, ss_s, half, False,
                                           INTERLEAVED, BLOCK_D)
    x_tok = x_ptr + b * sx_b + s * sx_s
    xs_tok = xs_ptr + tok * (n_qh + n_kh) * head_dim
    rs_tok = rs_ptr + tok * (n_qh + n_kh)
    _norm_rope_heads(x_tok, xs_tok, rs_tok, wq_ptr, n_qh, head_dim, head_dim, head_dim, half, n_rest, eps, offset,
                     c1, c2, s1, s2, o1, o2, CASTING, BLOCK_HQ, BLOCK_D, BLOCK_R)
    _norm_rope_heads(x_tok + n_qh * head_dim, xs_tok + n_qh * head_dim, rs_tok + n_qh, wk_ptr, n_kh, head_dim,
                     head_dim, head_dim, half, n_rest, eps, offset, c1, c2, s1, s2, o1, o2, CASTING, BLOCK_HK,
                     BLOCK_D, BLOCK_R)


@triton.jit
def _norm_rope_qkv_bwd_kernel(dy_ptr, dx_ptr, xs_ptr, rs_ptr, wq_ptr, wk_ptr, dw_ptr, cos_ptr, sin_ptr,
                              n_tokens, seq_len, n_qh, n_kh, sc_b, sc_s, ss_b, ss_s, head_dim, half, n_rest, offset,
                              INTERLEAVED: tl.constexpr, TOKENS: tl.constexpr, BLOCK_HQ: tl.constexpr,
                              BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_V: tl.constexpr):
    """Backward of :func:`_norm_rope_qkv_kernel` for ``TOKENS`` consecutive tokens: dy, dx contiguous
    (B*S, (Hq + 2*Hkv) * D), the v heads copied (BLOCK_V > 0) or dx = dy, in place (BLOCK_V = 0: each
    tile is loaded before it is stored); the program's fp32 partial weight gradients, summed over its
    tokens, in row ``program_id`` of dw (programs, 2 * D): q's then k's."""
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    r = tl.arange(0, BLOCK_R)
    dmask = d < half
    rmask = r < n_rest
    q1 = tl.zeros((BLOCK_HQ, BLOCK_D), dtype=tl.float32)
    q2 = tl.zeros((BLOCK_HQ, BLOCK_D), dtype=tl.float32)
    qr = tl.zeros((BLOCK_HQ, BLOCK_R), dtype=tl.float32)
    k1 = tl.zeros((BLOCK_HK, BLOCK_D), dtype=tl.float32)
    k2 = tl.zeros((BLOCK_HK, BLOCK_D), dtype=tl.float32)
    kr = tl.zeros((BLOCK_HK, BLOCK_R), dtype=tl.float32)
    for i in range(TOKENS):
        tok = (pid * TOKENS + i).to(tl.int64)
        if tok < n_tokens:
            b = tok // seq_len
            s = tok - b * seq_len
            c1, c2, s1, s2, o1, o2 = _load_cos_sin(cos_ptr, sin_ptr, b, s, sc_b, sc_s, ss_b, ss_s, half, True,
                                                   INTERLEAVED, BLOCK_D)
            row = tok * (n_qh + 2 * n_kh) * head_dim
            xs_tok = xs_ptr + tok * (n_qh + n_kh) * head_dim
            rs_tok = rs_ptr + tok * (n_qh + n_kh)
            q1, q2, qr = _norm_rope_heads_bwd(dy_ptr + row, dx_ptr + row, xs_tok, rs_tok, wq_ptr, n_qh, head_dim,
                                              head_dim, head_dim, half, n_rest, offset, c1, c2, s1, s2, o1, o2,
                                              q1, q2, qr, BLOCK_HQ, BLOCK_D, BLOCK_R)
            kq = n_qh * head_dim
            k1, k2, kr = _norm_rope_heads_bwd(dy_ptr + row + kq, dx_ptr + row + kq, xs_tok + kq, rs_tok + n_qh,
                                              wk_ptr, n_kh, head_dim, head_dim, head_dim, half, n_rest, offset,
                                              c1, c2, s1, s2, o1, o2, k1, k2, kr, BLOCK_HK, BLOCK_D, BLOCK_R)
            if BLOCK_V > 0:  # out of place: the v heads pass through unchanged (in place they are already there)
                vo = row + (n_qh + n_kh) * head_dim
                _copy_span(dy_ptr + vo, dx_ptr + vo, n_kh * head_dim, BLOCK_V)
    o1, o2, _ = _pair_offsets(d, half, INTERLEAVED)
    wq_row = dw_ptr + pid * 2 * head_dim
    wk_row = wq_row + head_dim
    tl.store(wq_row + o1, tl.sum(q1, axis=0), mask=dmask)
    tl.store(wq_row + o2, tl.sum(q2, axis=0), mask=dmask)
    tl.store(wq_row + 2 * half + r, tl.sum(qr, axis=0), mask=rmask)
    tl.store(wk_row + o1, tl.sum(k1, axis=0), mask=dmask)
    tl.store(wk_row + o2, tl.sum(k2, axis=0), mask=dmask)
    tl.store(wk_row + 2 * half + r, tl.sum(kr, axis=0), mask=rmask)


@triton.jit
def _head_group_tiles(dy_tok, xs_tok, rs_tok, cos_ptr, sin_ptr, co, so, ok, NH: tl.constexpr, BH: tl.constexpr,
                      HALF: tl.constexpr, DY_TOK: tl.constexpr, XS_TOK: tl.constexpr, RS_TOK: tl.constexpr,
                      MASKED: tl.constexpr):
    """One token's loads for one head group (its q or its k heads) of :func:`_norm_rope_qkv_bwd_persistent`:
    dy's and xs's two halves as (1, BH, HALF) tiles, the rstd, and (c1, c2, s1, s2) = cos[d], cos[d + HALF],
    sin[d + HALF], sin[d] (the transposed rotation's factors). cos / sin are loaded at the tiles' full shape
    (every head re-reads its token's row: L1 hits): a (1, 1, HALF) load got a one-element-per-thread layout
    that the compiler then kept for the whole computation, moving every tile through shared memory."""
    t = tl.arange(0, 1)[:, None, None]
    h = tl.arange(0, BH)[None, :, None]
    d = tl.arange(0, HALF)[None, None, :]
    live = (t < tl.where(ok, 1, 0)) & (h < NH)  # (1, BH, 1): this token, and a real head
    m = live & (d < HALF)
    dy_row = dy_tok + t * DY_TOK + h * (2 * HALF) + d
    xs_row = xs_tok + t * XS_TOK + h * (2 * HALF) + d
    zh = h * 0
    if MASKED:
        tiles = (tl.load(dy_row, mask=m, other=0.0), tl.load(dy_row + HALF, mask=m, other=0.0),
                 tl.load(xs_row, mask=m, other=0.0), tl.load(xs_row + HALF, mask=m, other=0.0),
                 tl.load(rs_tok + t * RS_TOK + h, mask=live, other=0.0),
                 tl.load(cos_ptr + co + zh + d, mask=m, other=0.0),
                 tl.load(cos_ptr + co + zh + HALF + d, mask=m, other=0.0),
                 tl.load(sin_ptr + so + zh + HALF + d, mask=m, other=0.0),
                 tl.load(sin_ptr + so + zh + d, mask=m, other=0.0))
    else:
        tiles = (tl.load(dy_row), tl.load(dy_row + HALF), tl.load(xs_row), tl.load(xs_row + HALF),
                 tl.load(rs_tok + t * RS_TOK + h), tl.load(cos_ptr + co + zh + d),
                 tl.load(cos_ptr + co + zh + HALF + d), tl.load(sin_ptr + so + zh + HALF + d),
                 tl.load(sin_ptr + so + zh + d))
    return tiles


@triton.jit
def _token_tiles(dy_ptr, xs_ptr, rs_ptr, cos_ptr, sin_ptr, tok, live, seq_len, sc_b, sc_s, ss_b, ss_s,
                 HQ: tl.constexpr, HKV: tl.constexpr, BHQ: tl.constexpr, BHK: tl.constexpr, HALF: tl.constexpr,
                 MASKED: tl.constexpr):
    """Every load of token ``tok`` (q and k heads, cos / sin), issued before any of them is used; ``live``
    False masks them all off (MASKED only)."""
    D: tl.constexpr = 2 * HALF
    DY_TOK: tl.constexpr = (HQ + 2 * HKV) * D
    XS_TOK: tl.constexpr = (HQ + HKV) * D
    RS_TOK: tl.constexpr = HQ + HKV
    tok = tok.to(tl.int64)
    b = tok // seq_len
    s = tok - b * seq_len
    co = b * sc_b + s * sc_s
    so = b * ss_b + s * ss_s
    dy_tok = dy_ptr + tok * DY_TOK
    xs_tok = xs_ptr + tok * XS_TOK
    rs_tok = rs_ptr + tok * RS_TOK
    q = _head_group_tiles(dy_tok, xs_tok, rs_tok, cos_ptr, sin_ptr, co, so, live, HQ, BHQ, HALF, DY_TOK, XS_TOK,
                          RS_TOK, MASKED)
    k = _head_group_tiles(dy_tok + HQ * D, xs_tok + HQ * D, rs_tok + HQ, cos_ptr, sin_ptr, co, so, live, HKV, BHK,
                          HALF, DY_TOK, XS_TOK, RS_TOK, MASKED)
    return q, k


@triton.jit
def _head_group_bwd(dy_tok, tiles, w1, w2, acc1, acc2, NH: tl.constexpr, BH: tl.constexpr, HALF: tl.constexpr,
                    MASKED: tl.constexpr):
    """The math of :func:`_norm_rope_heads_bwd` on one head group's tiles (whole-head rotate-half rotary):
    dx stored over dy at ``dy_tok``; the fp32 weight-gradient accumulators returned."""
    dy1, dy2, x1, x2, rstd, c1, c2, s1, s2 = tiles
    dy1 = dy1.to(tl.float32)
    dy2 = dy2.to(tl.float32)
    g1 = dy1 * c1.to(tl.float32) + dy2 * s1.to(tl.float32)
    g2 = dy2 * c2.to(tl.float32) - dy1 * s2.to(tl.float32)
    n1 = x1.to(tl.float32) * rstd
    n2 = x2.to(tl.float32) * rstd
    dn1 = g1 * w1
    dn2 = g2 * w2
    mean = (tl.sum(dn1 * n1, axis=2) + tl.sum(dn2 * n2, axis=2))[:, :, None] * (1.0 / (2 * HALF))
    dt = dy_tok.dtype.element_ty
    h = tl.arange(0, BH)[None, :, None]
    d = tl.arange(0, HALF)[None, None, :]
    row = dy_tok + h * (2 * HALF) + d
    y1 = ((dn1 - n1 * mean) * rstd).to(dt)
    y2 = ((dn2 - n2 * mean) * rstd).to(dt)
    if MASKED:
        m = (h < NH) & (d < HALF)
        tl.store(row, y1, mask=m)
        tl.store(row + HALF, y2, mask=m)
    else:
        tl.store(row, y1)
        tl.store(row + HALF, y2)
    return acc1 + g1 * n1, acc2 + g2 * n2


@triton.jit
def _norm_rope_qkv_bwd_persistent(dy_ptr, xs_ptr, rs_ptr, wq_ptr, wk_ptr, dw_ptr, cos_ptr, sin_ptr,
                                  n_tokens, seq_len, sc_b, sc_s, ss_b, ss_s, offset, HQ: tl.constexpr,
                                  HKV: tl.constexpr, BHQ: tl.constexpr, BHK: tl.constexpr, HALF: tl.constexpr,
                                  MASKED: tl.constexpr):
    """:func:`_norm_rope_qkv_bwd_kernel` in place (dx over dy's q / k heads; v untouched) for whole-head
    rotate-half rotary at a power-of-two head dim ``2 * HALF``: a persistent grid of G programs, program
    ``pid`` taking tokens pid, pid + G, ..., with the next token's loads issued before the current token's
    math and stores (a token's loads are always in flight). Head counts and strides are compile-time
    constants, so nothing is masked unless the head counts are not powers of two (MASKED); the partial
    weight gradients of a program, summed over its tokens and heads in registers, go to row ``pid`` of dw
    (G, 2 * D): q's then k's. On an H200 (the same variants file) 1.6x / 2.1x faster than the per-8-tokens kernel at
    head dims 128 / 256: fewer instructions per element (half rows of 8 bf16 a thread, no head loop, no
    masks) and more bytes in flight."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    count = tl.cdiv(n_tokens - pid, progs)
    d = tl.arange(0, HALF)[None, None, :]
    zq = tl.arange(0, BHQ)[None, :, None] * 0
    zk = tl.arange(0, BHK)[None, :, None] * 0
    wq1 = tl.load(wq_ptr + zq + d).to(tl.float32) + offset  # at the tiles' full shape (see _head_group_tiles)
    wq2 = tl.load(wq_ptr + zq + HALF + d).to(tl.float32) + offset
    wk1 = tl.load(wk_ptr + zk + d).to(tl.float32) + offset
    wk2 = tl.load(wk_ptr + zk + HALF + d).to(tl.float32) + offset
    aq1 = tl.zeros((1, BHQ, HALF), dtype=tl.float32)
    aq2 = tl.zeros((1, BHQ, HALF), dtype=tl.float32)
    ak1 = tl.zeros((1, BHK, HALF), dtype=tl.float32)
    ak2 = tl.zeros((1, BHK, HALF), dtype=tl.float32)
    tok = pid
    q, k = _token_tiles(dy_ptr, xs_ptr, rs_ptr, cos_ptr, sin_ptr, tok, count > 0, seq_len, sc_b, sc_s, ss_b, ss_s,
                        HQ, HKV, BHQ, BHK, HALF, MASKED)
    for j in range(count):
        nxt = tok + progs
        # the last prefetch re-reads this token (cached, unused) unless masked loads can skip it
        nq, nk = _token_tiles(dy_ptr, xs_ptr, rs_ptr, cos_ptr, sin_ptr, tl.where(j + 1 < count, nxt, tok),
                              j + 1 < count, seq_len, sc_b, sc_s, ss_b, ss_s, HQ, HKV, BHQ, BHK, HALF, MASKED)
        dy_tok = dy_ptr + tok.to(tl.int64) * ((HQ + 2 * HKV) * 2 * HALF)
        aq1, aq2 = _head_group_bwd(dy_tok, q, wq1, wq2, aq1, aq2, HQ, BHQ, HALF, MASKED)
        ak1, ak2 = _head_group_bwd(dy_tok + HQ * 2 * HALF, k, wk1, wk2, ak1, ak2, HKV, BHK, HALF, MASKED)
        q = nq
        k = nk
        tok = nxt
    row = dw_ptr + pid * 4 * HALF + tl.arange(0, HALF)
    tl.store(row, tl.sum(tl.sum(aq1, axis=1), axis=0))
    tl.store(row + HALF, tl.sum(tl.sum(aq2, axis=1), axis=0))
    tl.store(row + 2 * HALF, tl.sum(tl.sum(ak1, axis=1), axis=0))
    tl.store(row + 3 * HALF, tl.sum(tl.sum(ak2, axis=1), axis=0))


# ------------------------------------------------------------------------------------ custom ops
def _cs_strides(t: torch.Tensor) -> tuple[int, int]:
    """(batch, seq) strides of cos / sin; 0 on the batch when it is shared ((S, D) or (1, S, D))."""
    if t.dim() == 2:
        return 0, t.stride(0)
    return (0 if t.shape[0] == 1 else t.stride(0)), t.stride(1)


def _token_launch(elements: int) -> tuple[int, int]:
    """(tile elements, num_warps) of a one-token-a-program kernel whose token moves ``elements`` q / k
    elements (see :data:`_SMALL_TOKEN`)."""
    return (2048, 1) if elements <= _SMALL_TOKEN else (_TILE, _WARPS)


def _head_block(n_heads: int, block_d: int, tile: int = _TILE) -> int:
    """Heads a tile holds: all of them, or as many rows of ``block_d`` as ``tile`` elements take."""
    return min(triton.next_power_of_2(max(n_heads, 1)), max(tile // block_d, 1))


def _blocks(head_dim: int, rotary_dim: int) -> tuple[int, int, int, int]:
    """(half, n_rest, BLOCK_D, BLOCK_R): rotary pairs, channels past the rotary ones, and their tile sizes
    (compile-time sizes: int() specialises symbolic shapes)."""
    half, n_rest = int(rotary_dim) // 2, int(head_dim) - int(rotary_dim)
    return half, n_rest, triton.next_power_of_2(max(half, 1)), triton.next_power_of_2(max(n_rest, 1))


def _launch(x_q: torch.Tensor, x_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qo: torch.Tensor,
            ko: torch.Tensor, backward: bool, interleaved: bool, copy_rest: bool,
            v: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Rotate x_q -> qo and x_k -> ko, all (B, S, H, D) with unit last stride (qo / ko may alias x_q / x_k).
    The first cos.shape[-1] channels rotate; with ``copy_rest`` the others are copied. ``v``: (v, vo), v
    heads (B, S, Hv, D) whose heads and channels are contiguous per token, copied in the same launch."""
    B, S, Hq, D = x_q.shape
    Hkv = x_k.shape[2]
    if B * S == 0 or D == 0:
        return
    half, n_rest, block_d, block_r = _blocks(D, cos.shape[-1])
    sc_b, sc_s = _cs_strides(cos)
    ss_b, ss_s = _cs_strides(sin)
    xv, vo = v if v is not None else (x_k, ko)
    n_v = int(xv.shape[2]) * int(D) if v is not None else 0
    # Partial rotate-half rotary: whole-row tiles (_rotate_rows), as wide as the channels stored (the row, or
    # in place only the rotary ones); whole-head and interleaved rotary keep the pair tiles (_rotate_heads).
    row = not interleaved and n_rest > 0
    block_f = triton.next_power_of_2(int(D) if copy_rest else 2 * half) if row else 1
    block_h = block_f if row else block_d
    tile, warps = _token_launch((int(Hq) + int(Hkv)) * (int(D) if copy_rest else 2 * half))
    wrap_triton(_rope_kernel)[(B * S,)](
        x_q, x_k, cos, sin, qo, ko, xv, vo, S, Hq, Hkv,
        x_q.stride(0), x_q.stride(1), x_q.stride(2), x_k.stride(0), x_k.stride(1), x_k.stride(2),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
        xv.stride(0), xv.stride(1), vo.stride(0), vo.stride(1), n_v, sc_b, sc_s, ss_b, ss_s, half, n_rest,
        BACKWARD=backward, INTERLEAVED=interleaved, COPY_REST=copy_rest and n_rest > 0,
        BLOCK_HQ=_head_block(int(Hq), block_h, tile), BLOCK_HK=_head_block(int(Hkv), block_h, tile),
        BLOCK_D=block_d, BLOCK_R=block_r, BLOCK_V=min(_TILE, triton.next_power_of_2(n_v)) if n_v else 0,
        ROW=row, BLOCK_F=block_f, num_warps=warps)


def _rotate_new(x_q: torch.Tensor, x_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backward: bool, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of x_q and x_k as fresh contiguous tensors in x_q's dtype."""
    x_q, x_k, cos, sin = unit_last(x_q), unit_last(x_k), unit_last(cos), unit_last(sin)
    qo = torch.empty(x_q.shape, dtype=x_q.dtype, device=x_q.device)
    ko = torch.empty(x_k.shape, dtype=x_q.dtype, device=x_q.device)
    _launch(x_q, x_k, cos, sin, qo, ko, backward, interleaved, copy_rest=True)
    return qo, ko


def _split_heads(qkv: torch.Tensor, n_q: int, n_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, S, (Hq + 2*Hkv) * D) -> q, k, v views (B, S, H, D) of the packed projection output."""
    b, s, n = qkv.shape
    heads = qkv.view(b, s, n_q + 2 * n_kv, n // (n_q + 2 * n_kv))
    return heads[:, :, :n_q], heads[:, :, n_q:n_q + n_kv], heads[:, :, n_q + n_kv:]


@eager_op
@triton_op(f"{LIB}::rope_fwd", mutates_args={})
def _rope_fwd(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_rot, k_rot), fresh contiguous (B, S, H, D) tensors in q's dtype."""
    return _rotate_new(q, k, cos, sin, False, interleaved)


@eager_op
@triton_op(f"{LIB}::rope_bwd", mutates_args={})
def _rope_bwd(dq_rot: torch.Tensor, dk_rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dk) from the gradients of q_rot and k_rot, fresh contiguous (B, S, H, D) tensors."""
    return _rotate_new(dq_rot, dk_rot, cos, sin, True, interleaved)


@eager_op
@triton_op(f"{LIB}::rope_qkv_", mutates_args={"qkv"})
def _rope_qkv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int,
               interleaved: bool = False, backward: bool = False) -> None:
    """Rotate the q and k heads of a packed (B, S, (Hq + 2*Hkv) * D) projection output in place; with
    ``backward``, rotate them back (the packed output gradient into the input gradient, in place)."""
    q, k, _ = _split_heads(qkv, n_q, n_kv)
    _launch(q, k, unit_last(cos), unit_last(sin), q, k, backward, interleaved, copy_rest=False)


@eager_op
@triton_op(f"{LIB}::rope_qkv_bwd", mutates_args={})
def _rope_qkv_bwd(dqkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int,
                  interleaved: bool = False) -> torch.Tensor:
    """Gradient of the packed qkv before :func:`_rope_qkv_`: q / k heads rotated back, v heads copied."""
    dqkv = unit_last(dqkv)
    out = torch.empty(dqkv.shape, dtype=dqkv.dtype, device=dqkv.device)
    dq, dk, dv = _split_heads(dqkv, n_q, n_kv)
    oq, ok, ov = _split_heads(out, n_q, n_kv)
    _launch(dq, dk, unit_last(cos), unit_last(sin), oq, ok, True, interleaved, copy_rest=True, v=(dv, ov))
    return out


@eager_op
@triton_op(f"{LIB}::qk_norm_rope_qkv_", mutates_args={"qkv"})
def _qk_norm_rope_qkv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, n_q: int, n_kv: int, eps: float, offset: float, casting: int,
                       interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Norm each q / k head of a contiguous packed (B, S, (Hq + 2*Hkv) * D) buffer and rotate it, in place.

    Returns (x_saved (B, S, Hq + Hkv, D) in qkv's dtype: the q and k heads as they were read;
    rstd (B, S, Hq + Hkv) fp32), what the backward needs.
    """
    B, S, n = qkv.shape
    D = n // (n_q + 2 * n_kv)
    xs = torch.empty((B, S, n_q + n_kv, D), dtype=qkv.dtype, device=qkv.device)
    rs = torch.empty((B, S, n_q + n_kv), dtype=torch.float32, device=qkv.device)
    if B * S == 0 or D == 0:
        return xs, rs
    cos, sin = unit_last(cos), unit_last(sin)
    half, n_rest, block_d, block_r = _blocks(D, cos.shape[-1])
    sc_b, sc_s = _cs_strides(cos)
    ss_b, ss_s = _cs_strides(sin)
    block_full = 2 * max(block_d, block_r)
    _, warps = _token_launch((int(n_q) + int(n_kv)) * int(D))  # its 1024-element tiles: 2048 spilled at D 128
    wrap_triton(_norm_rope_qkv_kernel)[(B * S,)](
        qkv, xs, rs, q_weight, k_weight, cos, sin, S, n_q, n_kv, qkv.stride(0), qkv.stride(1),
        sc_b, sc_s, ss_b, ss_s, D, half, n_rest, eps, offset,
        CASTING=casting, INTERLEAVED=interleaved, BLOCK_HQ=_head_block(int(n_q), block_full),
        BLOCK_HK=_head_block(int(n_kv), block_full), BLOCK_D=block_d, BLOCK_R=block_r, num_warps=warps)
    return xs, rs


def _norm_bwd_launch(dqkv: torch.Tensor, out: torch.Tensor, xs: torch.Tensor, rs: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, n_q: int, n_kv: int,
                     offset: float, interleaved: bool, copy_v: bool) -> torch.Tensor:
    """Run :func:`_norm_rope_qkv_bwd_kernel` from contiguous ``dqkv`` into ``out``: a new buffer, the v heads
    copied (``copy_v``), or ``dqkv`` itself, in place (said by the caller: a traced tensor has no address). Returns
    the weight gradients as one (2, D) tensor in q_weight's dtype (q's, then k's): the programs' fp32 partials
    (programs, 2 * D) summed by one more launch (:func:`kernels.rms_norm._rms_norm_dw_kernel`), two launches in
    all."""
    B, S, n = dqkv.shape
    D = n // (n_q + 2 * n_kv)
    dw = torch.empty((2, D), dtype=q_weight.dtype, device=dqkv.device)
    if B * S == 0 or D == 0:
        return dw.zero_()
    cos, sin = unit_last(cos), unit_last(sin)
    half, n_rest, block_d, block_r = _blocks(D, cos.shape[-1])
    sc_b, sc_s = _cs_strides(cos)
    ss_b, ss_s = _cs_strides(sin)
    block_full = 2 * max(block_d, block_r)
    if not copy_v and n_rest == 0 and not interleaved and D & (D - 1) == 0:  # the persistent kernel's case
        programs = min(B * S, sm_count(dqkv.device) * _NORM_BWD_PROGRAMS_PER_SM)
        partial = torch.empty((programs, 2 * D), dtype=torch.float32, device=dqkv.device)
        wrap_triton(_norm_rope_qkv_bwd_persistent)[(programs,)](
            dqkv, xs, rs, q_weight, k_weight, partial, cos, sin, B * S, S, sc_b, sc_s, ss_b, ss_s, offset,
            HQ=int(n_q), HKV=int(n_kv), BHQ=triton.next_power_of_2(int(n_q)), BHK=triton.next_power_of_2(int(n_kv)),
            HALF=int(D) // 2, MASKED=(n_q & (n_q - 1)) != 0 or (n_kv & (n_kv - 1)) != 0, num_warps=_WARPS)
    else:
        programs = triton.cdiv(B * S, _NORM_BWD_TOKENS)
        partial = torch.empty((programs, 2 * D), dtype=torch.float32, device=dqkv.device)
        wrap_triton(_norm_rope_qkv_bwd_kernel)[(programs,)](
            dqkv, out, xs, rs, q_weight, k_weight, partial, cos, sin, B * S, S, n_q, n_kv, sc_b, sc_s, ss_b,
            ss_s, D, half, n_rest, offset, INTERLEAVED=interleaved, TOKENS=_NORM_BWD_TOKENS,
            BLOCK_HQ=_head_block(int(n_q), block_full), BLOCK_HK=_head_block(int(n_kv), block_full),
            BLOCK_D=block_d, BLOCK_R=block_r,
            BLOCK_V=min(_TILE, triton.next_power_of_2(int(n_kv) * int(D))) if copy_v else 0, num_warps=_WARPS)
    block_p, block_n, warps = _dw_tiling(programs, 2 * D)
    wrap_triton(_rms_norm_dw_kernel)[(triton.cdiv(2 * D, block_n),)](
        partial, dw, programs, 2 * D, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=warps)
    return dw


@eager_op
@triton_op(f"{LIB}::qk_norm_rope_qkv_bwd", mutates_args={})
def _qk_norm_rope_qkv_bwd(dqkv: torch.Tensor, xs: torch.Tensor, rs: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, n_q: int, n_kv: int,
                          offset: float, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dqkv before the op (B, S, (Hq + 2*Hkv) * D), the weight gradients (2, D): q's, k's, in q_weight's dtype)."""
    dqkv = dqkv.contiguous()
    out = torch.empty(dqkv.shape, dtype=dqkv.dtype, device=dqkv.device)
    return out, _norm_bwd_launch(dqkv, out, xs, rs, cos, sin, q_weight, k_weight, n_q, n_kv, offset, interleaved,
                                 True)


@eager_op
@triton_op(f"{LIB}::qk_norm_rope_qkv_bwd_", mutates_args={"dqkv"})
def _qk_norm_rope_qkv_bwd_(dqkv: torch.Tensor, xs: torch.Tensor, rs: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, n_q: int, n_kv: int,
                           offset: float, interleaved: bool) -> torch.Tensor:
    """:func:`_qk_norm_rope_qkv_bwd` in place: contiguous ``dqkv`` becomes the gradient before the op (its v
    heads are already that); returns the weight gradients (2, D)."""
    return _norm_bwd_launch(dqkv, dqkv, xs, rs, cos, sin, q_weight, k_weight, n_q, n_kv, offset, interleaved,
                            False)


class RoPEFunction(torch.autograd.Function):
    """Autograd wrapper: ``forward(q, k, cos, sin, interleaved) -> (q_rot, k_rot)``; no gradient for cos / sin."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                interleaved: bool = False):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rope_fwd(q, k, cos, sin, interleaved)

    @staticmethod
    def backward(ctx, dq_rot: torch.Tensor, dk_rot: torch.Tensor):
        cos, sin = ctx.saved_tensors
        dq, dk = _rope_bwd(dq_rot, dk_rot, cos, sin, ctx.interleaved)
        return dq, dk, None, None, None


def _reusable(ctx, grad: torch.Tensor) -> bool:
    """Whether a backward may write its input gradient over ``grad``: the caller allowed it (``reuse_grad``)
    and ``grad`` is a plain contiguous buffer (not, e.g., the stride-0 expansion of a sum's gradient)."""
    return ctx.reuse_grad and grad.is_contiguous() and not torch.is_grad_enabled()


class RoPEQKVInplaceFunction(torch.autograd.Function):
    """Autograd wrapper of the in-place rotation of a packed qkv:
    ``forward(qkv, cos, sin, n_q, n_kv, interleaved, reuse_grad) -> qkv``.

    The forward overwrites q and k in the caller's buffer (``mark_dirty``). The backward writes a new
    gradient buffer (the incoming one left as it is), or with ``reuse_grad`` rotates the incoming
    gradient's q / k heads back in place (``_reusable``): no new buffer, no copy of the v heads.
    """

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int,
                interleaved: bool = False, reuse_grad: bool = False) -> torch.Tensor:
        _rope_qkv_(qkv, cos, sin, n_q, n_kv, interleaved)
        ctx.mark_dirty(qkv)
        ctx.save_for_backward(cos, sin)
        ctx.heads = (n_q, n_kv, interleaved)
        ctx.reuse_grad = reuse_grad
        return qkv

    @staticmethod
    def backward(ctx, dqkv: torch.Tensor):
        cos, sin = ctx.saved_tensors
        if _reusable(ctx, dqkv):
            _rope_qkv_(dqkv, cos, sin, *ctx.heads, backward=True)
        else:
            dqkv = _rope_qkv_bwd(dqkv, cos, sin, *ctx.heads)
        return dqkv, None, None, None, None, None, None


class QKNormRoPEQKVInplaceFunction(torch.autograd.Function):
    """Autograd wrapper of the in-place q/k head norm + rotation of a packed qkv:
    ``forward(qkv, cos, sin, q_weight, k_weight, n_q, n_kv, eps, offset, casting, interleaved) -> qkv``.

    Saves the q / k heads as they were read (one (B, S, Hq + Hkv, D) copy, what an unfused norm would
    keep too) and the per-head rstd; gradients flow to qkv and both weights. ``reuse_grad`` as in
    :class:`RoPEQKVInplaceFunction`: the qkv gradient is written over the incoming one.
    """

    @staticmethod
    def forward(ctx, qkv, cos, sin, q_weight, k_weight, n_q: int, n_kv: int, eps: float, offset: float,
                casting: int, interleaved: bool, reuse_grad: bool = False) -> torch.Tensor:
        xs, rs = _qk_norm_rope_qkv_(qkv, cos, sin, q_weight, k_weight, n_q, n_kv, eps, offset, casting, interleaved)
        ctx.mark_dirty(qkv)
        ctx.save_for_backward(xs, rs, cos, sin, q_weight, k_weight)
        ctx.args = (n_q, n_kv, offset, interleaved)
        ctx.reuse_grad = reuse_grad
        return qkv

    @staticmethod
    def backward(ctx, dqkv: torch.Tensor):
        xs, rs, cos, sin, wq, wk = ctx.saved_tensors
        if _reusable(ctx, dqkv):
            dw = _qk_norm_rope_qkv_bwd_(dqkv, xs, rs, cos, sin, wq, wk, *ctx.args)
        else:
            dqkv, dw = _qk_norm_rope_qkv_bwd(dqkv, xs, rs, cos, sin, wq, wk, *ctx.args)
        return dqkv, None, None, dw[0], dw[1].to(wk.dtype), None, None, None, None, None, None, None


# ------------------------------------------------------------------------------------- reference
def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch RoPE in fp32 (fp64 for fp64 inputs), rounded once to q's dtype, as HF writes it.

    The first ``R = cos.shape[-1]`` channels rotate (rotate-half pairs (i, i + R/2), or with
    ``interleaved`` GPT-J pairs (2i, 2i + 1) using ``cos[..., :R/2]``); the others pass unchanged.
    Shapes as in :func:`apply_rope`; differentiable through autograd (cos / sin included).
    """
    cd = compute_dtype(q.dtype)
    rd = cos.shape[-1]
    c, s = cos.to(cd).unsqueeze(-2), sin.to(cd).unsqueeze(-2)  # broadcast over heads
    if interleaved:
        c = c[..., : rd // 2].repeat_interleave(2, dim=-1)
        s = s[..., : rd // 2].repeat_interleave(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xr, rest = x[..., :rd].to(cd), x[..., rd:]
        if interleaved:
            rot = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
        else:
            x1, x2 = xr.chunk(2, dim=-1)
            rot = torch.cat((-x2, x1), dim=-1)
        return torch.cat(((xr * c + rot * s).to(q.dtype), rest.to(q.dtype)), dim=-1)

    return rotate(q), rotate(k)


def qk_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0,
                           casting: str = "llama", interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch RMSNorm of each q head (weight (D,)) and k head, then :func:`rope_reference`, as HF's
    Qwen3 / Gemma 3 attention: q (B, S, Hq, D), k (B, S, Hkv, D) -> new (q_rot, k_rot)."""
    return rope_reference(rms_norm_reference(q, q_weight, eps, offset, casting),
                          rms_norm_reference(k, k_weight, eps, offset, casting), cos, sin, interleaved)


def _pair_halves(t: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the two members of every rotary pair of ``t``'s last dim: its halves, or (interleaved) its even
    and odd channels."""
    return (t[..., 0::2], t[..., 1::2]) if interleaved else t.chunk(2, dim=-1)


def _rotate_qkv_host_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int,
                      interleaved: bool, backward: bool) -> torch.Tensor:
    """Rotate (``backward``: rotate back, the transpose) the q and k heads of a contiguous packed
    (B, S, (Hq + 2*Hkv) * D) tensor in place with PyTorch ops; returns it.

    The pair formula of this module's docstring, each product and sum rounded as :func:`rope_reference`'s ops
    round them (``x2 * s1`` then a subtraction is ``(-x2) * s1`` then an addition, bit for bit), and the backward
    as autograd differentiates that reference: the same numbers as the reference path, without its graph of
    concatenations, slices and zero-filled gradients. At the demo's layer (16 x 128 tokens, 4 + 8 heads of 32,
    cos per token) a forward and backward took 8.3-8.9 ms through that graph and 5.3-5.9 ms here, on one thread of
    a 2-core AMD EPYC; the demo's whole step, about 205 ms there, did not move beyond its run-to-run noise."""
    cd, rd = compute_dtype(qkv.dtype), cos.shape[-1]
    c, s = cos.to(cd).unsqueeze(-2), sin.to(cd).unsqueeze(-2)  # broadcast over heads
    if interleaved:  # pair i of (2i, 2i + 1) takes entry i (HF GLM's repeat_interleave of the first half)
        (c1, c2), (s1, s2) = (c[..., : rd // 2],) * 2, (s[..., : rd // 2],) * 2
    else:
        (c1, c2), (s1, s2) = c.chunk(2, dim=-1), s.chunk(2, dim=-1)
    if backward:
        s1, s2 = -s2, -s1
    for x in _split_heads(qkv, n_q, n_kv)[:2]:
        x1, x2 = _pair_halves(x[..., :rd], interleaved)
        a1, a2 = x1.to(cd), x2.to(cd)
        y1, y2 = a1 * c1 - a2 * s1, a2 * c2 + a1 * s2  # both computed before either is written: they read x
        x1.copy_(y1)
        x2.copy_(y2)
    return qkv


class _RoPEQKVHostFunction(torch.autograd.Function):
    """The reference path of :func:`apply_rope_qkv_` under autograd (a CPU without the interpreter, fp64):
    ``forward(qkv, cos, sin, n_q, n_kv, interleaved)`` returns a new contiguous tensor, as the reference's
    out-of-place form does, with :func:`_rotate_qkv_host_`'s numbers both ways."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int,
                interleaved: bool):
        ctx.save_for_backward(cos, sin)
        ctx.args = (n_q, n_kv, interleaved)
        return _rotate_qkv_host_(qkv.clone(memory_format=torch.contiguous_format), cos, sin, *ctx.args, False)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        cos, sin = ctx.saved_tensors
        dqkv = _rotate_qkv_host_(dout.clone(memory_format=torch.contiguous_format), cos, sin, *ctx.args, True)
        return dqkv, None, None, None, None, None


# ---------------------------------------------------------------------------------------- public
def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"apply_rope: q and k must be 4-D (batch, seq, heads, head_dim), "
                         f"got q {tuple(q.shape)} and k {tuple(k.shape)}")
    (B, S, _, D), (Bk, Sk, _, Dk) = q.shape, k.shape
    if Bk != B:
        raise ValueError(f"apply_rope: q and k differ in batch: {B} vs {Bk}")
    if Sk != S:
        raise ValueError(f"apply_rope: q and k differ in seq: {S} vs {Sk}")
    if Dk != D:
        raise ValueError(f"apply_rope: q and k differ in head_dim: {D} vs {Dk}")
    if q.dtype != k.dtype or not q.dtype.is_floating_point:
        raise ValueError(f"apply_rope: q and k must share one floating dtype, got {q.dtype} and {k.dtype}")
    if cos.shape != sin.shape:
        raise ValueError(f"apply_rope: cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dim() not in (2, 3):
        raise ValueError(f"apply_rope: cos/sin must be (batch, seq, rotary_dim) or (seq, rotary_dim), "
                         f"got {tuple(cos.shape)}")
    if cos.shape[-1] > D:
        raise ValueError(f"apply_rope: cos/sin head_dim (rotary dim) {cos.shape[-1]} > q/k head_dim {D}")
    if cos.shape[-1] % 2:
        raise ValueError(f"apply_rope: the rotary dim (cos/sin last dim) must be even, got {cos.shape[-1]}")
    if cos.shape[-2] != S:
        raise ValueError(f"apply_rope: cos/sin seq {cos.shape[-2]} != q/k seq {S}")
    if cos.dim() == 3 and cos.shape[0] not in (1, B):
        raise ValueError(f"apply_rope: cos/sin batch {cos.shape[0]} != q/k batch {B} (or 1)")
    if not (cos.dtype.is_floating_point and sin.dtype.is_floating_point):
        raise ValueError(f"apply_rope: cos/sin must be floating point, got {cos.dtype} and {sin.dtype}")
    check_same_device(q, k, cos, sin)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k, one kernel launch per pass.

    Args:
        q: (B, S, Hq, D), possibly a strided view (only the last dim need be unit-stride).
        k: (B, S, Hkv, D), same batch, seq, head_dim and dtype as q.
        cos, sin: (B, S, R), (1, S, R) or (S, R) with R <= D even: the first R channels rotate (partial
            rotary when R < D), the others pass. fp32 or the model dtype. No gradient flows to them.
        interleaved: GPT-J pairs (2i, 2i + 1) with ``cos[..., :R/2]`` (GLM) instead of rotate-half.
    Returns:
        (q_rot, k_rot): fresh contiguous (B, S, Hq, D) and (B, S, Hkv, D) tensors in q's dtype.
    """
    _check(q, k, cos, sin)
    if not use_triton(q):
        return rope_reference(q, k, cos, sin, interleaved)
    return RoPEFunction.apply(q, k, cos, sin, bool(interleaved))


def _check_packed(op: str, qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int) -> int:
    if qkv.dim() != 3:
        raise ValueError(f"{op}: qkv must be (batch, seq, (Hq + 2*Hkv) * head_dim), got {tuple(qkv.shape)}")
    heads = num_q_heads + 2 * num_kv_heads
    if num_q_heads < 1 or num_kv_heads < 1 or qkv.shape[-1] % heads:
        raise ValueError(f"{op}: last dim {qkv.shape[-1]} is not (Hq + 2*Hkv) * head_dim for "
                         f"Hq={num_q_heads}, Hkv={num_kv_heads}")
    if qkv.stride(-1) != 1:
        raise ValueError(f"{op}: qkv must have a unit last stride")
    return heads


def _write_back(qkv: torch.Tensor, q_rot: torch.Tensor, k_rot: torch.Tensor, heads: int) -> torch.Tensor:
    """The reference path of the in-place ops: out of place under autograd, else copied into qkv."""
    q, k, _ = _split_heads(qkv, q_rot.shape[2], k_rot.shape[2])
    if qkv.requires_grad and torch.is_grad_enabled():  # autograd needs an out-of-place form
        return torch.cat([q_rot, k_rot, qkv.view(q.shape[:2] + (heads, -1))[:, :, q.shape[2] + k.shape[2]:]],
                         dim=2).flatten(2)
    with torch.no_grad():
        q.copy_(q_rot)
        k.copy_(k_rot)
    return qkv


def apply_rope_qkv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                    num_kv_heads: int, interleaved: bool = False, reuse_grad: bool = False) -> torch.Tensor:
    """Rotate the q and k heads of a packed q/k/v projection output **in place**; returns ``qkv``.

    For blocks that own the projection's output buffer: the rotated q and k take no new memory, so
    attention saves views of this one buffer for backward instead of separate rotated copies
    (at Llama-3.2-1B, batch 8 x 2048, 1.3 GB less). Unlike the other public ops this one
    modifies its input, by design; autograd tracks it (``mark_dirty``), so a stale use raises.

    Args:
        qkv: (B, S, (Hq + 2*Hkv) * D) with unit last stride, heads ordered q, k, v (the layout of a
            fused projection); not a view (the projection's own output).
        cos, sin: as in :func:`apply_rope` (R <= D channels rotate).
        num_q_heads, num_kv_heads: Hq and Hkv.
        interleaved: GPT-J pairs, as in :func:`apply_rope`.
        reuse_grad: the backward writes qkv's gradient over the incoming gradient of the result (when that
            is contiguous) instead of a new buffer: only the rotary channels of the q / k heads are touched
            (at Phi-4-mini's heads 40% fewer bytes than rotating into a new buffer and copying the rest). For
            callers whose result gradient no one else reads, as in the attention block (autograd builds it
            by concatenating the q / k / v gradients): a gradient tensor passed straight in by a caller would
            be overwritten.
    Returns:
        ``qkv``, with its q and k heads rotated; view it as (B, S, Hq + 2*Hkv, D) to split heads.
    """
    _check_packed("apply_rope_qkv_", qkv, num_q_heads, num_kv_heads)
    q, k, _ = _split_heads(qkv, num_q_heads, num_kv_heads)
    _check(q, k, cos, sin)
    if not use_triton(qkv):
        if qkv.requires_grad and torch.is_grad_enabled():  # autograd needs an out-of-place form
            return _RoPEQKVHostFunction.apply(qkv, cos, sin, int(num_q_heads), int(num_kv_heads), bool(interleaved))
        with torch.no_grad():
            return _rotate_qkv_host_(qkv, cos, sin, num_q_heads, num_kv_heads, interleaved, False)
    return RoPEQKVInplaceFunction.apply(qkv, cos, sin, int(num_q_heads), int(num_kv_heads), bool(interleaved),
                                        bool(reuse_grad))


def apply_qk_norm_rope_qkv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                            num_kv_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float = 1e-6,
                            offset: float = 0.0, casting: str = "llama", interleaved: bool = False,
                            reuse_grad: bool = False) -> torch.Tensor:
    """RMSNorm over each q head and each k head, then RoPE, of a packed q/k/v projection output, **in
    place** in one pass (Qwen3's / Gemma 3's ``q_norm`` / ``k_norm`` before the rotation); returns ``qkv``.

    ``q = rope(rms_norm(q_head, q_weight))``, ``k = rope(rms_norm(k_head, k_weight))``, v untouched; norm
    rounding as :func:`kernels.rms_norm` (``casting``, ``offset``). As :func:`apply_rope_qkv_`, the result
    takes no new buffer; for backward it keeps the q / k heads as read and one rstd per head.

    Args:
        qkv: (B, S, (Hq + 2*Hkv) * D), contiguous, heads ordered q, k, v.
        cos, sin: as in :func:`apply_rope`.
        num_q_heads, num_kv_heads: Hq and Hkv.
        q_weight, k_weight: (D,) norm weights.
        reuse_grad: as in :func:`apply_rope_qkv_`: qkv's gradient is written over the result's (no new
            buffer, no copy of the v heads).
    Returns:
        ``qkv``, q and k heads normed and rotated.
    """
    heads = _check_packed("apply_qk_norm_rope_qkv_", qkv, num_q_heads, num_kv_heads)
    q, k, _ = _split_heads(qkv, num_q_heads, num_kv_heads)
    _check(q, k, cos, sin)
    D = q.shape[-1]
    if q_weight.shape != (D,) or k_weight.shape != (D,):
        raise ValueError(f"apply_qk_norm_rope_qkv_: q/k norm weights must be (head_dim,) = ({D},), got "
                         f"{tuple(q_weight.shape)} and {tuple(k_weight.shape)}")
    if casting not in ("llama", "gemma"):
        raise ValueError(f"apply_qk_norm_rope_qkv_: casting must be 'llama' or 'gemma', got {casting!r}")
    check_same_device(qkv, q_weight, k_weight)
    if not use_triton(qkv):
        ref = qk_norm_rope_reference(q, k, cos, sin, q_weight, k_weight, eps, offset, casting, interleaved)
        return _write_back(qkv, *ref, heads)
    if not qkv.is_contiguous():
        raise ValueError("apply_qk_norm_rope_qkv_: qkv must be contiguous")
    return QKNormRoPEQKVInplaceFunction.apply(qkv, cos, sin, q_weight, k_weight, int(num_q_heads),
                                              int(num_kv_heads), float(eps), float(offset),
                                              0 if casting == "llama" else 1, bool(interleaved), bool(reuse_grad))
