"""RMSNorm, ``y = x * rsqrt(mean(x^2, -1) + eps) * (offset + weight)``, and its fused residual-add form.

``fused_add_rms_norm(x, residual, weight)`` returns ``(rms_norm(x + residual), x + residual)``: the
op that carries the residual stream between decoder layers, done in one pass instead of an add
kernel followed by a norm kernel.

Two rounding conventions (``casting``), so a model reproduces its Hugging Face reference exactly:

* ``"llama"`` (Llama, Mistral, Qwen2, Phi-3): normalise in fp32, round ``n = x * rstd`` to the input
  dtype, then multiply by ``offset + weight`` and round again (HF: ``weight * n.to(input_dtype)``;
  the product of two bf16 values is exact in fp32, so computing it in fp32 and rounding once is
  bit-for-bit PyTorch's bf16 multiply).
* ``"gemma"``: ``x.float() * rstd * (offset + weight.float())`` all in fp32, rounded to the input
  dtype once at the end (use ``offset=1.0``: Gemma stores ``w`` and scales by ``1 + w``).

The output has the input's dtype whatever the weight's dtype (bf16 or fp32). Statistics, the
backward pass and the weight gradient run in fp32 (in the kernels also for fp64 inputs; the
PyTorch reference, used on CPU without the interpreter, runs those in fp64). The forward saves
the per-row ``rstd`` (fp32), so the backward pass recomputes ``n = x * rstd`` without a second
reduction over ``x^2``.

Backward, with ``n = x * rstd`` and ``g = dy * (offset + w)`` (roundings treated as identity)::

    dx = rstd * (g - n * mean(g * n, -1))        (+ dh for the fused op; dresidual = dx)
    dw = sum over rows of dy * n                 (accumulated in fp32)

The weight gradient is a reduction over all rows: a fixed number of programs (``_BWD_PROGRAMS_PER_SM``
per SM, 1 by default) each loop over a contiguous range of rows (loading the next tile while
computing the current one), keep a partial ``dw`` in fp32 registers, and write one fp32 row of a
(programs, H) buffer; a second small kernel sums that buffer
over its rows in fp32 (columns split over programs) and writes ``dw`` in the weight's dtype, rounded
once. The backward is two launches whatever the shape. A single-launch variant, in which the last
programs to arrive (counted on an atomic arrival counter) sum dw while the others exit, was 1-2.5 us
slower than the second launch at every shape measured (H100, 4096-32768 rows of 2048-8192, each summing
program 64-256 columns), so it was not kept. For GPU
tuning sweeps, the environment variable ``LIGER_RMS_BWD_PPS`` (a positive integer, read at import)
overrides the programs per SM.

Bytes moved (the fewest the op must move), for M rows of H elements of s bytes (weight, dw and the
4*M bytes of rstd are small next to these):

* ``rms_norm``: forward 2*M*H*s (read x; write y); backward 3*M*H*s (read dy, x; write dx).
* ``fused_add_rms_norm``: forward 4*M*H*s (read x, residual; write y, h); backward 4*M*H*s
  (read dy, dh, h; write dx, which is also the residual's gradient), 3*M*H*s when h is unused.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kernels._common import (
    INTERPRET,
    LIB,
    as_rows,
    check_floating,
    check_same_device,
    compute_dtype,
    eager_op,
    row_block,
    row_warps,
    sm_count,
    use_triton,
)
from kernels.fp8 import E4M3, _fp8_grid, _pow2_scale

LLAMA, GEMMA = 0, 1
_CASTINGS = {"llama": LLAMA, "gemma": GEMMA}


def _env_positive_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return n


#: Programs per SM of the backward kernel (each owns one fp32 row of partial dw); ``LIGER_RMS_BWD_PPS``
#: overrides it at import. Measured on an H100 (kernel time of the main kernel, bf16, prefetching, 4096-32768
#: rows of 2048-8192): 1 and 2 per SM within 2 points of each other (1 ahead at 4096 rows, 2 ahead at
#: 32768 x 2048), 4 per SM with smaller tiles no better.
_BWD_PROGRAMS_PER_SM: int = _env_positive_int("LIGER_RMS_BWD_PPS", 1)


# --------------------------------------------------------------------------------------- kernels
@triton.jit
def _rms_norm_fwd_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr, s_ptr,
                         stride_x, stride_r, stride_y, stride_h, n_rows, n_cols, eps, offset,
                         HAS_RESIDUAL: tl.constexpr, CASTING: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr):
    """BLOCK_M whole rows per program. With HAS_RESIDUAL, h = x + r (rounded to x's dtype) is
    written and normalised; otherwise r_ptr / h_ptr are unused placeholders. With FP8 1 (e4m3), y is
    written in FP8, each row divided by its power-of-two scale (:mod:`kernels.fp8`), stored at s_ptr
    (unused otherwise)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    n = xf * rstd[:, None]
    if CASTING == 0:  # llama: round the normalised row to the input dtype before the weight
        n = n.to(x_ptr.dtype.element_ty).to(tl.float32)
    y = n * w[None, :]
    if FP8 > 0:
        scale, inv = _pow2_scale(tl.max(tl.abs(y), axis=1), FP8)
        tl.store(s_ptr + rows, scale, mask=row_mask)
        y = _fp8_grid(y * inv[:, None], FP8)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_tile(dy, x, dh, rstd, w, rows, end, cols, col_mask, dx_ptr, stride_dx, n_cols,
                       HAS_DH: tl.constexpr):
    """Write dx of one (BLOCK_M, BLOCK_N) tile (rows ``rows`` below ``end``); return its dw contribution (BLOCK_N,)."""
    dy = dy.to(tl.float32)
    n = x.to(tl.float32) * rstd[:, None]
    g = dy * w[None, :]
    c = tl.sum(g * n, axis=1) / n_cols
    dx = (g - n * c[:, None]) * rstd[:, None]
    if HAS_DH:
        dx += dh.to(tl.float32)
    mask = (rows < end)[:, None] & col_mask[None, :]
    tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    return tl.sum(dy * n, axis=0)


@triton.jit
def _rms_norm_bwd_load(dy_ptr, dh_ptr, x_ptr, rstd_ptr, rows, end, cols, col_mask, stride_dy, stride_dh, stride_x,
                       HAS_DH: tl.constexpr):
    """(dy, x, dh, rstd) of the rows ``rows`` below ``end``, in their stored dtypes (dh is dy without HAS_DH)."""
    mask = (rows < end)[:, None] & col_mask[None, :]
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dh = dy
    if HAS_DH:
        dh = tl.load(dh_ptr + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0)
    return dy, x, dh, tl.load(rstd_ptr + rows, mask=rows < end, other=0.0)


@triton.jit
def _rms_norm_bwd_kernel(dy_ptr, dh_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr,
                         stride_dy, stride_dh, stride_x, stride_dx, n_rows, n_cols, rows_per_program, offset,
                         HAS_DH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         PREFETCH: tl.constexpr):
    """Program p handles rows [p*rows_per_program, (p+1)*rows_per_program), BLOCK_M at a time
    (rows_per_program is a multiple of BLOCK_M), and writes its fp32 partial dw to row p of dw_ptr.
    With HAS_DH the incoming gradient dh is added to dx; otherwise dh_ptr is an unused placeholder.

    PREFETCH: the loads of the next tile are issued before the current tile is computed and stored
    (register double buffering), so each program keeps two tiles of reads in flight; this is what
    brings one program per SM near copy bandwidth. Off for tiles too large to hold twice in registers."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)  # one row: a (BLOCK_M, BLOCK_N) accumulator costs registers
    first = pid.to(tl.int64) * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    rows = first + tl.arange(0, BLOCK_M)
    if PREFETCH:
        dy_next, x_next, dh_next, rstd_next = _rms_norm_bwd_load(
            dy_ptr, dh_ptr, x_ptr, rstd_ptr, rows, end, cols, col_mask, stride_dy, stride_dh, stride_x, HAS_DH)
        for _ in range(0, rows_per_program, BLOCK_M):
            cur, dy, x, dh, rstd = rows, dy_next, x_next, dh_next, rstd_next
            rows = cur + BLOCK_M
            dy_next, x_next, dh_next, rstd_next = _rms_norm_bwd_load(
                dy_ptr, dh_ptr, x_ptr, rstd_ptr, rows, end, cols, col_mask, stride_dy, stride_dh, stride_x, HAS_DH)
            dw += _rms_norm_bwd_tile(dy, x, dh, rstd, w, cur, end, cols, col_mask, dx_ptr, stride_dx, n_cols, HAS_DH)
    else:
        for i in range(0, rows_per_program, BLOCK_M):
            cur = rows + i
            dy, x, dh, rstd = _rms_norm_bwd_load(
                dy_ptr, dh_ptr, x_ptr, rstd_ptr, cur, end, cols, col_mask, stride_dy, stride_dh, stride_x, HAS_DH)
            dw += _rms_norm_bwd_tile(dy, x, dh, rstd, w, cur, end, cols, col_mask, dx_ptr, stride_dx, n_cols, HAS_DH)
    tl.store(dw_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=col_mask)


@triton.jit
def _rms_norm_dw_kernel(partial_ptr, dw_ptr, n_partial, n_cols, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """dw[cols] = sum over the n_partial rows of the fp32 (n_partial, n_cols) partial buffer, for the
    BLOCK_N columns of this program, accumulated in fp32 (BLOCK_P rows at a time) and rounded once to
    dw's dtype. With n_partial = 0 it writes zeros."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for i in range(0, n_partial, BLOCK_P):
        rows = i + tl.arange(0, BLOCK_P)
        mask = (rows < n_partial)[:, None] & col_mask[None, :]
        acc += tl.load(partial_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(dw_ptr + cols, tl.sum(acc, axis=0).to(dw_ptr.dtype.element_ty), mask=col_mask)


# ------------------------------------------------------------------------------------ launch sizing
def _rows_per_block(cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): whole rows per program, several when rows are short (<= 1024),
    so that every program moves at least ~2048 elements."""
    block_n = row_block(cols)
    block_m = max(1, min(16, 2048 // block_n))
    return block_m, block_n, row_warps(block_m * block_n)


def _bwd_tiling(cols: int, elem_size: int) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, PREFETCH) of the backward. It keeps few programs alive (each owns an
    fp32 partial dw), so each iteration moves whole rows worth ~16 KB of every input (8192 bf16 or 4096
    fp32 elements) and, when a tile is no larger than that, prefetches the next one (two tiles in
    flight per program). Rows longer than the budget take one row per iteration, without prefetch."""
    budget = 16384 // elem_size
    block_n = row_block(cols)
    block_m = max(1, min(16, budget // block_n))
    tile = block_m * block_n
    return block_m, block_n, 8 if tile >= 4096 else row_warps(tile), tile <= budget


def _bwd_programs(device: torch.device, rows: int, block_m: int, block_n: int) -> int:
    """Programs of the backward kernel: ``_BWD_PROGRAMS_PER_SM`` per SM, each looping over a contiguous
    range of rows, so the fp32 partial-dw buffer (programs, H) stays small next to the rows it summarises.
    The interpreter runs programs one after the other, so there a handful suffice."""
    tiles = triton.cdiv(rows, block_m)
    if device.type != "cuda" or INTERPRET:
        return max(1, min(tiles, 4))
    return max(1, min(tiles, _BWD_PROGRAMS_PER_SM * sm_count(device)))


def _dw_tiling(partials: int, cols: int) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_N, num_warps) of the partial-dw sum: 16 columns (64 contiguous bytes of each
    partial row) per program, so H = 2048-8192 gives 128-512 programs, and up to 256 partial rows per
    iteration (one iteration at one program per SM). Measured on an H100: 2.9-3.6 us, against
    6.1-7.0 us with 64 columns and 64 rows."""
    block_n = min(16, row_block(cols))
    block_p = min(256, triton.next_power_of_2(max(partials, 1)))
    return block_p, block_n, 4 if block_p * block_n >= 2048 else 1


def _launch_fwd(x2, r2, weight, y2, h2, rstd, eps: float, offset: float, casting: int, has_residual: bool,
                scales=None, fp8: int = 0) -> None:
    rows, cols = x2.shape
    block_m, block_n, warps = _rows_per_block(cols)
    wrap_triton(_rms_norm_fwd_kernel)[(triton.cdiv(rows, block_m),)](
        x2, r2, weight, y2, h2, rstd, rstd if scales is None else scales, x2.stride(0), r2.stride(0), y2.stride(0),
        h2.stride(0), rows, cols, eps, offset, HAS_RESIDUAL=has_residual, CASTING=casting, BLOCK_M=block_m,
        BLOCK_N=block_n, FP8=fp8, num_warps=warps)


# ------------------------------------------------------------------------------------ custom ops
@eager_op
@triton_op(f"{LIB}::rms_norm_fwd", mutates_args={})
def _rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                  casting: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y with x's shape and dtype, rstd (rows,) fp32)."""
    x2 = as_rows(x)
    rows, cols = x2.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if y.numel() > 0:
        y2 = y.view(rows, cols)  # y2 doubles as the unused residual-output placeholder
        _launch_fwd(x2, x2, weight.contiguous(), y2, y2, rstd, eps, offset, casting, False)
    return y, rstd


@eager_op
@triton_op(f"{LIB}::fused_add_rms_norm_fwd", mutates_args={})
def _fused_add_rms_norm_fwd(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            offset: float, casting: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h = x + residual, rstd (rows,) fp32); y and h have x's shape and dtype."""
    x2, r2 = as_rows(x), as_rows(residual)
    rows, cols = x2.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if y.numel() > 0:
        _launch_fwd(x2, r2, weight.contiguous(), y.view(rows, cols), h.view(rows, cols), rstd, eps, offset, casting,
                    True)
    return y, h, rstd


def _launch_fwd_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, h: torch.Tensor | None,
                    eps: float, offset: float, casting: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y (rows, H) e4m3, its row scales (rows, 1) fp32, rstd (rows,) fp32) of the norm of x (+ residual, the sum
    written to h): y quantised by rows as :func:`kernels.fp8.quantize_rows` quantises the fp32 norm output."""
    x2 = as_rows(x)
    rows, cols = x2.shape
    y = torch.empty((rows, cols), dtype=E4M3, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if y.numel() > 0:
        r2, h2 = (x2, x2) if residual is None else (as_rows(residual), h.view(rows, cols))
        _launch_fwd(x2, r2, weight.contiguous(), y, h2, rstd, eps, offset, casting, residual is not None, scales,
                    1)
    return y, scales, rstd


@eager_op
@triton_op(f"{LIB}::rms_norm_fwd_fp8", mutates_args={})
def _rms_norm_fwd_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                      casting: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y (rows, H) e4m3, row scales (rows, 1) fp32, rstd (rows,) fp32): the norm of x, quantised by rows."""
    return _launch_fwd_fp8(x, None, weight, None, eps, offset, casting)


@eager_op
@triton_op(f"{LIB}::fused_add_rms_norm_fwd_fp8", mutates_args={})
def _fused_add_rms_norm_fwd_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                offset: float, casting: int
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y (rows, H) e4m3, row scales (rows, 1) fp32, h = x + residual (x's shape and dtype), rstd (rows,) fp32)."""
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y, scales, rstd = _launch_fwd_fp8(x, residual, weight, h, eps, offset, casting)
    return y, scales, h, rstd


@eager_op
@torch.library.custom_op(f"{LIB}::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(dy: torch.Tensor, dh: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                  offset: float, has_dh: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx with x's shape and dtype, dw (H,) in weight's dtype). ``x`` is the normalised input (h for
    the fused op); ``dh`` is added to dx when ``has_dh``, else ignored (pass any tensor, e.g. dy).

    An opaque ``custom_op`` rather than a ``triton_op``: Inductor compiles a ``triton_op``'s kernels
    itself, and this one came out 2.5-2.9x slower that way (H100, torch 2.11: 114 vs 40 us at
    8192 x 1536), so under torch.compile it launches the kernels exactly as in eager."""
    dy2, x2 = as_rows(dy), as_rows(x)
    dh2 = as_rows(dh) if has_dh else dy2
    rows, cols = x2.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_m, block_n, warps, prefetch = _bwd_tiling(cols, x.element_size())
    programs = _bwd_programs(x.device, rows, block_m, block_n) if rows > 0 else 0
    rows_per_program = triton.cdiv(triton.cdiv(rows, programs), block_m) * block_m if programs else 0
    programs = triton.cdiv(rows, rows_per_program) if programs else 0
    if rows * cols == 0:
        return dx, torch.zeros(cols, dtype=weight.dtype, device=x.device)
    partial = torch.empty(programs, cols, dtype=torch.float32, device=x.device)  # every row written
    dx2 = dx.view(rows, cols)
    _rms_norm_bwd_kernel[(programs,)](
        dy2, dh2, x2, weight.contiguous(), rstd, dx2, partial, dy2.stride(0), dh2.stride(0), x2.stride(0),
        dx2.stride(0), rows, cols, rows_per_program, offset,
        HAS_DH=has_dh, BLOCK_M=block_m, BLOCK_N=block_n, PREFETCH=prefetch, num_warps=warps)
    dw = torch.empty(cols, dtype=weight.dtype, device=x.device)
    block_p, block_n, warps = _dw_tiling(programs, cols)
    _rms_norm_dw_kernel[(triton.cdiv(cols, block_n),)](
        partial, dw, programs, cols, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=warps)
    return dx, dw


@_rms_norm_bwd.register_fake
def _(dy, dh, x, weight, rstd, offset, has_dh):
    return torch.empty_like(x, memory_format=torch.contiguous_format), weight.new_empty(x.shape[-1])


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: ``forward(x, weight, eps, offset, casting)`` with ``casting`` an int code."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: int) -> torch.Tensor:
        y, rstd = _rms_norm_fwd(x, weight, eps, offset, casting)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _rms_norm_bwd(dy, dy, x, weight, rstd, ctx.offset, False)
        return dx, dw, None, None, None


class FusedAddRMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: ``forward(x, residual, weight, eps, offset, casting)`` -> (y, h).

    Saves h (an output) rather than x and residual. In eager mode a missing gradient of h (h
    unused) is not materialised as zeros: the kernel skips the add. x and residual get the same
    gradient tensor, which autograd treats as read-only (it copies before accumulating into a
    leaf's ``.grad``), so one pass writes one dx for both.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                casting: int) -> tuple[torch.Tensor, torch.Tensor]:
        y, h, rstd = _fused_add_rms_norm_fwd(x, residual, weight, eps, offset, casting)
        ctx.save_for_backward(h, weight, rstd)
        ctx.offset = offset
        if not torch.compiler.is_compiling():  # dynamo does not trace this ctx method; compiled
            ctx.set_materialize_grads(False)  # graphs get zero tangents instead, same result
        return y, h

    @staticmethod
    def backward(ctx, dy: torch.Tensor | None, dh: torch.Tensor | None):
        h, weight, rstd = ctx.saved_tensors
        if dy is None:  # only h was used: y contributes nothing
            return dh, dh, None, None, None, None
        dx, dw = _rms_norm_bwd(dy, dy if dh is None else dh, h, weight, rstd, ctx.offset, dh is not None)
        return dx, dx, dw, None, None, None


# ------------------------------------------------------------------------------------- reference
def _casting_code(casting: str) -> int:
    if casting not in _CASTINGS:
        raise ValueError(f"rms_norm: casting must be 'llama' or 'gemma', got {casting!r}")
    return _CASTINGS[casting]


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    check_floating("rms_norm", x=x, weight=weight, residual=residual)
    if weight.dim() != 1 or x.dim() == 0 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight must have shape (H,) with H = x.shape[-1], "
                         f"got weight {tuple(weight.shape)} for x {tuple(x.shape)}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"fused_add_rms_norm: x and residual must have one shape and dtype, got "
                             f"{tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}")
        check_same_device(x, residual, weight)
    else:
        check_same_device(x, weight)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0,
                       casting: str = "llama") -> torch.Tensor:
    """Pure-PyTorch RMSNorm in fp32 (fp64 for fp64 inputs) with the kernels' rounding rules.

    x: (..., H); weight: (H,). Returns (..., H) in x's dtype. Differentiable by autograd, with the
    kernels' gradient: Llama's intermediate rounding counts as identity (no bf16 rounding of the
    gradient in the middle of the backward pass).
    """
    code = _casting_code(casting)
    _check(x, weight)
    cd = compute_dtype(x.dtype)
    xf = x.to(cd)
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = offset + weight.to(cd)
    if code == GEMMA:
        return (n * w).to(x.dtype)
    # llama: the value rounds n to x's dtype before the weight; the gradient is that of the
    # unrounded n * w (the kernels' gradient): value + (t - t) is the value exactly.
    t = n * w
    return ((n.to(x.dtype).to(cd) * w).detach() + (t - t.detach())).to(x.dtype)


def fused_add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                                 offset: float = 0.0, casting: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch ``(rms_norm(x + residual), x + residual)``; the add rounds to x's dtype, as HF's does."""
    _check(x, weight, residual)
    h = x + residual
    return rms_norm_reference(h, weight, eps, offset, casting), h


# ---------------------------------------------------------------------------------------- public
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0,
             casting: str = "llama") -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * (offset + weight)``, rounded as HF Llama or Gemma does.

    Args:
        x: (..., H), any leading dims, any strides.
        weight: (H,), bf16 or fp32.
        eps: added to the mean square.
        offset: added to the weight (1.0 for Gemma, which stores ``w`` and scales by ``1 + w``).
        casting: "llama" (round the normalised x to x's dtype, then scale) or "gemma" (scale in fp32,
            round once); see the module docstring.
    Returns:
        (..., H) in x's dtype.
    """
    code = _casting_code(casting)
    _check(x, weight)
    if not use_triton(x):
        return rms_norm_reference(x, weight, eps, offset, casting)
    return RMSNormFunction.apply(x, weight, float(eps), float(offset), code)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       offset: float = 0.0, casting: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (rounded to x's dtype) and ``y = rms_norm(h)``, in one pass.

    Args:
        x, residual: (..., H), one shape and dtype.
        weight, eps, offset, casting: as in :func:`rms_norm`.
    Returns:
        (y, h), both (..., H) in x's dtype: y feeds the next sub-layer, h is the new residual stream.
    """
    code = _casting_code(casting)
    _check(x, weight, residual)
    if not use_triton(x):
        return fused_add_rms_norm_reference(x, residual, weight, eps, offset, casting)
    return FusedAddRMSNormFunction.apply(x, residual, weight, float(eps), float(offset), code)
