"""FP8 linear layers: e4m3 GEMMs with one power-of-two scale per row of each operand.

A projection ``out = x @ W.T`` (x (M, K), W (N, K)) trains with three GEMMs. Under FP8 two of them run on FP8 tensor
cores through ``torch._scaled_mm`` (twice bf16's peak on an H100), the third stays bf16:

* forward ``out = q(x) @ q(W).T``: x quantised per row (over K), W per output row (over K), both e4m3;
* input gradient ``dx = q(dout) @ q(W.T).T``: dout per row (over N), e4m3 or e5m2; W per input column (over N);
* weight gradient ``dW = dout.T @ x`` in bf16 from the unquantised operands (the reduction runs over tokens, along
  which neither operand is quantised; torchao's "rowwise with high-precision weight gradient" recipe).

Quantising a row v: ``s = 2^ceil(log2(amax|v| / FMAX))`` (fp32; FMAX = 448 for e4m3, 57344 for e5m2) and
``q = round_to_fp8(v / s)``; the GEMM multiplies its fp32 accumulator by ``s_row * s_col``. A power-of-two scale
makes ``v / s`` exact (no rounding besides fp8's own) and is found from the bits of ``amax / FMAX``: the exponent,
plus one unless the mantissa is zero.

The kernels that write each GEMM's input write it quantised, with its scales, in the same pass
(:mod:`kernels.rms_norm`: the norm output feeding q/k/v and gate/up; :mod:`kernels.glu`: the activation feeding
the down projection); the attention output feeding the o projection, the output gradients and the weights go
through :func:`quantize_rows` (one read, one fp8 write). Weights are quantised on every call (their values change
every step): W (2 bytes read, 1 written per element) for the forward, and its transpose, for the input gradient,
through a bf16 transposed copy.

``torch._scaled_mm`` needs K and N multiples of 16 (CUDA); other shapes, and the CPU without the interpreter,
multiply the dequantised operands in fp32: the same products, summed in another order. The float64 oracle of the
quantised math is ``tests/test_fp8.py``'s, on :func:`quantize_rows_reference`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kernels._common import (
    LIB,
    as_rows,
    check_floating,
    check_same_device,
    eager_op,
    needs_capability,
    row_block,
    use_triton,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: Largest finite value of each FP8 format.
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
class FP8Recipe(NamedTuple):
    """How a projection trains in FP8: the output gradient's FP8 dtype, and whether the weight gradient's GEMM
    runs in FP8 (else in bf16 from the unquantised operands)."""

    grad_dtype: torch.dtype
    weight_grad: bool


#: The FP8 modes a model or op takes: all three GEMMs in FP8 with e4m3 everywhere (``rowwise``) or e5m2 output
#: gradients (``rowwise-e5m2``), or the weight gradient in bf16 (``rowwise-gw-bf16``).
FP8_MODES = {"rowwise": FP8Recipe(E4M3, True), "rowwise-e5m2": FP8Recipe(E5M2, True),
             "rowwise-gw-bf16": FP8Recipe(E4M3, False)}


def fp8_recipe(mode: str | None, what: str, param: str = "fp8") -> FP8Recipe | None:
    """The :class:`FP8Recipe` of ``mode`` (None for None); an unknown mode raises ValueError naming ``what``."""
    if mode is not None and mode not in FP8_MODES:
        raise ValueError(f"{what}: {param} must be None or one of {sorted(FP8_MODES)}, got {mode!r}")
    return None if mode is None else FP8_MODES[mode]


_SMALLEST_NORMAL = 1.1754943508222875e-38
#: Row quantisation: rows of up to _BLOCK elements in one block (a warp per 1024), wider rows in two passes over
#: _WIDE_BLOCK-element blocks with _WIDE_WARPS warps. Measured on an H200 (kernel time, bf16): 4096-wide rows at
#: 74-90% of copy bandwidth with 4 warps against 67-82% with 8; 28672-wide rows at 65% with 8192 x 16 warps against
#: 57-60% with 4096-element blocks. The GLU's rows (the activation computed on the fly) take one block up to
#: _GLU_BLOCK elements: 14336-wide rows at 74% in one 16384-element block with 32 warps, 50% in two passes.
_BLOCK = 4096
_WIDE_BLOCK, _WIDE_WARPS = 8192, 16
_GLU_BLOCK = 16384
#: (rows, columns, warps) of the column quantisation's tiles: the maxima pass, the quantise-and-transpose pass; and
#: the number of row chunks the maxima pass splits each column block into. H200: (128, 64, 4) maxima tiles took the
#: pair from 62-67% to 69-76% of copy bandwidth at 4096 x 28672, 28672 x 4096 and 14336 x 4096; the quantise
#: pass's tile and the chunk count moved it by under 3 points.
_COLS_AMAX_TILE = (128, 64, 4)
_COLS_QUANT_TILE = (64, 64, 4)
_COLS_CHUNKS = 32


# --------------------------------------------------------------------------------------- kernels
@triton.jit
def _pow2_scale(amax, FORMAT: tl.constexpr):
    """(scale, 1 / scale) of rows with absolute maxima ``amax``: the least power of two >= amax / FMAX (FORMAT 1:
    e4m3, FMAX 448; 2: e5m2, FMAX 57344), both exact powers of two built from the exponent bits of
    ``amax / FMAX``. (An integer format code, not a float constant: the float-constant form of these kernels
    failed to compile under torch.compile's Inductor, torch 2.11.)"""
    if FORMAT == 1:
        fmax = 448.0
    else:
        fmax = 57344.0
    v = tl.maximum(amax / fmax, 1.1754943508222875e-38)
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (e << 23).to(tl.float32, bitcast=True), ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_grid(v, FORMAT: tl.constexpr):
    """fp32 ``v`` (|v| <= FMAX) rounded to the nearest value of the FP8 format FORMAT (1: e4m3, 2: e5m2; ties
    to even), still in fp32, so that the cast to FP8 that follows is exact. Normal values: the fp32 mantissa
    rounded to 3 (e4m3) or 2 (e5m2) bits on its bits; below the smallest normal (2^-6, 2^-14), to a multiple of the
    subnormal step (2^-9, 2^-16) by adding and subtracting 1.5 * 2^23 steps. (Rounding here, not in the cast, also
    keeps Triton's interpreter right: its cast loses the carry when rounding up crosses a power of two.)"""
    if FORMAT == 1:
        shift, limit, magic = 20, 0.015625, 24576.0
    else:
        shift, limit, magic = 21, 6.103515625e-05, 192.0
    bits = v.to(tl.int32, bitcast=True)
    normal = (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) & ~((1 << shift) - 1)
    small = ((tl.abs(v) + magic) - magic).to(tl.int32, bitcast=True) | (bits & -2147483648)  # v's sign, -0 kept
    return tl.where(tl.abs(v) < limit, small, normal).to(tl.float32, bitcast=True)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, n_cols, FORMAT: tl.constexpr,
                       BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """One row per program: its absolute maximum, its scale, its fp8 values. Rows wider than BLOCK are read
    twice (the second read mostly from L2)."""
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        scale, inv = _pow2_scale(tl.max(tl.abs(x), axis=0), FORMAT)
        tl.store(q_row + cols, _fp8_grid(x * inv, FORMAT).to(q_ptr.dtype.element_ty), mask=cols < n_cols)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + c, mask=c < n_cols, other=0.0).to(tl.float32)))
        scale, inv = _pow2_scale(tl.max(amax, axis=0), FORMAT)
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            x = tl.load(x_row + c, mask=c < n_cols, other=0.0).to(tl.float32)
            tl.store(q_row + c, _fp8_grid(x * inv, FORMAT).to(q_ptr.dtype.element_ty), mask=c < n_cols)
    tl.store(s_ptr + row, scale)


@triton.jit
def _col_amax_kernel(x_ptr, amax_ptr, stride_x, n_rows, n_cols, ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr):
    """The absolute maximum of each of BLOCK_C columns over ROWS rows, folded into amax (C,) by atomic max (a max
    is the same in any order)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    first = tl.program_id(1).to(tl.int64) * ROWS
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for r in range(0, ROWS, BLOCK_R):
        rows = first + r + tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.max(tl.abs(x), axis=0))
    tl.atomic_max(amax_ptr + cols, acc, mask=cols < n_cols)


@triton.jit
def _quant_cols_t_kernel(x_ptr, amax_ptr, q_ptr, s_ptr, stride_x, stride_q, n_rows, n_cols, FORMAT: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One (BLOCK_R, BLOCK_C) tile of x, each column divided by its scale, written transposed into q (C, R); the
    first row of programs writes the scales."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    scale, inv = _pow2_scale(tl.load(amax_ptr + cols, mask=col_mask, other=0.0), FORMAT)
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q = tl.trans(_fp8_grid(x * inv[None, :], FORMAT).to(q_ptr.dtype.element_ty))
    tl.store(q_ptr + cols[:, None] * stride_q + rows[None, :], q, mask=tl.trans(mask))
    if tl.program_id(0) == 0:
        tl.store(s_ptr + cols, scale, mask=col_mask)


def quant_block(cols: int, glu: bool = False) -> tuple[int, bool, int]:
    """(BLOCK, one block per row, warps) of a quantisation loop over rows of ``cols`` elements: one block when the
    row fits ``_BLOCK`` elements (``_GLU_BLOCK`` for the GLU's), a warp per 1024 elements (per 512 for the GLU's,
    at most 32), else two passes over ``_WIDE_BLOCK``-element blocks."""
    block = row_block(cols)
    if block <= (_GLU_BLOCK if glu else _BLOCK):
        return block, True, max(1, min(32, block // (512 if glu else 1024)))
    return _WIDE_BLOCK, False, _WIDE_WARPS


# ------------------------------------------------------------------------------------ custom ops
def _quantized_empty(rows: int, cols: int, e5m2: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (q (rows, cols) e4m3 or e5m2, scales (rows, 1) fp32)."""
    return (torch.empty((rows, cols), dtype=E5M2 if e5m2 else E4M3, device=device),
            torch.empty((rows, 1), dtype=torch.float32, device=device))


@eager_op
@triton_op(f"{LIB}::fp8_quantize_rows", mutates_args={})
def _quantize_rows(x: torch.Tensor, e5m2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (M, K) fp8, scales (M, 1) fp32) of rows x (M, K)."""
    x2 = as_rows(x)
    rows, cols = x2.shape
    q, s = _quantized_empty(rows, cols, e5m2, x.device)
    if q.numel() > 0:
        block, one, warps = quant_block(cols)
        wrap_triton(_quant_rows_kernel)[(rows,)](x2, q, s, x2.stride(0), q.stride(0), cols, FORMAT=2 if e5m2 else 1,
                                                 BLOCK=block, ONE_BLOCK=one, num_warps=warps)
    return q, s


@eager_op
@triton_op(f"{LIB}::fp8_quantize_cols_t", mutates_args={})
def _quantize_cols_t(x: torch.Tensor, e5m2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (C, R) fp8, scales (C, 1) fp32): the columns of x (R, C) quantised, written as rows (x transposed)."""
    x2 = as_rows(x)
    rows, cols = x2.shape
    q, s = _quantized_empty(cols, rows, e5m2, x.device)
    amax = torch.zeros(cols, dtype=torch.float32, device=x.device)
    if q.numel() > 0:
        (ar, ac, aw), (qr, qc, qw) = _COLS_AMAX_TILE, _COLS_QUANT_TILE
        chunk = ar * max(1, triton.cdiv(rows, ar * _COLS_CHUNKS))  # at most _COLS_CHUNKS row chunks per column block
        wrap_triton(_col_amax_kernel)[(triton.cdiv(cols, ac), triton.cdiv(rows, chunk))](
            x2, amax, x2.stride(0), rows, cols, ROWS=chunk, BLOCK_R=ar, BLOCK_C=ac, num_warps=aw)
        wrap_triton(_quant_cols_t_kernel)[(triton.cdiv(rows, qr), triton.cdiv(cols, qc))](
            x2, amax, q, s, x2.stride(0), q.stride(0), rows, cols, FORMAT=2 if e5m2 else 1, BLOCK_R=qr, BLOCK_C=qc,
            num_warps=qw)
    return q, s


# ------------------------------------------------------------------------------------- reference
def pow2_scale_reference(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """:func:`_pow2_scale`'s scale in PyTorch: the least power of two >= amax / FMAX (fp32)."""
    v = torch.clamp(amax.float() / FP8_MAX[fp8_dtype], min=_SMALLEST_NORMAL)
    mantissa, exponent = torch.frexp(v)  # v = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(v), exponent - (mantissa == 0.5).to(exponent.dtype))


def quantize_rows_reference(x: torch.Tensor, fp8_dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (M, K) fp8, scales (M, 1) fp32) of rows x (..., K), in PyTorch (any float dtype, float64 included)."""
    x2 = x.reshape(-1, x.shape[-1])
    s = pow2_scale_reference(x2.abs().amax(dim=1, keepdim=True) if x2.shape[1] else x2.new_zeros(x2.shape[0], 1),
                             fp8_dtype)
    return (x2 / s.to(x2.dtype)).to(fp8_dtype), s


def dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * s in ``dtype`` (exact in fp32 and float64: fp8 values times powers of two)."""
    return q.to(dtype) * s.to(dtype)


# ------------------------------------------------------------------------------------------ GEMMs
def quantize_rows(x: torch.Tensor, fp8_dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (M, K) fp8, scales (M, 1) fp32) of rows x (..., K): the kernel where Triton runs, else the reference."""
    if not use_triton(x):
        return quantize_rows_reference(x, fp8_dtype)
    return _quantize_rows(x, fp8_dtype == E5M2)


def quantize_cols_t(x: torch.Tensor, fp8_dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (C, R) fp8, scales (C, 1) fp32): x (R, C) transposed, each of its columns quantised as a row (one read
    for the columns' maxima, one read and one fp8 write for the values); the operand layout of a GEMM that reduces
    over x's rows."""
    if not use_triton(x):
        return quantize_rows_reference(x.t(), fp8_dtype)
    return _quantize_cols_t(x, fp8_dtype == E5M2)


def scaled_mm(aq: torch.Tensor, a_s: torch.Tensor, bq: torch.Tensor, b_s: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``(aq * a_s) @ (bq * b_s).T`` (M, N) in ``out_dtype`` from rowwise-quantised aq (M, K), bq (N, K) and their
    (M, 1) / (N, 1) scales: ``torch._scaled_mm`` on CUDA when K and N are multiples of 16 (fp32 accumulation), else
    the dequantised operands multiplied in fp32."""
    if aq.is_cuda and aq.shape[1] % 16 == 0 and bq.shape[0] % 16 == 0:
        return torch._scaled_mm(aq, bq.t(), scale_a=a_s, scale_b=b_s.t(), out_dtype=out_dtype)
    return (dequantize(aq, a_s) @ dequantize(bq, b_s).t()).to(out_dtype)


@torch.library.custom_op(f"{LIB}::add_bias_", mutates_args={"out"})
def add_bias_(out: torch.Tensor, bias: torch.Tensor) -> None:
    """``out += bias`` in place on a GEMM's (M, N) output. One op, so that selective activation checkpointing, which
    keeps the GEMM's output, keeps this update with it (``ligermodels.train.parallelize.IN_PLACE_OPS``) rather than
    apply it a second time when it recomputes a layer."""
    out.add_(bias)


@add_bias_.register_fake
def _(out: torch.Tensor, bias: torch.Tensor) -> None:
    return None


def fp8_forward(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    """The forward GEMM on an input already quantised by rows (xq (M, K), xs (M, 1)): W (N, K) quantised by rows
    here, ``(M, N)`` in ``out_dtype``, plus the bias (added after the GEMM, in place)."""
    wq, ws = quantize_rows(weight)
    out = scaled_mm(xq, xs, wq, ws, out_dtype)
    if bias is not None:
        add_bias_(out, bias)
    return out


def fp8_input_grad(dout: torch.Tensor, weight: torch.Tensor, grad_dtype: torch.dtype) -> torch.Tensor:
    """``dout @ W`` (M, K) with dout (M, N) quantised by rows into ``grad_dtype`` and W (N, K) by columns (its
    transpose, copied contiguous in bf16, by rows) into e4m3; in dout's dtype."""
    dq, ds = quantize_rows(dout, grad_dtype)
    wtq, wts = quantize_cols_t(weight)
    return scaled_mm(dq, ds, wtq, wts, dout.dtype)


def fp8_weight_grad(dout: torch.Tensor, x: torch.Tensor, grad_dtype: torch.dtype) -> torch.Tensor:
    """``dout.T @ x`` (N, K) from dout (M, N) and x (M, K), both quantised along M (the tokens the product sums
    over: :func:`quantize_cols_t`), dout into ``grad_dtype``, x into e4m3; in dout's dtype."""
    dq, ds = quantize_cols_t(dout, grad_dtype)
    xq, xs = quantize_cols_t(x)
    return scaled_mm(dq, ds, xq, xs, dout.dtype)


# ------------------------------------------------------------------------------------- autograd
def input_grad(dout: torch.Tensor, weight: torch.Tensor, recipe: FP8Recipe | None) -> torch.Tensor:
    """``dout @ W`` (M, K) for rows dout (M, N): :func:`fp8_input_grad` under a recipe, else a GEMM in dout's
    dtype."""
    return dout @ weight if recipe is None else fp8_input_grad(dout, weight, recipe.grad_dtype)


def weight_grad(dout: torch.Tensor, x: torch.Tensor, recipe: FP8Recipe | None) -> torch.Tensor:
    """``dout.T @ x`` (N, K) for rows dout (M, N) and x (M, K): :func:`fp8_weight_grad` when the recipe puts the
    weight gradient in FP8, else a GEMM in dout's dtype (no recipe, or ``rowwise-gw-bf16``)."""
    if recipe is not None and recipe.weight_grad:
        return fp8_weight_grad(dout, x, recipe.grad_dtype)
    return dout.t().mm(x)


class FP8LinearFunction(torch.autograd.Function):
    """``forward(x (..., K), weight (N, K), bias (N,) | None, recipe)`` -> (..., N): the GEMMs in FP8 as the
    :class:`FP8Recipe` says (module docstring), from the saved x."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe):
        x2 = as_rows(x)
        xq, xs = quantize_rows(x2)
        out = fp8_forward(xq, xs, weight, bias, x.dtype)
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.has_bias = recipe, bias is not None
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dout):
        x, weight = ctx.saved_tensors
        d2 = as_rows(dout)
        dx = input_grad(d2, weight, ctx.recipe).view(x.shape) if ctx.needs_input_grad[0] else None
        dw = weight_grad(d2, as_rows(x), ctx.recipe) if ctx.needs_input_grad[1] else None
        db = d2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               mode: str = "rowwise") -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the forward and input-gradient GEMMs in FP8 (module docstring).

    Args:
        x: (..., K) bf16/fp16/fp32; weight: (N, K); bias: (N,) or None.
        mode: a key of :data:`FP8_MODES`: "rowwise" (every GEMM in FP8, e4m3), "rowwise-e5m2" (output gradients
            in e5m2) or "rowwise-gw-bf16" (the weight gradient's GEMM in bf16).
    Returns:
        (..., N) in x's dtype; differentiable in x, weight and bias (gradients in their dtypes).
    """
    if mode not in FP8_MODES:
        raise ValueError(f"fp8_linear: mode must be one of {sorted(FP8_MODES)}, got {mode!r}")
    check_floating("fp8_linear", x=x, weight=weight, bias=bias)
    check_same_device(x, weight, bias)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"fp8_linear: weight must be (N, K) with K = x.shape[-1] = {x.shape[-1]}, "
                         f"got {tuple(weight.shape)}")
    return FP8LinearFunction.apply(x.contiguous(), weight, bias, FP8_MODES[mode])


def fp8_supported(device: torch.device) -> str | None:
    """None when FP8 GEMMs run on ``device``; else why not (CUDA before compute capability 8.9 has no FP8 tensor
    cores). The CPU runs them dequantised (tests, the interpreter)."""
    return needs_capability(device, (8, 9), "FP8 (Ada, Hopper)")
