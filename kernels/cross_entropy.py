"""Cross-entropy losses: ``cross_entropy`` over (N, V) logits, and ``fused_linear_cross_entropy``,
the loss of ``hidden @ weight.T (+ bias)`` computed chunk by chunk so the (N, V) logits never exist.

Per token, with logits ``x`` (one row of V), target ``y``, label smoothing ``eps`` and z-loss scale ``s``::

    z    = softcap * tanh(x / softcap)                 # only when softcap is set (Gemma 2)
    lse  = logsumexp(z)
    loss = (1 - eps) * (lse - z[y]) + eps * (lse - mean(z)) + s * lse**2
    d loss / d z = softmax(z) * (1 + 2*s*lse) - (1 - eps) * onehot(y) - eps / V

(label smoothing as in ``torch.nn.functional.cross_entropy``, z-loss as in PaLM). Tokens whose target
is ``ignore_index`` contribute 0 to the loss and get zero gradient. ``reduction="mean"`` divides by the
number of non-ignored tokens (never by zero: all ignored gives loss 0 and zero gradients), or by
``num_items`` when given; "sum" and "none" as usual. The loss comes back in float32 whatever the
input dtype (the kernels compute it in fp32; rounding it to bf16 would only throw precision away).

Targets outside [0, V) that are not ``ignore_index`` cannot be checked on the host without a
device sync, so the kernels poison them instead: such a token's loss and gradient row are NaN
(never a silently wrong finite value, and it propagates into a reduced loss and the parameter
gradients); with ``TRITON_DEBUG=1`` on the GPU a device-side assert also names the problem. The
PyTorch reference raises an index error.

Design (no host-device synchronisation anywhere, forward or backward):

* ``cross_entropy``: the forward kernel reads each logits row once (online max / sum-exp, plus the
  row sum for label smoothing) and keeps the per-row ``lse`` (N floats). The backward kernel reads
  the row again and writes ``d logits`` scaled by the upstream gradient, which it reads through a
  pointer (stride 0 for the 0-dim gradient of "mean"/"sum", per token for "none"). Bytes: forward
  N*V*s, backward 2*N*V*s -- the fewest possible for an unfused loss.
* ``fused_linear_cross_entropy`` has two strategies (``strategy=``), both with fp32 accumulation of
  every gradient and no host sync:

  - "tokens" (default; 3 GEMMs, the fastest): chunks over the TOKENS. "mean"/"sum": one pass in the
    forward does everything. Per chunk: ``logits = h @ W.T (+ b)`` into a reused (C, V) buffer; the
    CE kernel computes the loss and writes ``d loss / d logits`` (already divided by the token
    count, read from device) back into that same buffer; then ``dh[chunk] = dlogits @ W`` and
    ``dW += dlogits.T @ h`` with **fp32 accumulation** (``torch.addmm(..., out_dtype=float32)`` into
    an fp32 (V, H) buffer on CUDA; bf16 accumulation over many chunks is a known divergence cause),
    ``db += dlogits.sum(0)`` in fp32. The forward rounds dW once to a 16-bit weight's dtype (as dh is
    rounded to the hidden dtype), so backward holds V*H*s bytes, not 4*V*H; backward only multiplies
    these by the incoming 0-dim gradient, on the device, in one Triton pass that casts to the parameter
    dtype (a second rounding only where that gradient is not a power of two).
    The rounding would briefly hold the fp32 accumulator and dW together (6*V*H bytes in bf16): where
    chunks of H/2 tokens are long enough (``FLCE_SPLIT_MIN_CHUNK``), the accumulator is two row halves and
    the chunk buffer is cut to half of dW, the first half is cast into that buffer and freed, and dW is
    allocated where it was: the loss head then peaks at 5*V*H bytes (Gemma's 256000 x 2048 head: 2.6 GB
    instead of 3.1).
    "none": the upstream gradient is per token, so the forward computes loss and ``lse`` only and
    the backward recomputes the chunk logits and runs the same loop with the per-token gradient.
    Chunk size: the largest C (a multiple of 256 when possible, balanced over the chunks) whose
    (C, V) buffer fits ``FLCE_CHUNK_BUDGET_BYTES`` (1 GiB by default: C = 3328 at V = 152064 in
    bf16). Extra memory ~ chunk buffer + 4*V*H (the fp32 dW accumulator, independent of N; 2.5 GB
    at V = 152064, H = 4096) + N*H*s (dh held from forward to backward for "mean"/"sum").
  - "vocab" (4 GEMMs, about 1.33x the matmul floor; least memory when 4*V*H is large against
    4*N*H): windows over the VOCABULARY, every reduction. Forward: per window [v0, v1) of Vc
    columns, ``logits = h @ W[v0:v1].T (+ b)`` into a reused (N, Vc) buffer, and
    ``_ce_window_kernel`` folds it into per-token fp32 running state (online max, sum-exp, row sum
    of z, the target's z when it falls in the window); the last window yields loss and ``lse``.
    Backward: per window, recompute the logits, ``_ce_kernel`` (BWD, with the window's column
    offset and the full V) writes dlogits in place, then ``dW[v0:v1] = dlogits.T @ h`` straight into
    the weight gradient (one GEMM over all N tokens, fp32 accumulation inside cuBLAS, one rounding:
    no (V, H) buffer), ``db[v0:v1] = dlogits.sum(0)`` in fp32, ``dh += dlogits @ W[v0:v1]`` into an
    fp32 (N, H) accumulator cast once at the end. Window: the largest multiple of 256 columns whose
    (N, Vc) buffer fits ``FLCE_VOCAB_BUDGET_BYTES`` (256 MiB by default: Vc = 8192 at N = 16384 in
    bf16), balanced over the windows. Extra memory ~ window buffer + 4*N*H (+ 24*N).

  Pick "tokens" for speed, or when N*H is large against V*H (long sequences, small vocabularies);
  "vocab" when memory is tight and V*H is large (e.g. V = 256000, H = 2048 at N = 8192: 0.33 GB
  instead of 3.2 GB extra). :func:`flce_chunk_plan` predicts the extra bytes of both.

torch.compile: the kernel launchers are ``torch.library.triton_op`` ops; each FLCE loop (tokens:
``flce_fwd``/``flce_bwd``; vocab: ``flce_vocab_fwd``/``flce_vocab_bwd``) is a
``torch.library.custom_op`` with a fake (meta) implementation, so Dynamo traces one opaque op per
direction (no graph break, no specialisation on the number of chunks). Inputs are never modified.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kernels._common import (
    INTERPRET,
    LIB,
    check_floating,
    compute_dtype,
    eager_op,
    n_rows,
    row_block,
    row_warps,
    use_triton,
)

_REDUCTIONS = ("mean", "sum", "none")
_STRATEGIES = ("tokens", "vocab")

#: Largest block (elements of one row) a CE program loads at once; rows longer than this are looped over.
CE_MAX_BLOCK: int = 4096
#: When set, forces the rows per CE program (else chosen from V, see ``_ce_tile``).
CE_ROWS: int | None = None
#: Bytes the FLCE (C, V) logits chunk buffer may take; the chunk size C follows from it (and V, dtype).
FLCE_CHUNK_BUDGET_BYTES: int = int(os.environ.get("LIGERMODELS_FLCE_CHUNK_BYTES", 1 << 30))
#: When set, forces the FLCE chunk size (tokens per chunk); tests use it to run many chunks on small shapes.
FLCE_CHUNK_SIZE: int | None = int(os.environ.get("LIGERMODELS_FLCE_CHUNK", 0)) or None
#: "tokens" with a 16-bit weight: the fp32 dW accumulator is kept as two row halves and the chunk cut to about H/2
#: tokens, whose buffer then holds half of dW in the weight's dtype (:func:`flce_chunk_plan`), when that chunk is
#: at least this many tokens: below ~1000 tokens the dW GEMM's fp32 read-modify-write of the accumulator would
#: outweigh its math (at V*H 8 bytes a chunk against 2*C*V*H flops: C ~ 4 * 670 TFLOPS / 3.2 TB/s on an H100).
FLCE_SPLIT_MIN_CHUNK: int = int(os.environ.get("LIGERMODELS_FLCE_SPLIT_MIN_CHUNK", 1024))
#: Bytes the "vocab" FLCE (N, Vc) window buffer may take; the window Vc follows from it (and N, dtype).
FLCE_VOCAB_BUDGET_BYTES: int = int(os.environ.get("LIGERMODELS_FLCE_VOCAB_BYTES", 256 << 20))
#: When set, forces the "vocab" FLCE window (vocabulary columns per window); tests use it to run many windows.
FLCE_VOCAB_CHUNK: int | None = int(os.environ.get("LIGERMODELS_FLCE_VOCAB_CHUNK", 0)) or None
_SCALE_BLOCK = 2048


# --------------------------------------------------------------------------------------- kernels
@triton.jit
def _softcap(x, cap):
    """Return (cap * tanh(x / cap), 1 - tanh(x / cap)**2) in fp32.

    tanh from exp alone (the interpreter has no libdevice): (1 - e) / (1 + e) with e = exp(-2|u|),
    and its odd Taylor series below |u| = 0.25 where 1 - e would cancel. sech^2 = 4e / (1 + e)^2
    keeps the derivative accurate where tanh is close to 1.
    """
    u = x / cap
    a = tl.abs(u)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    a2 = a * a
    small = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333
                                                          + a2 * (-0.05396825396825397 + a2 * 0.021869488536155203))))
    is_small = a < 0.25
    t = tl.where(is_small, small, big)
    dt = tl.where(is_small, 1.0 - t * t, 4.0 * e / ((1.0 + e) * (1.0 + e)))
    t = tl.where(u < 0.0, -t, t)
    return cap * t, dt


@triton.jit
def _lse_step(m, s, z):
    """One block of the online logsumexp: running max ``m`` and sum ``s`` (ROWS,) updated with the
    (ROWS, BLOCK) logits ``z``. While a row has seen only -inf (a masked first block), its max stays
    -inf and the exponents are taken against 0 instead, so they give 0 rather than exp(-inf + inf) = NaN."""
    m_new = tl.maximum(m, tl.max(z, axis=1))
    base = tl.where(m_new == -float("inf"), 0.0, m_new)
    return m_new, s * tl.exp(m - base) + tl.sum(tl.exp(z - base[:, None]), axis=1)


@triton.jit
def _ce_kernel(x_ptr, stride_x, dx_ptr, stride_dx, y_ptr, loss_ptr, lse_ptr, g_ptr, stride_g,
               n_rows, n_cols, col0, v_total, ignore_index, eps, zscale, cap,
               FWD: tl.constexpr, BWD: tl.constexpr, SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr,
               ZLOSS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """ROWS rows (tokens) of n_cols logits per program, walked in BLOCK-wide steps; all math in fp32.

    The n_cols columns of x are the vocabulary columns [col0, col0 + n_cols) of v_total (the whole
    row for ``cross_entropy`` and the "tokens" FLCE: col0 = 0, v_total = n_cols; one window of
    the vocabulary for the "vocab" FLCE backward). FWD (whole rows only): one pass over the rows
    (online max and sum-exp) stores loss[row] and lse[row]; otherwise lse[row] is read. BWD: a
    second pass stores dx[row] = g[row * stride_g] * d loss / d x for the columns held (dx may be x
    itself: every element is read, then overwritten, by the same program). ROWS is 1 for long rows.
    """
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    y = tl.load(y_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    valid = y != ignore_index
    in_range = (y >= 0) & (y < v_total)
    tl.device_assert(in_range | (~valid), "cross_entropy: target out of [0, V) and not ignore_index")
    bad = valid & (~in_range)
    x_rows = x_ptr + rows[:, None] * stride_x
    offs = tl.arange(0, BLOCK)[None, :]

    if FWD:
        m = tl.full([ROWS], -float("inf"), tl.float32)
        s = tl.zeros([ROWS], tl.float32)
        zsum = tl.zeros([ROWS], tl.float32)
        for off in range(0, n_cols, BLOCK):
            cols = off + offs
            col_ok = cols < n_cols
            z = tl.load(x_rows + cols, mask=row_ok[:, None] & col_ok, other=0.0).to(tl.float32)
            if SOFTCAP:
                z, _ = _softcap(z, cap)
            if SMOOTH:
                zsum += tl.sum(tl.where(col_ok, z, 0.0), axis=1)
            z = tl.where(col_ok, z, -float("inf"))  # rows past n_rows read 0: finite, discarded
            m, s = _lse_step(m, s, z)
        lse = m + tl.log(s)
        # target logit, read before the gradient pass may overwrite the row in place
        zy = tl.load(x_ptr + rows * stride_x + tl.where(valid & in_range, y, 0), mask=row_ok, other=0.0)
        zy = zy.to(tl.float32)
        if SOFTCAP:
            zy, _ = _softcap(zy, cap)
        loss = lse - (1.0 - eps) * zy
        if SMOOTH:
            loss -= eps * zsum / v_total
        if ZLOSS:
            loss += zscale * lse * lse
        loss = tl.where(valid, loss, 0.0)
        loss = tl.where(bad, float("nan"), loss)
        tl.store(loss_ptr + rows, loss, mask=row_ok)
        tl.store(lse_ptr + rows, lse, mask=row_ok)
    else:
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)

    if BWD:
        g = tl.load(g_ptr + rows * stride_g, mask=row_ok, other=0.0).to(tl.float32)
        coef = tl.where(valid, g, 0.0)
        coef = tl.where(bad, float("nan"), coef)
        coef_p = coef
        if ZLOSS:
            coef_p = coef * (1.0 + 2.0 * zscale * lse)
        coef_y = ((1.0 - eps) * coef)[:, None]
        coef_s = (eps / v_total * coef)[:, None]
        coef_p = coef_p[:, None]
        lse2 = lse[:, None]
        y2 = (y - col0)[:, None]  # the target's column within this window (may lie outside it)
        dx_rows = dx_ptr + rows[:, None] * stride_dx
        for off in range(0, n_cols, BLOCK):
            cols = off + offs
            mask = row_ok[:, None] & (cols < n_cols)
            x = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
            if SOFTCAP:
                z, dz = _softcap(x, cap)
            else:
                z = x
            d = tl.exp(z - lse2) * coef_p - tl.where(cols == y2, coef_y, 0.0)
            if SMOOTH:
                d -= coef_s
            if SOFTCAP:
                d *= dz
            tl.store(dx_rows + cols, d.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ce_window_kernel(x_ptr, stride_x, y_ptr, state_ptr, loss_ptr, lse_ptr, n_rows, n_cols, col0, v_total,
                      ignore_index, eps, zscale, cap,
                      FIRST: tl.constexpr, LAST: tl.constexpr, SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr,
                      ZLOSS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """One vocabulary window of the "vocab" FLCE forward: x (n_rows, n_cols) holds the logits of the
    columns [col0, col0 + n_cols) of v_total. All math in fp32.

    Per-token running state, ``state`` (4, n_rows) fp32: online max m, sum-exp s (relative to m), the
    row sum of z (label smoothing) and the target's logit z_y (set by the window holding the target).
    FIRST: the state starts empty (not read); LAST: instead of storing the state, store
    lse = m + log(s) and the loss, with the semantics of ``_ce_kernel`` (0 for ignore_index, NaN for
    a target outside [0, v_total)). Both for a single window.
    """
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    y = tl.load(y_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    valid = y != ignore_index
    if FIRST:
        m = tl.full([ROWS], -float("inf"), tl.float32)
        s = tl.zeros([ROWS], tl.float32)
        zsum = tl.zeros([ROWS], tl.float32)
        zy = tl.zeros([ROWS], tl.float32)
    else:
        m = tl.load(state_ptr + rows, mask=row_ok, other=0.0)
        s = tl.load(state_ptr + n_rows + rows, mask=row_ok, other=0.0)
        zsum = tl.load(state_ptr + 2 * n_rows + rows, mask=row_ok, other=0.0)
        zy = tl.load(state_ptr + 3 * n_rows + rows, mask=row_ok, other=0.0)
    x_rows = x_ptr + rows[:, None] * stride_x
    offs = tl.arange(0, BLOCK)[None, :]
    for off in range(0, n_cols, BLOCK):
        cols = off + offs
        col_ok = cols < n_cols
        z = tl.load(x_rows + cols, mask=row_ok[:, None] & col_ok, other=0.0).to(tl.float32)
        if SOFTCAP:
            z, _ = _softcap(z, cap)
        if SMOOTH:
            zsum += tl.sum(tl.where(col_ok, z, 0.0), axis=1)
        z = tl.where(col_ok, z, -float("inf"))
        m, s = _lse_step(m, s, z)
    yl = y - col0  # the target's column within this window
    here = row_ok & valid & (yl >= 0) & (yl < n_cols)
    zt = tl.load(x_ptr + rows * stride_x + tl.where(here, yl, 0), mask=here, other=0.0).to(tl.float32)
    if SOFTCAP:
        zt, _ = _softcap(zt, cap)
    zy = tl.where(here, zt, zy)
    if LAST:
        in_range = (y >= 0) & (y < v_total)
        tl.device_assert(in_range | (~valid), "cross_entropy: target out of [0, V) and not ignore_index")
        bad = valid & (~in_range)
        lse = m + tl.log(s)
        loss = lse - (1.0 - eps) * zy
        if SMOOTH:
            loss -= eps * zsum / v_total
        if ZLOSS:
            loss += zscale * lse * lse
        loss = tl.where(valid, loss, 0.0)
        loss = tl.where(bad, float("nan"), loss)
        tl.store(loss_ptr + rows, loss, mask=row_ok)
        tl.store(lse_ptr + rows, lse, mask=row_ok)
    else:
        tl.store(state_ptr + rows, m, mask=row_ok)
        tl.store(state_ptr + n_rows + rows, s, mask=row_ok)
        tl.store(state_ptr + 2 * n_rows + rows, zsum, mask=row_ok)
        tl.store(state_ptr + 3 * n_rows + rows, zy, mask=row_ok)


@triton.jit
def _scale_cast_kernel(src_ptr, dst_ptr, g_ptr, n, BLOCK: tl.constexpr):
    """dst = (src * g[0]) in dst's dtype, math in fp32."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr).to(tl.float32)
    x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, (x * g).to(dst_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------ launching
def _ce_tile(n_cols: int) -> tuple[int, int]:
    """(ROWS, BLOCK) of a CE program: BLOCK covers the row up to CE_MAX_BLOCK; short rows share a program.

    On the GPU a tile holds about 4096 elements (one row per program for vocabularies >= 4096). The
    interpreter pays per operation rather than per element, so there tiles are larger.
    """
    block = min(row_block(n_cols), CE_MAX_BLOCK)
    if CE_ROWS is not None:
        return row_block(CE_ROWS), block
    tile = 16384 if INTERPRET else 4096
    return max(1, min(32, tile // block)), block


def _launch_ce(kernel, x, dx, target, loss, lse, g, stride_g, ignore_index, eps, zscale, cap, fwd, bwd,
               col0=0, v_total=None):
    """Launch ``_ce_kernel`` (``kernel`` is it, or ``wrap_triton`` of it) over the rows of ``x`` (rows, V).

    ``x`` may hold only the vocabulary columns [col0, col0 + x.shape[1]) of ``v_total`` (backward only).
    """
    n_rows, n_cols = x.shape
    rows, block = _ce_tile(n_cols)
    kernel[(triton.cdiv(n_rows, rows),)](
        x, x.stride(0), dx, dx.stride(0), target, loss, lse, g, stride_g,
        n_rows, n_cols, col0, n_cols if v_total is None else v_total, ignore_index, eps, zscale, cap if cap else 1.0,
        FWD=fwd, BWD=bwd, SOFTCAP=bool(cap), SMOOTH=eps != 0.0, ZLOSS=zscale != 0.0, ROWS=rows, BLOCK=block,
        num_warps=row_warps(rows * block))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(rows, V) with unit last stride (the kernels index rows by stride and columns by 1)."""
    return x if x.stride(-1) == 1 else x.contiguous()


@eager_op
@triton_op(f"{LIB}::cross_entropy_fwd", mutates_args={})
def _ce_fwd(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
            lse_square_scale: float, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss (N,) and logsumexp (N,), both fp32, of (N, V) logits (softcap 0 = off)."""
    x = _rows(logits)
    n = x.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=x.device)
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    if n > 0 and x.shape[1] > 0:
        _launch_ce(wrap_triton(_ce_kernel), x, loss.view(n, 1), target, loss, lse, lse, 0,
                   ignore_index, label_smoothing, lse_square_scale, softcap, True, False)
    return loss, lse


@eager_op
@triton_op(f"{LIB}::cross_entropy_bwd", mutates_args={})
def _ce_bwd(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, ignore_index: int,
            label_smoothing: float, lse_square_scale: float, softcap: float) -> torch.Tensor:
    """d(sum_i grad_i * loss_i) / d logits, in the logits dtype; ``grad`` is 0-dim (broadcast) or (N,)."""
    x = _rows(logits)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if dx.numel() > 0:
        _launch_ce(wrap_triton(_ce_kernel), x, dx, target, lse, lse, grad, grad.stride(0) if grad.dim() else 0,
                   ignore_index, label_smoothing, lse_square_scale, softcap, False, True)
    return dx


@eager_op
@triton_op(f"{LIB}::scale_cast", mutates_args={})
def _scale_cast(src: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(src * g).to(dtype)`` for a contiguous ``src`` and a 0-dim ``g``, in one pass, math in fp32."""
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    n = src.numel()
    if n > 0:
        wrap_triton(_scale_cast_kernel)[(triton.cdiv(n, _SCALE_BLOCK),)](src, out, g, n, BLOCK=_SCALE_BLOCK,
                                                                         num_warps=4)
    return out


# ---------------------------------------------------------------------------- chunk size planning
class ChunkPlan(NamedTuple):
    """How :func:`fused_linear_cross_entropy` splits the work, and the extra device memory it predicts.

    ``extra_bytes`` is what the op allocates beyond its inputs and the final gradients it returns:

    * "tokens": chunks of ``chunk_size`` tokens. The (C, V) logits/dlogits chunk buffer, per-token
      fp32 loss and lse (8*N), the fp32 weight- and bias-gradient accumulators (``accum_bytes`` =
      4*V*H + 4*V, independent of N), and, for "mean"/"sum", the hidden gradient computed in the
      forward and held until backward scales it into a fresh tensor (N*H*s). The weight gradient is
      returned in a 16-bit weight's dtype (V*H*s, a final gradient: not counted); with ``split`` the chunk
      buffer (``chunk_bytes``) is at least half of it, and the first half of the accumulator is cast into
      the buffer and freed before it is allocated, so casting it costs nothing beyond the loop's peak.
    * "vocab": windows of ``chunk_size`` vocabulary columns. The (N, Vc) logits/dlogits window
      buffer, per-token fp32 vectors (24*N: loss, lse and the 4 running-state vectors of the
      forward), and ``accum_bytes``: the fp32 (N, H) hidden-gradient accumulator (4*N*H; none
      for fp32 hidden, whose gradient is accumulated in place) plus a (Vc,) fp32 bias-gradient
      window. No (V, H) buffer: each window's weight gradient is written straight into the result.
    """

    chunk_size: int
    n_chunks: int
    chunk_bytes: int
    accum_bytes: int
    held_grad_hidden_bytes: int
    per_token_bytes: int
    extra_bytes: int
    strategy: str = "tokens"
    split: bool = False  #: "tokens": the dW accumulator in two halves, the first cast into the chunk buffer


def _round_chunk(c: int) -> int:
    """Round a chunk size down to a GEMM-friendly multiple (256 when large enough, else 16)."""
    for m in (256, 16):
        if c >= m:
            return c - c % m
    return max(c, 1)


def _balanced(total: int, c_max: int, multiple: int) -> int:
    """The chunk size splitting ``total`` into as many chunks as ``c_max`` needs, as equal as possible
    (rounded up to ``multiple`` when ``c_max`` is at least that, never above ``c_max``)."""
    if total <= c_max:
        return max(total, 1)
    k = triton.cdiv(total, c_max)
    return min(c_max, triton.cdiv(triton.cdiv(total, k), multiple) * multiple) if c_max >= multiple else c_max


def _check_strategy(strategy: str) -> None:
    if strategy not in _STRATEGIES:
        raise ValueError(f"strategy must be one of {_STRATEGIES}, got {strategy!r}")


def flce_chunk_plan(n_tokens: int, hidden_size: int, vocab_size: int, dtype: torch.dtype = torch.bfloat16, *,
                    grad_hidden: bool = True, grad_weight: bool = True, bias: bool = False,
                    reduction: str = "mean", budget_bytes: int | None = None,
                    chunk_size: int | None = None, strategy: str = "tokens") -> ChunkPlan:
    """Chunk (or window) size for :func:`fused_linear_cross_entropy` and the extra bytes it will allocate.

    "tokens": C is the largest GEMM-friendly size whose (C, V) buffer in ``dtype`` fits
    ``budget_bytes`` (``FLCE_CHUNK_BUDGET_BYTES``, 1 GiB by default), then shrunk to balance the
    chunks (the same number of chunks, as equal as possible). Larger chunks mean fewer
    read-modify-writes of the fp32 (V, H) accumulator (8*V*H bytes per chunk), so the budget trades
    memory for speed. At V = 152064, H = 4096, bf16: C = 3328, chunk buffer 0.94 GiB, accumulator 2.3 GiB.

    "vocab": the window Vc (vocabulary columns) is the largest multiple of 256 (at least 256, at most
    V) whose (N, Vc) buffer fits ``budget_bytes`` (``FLCE_VOCAB_BUDGET_BYTES``, 256 MiB by default),
    balanced over the windows; ``chunk_size`` (or ``FLCE_VOCAB_CHUNK``) forces it. At N = 16384,
    bf16: Vc = 8192 (19 windows at V = 152064), window buffer 256 MiB, hidden-gradient accumulator
    4*N*H (256 MiB at H = 4096).
    """
    _check_strategy(strategy)
    n, h, v = int(n_tokens), int(hidden_size), int(vocab_size)
    s = dtype.itemsize
    any_grad = grad_hidden or grad_weight or bias
    if strategy == "vocab":
        forced = chunk_size if chunk_size is not None else FLCE_VOCAB_CHUNK
        if forced is not None:
            c = max(1, min(int(forced), v))
        else:
            budget = FLCE_VOCAB_BUDGET_BYTES if budget_bytes is None else int(budget_bytes)
            c_max = min(max(budget // max(n * s, 1) // 256 * 256, 256), v)
            c = _balanced(v, c_max, 256)
        n_chunks = triton.cdiv(v, c)
        chunk_bytes = n * c * s
        accum = (4 * n * h if grad_hidden and s != 4 else 0) + (4 * c if bias else 0)
        per_token = 24 * n
        extra = chunk_bytes + per_token + (accum if any_grad else 0)
        return ChunkPlan(c, n_chunks, chunk_bytes, accum if any_grad else 0, 0, per_token, extra, strategy)
    forced = chunk_size if chunk_size is not None else FLCE_CHUNK_SIZE
    budget = FLCE_CHUNK_BUDGET_BYTES if budget_bytes is None else int(budget_bytes)
    c_max = _round_chunk(max(budget // max(v * s, 1), 1))
    # the split: chunks of about H/2 tokens, whose buffer holds half of dW in the weight's dtype
    half = _round_chunk(max((h + 1) // 2, 1))
    split = grad_weight and s < 4 and half >= FLCE_SPLIT_MIN_CHUNK and (half < c_max or forced is not None)
    if forced is not None:
        c = max(1, min(int(forced), max(n, 1)))
    else:
        c = _balanced(n, min(c_max, half) if split else c_max, 256)
    n_chunks = triton.cdiv(n, c) if n > 0 else 0
    chunk_bytes = min(c, n) * v * s if n > 0 else 0
    if split and n > 0:
        chunk_bytes = max(chunk_bytes, (v + 1) // 2 * h * s)
    accum = (4 * v * h if grad_weight else 0) + (4 * v if bias else 0)
    held = n * h * s if (grad_hidden and reduction != "none") else 0
    per_token = 8 * n
    extra = chunk_bytes + per_token + (accum + held if any_grad else 0)
    return ChunkPlan(c, n_chunks, chunk_bytes, accum if any_grad else 0, held if any_grad else 0, per_token, extra,
                     split=split)


# -------------------------------------------------------------------------------- FLCE chunk loop
_ADDMM_OUT_DTYPE_OK: bool | None = None  # learnt on first use: does torch.addmm(..., out_dtype=fp32) work here?


def _accumulate_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 1.0) -> None:
    """``acc = beta * acc + a @ b`` with ``acc`` fp32, the products accumulated in fp32 for any input dtype.

    ``beta = 0`` (the first chunk) ignores ``acc``'s contents, so the accumulator needs no zero fill.
    fp32 inputs: ``addmm``. bf16/fp16 on CUDA: ``torch.addmm(acc, a, b, out_dtype=float32, out=acc)``
    -- one cuBLAS GEMM with fp32 output and beta = 1, i.e. the bf16 products of this chunk are summed
    in fp32 and added to the fp32 accumulator with no intermediate rounding to bf16 (torch >= 2.10
    accepts an fp32 ``self`` there). Elsewhere (CPU, or a torch where that overload refuses), the
    operands are upcast first: bf16 -> fp32 is exact, so the result is the same fp32 accumulation.
    """
    global _ADDMM_OUT_DTYPE_OK
    if a.dtype == torch.float32:
        torch.addmm(acc, a, b, beta=beta, out=acc)
        return
    if acc.device.type == "cuda" and _ADDMM_OUT_DTYPE_OK is not False:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, beta=beta, out=acc)
            _ADDMM_OUT_DTYPE_OK = True
            return
        except (RuntimeError, TypeError):  # argument checks only: raised on the host, before any launch
            if _ADDMM_OUT_DTYPE_OK:
                raise
            _ADDMM_OUT_DTYPE_OK = False
    torch.addmm(acc, a.float(), b.float(), beta=beta, out=acc)


def _flce_loop(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
               g: torch.Tensor | None, lse_in: torch.Tensor | None, ignore_index: int, eps: float, zscale: float,
               cap: float, want_h: bool, want_w: bool, want_b: bool,
               chunks: list[tuple[int, int]] | None = None, chunk_grad=None):
    """The chunk loop shared by forward ("mean"/"sum": loss + gradients; "none": loss) and backward ("none").

    ``g``: 0-dim (the 1/count scale) or (N,) per-token upstream gradient; ``lse_in``: per-token lse when
    recomputing in backward (skips the loss pass), else None. Returns (loss (N,) fp32, lse (N,) fp32,
    dh (N, H) hidden dtype, dW (V, H) in :func:`_dw_dtype`, db (V,) fp32), with (0,) placeholders for what
    is not asked. dW accumulates in fp32 and is rounded once, here; with the plan's ``split`` its fp32 rows sit
    in two halves, and the first is cast into the chunk buffer and freed before dW is allocated (module docstring).

    ``chunks`` (token ranges covering [0, N) in order) replaces the plan's chunking; with ``chunk_grad`` (forward
    only, ``g`` None) each chunk's upstream gradient is learnt inside the loop: the CE kernel first writes the
    chunk's loss and lse only, ``chunk_grad(start, end, loss[start:end])`` returns the chunk's fp32 per-token
    gradient (end - start,), and the kernel then turns the logits, still in the buffer, into their gradient
    (:func:`kernels.logprobs.fused_linear_logprob_loss`: 3 GEMMs where a per-token gradient known only after the
    forward takes 4).
    """
    n, h_size = hidden.shape
    v = weight.shape[0]
    dev, dt = hidden.device, hidden.dtype
    fwd = lse_in is None
    bwd = want_h or want_w or want_b
    f32 = dict(dtype=torch.float32, device=dev)
    # every output is a fresh tensor (custom ops may not return aliases), (0,) when not asked for
    loss = torch.empty(n if fwd else 0, **f32)
    lse = torch.empty(n, **f32) if fwd else lse_in
    dh = torch.empty((n, h_size) if want_h else (0,), dtype=dt, device=dev)
    db = torch.zeros(v if want_b else 0, **f32)
    if n == 0:
        return loss, lse, dh, torch.zeros((v, h_size) if want_w else (0,), dtype=_dw_dtype(weight), device=dev), db
    if chunks is None:
        plan = flce_chunk_plan(n, h_size, v, dt, grad_weight=want_w)
        c, split, store_size = plan.chunk_size, plan.split and weight.dtype == dt, plan.chunk_bytes // dt.itemsize
        chunks = [(s, min(s + c, n)) for s in range(0, n, c)]
    else:
        c, split = max(e - s for s, e in chunks), False
        store_size = c * v
    va = (v + 1) // 2 if split else v  # the accumulator's first part: rows [0, va)
    # fp32 accumulators, overwritten by the first chunk (beta = 0)
    acc = [torch.empty((va, h_size), **f32), torch.empty((v - va, h_size), **f32)] if want_w else []
    store = torch.empty(store_size, dtype=dt, device=dev)  # split: at least half of dW
    buf = store[:min(c, n) * v].view(min(c, n), v)
    wt = weight.t()
    per_token_g = g is not None and g.dim() == 1
    stride_g = 1 if chunk_grad is not None else g.stride(0) if per_token_g else 0
    for s, e in chunks:
        hc, logits = hidden[s:e], buf[: e - s]
        if bias is None:
            torch.mm(hc, wt, out=logits)
        else:
            torch.addmm(bias, hc, wt, out=logits)
        if chunk_grad is None:
            _launch_ce(_ce_kernel, logits, logits, target[s:e], loss[s:e] if fwd else lse, lse[s:e],
                       g[s:e] if per_token_g else g, stride_g, ignore_index, eps, zscale, cap, fwd, bwd)
        else:  # the loss, then its gradient from what the chunk's loss says, then the logits' gradient in place
            _launch_ce(_ce_kernel, logits, logits, target[s:e], loss[s:e], lse[s:e], lse, 0, ignore_index, eps,
                       zscale, cap, True, False)
            _launch_ce(_ce_kernel, logits, logits, target[s:e], lse, lse[s:e], chunk_grad(s, e, loss[s:e]),
                       stride_g, ignore_index, eps, zscale, cap, False, True)
        if want_h:
            torch.mm(logits, weight, out=dh[s:e])
        if want_w:  # (no name is kept for logits.t(): a view of the chunk buffer would keep it alive below)
            _accumulate_fp32(acc[0], logits.t()[:va], hc, beta=0.0 if s == 0 else 1.0)
            if va < v:
                _accumulate_fp32(acc[1], logits.t()[va:], hc, beta=0.0 if s == 0 else 1.0)
        if want_b:
            db += logits.sum(0, dtype=torch.float32)
    del buf, hc, logits  # only `store` holds the chunk buffer now: freed below, or kept for dW's first half
    if not want_w:
        return loss, lse, dh, torch.empty(0, dtype=_dw_dtype(weight), device=dev), db
    if not split:
        del store
        return loss, lse, dh, (acc[0] if acc[0].dtype == _dw_dtype(weight) else acc[0].to(_dw_dtype(weight))), db
    first = store[:va * h_size].view(va, h_size)
    first.copy_(acc.pop(0))  # rounded once, into the chunk buffer; its fp32 rows are freed here
    dw = torch.empty((v, h_size), dtype=weight.dtype, device=dev)  # where they were
    dw[:va].copy_(first)
    dw[va:].copy_(acc.pop())
    return loss, lse, dh, dw, db


def _dw_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the FLCE loop returns the weight gradient in: a 16-bit weight's own (rounded once from the
    fp32 accumulator, in forward for "mean"/"sum": backward then holds half the bytes), else fp32."""
    return weight.dtype if weight.dtype in (torch.bfloat16, torch.float16) else torch.float32


def _placeholder_outputs(hidden, weight, target, lse_given, want_h, want_w, want_b):
    n, h_size = target.numel(), hidden.shape[-1]
    v = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    return (hidden.new_empty(n if not lse_given else 0, **f32), hidden.new_empty(n, **f32),
            hidden.new_empty((n, h_size) if want_h else (0,)),
            hidden.new_empty((v, h_size) if want_w else (0,), dtype=_dw_dtype(weight)),
            hidden.new_empty(v if want_b else 0, **f32))


@eager_op
@torch.library.custom_op(f"{LIB}::flce_fwd", mutates_args=())
def _flce_fwd(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
              scale: torch.Tensor, ignore_index: int, label_smoothing: float, lse_square_scale: float,
              softcap: float, want_h: bool, want_w: bool, want_b: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FLCE forward: (loss (N,), lse (N,), dh, dW (:func:`_dw_dtype`), db fp32); gradients of sum_i scale * loss_i."""
    return _flce_loop(hidden, weight, bias, target, scale, None, ignore_index, label_smoothing, lse_square_scale,
                      softcap, want_h, want_w, want_b)


@_flce_fwd.register_fake
def _(hidden, weight, bias, target, scale, ignore_index, label_smoothing, lse_square_scale, softcap,
      want_h, want_w, want_b):
    return _placeholder_outputs(hidden, weight, target, False, want_h, want_w, want_b)


@eager_op
@torch.library.custom_op(f"{LIB}::flce_bwd", mutates_args=())
def _flce_bwd(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
              lse: torch.Tensor, grad: torch.Tensor, ignore_index: int, label_smoothing: float,
              lse_square_scale: float, softcap: float, want_h: bool, want_w: bool, want_b: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FLCE backward for per-token upstream ``grad`` (N,): recomputes chunk logits; (dh, dW, db) in input dtypes."""
    _, _, dh, dw, db = _flce_loop(hidden, weight, bias, target, grad, lse, ignore_index, label_smoothing,
                                  lse_square_scale, softcap, want_h, want_w, want_b)
    if want_w:
        dw = dw.to(weight.dtype)
    if want_b:
        db = db.to(bias.dtype)
    return dh, dw, db


@_flce_bwd.register_fake
def _(hidden, weight, bias, target, lse, grad, ignore_index, label_smoothing, lse_square_scale, softcap,
      want_h, want_w, want_b):
    _, _, dh, dw, db = _placeholder_outputs(hidden, weight, target, True, want_h, want_w, want_b)
    return dh, (dw.to(weight.dtype) if want_w else dw), (db.to(bias.dtype) if want_b else db)


# ------------------------------------------------------------------- FLCE vocabulary-window loops
def _vocab_windows(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Yield (v0, v1, logits) per vocabulary window: ``logits = hidden @ weight[v0:v1].T (+ bias[v0:v1])``,
    (N, v1 - v0) contiguous, in one reused buffer (each window overwrites the previous one's)."""
    n, h_size = hidden.shape
    v = weight.shape[0]
    c = flce_chunk_plan(n, h_size, v, hidden.dtype, strategy="vocab").chunk_size
    flat = torch.empty(n * min(c, v), dtype=hidden.dtype, device=hidden.device)
    for v0 in range(0, v, c):
        v1 = min(v0 + c, v)
        logits = flat[: n * (v1 - v0)].view(n, v1 - v0)  # contiguous, so the GEMM writes it in place
        wt = weight[v0:v1].t()
        if bias is None:
            torch.mm(hidden, wt, out=logits)
        else:
            torch.addmm(bias[v0:v1], hidden, wt, out=logits)
        yield v0, v1, logits


def _vocab_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                   ignore_index: int, label_smoothing: float, lse_square_scale: float, softcap: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """"vocab" FLCE forward: per-token loss (N,) and lse (N,), fp32, one vocabulary window at a time.

    Per window, one GEMM into the (N, Vc) buffer, then ``_ce_window_kernel`` folds the window into the
    per-token running state (4, N); the last window's launch turns the state into loss and lse.
    """
    n, v = hidden.shape[0], weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    loss, lse = torch.empty(n, **f32), torch.empty(n, **f32)
    if n == 0:
        return loss, lse
    state = torch.empty(4, n, **f32)
    eps, zscale, cap = label_smoothing, lse_square_scale, softcap
    for v0, v1, logits in _vocab_windows(hidden, weight, bias):
        rows, block = _ce_tile(v1 - v0)
        _ce_window_kernel[(triton.cdiv(n, rows),)](
            logits, logits.stride(0), target, state, loss, lse, n, v1 - v0, v0, v, ignore_index, eps, zscale,
            cap if cap else 1.0, FIRST=v0 == 0, LAST=v1 == v, SOFTCAP=bool(cap), SMOOTH=eps != 0.0,
            ZLOSS=zscale != 0.0, ROWS=rows, BLOCK=block, num_warps=row_warps(rows * block))
    return loss, lse


@eager_op
@torch.library.custom_op(f"{LIB}::flce_vocab_fwd", mutates_args=())
def _flce_vocab_fwd(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                    ignore_index: int, label_smoothing: float, lse_square_scale: float, softcap: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The custom op of :func:`_vocab_forward`: (loss (N,), lse (N,)), fp32."""
    return _vocab_forward(hidden, weight, bias, target, ignore_index, label_smoothing, lse_square_scale, softcap)


@_flce_vocab_fwd.register_fake
def _(hidden, weight, bias, target, ignore_index, label_smoothing, lse_square_scale, softcap):
    n = target.numel()
    return hidden.new_empty(n, dtype=torch.float32), hidden.new_empty(n, dtype=torch.float32)


def _vocab_grad_outputs(hidden, weight, bias, want_h, want_w, want_b):
    """(dh, dW, db) in the input dtypes, (0,) placeholders for what is not asked for."""
    n, h_size = hidden.shape
    return (hidden.new_empty((n, h_size) if want_h else (0,)),
            weight.new_empty(weight.shape if want_w else (0,)),
            (bias if want_b else hidden).new_empty(weight.shape[0] if want_b else 0))


def _vocab_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                    lse: torch.Tensor, grad: torch.Tensor, ignore_index: int, label_smoothing: float,
                    lse_square_scale: float, softcap: float, want_h: bool, want_w: bool, want_b: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """"vocab" FLCE backward: (dh, dW, db) in the input dtypes, of sum_i grad_i * loss_i.

    ``grad``: 0-dim (already times the reduction scale) or (N,) per token. Per window: recompute the
    logits (GEMM), ``_ce_kernel`` (BWD, column offset v0 of V) turns them into dlogits in place, then
    ``dW[v0:v1] = dlogits.T @ h`` straight into the result (one GEMM over all N tokens: fp32
    accumulation inside the GEMM, one rounding), ``db[v0:v1] = dlogits.sum(0)`` in fp32, and
    ``dh += dlogits @ W[v0:v1]`` into an fp32 (N, H) accumulator (the result itself for fp32 hidden).
    """
    dh, dw, db = _vocab_grad_outputs(hidden, weight, bias, want_h, want_w, want_b)
    n = hidden.shape[0]
    if n == 0:
        return dh, dw.zero_(), db.zero_()
    v = weight.shape[0]
    acc = None
    if want_h:
        acc = dh if hidden.dtype == torch.float32 else torch.empty(dh.shape, dtype=torch.float32, device=dh.device)
    stride_g = grad.stride(0) if grad.dim() else 0
    for v0, v1, logits in _vocab_windows(hidden, weight, bias):
        _launch_ce(_ce_kernel, logits, logits, target, lse, lse, grad, stride_g, ignore_index, label_smoothing,
                   lse_square_scale, softcap, False, True, col0=v0, v_total=v)
        if want_h:
            _accumulate_fp32(acc, logits, weight[v0:v1], beta=0.0 if v0 == 0 else 1.0)
        if want_w:
            torch.mm(logits.t(), hidden, out=dw[v0:v1])
        if want_b:
            db[v0:v1] = logits.sum(0, dtype=torch.float32)
    if want_h and acc is not dh:
        dh.copy_(acc)
    return dh, dw, db


@eager_op
@torch.library.custom_op(f"{LIB}::flce_vocab_bwd", mutates_args=())
def _flce_vocab_bwd(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                    lse: torch.Tensor, grad: torch.Tensor, ignore_index: int, label_smoothing: float,
                    lse_square_scale: float, softcap: float, want_h: bool, want_w: bool, want_b: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The custom op of :func:`_vocab_backward`: (dh, dW, db) in the input dtypes."""
    return _vocab_backward(hidden, weight, bias, target, lse, grad, ignore_index, label_smoothing,
                           lse_square_scale, softcap, want_h, want_w, want_b)


@_flce_vocab_bwd.register_fake
def _(hidden, weight, bias, target, lse, grad, ignore_index, label_smoothing, lse_square_scale, softcap,
      want_h, want_w, want_b):
    return _vocab_grad_outputs(hidden, weight, bias, want_h, want_w, want_b)


# ---------------------------------------------------------------------------------- autograd glue
def _scale_tensor(target: torch.Tensor, ignore_index: int, reduction: str,
                  num_items: int | float | torch.Tensor | None) -> torch.Tensor:
    """The 0-dim fp32 factor the summed per-token loss is multiplied by, built on the device (no sync)."""
    dev = target.device
    if reduction == "sum":
        return torch.ones((), dtype=torch.float32, device=dev)
    if num_items is None:
        count = (target != ignore_index).sum().clamp_min(1)
        return 1.0 / count.to(torch.float32)
    if isinstance(num_items, torch.Tensor):
        return 1.0 / num_items.detach().to(device=dev, dtype=torch.float32).reshape(())
    return torch.full((), 1.0 / float(num_items), dtype=torch.float32, device=dev)


def _reduce(loss_tok: torch.Tensor, scale: torch.Tensor, reduction: str) -> torch.Tensor:
    return loss_tok if reduction == "none" else loss_tok.sum() * scale


class CrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper of the CE kernels over (N, V) logits; backward recomputes from the saved lse."""

    @staticmethod
    def forward(ctx, logits, target, num_items, ignore_index, label_smoothing, lse_square_scale, softcap, reduction):
        loss_tok, lse = _ce_fwd(logits, target, ignore_index, label_smoothing, lse_square_scale, softcap)
        scale = _scale_tensor(target, ignore_index, reduction, num_items)
        ctx.save_for_backward(logits, target, lse, scale)
        ctx.opts = (ignore_index, label_smoothing, lse_square_scale, softcap)
        ctx.reduction = reduction
        return _reduce(loss_tok, scale, reduction)

    @staticmethod
    def backward(ctx, grad):
        logits, target, lse, scale = ctx.saved_tensors
        g = grad if ctx.reduction == "none" else grad.to(torch.float32) * scale
        dlogits = _ce_bwd(logits, target, lse, g, *ctx.opts)
        return dlogits, None, None, None, None, None, None, None


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper of the FLCE loops.

    "tokens", "mean"/"sum": gradients are computed in the forward and only scaled by the 0-dim upstream
    gradient in backward (out of place, so a retained graph can be backpropagated twice).
    "tokens", "none": forward keeps lse (N,), backward reruns the chunk loop with the per-token gradient.
    "vocab" (every reduction): forward keeps lse (N,) and the 0-dim reduction scale; backward runs the
    window loop with the upstream gradient (times the scale for "mean"/"sum").
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, num_items, ignore_index, label_smoothing, lse_square_scale,
                softcap, reduction, want_h, want_w, want_b, strategy):
        opts = (ignore_index, label_smoothing, lse_square_scale, softcap)
        ctx.opts, ctx.reduction, ctx.wants = opts, reduction, (want_h, want_w, want_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.strategy = strategy
        scale = _scale_tensor(target, ignore_index, reduction, num_items)
        if strategy == "vocab":
            loss_tok, lse = _flce_vocab_fwd(hidden, weight, bias, target, *opts)
            ctx.save_for_backward(hidden, weight, bias, target, lse, scale)
            return _reduce(loss_tok, scale, reduction)
        grads_now = reduction != "none"
        loss_tok, lse, dh, dw, db = _flce_fwd(hidden, weight, bias, target, scale, *opts,
                                              want_h and grads_now, want_w and grads_now, want_b and grads_now)
        if grads_now:
            ctx.save_for_backward(dh, dw, db)
        else:
            ctx.save_for_backward(hidden, weight, bias, target, lse)
        return _reduce(loss_tok, scale, reduction)

    @staticmethod
    def backward(ctx, grad):
        want_h, want_w, want_b = ctx.wants
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        if ctx.strategy == "vocab":
            hidden, weight, bias, target, lse, scale = ctx.saved_tensors
            g = grad if ctx.reduction == "none" else grad.to(torch.float32).reshape(()) * scale
            dh, dw, db = _flce_vocab_bwd(hidden, weight, bias, target, lse, g, *ctx.opts, want_h, want_w, want_b)
            dh, dw, db = (dh if want_h else None), (dw if want_w else None), (db if want_b else None)
        elif ctx.reduction != "none":
            dh, dw, db = ctx.saved_tensors
            g = grad.reshape(())
            dh = _scale_cast(dh, g, h_dtype) if want_h else None
            dw = _scale_cast(dw, g, w_dtype) if want_w else None
            db = _scale_cast(db, g, b_dtype) if want_b else None
        else:
            hidden, weight, bias, target, lse = ctx.saved_tensors
            dh, dw, db = _flce_bwd(hidden, weight, bias, target, lse, grad, *ctx.opts, want_h, want_w, want_b)
            dh, dw, db = (dh if want_h else None), (dw if want_w else None), (db if want_b else None)
        return dh, dw, db, None, None, None, None, None, None, None, None, None, None, None


# ------------------------------------------------------------------------------------- reference
def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                            label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                            softcap: float | None = None, reduction: str = "mean",
                            num_items: int | float | torch.Tensor | None = None) -> torch.Tensor:
    """Pure-PyTorch loss of (..., V) logits against (...) targets, in fp32 (fp64 for fp64 logits).

    The readable statement of the math (see the module docstring); differentiable by autograd.
    Out-of-range targets raise (through ``gather``).
    """
    _check_options(ignore_index, label_smoothing, lse_square_scale, softcap, reduction)
    cd = compute_dtype(logits.dtype)
    z = logits.to(cd).reshape(-1, logits.shape[-1])
    t = target.reshape(-1)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, dim=-1)
    valid = t != ignore_index
    z_y = z.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
    loss = lse - (1.0 - label_smoothing) * z_y
    if label_smoothing:
        loss = loss - label_smoothing * z.mean(dim=-1)
    if lse_square_scale:
        loss = loss + lse_square_scale * lse * lse
    loss = torch.where(valid, loss, torch.zeros((), dtype=cd, device=z.device))
    if reduction == "none":
        return loss.reshape(target.shape)
    if reduction == "sum":
        return loss.sum()
    if num_items is None:
        return loss.sum() / valid.sum().clamp_min(1).to(cd)
    if isinstance(num_items, torch.Tensor):
        return loss.sum() / num_items.to(device=z.device, dtype=cd)
    return loss.sum() / float(num_items)


def fused_linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                         bias: torch.Tensor | None = None, ignore_index: int = -100,
                                         label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                                         softcap: float | None = None, reduction: str = "mean",
                                         num_items: int | float | torch.Tensor | None = None) -> torch.Tensor:
    """Pure-PyTorch FLCE: ``cross_entropy_reference(F.linear(hidden, weight, bias), ...)``.

    Materialises the (N, V) logits (in the input dtype, as a plain linear layer would); it is the
    CPU fallback and the readable statement of what the chunked op computes.
    """
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return cross_entropy_reference(logits, target, ignore_index, label_smoothing, lse_square_scale, softcap,
                                   reduction, num_items)


# ---------------------------------------------------------------------------------------- public
def _check_options(ignore_index, label_smoothing, lse_square_scale, softcap, reduction) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"softcap must be None or > 0, got {softcap}")
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    float(lse_square_scale)


def _check_target(target: torch.Tensor, lead_shape: torch.Size, what: str) -> None:
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{what}: target must be int64 (or int32), got {target.dtype}")
    if target.shape != lead_shape:
        raise ValueError(f"{what}: target shape {tuple(target.shape)} does not match {tuple(lead_shape)}")


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, label_smoothing: float = 0.0,
                  lse_square_scale: float = 0.0, softcap: float | None = None,
                  reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of (N, V) (or (..., V)) logits against int64 targets (N,) (or (...)).

    Args:
        logits: (N, V), any float dtype; never modified.
        target: (N,) class indices; ``ignore_index`` marks tokens that contribute nothing.
        label_smoothing: eps of ``F.cross_entropy``; lse_square_scale: PaLM z-loss weight;
        softcap: apply ``softcap * tanh(logits / softcap)`` first (Gemma 2).
        reduction: "mean" (over non-ignored tokens; 0 when all are ignored), "sum" or "none".
    Returns:
        fp32 loss: 0-dim, or shaped like ``target`` for "none" (float64 logits: the float64 reference).
    """
    _check_options(ignore_index, label_smoothing, lse_square_scale, softcap, reduction)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"cross_entropy: logits need a non-empty class dim, got shape {tuple(logits.shape)}")
    check_floating("cross_entropy", logits=logits)
    _check_target(target, logits.shape[:-1], "cross_entropy")
    if not use_triton(logits) or logits.dtype == torch.float64:
        return cross_entropy_reference(logits, target, ignore_index, label_smoothing, lse_square_scale, softcap,
                                       reduction)
    if target.device != logits.device:
        raise ValueError(f"cross_entropy: target on {target.device}, logits on {logits.device}")
    x = logits.reshape(-1, logits.shape[-1])
    loss = CrossEntropyFunction.apply(x, target.reshape(-1).contiguous(), None, ignore_index, float(label_smoothing),
                                      float(lse_square_scale), float(softcap or 0.0), reduction)
    return loss.reshape(target.shape) if reduction == "none" else loss


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, ignore_index: int = -100,
                               label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                               softcap: float | None = None, reduction: str = "mean",
                               num_items: int | float | torch.Tensor | None = None,
                               strategy: str = "tokens") -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``target``, without materialising the logits.

    Args:
        hidden: (N, H) (or (..., H)) final hidden states; weight: (V, H) LM head (may be tied to the
            embedding, or an FSDP2-gathered parameter); bias: (V,) or None. One float dtype for all.
        target: (N,) (or (...)) int64 class indices.
        ignore_index, label_smoothing, lse_square_scale, softcap, reduction: as in :func:`cross_entropy`.
        num_items: for "mean", divide the summed loss by this instead of the local non-ignored count
            (e.g. the count over all micro-batches and data-parallel ranks). A Python number or a
            0-dim tensor (best on the same device); never read on the host.
        strategy: "tokens" (default: chunks of tokens, 3 GEMMs, fastest; extra memory about a 1 GiB
            chunk buffer + a 4*V*H fp32 weight-gradient accumulator) or "vocab" (windows of the
            vocabulary, 4 GEMMs, about 1.33x the matmul floor; extra memory about a 256 MiB window
            buffer + a 4*N*H fp32 hidden-gradient accumulator). See the module docstring.
    Returns:
        fp32 loss: 0-dim, or shaped like ``target`` for "none".

    Memory: see :func:`flce_chunk_plan`. Weight and bias gradients are accumulated in fp32 and cast
    to the parameter dtype once ("tokens": over the chunks; "vocab": inside one GEMM per window).
    """
    _check_options(ignore_index, label_smoothing, lse_square_scale, softcap, reduction)
    _check_strategy(strategy)
    check_head_inputs("fused_linear_cross_entropy", hidden, weight, bias, target)
    if not use_triton(hidden) or hidden.dtype == torch.float64:
        return fused_linear_cross_entropy_reference(hidden, weight, target, bias, ignore_index, label_smoothing,
                                                    lse_square_scale, softcap, reduction, num_items)
    h2, weight, bias, t, wants = head_operands("fused_linear_cross_entropy", hidden, weight, bias, target)
    loss = FusedLinearCrossEntropyFunction.apply(
        h2, weight, bias, t, num_items if reduction == "mean" else None, ignore_index, float(label_smoothing),
        float(lse_square_scale), float(softcap or 0.0), reduction, *wants, strategy)
    return loss.reshape(target.shape) if reduction == "none" else loss


def check_head_inputs(what: str, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      target: torch.Tensor) -> None:
    """The shape and dtype checks of a fused linear head's arguments: hidden (..., H), weight (V, H), bias (V,),
    integer target (...); ``what`` names the op in the error."""
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"{what}: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not fit (weight "
                         "must be (V, H), V > 0)")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"{what}: bias shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")
    check_floating(what, hidden=hidden, weight=weight, bias=bias)
    _check_target(target, hidden.shape[:-1], what)


def head_operands(what: str, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  target: torch.Tensor):
    """What the Triton chunk loop takes, from checked arguments: (hidden (N, H) with unit last stride, weight,
    bias, target (N,) contiguous, (want_h, want_w, want_b)); the matmul operands in the autocast dtype when autocast
    is on, as ``F.linear`` would run them."""
    dev_type = hidden.device.type
    if torch.is_autocast_enabled(dev_type):
        dt = torch.get_autocast_dtype(dev_type)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(f"{what}: hidden, weight and bias must share one dtype, got {hidden.dtype}, {weight.dtype}, "
                        f"{bias.dtype if bias is not None else None}")
    if weight.device != hidden.device or target.device != hidden.device or (
            bias is not None and bias.device != hidden.device):
        raise ValueError(f"{what}: hidden, weight, bias and target must be on one device")
    grad_on = torch.is_grad_enabled()
    wants = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
             grad_on and bias is not None and bias.requires_grad)
    h2 = hidden.reshape(n_rows(hidden), hidden.shape[-1])
    return (h2 if h2.stride(-1) == 1 else h2.contiguous()), weight, bias, target.reshape(-1).contiguous(), wants


def flce_chunk_tokens(vocab_size: int, dtype: torch.dtype) -> int:
    """The most tokens a "tokens" chunk holds: ``FLCE_CHUNK_SIZE`` when set, else what a (C, V) buffer in
    ``dtype`` fits in ``FLCE_CHUNK_BUDGET_BYTES``, rounded to a GEMM-friendly size."""
    if FLCE_CHUNK_SIZE is not None:
        return FLCE_CHUNK_SIZE
    return _round_chunk(max(FLCE_CHUNK_BUDGET_BYTES // max(vocab_size * dtype.itemsize, 1), 1))
