"""Gated linear units: ``swiglu`` = silu(gate) * up and ``geglu`` = gelu(gate) * up.

One elementwise kernel pair serves both (the activation is a compile-time switch), forward and
backward. The math runs in fp32 and is rounded once to the output dtype. The backward pass
recomputes the activation from ``gate`` instead of saving it, so the op keeps only its two inputs
alive for backward.

Inputs may be two tensors of shape (..., I) or one packed tensor (..., 2*I) from a fused gate+up
projection (gate first). For the packed form the gradient comes back packed too, written by the
kernel straight into one (..., 2*I) buffer: no split, no concatenation.

Bytes moved (the fewest the op must move), for M rows of I elements of s bytes:
forward 3*M*I*s (read gate, up; write out), backward 5*M*I*s (read dout, gate, up; write dgate, dup).

Each program covers a (rows x columns) tile of 8192 elements. The column block is chosen per I so
that few lanes are masked (``col_block``): one block of 8192 for I = 8192, 32 rows x 256 for
Qwen2-1.5B's I = 8960, which a one-row block of 8192 covered in two programs, the second 91% masked
(80-83% of copy bandwidth in the training profile; 94% with the tiles, H100 kernel benchmark).
Separate contiguous inputs are viewed as rows of up to 8192 whatever I is (``flat_width``: an
elementwise op does not care where rows end), so every tile is one contiguous run: 98-100% of copy
bandwidth at I = 8960 and 5632, against 94-96% with the column blocks (H100). The packed
form keeps the column blocks, since its gate and up halves alternate along each row.

``glu_linear`` fuses the GLU with the down projection that follows it in an MLP, for memory: the
(M, I) activation h = glu(gate, up) is an input of the down projection, which autograd would keep
for the weight gradient until the backward pass. ``glu_linear`` keeps only the packed gate+up and
has the backward kernel write h again while it computes the gate/up gradients (one extra write of
M*I*s bytes), saving M*I*s bytes of activation memory per MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kernels._common import (
    LIB,
    as_rows,
    check_floating,
    check_same_device,
    compute_dtype,
    eager_op,
    n_rows,
    row_block,
    use_triton,
)
from kernels.fp8 import (
    E4M3,
    _fp8_grid,
    _pow2_scale,
    fp8_forward,
    fp8_recipe,
    input_grad,
    quant_block,
    weight_grad,
)
from kernels.low_rank import (
    LowRank,
    check_low_rank,
    dropout_mask,
    lora_linear,
    low_rank_backward,
    low_rank_grad_a,
    low_rank_input_grad,
    low_rank_linear,
    low_rank_reference,
    save_low_rank,
    saved_low_rank,
)

SILU, GELU_TANH, GELU_ERF = 0, 1, 2
_GELU_MODES = {"tanh": GELU_TANH, "none": GELU_ERF}
#: Elements per program, and warps: 16 elements a thread. Measured on an H100 (kernel time, swiglu
#: bf16): 1024 x 4 warps ran at 92-96% of copy bandwidth, 8192 x 16 at 95-100%.
_BLOCK = 8192
_WARPS = 16
#: Narrowest column block of a (rows x cols) tile: 256 elements, 512 contiguous bytes per row in bf16.
_MIN_COLS = 256


# --------------------------------------------------------------------------------------- kernels
@triton.jit
def _activation(g, ACT: tl.constexpr):
    """Return (act(g), act'(g)) in fp32."""
    if ACT == 0:  # silu
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:  # gelu, tanh approximation; tanh(x) = 2*sigmoid(2x) - 1
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
    else:  # exact gelu
        e = tl.erf(g * 0.7071067811865476)
        a = 0.5 * g * (1.0 + e)
        da = 0.5 * (1.0 + e) + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    return a, da


@triton.jit
def _tile_index(n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(rows (BLOCK_R, 1) int64, cols (1, BLOCK_C), mask) of this program's (BLOCK_R x BLOCK_C) tile."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    return rows, cols, (rows < n_rows) & (cols < n_cols)


@triton.jit
def _glu_fwd_kernel(g_ptr, u_ptr, o_ptr, u_off, stride_g, stride_u, stride_o, n_rows, n_cols,
                    ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """out = act(g) * u over one tile, with u read at ``u_ptr + u_off`` (the up half of a packed row)."""
    rows, cols, mask = _tile_index(n_rows, n_cols, BLOCK_R, BLOCK_C)
    g = tl.load(g_ptr + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + u_off + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    a, _ = _activation(g, ACT)
    tl.store(o_ptr + rows * stride_o + cols, (a * u).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(do_ptr, g_ptr, u_ptr, d_ptr, h_ptr, u_off, du_off, stride_do, stride_g, stride_u,
                    stride_d, stride_h, n_rows, n_cols, ACT: tl.constexpr, STORE_H: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """dg, du of out = act(g) * u over one tile; u read at ``u_ptr + u_off``; dg written at ``d_ptr``, du
    at ``d_ptr + du_off`` (one output tensor, passed once: torch.compile clones each mutated argument)."""
    rows, cols, mask = _tile_index(n_rows, n_cols, BLOCK_R, BLOCK_C)
    do = tl.load(do_ptr + rows * stride_do + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + u_off + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    a, da = _activation(g, ACT)
    tl.store(d_ptr + rows * stride_d + cols, (do * u * da).to(d_ptr.dtype.element_ty), mask=mask)
    tl.store(d_ptr + du_off + rows * stride_d + cols, (do * a).to(d_ptr.dtype.element_ty), mask=mask)
    if STORE_H:  # glu_linear: the forward output again, for the down projection's weight gradient
        tl.store(h_ptr + rows * stride_h + cols, (a * u).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_fp8_fwd_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, n_cols, ACT: tl.constexpr, FORMAT: tl.constexpr,
                        BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """One packed gate+up row per program: act(g) * u in fp32, its absolute maximum, and the row divided by its
    power-of-two scale (:mod:`kernels.fp8`) written in FP8. Rows wider than BLOCK are computed twice (the
    second read of gate/up mostly from L2)."""
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        mask = cols < n_cols
        a, _ = _activation(tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32), ACT)
        h = a * tl.load(x_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        scale, inv = _pow2_scale(tl.max(tl.abs(h), axis=0), FORMAT)
        tl.store(q_row + cols, _fp8_grid(h * inv, FORMAT).to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            a, _ = _activation(tl.load(x_row + c, mask=c < n_cols, other=0.0).to(tl.float32), ACT)
            amax = tl.maximum(amax, tl.abs(a * tl.load(x_row + n_cols + c, mask=c < n_cols, other=0.0).to(tl.float32)))
        scale, inv = _pow2_scale(tl.max(amax, axis=0), FORMAT)
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            a, _ = _activation(tl.load(x_row + c, mask=c < n_cols, other=0.0).to(tl.float32), ACT)
            h = a * tl.load(x_row + n_cols + c, mask=c < n_cols, other=0.0).to(tl.float32)
            tl.store(q_row + c, _fp8_grid(h * inv, FORMAT).to(q_ptr.dtype.element_ty), mask=c < n_cols)
    tl.store(s_ptr + row, scale)


# ------------------------------------------------------------------------------------ custom ops
# The ops take a packed (..., 2*I) gate+up tensor whole (``up`` None) and address its halves with an
# element offset inside the kernel: no slice views reach the op, so torch.compile has none to copy.
def col_block(cols: int) -> int:
    """Column block for rows of ``cols`` elements: the widest power of two from ``_MIN_COLS`` up to
    ``_BLOCK`` that leaves the fewest masked lanes in the last column block. A row of 8960 (Qwen2-1.5B's
    intermediate size) takes 256 (35 full blocks) rather than 8192, whose second block per row is 91%
    masked."""
    if cols <= _MIN_COLS:
        return row_block(cols)
    widths = [w for w in (_BLOCK >> i for i in range(6)) if w >= _MIN_COLS]  # 8192 ... 256
    return min(widths, key=lambda w: (-cols % w, -w))


def launch_config(rows: int, cols: int) -> dict:
    """Grid and tile of a (rows x cols) GLU launch: tiles of up to ``_BLOCK`` elements, 16 per thread."""
    block_c = col_block(cols)
    block_r = max(1, _BLOCK // block_c)
    if isinstance(rows, int):  # fewer rows than a tile (decode); a symbolic row count stays unspecialised
        block_r = min(block_r, row_block(rows))
    warps = max(1, min(_WARPS, block_r * block_c // 512))
    return {"grid": (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c)),
            "meta": {"BLOCK_R": block_r, "BLOCK_C": block_c, "num_warps": warps}}


def flat_width(*tensors: torch.Tensor) -> int:
    """Row width to view separate operands of one shape as (numel / width, width): the widest power of
    two from ``_BLOCK`` down to ``_MIN_COLS`` that divides numel, when every operand is contiguous (0:
    keep their rows). An elementwise op does not care where rows end, and full ``_BLOCK``-wide tiles
    read and write long contiguous runs instead of narrow column blocks of (say) 8960-wide rows."""
    n = tensors[0].numel()
    if not isinstance(n, int) or n == 0 or not all(t.is_contiguous() for t in tensors):
        return 0  # a symbolic numel (torch.compile with dynamic shapes) keeps the rows
    return next((w for w in (_BLOCK >> i for i in range(6)) if w >= _MIN_COLS and n % w == 0), 0)


def _operands(gate: torch.Tensor, up: torch.Tensor | None, *more: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, int, int, int, list[torch.Tensor]]:
    """(gate rows, up rows, element offset of up in its rows tensor, rows, row width, ``more`` as rows)
    for packed (``up`` None: rows of I = width) or separate inputs (rows of I, or of :func:`flat_width`
    when all are contiguous). ``more`` are tensors of the op's output shape (the output gradient)."""
    if up is None:
        g2 = as_rows(gate)
        cols = g2.shape[1] // 2
        return g2, g2, cols, g2.shape[0], cols, [as_rows(t) for t in more]
    width = flat_width(gate, up, *more)
    if width:
        g2 = gate.view(-1, width)
        return g2, up.view(-1, width), 0, g2.shape[0], width, [t.view(-1, width) for t in more]
    g2 = as_rows(gate)
    return g2, as_rows(up), 0, g2.shape[0], g2.shape[1], [as_rows(t) for t in more]


@eager_op
@triton_op(f"{LIB}::glu_fwd", mutates_args={})
def _glu_fwd(gate: torch.Tensor, up: torch.Tensor | None, act: int) -> torch.Tensor:
    """glu(gate, up) (..., I); ``up`` None: ``gate`` is packed (..., 2*I)."""
    g2, u2, u_off, rows, cols, _ = _operands(gate, up)
    out_shape = gate.shape if up is not None else (*gate.shape[:-1], cols)
    out = torch.empty(out_shape, dtype=gate.dtype, device=gate.device)
    if out.numel() > 0:
        o2 = out.view(rows, cols)
        tile = launch_config(rows, cols)
        wrap_triton(_glu_fwd_kernel)[tile["grid"]](
            g2, u2, o2, u_off, g2.stride(0), u2.stride(0), o2.stride(0), rows, cols, ACT=act, **tile["meta"])
    return out


@eager_op
@triton_op(f"{LIB}::glu_fwd_fp8", mutates_args={})
def _glu_fwd_fp8(x: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(glu (rows, I) e4m3, row scales (rows, 1) fp32) of packed gate+up rows x (..., 2*I), quantised by rows as
    :func:`kernels.fp8.quantize_rows` quantises the fp32 activation."""
    x2 = as_rows(x)
    rows, cols = x2.shape[0], x2.shape[1] // 2
    q = torch.empty((rows, cols), dtype=E4M3, device=x.device)
    s = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if q.numel() > 0:
        block, one, warps = quant_block(cols, glu=True)
        wrap_triton(_glu_fp8_fwd_kernel)[(rows,)](x2, q, s, x2.stride(0), q.stride(0), cols, ACT=act,
                                                  FORMAT=1, BLOCK=block, ONE_BLOCK=one, num_warps=warps)
    return q, s


def _launch_bwd(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None, act: int,
                h: torch.Tensor | None) -> torch.Tensor:
    """Gradient buffer: (rows, 2*I) packed when ``up`` is None, else (2, ...) holding gate's then up's
    gradient, each contiguous with numel of gate; writes h when given."""
    g2, u2, u_off, rows, cols, (d2,) = _operands(gate, up, dout)
    if up is None:
        buf = torch.empty(rows, 2 * cols, dtype=gate.dtype, device=gate.device)
        du_off, stride_d = cols, 2 * cols
    else:
        buf = torch.empty(2, rows, cols, dtype=gate.dtype, device=gate.device)
        du_off, stride_d = rows * cols, cols
    h2 = d2 if h is None else h.view(rows, cols)  # without h: a read-only placeholder, never stored to
    if rows * cols > 0:
        tile = launch_config(rows, cols)
        wrap_triton(_glu_bwd_kernel)[tile["grid"]](
            d2, g2, u2, buf, h2, u_off, du_off, d2.stride(0), g2.stride(0), u2.stride(0), stride_d,
            h2.stride(0), rows, cols, ACT=act, STORE_H=h is not None, **tile["meta"])
    return buf


@eager_op
@triton_op(f"{LIB}::glu_bwd", mutates_args={})
def _glu_bwd(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None, act: int) -> torch.Tensor:
    """Gradients of gate and up: one (rows, 2*I) buffer when ``up`` is None (packed), else (2, ...), each half
    viewable as gate's shape."""
    return _launch_bwd(dout, gate, up, act, None)


@eager_op
@triton_op(f"{LIB}::glu_bwd_recompute", mutates_args={})
def _glu_bwd_recompute(dout: torch.Tensor, x: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed (rows, 2*I) gradient of the packed ``x``, the forward output glu(x) recomputed (..., I))."""
    h = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
    return _launch_bwd(dout, x, None, act, h), h


class GLUFunction(torch.autograd.Function):
    """Autograd wrapper: ``forward(gate, up, act)``, with ``up=None`` meaning ``gate`` is packed (..., 2*I)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, up: torch.Tensor | None, act: int) -> torch.Tensor:
        if up is None:
            _split(x)  # the even-width check
        ctx.save_for_backward(x, up)
        ctx.act = act
        return _glu_fwd(x, up, act)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        x, up = ctx.saved_tensors
        buf = _glu_bwd(dout, x, up, ctx.act)
        if up is None:
            return buf.view(x.shape), None, None
        return buf[0].view(x.shape), buf[1].view(up.shape), None


class GLULinearFunction(torch.autograd.Function):
    """Autograd wrapper of ``glu_linear``: saves the packed gate+up and the weight; the activation
    too when ``keep_activation`` (else the backward kernel writes it again, only when a weight gradient
    needs it). With low-rank adapters on the down projection (``lora_a`` not None, :mod:`kernels.low_rank`)
    the same activation feeds W and the stacked A, and in backward dW and dA. A frozen weight (no
    gradient asked) gets no dW GEMM."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: int,
                keep_activation: bool = False, lora_a=None, lora_b=None, lora_slices=None, lora_scale: float = 1.0,
                lora_dropout: float = 0.0, fp8=None) -> torch.Tensor:
        z = bb = mask = h = None
        ctx.fp8 = fp8
        if fp8 is not None and lora_a is None:  # the GLU kernel writes h in FP8 with its row scales
            hq, hs = _glu_fwd_fp8(x, act)
            out, keep_activation = fp8_forward(hq, hs, weight, bias, x.dtype).view(*x.shape[:-1], -1), False
        elif lora_a is None:
            h = _glu_fwd(x, None, act)
            out = F.linear(h, weight, bias)
        else:  # the adapters read h in x's dtype; under FP8 the base GEMM quantises it (low_rank_linear)
            h = _glu_fwd(x, None, act)
            h2 = h.view(-1, h.shape[-1])
            mask = dropout_mask(h2, lora_dropout)
            lr = LowRank(lora_a, lora_b, lora_slices, lora_scale, lora_dropout)
            out, z, bb = low_rank_linear(h2, weight, bias, lr, mask, fp8)
            out = out.view(*h.shape[:-1], weight.shape[0])
            ctx.low_rank = (lora_slices, lora_scale, lora_dropout)
        lora = save_low_rank(lora_a, lora_b, z, bb, mask)
        ctx.save_for_backward(x, weight, *lora, *([h] if keep_activation else []))
        ctx.n_lora = len(lora)
        ctx.act, ctx.has_bias = act, bias is not None
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        x, weight, *rest = ctx.saved_tensors
        lora_a, lora_b, z, bb, mask = saved_low_rank(rest[:ctx.n_lora])
        kept = rest[ctx.n_lora] if len(rest) > ctx.n_lora else None
        needs_w, needs_b = ctx.needs_input_grad[1:3]
        needs_la, needs_lb = ctx.needs_input_grad[5:7]
        d2 = dout.reshape(-1, dout.shape[-1])
        dla = dlb = None
        if lora_a is None:
            dh = input_grad(d2, weight, ctx.fp8)  # (M, I)
        else:
            lr = LowRank(lora_a, lora_b, *ctx.low_rank)
            dz, dlb = low_rank_backward(d2, lr, z, bb, needs_lb)
            dh = low_rank_input_grad(d2, weight, dz, lr, mask, ctx.fp8)
        needs_h = needs_w or (lora_a is not None and needs_la)
        if kept is not None or not needs_h:
            h, dx = kept, _glu_bwd(dh, x, None, ctx.act)
        else:
            dx, h = _glu_bwd_recompute(dh, x, ctx.act)
        dw = None
        if needs_h:
            h2 = h.view(n_rows(h), h.shape[-1])
            dw = weight_grad(d2, h2, ctx.fp8) if needs_w else None
            dla = low_rank_grad_a(dz, h2, lr, mask) if lora_a is not None and needs_la else None
        db = d2.sum(0) if ctx.has_bias and needs_b else None
        return dx.view(x.shape), dw, db, None, None, dla, dlb, None, None, None, None


# ------------------------------------------------------------------------------------- reference
def glu_reference(gate: torch.Tensor, up: torch.Tensor | None, act: int) -> torch.Tensor:
    """Pure-PyTorch GLU in fp32 (fp64 for fp64 inputs), rounded once to the input dtype."""
    if up is None:
        gate, up = _split(gate)
    cd = compute_dtype(gate.dtype)
    g, u = gate.to(cd), up.to(cd)
    if act == SILU:
        a = F.silu(g)
    else:
        a = F.gelu(g, approximate="tanh" if act == GELU_TANH else "none")
    return (a * u).to(gate.dtype)


# ---------------------------------------------------------------------------------------- public
def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[-1] % 2:
        raise ValueError(f"a packed gate+up tensor needs an even last dim, got shape {tuple(x.shape)}")
    return x.chunk(2, dim=-1)


def _glu(gate: torch.Tensor, up: torch.Tensor | None, act: int) -> torch.Tensor:
    check_floating("glu", gate=gate, up=up)
    check_same_device(gate, up)
    if up is not None and gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if not use_triton(gate):
        return glu_reference(gate, up, act)
    return GLUFunction.apply(gate, up, act)


def glu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               activation: str = "silu", keep_activation: bool = False,
               low_rank: LowRank | None = None, fp8: str | None = None) -> torch.Tensor:
    """``F.linear(glu(x), weight, bias)``: the GLU of a packed gate+up tensor followed by the down projection.

    The same numbers as :func:`swiglu` / :func:`geglu` then ``F.linear``, with less memory: the
    (..., I) activation is not kept for backward but written again by the backward kernel.

    Args:
        x: packed (..., 2*I) gate+up (gate first).
        weight: (H, I) down-projection weight; bias: (H,) or None.
        activation: "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU, tanh or erf).
        keep_activation: keep the (..., I) activation for backward instead of writing it again there
            (inside an activation-checkpointed layer, where it is kept only through that layer's
            backward; the backward kernel then moves five (..., I) tensors instead of six).
        low_rank: LoRA adapters on the down projection (:class:`kernels.low_rank.LowRank`), or None: their
            term of the activation is added (in fp32), with their dropout on their input only; backward
            writes the activation again once for both dW and dA. A frozen weight or bias gets no gradient.
        fp8: None (a bf16 GEMM), or a mode of :data:`kernels.fp8.FP8_MODES`: the GLU kernel writes the activation
            in FP8 with row scales for the forward GEMM, the gradients' GEMMs run in FP8 as the mode says
            (:mod:`kernels.fp8`); ``keep_activation`` is then ignored. With ``low_rank`` the activation is written
            in x's dtype for the adapters and quantised for the base GEMMs by a pass of its own.
    Returns:
        (..., H) in the input dtype.
    """
    act = {"silu": SILU, "gelu_tanh": GELU_TANH, "gelu": GELU_ERF}.get(activation)
    if act is None:
        raise ValueError(f"glu_linear: activation must be 'silu', 'gelu_tanh' or 'gelu', got {activation!r}")
    check_floating("glu_linear", x=x, weight=weight, bias=bias)
    check_same_device(x, weight, bias)
    if weight.dim() != 2:
        raise ValueError(f"glu_linear: weight must be (H, I), got shape {tuple(weight.shape)}")
    if weight.shape[-1] * 2 != x.shape[-1]:
        raise ValueError(f"glu_linear: x's last dim {x.shape[-1]} must be twice weight's {weight.shape[-1]}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"glu_linear: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    if low_rank is not None:
        check_low_rank(low_rank, weight.shape[1], weight.shape[0], "glu_linear")
    recipe = fp8_recipe(fp8, "glu_linear")
    if fp8 is not None and not use_triton(x):  # the activation materialised, then the same quantised GEMMs
        return lora_linear(glu_reference(x, None, act), weight, bias, low_rank, fp8)
    if not use_triton(x):
        h = glu_reference(x, None, act)
        out = F.linear(h, weight, bias)
        return out if low_rank is None else low_rank_reference(h, out, low_rank)
    lr = (None, None, None, 1.0, 0.0) if low_rank is None else (
        low_rank.a, low_rank.b, tuple(low_rank.slices), float(low_rank.scale), float(low_rank.dropout))
    return GLULinearFunction.apply(x, weight, bias, act, bool(keep_activation), *lr,
                                   recipe)


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up``.

    Args:
        gate: (..., I), or the packed (..., 2*I) output of a fused gate+up projection when ``up`` is None.
        up: (..., I) or None.
    Returns:
        (..., I) in the input dtype.
    """
    return _glu(gate, up, SILU)


def geglu(gate: torch.Tensor, up: torch.Tensor | None = None, approximate: str = "tanh") -> torch.Tensor:
    """``gelu(gate, approximate) * up`` with ``approximate`` "tanh" (Gemma's) or "none" (erf).

    Shapes as in :func:`swiglu`.
    """
    if approximate not in _GELU_MODES:
        raise ValueError(f"geglu: approximate must be 'tanh' or 'none', got {approximate!r}")
    return _glu(gate, up, _GELU_MODES[approximate])
