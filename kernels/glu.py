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
that few lanes are masked (``_col_block``): one block of 8192 for I = 8192, 32 rows x 256 for
Qwen2-1.5B's I = 8960, which a one-row block of 8192 covered in two programs, the second 91% masked
(80-83% of copy bandwidth in the training profile; 94% with the tiles, H100 kernel benchmark).
Separate contiguous inputs are viewed as rows of up to 8192 whatever I is (``_flat_width``: an
elementwise op does not care where rows end), so every tile is one contiguous run: 98-100% of copy
bandwidth at I = 8960 and 5632, against 94-96% with the column blocks (H100, session 8). The packed
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
    INTERPRET,
    LIB,
    as_rows,
    check_floating,
    check_same_device,
    compute_dtype,
    dot_precision,
    n_rows,
    row_block,
    use_triton,
)
from kernels.low_rank import (
    LowRank,
    LowRankTerm,
    add_low_rank_term,
    check_low_rank,
    check_low_rank_term,
    dropout_mask,
    grad_b,
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
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """tl.dot(a, b, acc); PRECISION "upcast": in fp32 (the interpreter multiplies bf16 as its raw bits)."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _term_tiles(acc, z_ptr, stride_z, z_off, bt_ptr, stride_bt, col0, rows, cols, n_rows, n_cols, R,
                BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """(acc + z[rows, z_off:z_off+R] @ bt[:R, col0+cols], that bt tile (BLOCK_K, BLOCK_C)): a low-rank term
    over one tile, in fp32 (``bt`` holds B.T, (R, columns) row-major: the tile is its contiguous row runs)."""
    k = tl.arange(0, BLOCK_K)
    zt = tl.load(z_ptr + rows * stride_z + z_off + k[None, :], mask=(rows < n_rows) & (k[None, :] < R), other=0.0)
    bt = tl.load(bt_ptr + k[:, None] * stride_bt + col0 + cols, mask=(k[:, None] < R) & (cols < n_cols), other=0.0)
    return _dot(zt, bt, acc, PRECISION), bt


@triton.jit
def _term_grad_store(d, bt, part_ptr, stride_pr, z_off, rows, n_rows, R, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr):
    """Store this tile's share of z's gradient, d (BLOCK_R, BLOCK_C) @ bt.T -> (BLOCK_R, R), at z's columns."""
    k = tl.arange(0, BLOCK_K)[None, :]
    dz = _dot(d, tl.trans(bt), None, PRECISION)
    tl.store(part_ptr + rows * stride_pr + z_off + k, dz, mask=(rows < n_rows) & (k < R))


@triton.jit
def _glu_term_fwd_kernel(x_ptr, o_ptr, z_ptr, bt_ptr, stride_x, stride_o, stride_z, stride_bt, n_rows, n_cols,
                         zg_off, zu_off, R, ACT: tl.constexpr, HAS_G: tl.constexpr, HAS_U: tl.constexpr,
                         PRECISION: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """out = act(g) * u of a packed (rows, 2*n_cols) x whose halves still lack their adapters' term: g gets
    z[:, zg_off:zg_off+R] @ bt[:, :n_cols] (when HAS_G), u gets z[:, zu_off:zu_off+R] @ bt[:, n_cols:]."""
    rows, cols, mask = _tile_index(n_rows, n_cols, BLOCK_R, BLOCK_C)
    g = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + n_cols + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_G:
        g, _ = _term_tiles(g, z_ptr, stride_z, zg_off, bt_ptr, stride_bt, 0, rows, cols, n_rows, n_cols, R,
                           BLOCK_K, PRECISION)
    if HAS_U:
        u, _ = _term_tiles(u, z_ptr, stride_z, zu_off, bt_ptr, stride_bt, n_cols, rows, cols, n_rows, n_cols, R,
                           BLOCK_K, PRECISION)
    a, _ = _activation(g, ACT)
    tl.store(o_ptr + rows * stride_o + cols, (a * u).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_term_bwd_kernel(do_ptr, x_ptr, d_ptr, h_ptr, z_ptr, bt_ptr, dzd_ptr, ad_ptr, part_ptr,
                         stride_do, stride_x, stride_d, stride_h, stride_z, stride_bt, stride_dzd, stride_ad,
                         stride_pc, stride_pr, n_rows, n_cols, zg_off, zu_off, R, RD, ACT: tl.constexpr,
                         HAS_G: tl.constexpr, HAS_U: tl.constexpr, HAS_DOWN: tl.constexpr, STORE_H: tl.constexpr,
                         PRECISION: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_KD: tl.constexpr):
    """:func:`_glu_bwd_kernel` of a packed x with adapter terms: the gate/up halves' (recomputed as in
    :func:`_glu_term_fwd_kernel`; this program's share of their z gradient stored in ``part``, one
    (rows, T*r) fp32 slab per column block) and the down projection's, ``dzd @ ad`` added to ``do``."""
    rows, cols, mask = _tile_index(n_rows, n_cols, BLOCK_R, BLOCK_C)
    do = tl.load(do_ptr + rows * stride_do + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DOWN:
        do, _ = _term_tiles(do, dzd_ptr, stride_dzd, 0, ad_ptr, stride_ad, 0, rows, cols, n_rows, n_cols, RD,
                            BLOCK_KD, PRECISION)
    g = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + n_cols + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_G:
        g, bt_g = _term_tiles(g, z_ptr, stride_z, zg_off, bt_ptr, stride_bt, 0, rows, cols, n_rows, n_cols, R,
                              BLOCK_K, PRECISION)
    if HAS_U:
        u, bt_u = _term_tiles(u, z_ptr, stride_z, zu_off, bt_ptr, stride_bt, n_cols, rows, cols, n_rows, n_cols,
                              R, BLOCK_K, PRECISION)
    a, da = _activation(g, ACT)
    dg = (do * u * da).to(d_ptr.dtype.element_ty)
    du = (do * a).to(d_ptr.dtype.element_ty)
    tl.store(d_ptr + rows * stride_d + cols, dg, mask=mask)
    tl.store(d_ptr + n_cols + rows * stride_d + cols, du, mask=mask)
    if STORE_H:
        tl.store(h_ptr + rows * stride_h + cols, (a * u).to(h_ptr.dtype.element_ty), mask=mask)
    part_ptr += tl.program_id(1) * stride_pc
    if HAS_G:
        _term_grad_store(dg, bt_g, part_ptr, stride_pr, zg_off, rows, n_rows, R, BLOCK_K, PRECISION)
    if HAS_U:
        _term_grad_store(du, bt_u, part_ptr, stride_pr, zu_off, rows, n_rows, R, BLOCK_K, PRECISION)


# ------------------------------------------------------------------------------------ custom ops
# The ops take a packed (..., 2*I) gate+up tensor whole (``up`` None) and address its halves with an
# element offset inside the kernel: no slice views reach the op, so torch.compile has none to copy.
def _col_block(cols: int) -> int:
    """Column block for rows of ``cols`` elements: the widest power of two from ``_MIN_COLS`` up to
    ``_BLOCK`` that leaves the fewest masked lanes in the last column block. A row of 8960 (Qwen2-1.5B's
    intermediate size) takes 256 (35 full blocks) rather than 8192, whose second block per row is 91%
    masked."""
    if cols <= _MIN_COLS:
        return row_block(cols)
    widths = [w for w in (_BLOCK >> i for i in range(6)) if w >= _MIN_COLS]  # 8192 ... 256
    return min(widths, key=lambda w: (-cols % w, -w))


def _launch(rows: int, cols: int) -> dict:
    """Grid and tile of a (rows x cols) GLU launch: tiles of up to ``_BLOCK`` elements, 16 per thread."""
    block_c = _col_block(cols)
    block_r = max(1, _BLOCK // block_c)
    if isinstance(rows, int):  # fewer rows than a tile (decode); a symbolic row count stays unspecialised
        block_r = min(block_r, row_block(rows))
    warps = max(1, min(_WARPS, block_r * block_c // 512))
    return {"grid": (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c)),
            "meta": {"BLOCK_R": block_r, "BLOCK_C": block_c, "num_warps": warps}}


def _flat_width(*tensors: torch.Tensor) -> int:
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
    for packed (``up`` None: rows of I = width) or separate inputs (rows of I, or of :func:`_flat_width`
    when all are contiguous). ``more`` are tensors of the op's output shape (the output gradient)."""
    if up is None:
        g2 = as_rows(gate)
        cols = g2.shape[1] // 2
        return g2, g2, cols, g2.shape[0], cols, [as_rows(t) for t in more]
    width = _flat_width(gate, up, *more)
    if width:
        g2 = gate.view(-1, width)
        return g2, up.view(-1, width), 0, g2.shape[0], width, [t.view(-1, width) for t in more]
    g2 = as_rows(gate)
    return g2, as_rows(up), 0, g2.shape[0], g2.shape[1], [as_rows(t) for t in more]


@triton_op(f"{LIB}::glu_fwd", mutates_args={})
def _glu_fwd(gate: torch.Tensor, up: torch.Tensor | None, act: int) -> torch.Tensor:
    """glu(gate, up) (..., I); ``up`` None: ``gate`` is packed (..., 2*I)."""
    g2, u2, u_off, rows, cols, _ = _operands(gate, up)
    out_shape = gate.shape if up is not None else (*gate.shape[:-1], cols)
    out = torch.empty(out_shape, dtype=gate.dtype, device=gate.device)
    if out.numel() > 0:
        o2 = out.view(rows, cols)
        tile = _launch(rows, cols)
        wrap_triton(_glu_fwd_kernel)[tile["grid"]](
            g2, u2, o2, u_off, g2.stride(0), u2.stride(0), o2.stride(0), rows, cols, ACT=act, **tile["meta"])
    return out


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
        tile = _launch(rows, cols)
        wrap_triton(_glu_bwd_kernel)[tile["grid"]](
            d2, g2, u2, buf, h2, u_off, du_off, d2.stride(0), g2.stride(0), u2.stride(0), stride_d,
            h2.stride(0), rows, cols, ACT=act, STORE_H=h is not None, **tile["meta"])
    return buf


@triton_op(f"{LIB}::glu_bwd", mutates_args={})
def _glu_bwd(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None, act: int) -> torch.Tensor:
    """Gradients of gate and up: one (rows, 2*I) buffer when ``up`` is None (packed), else (2, ...), each half
    viewable as gate's shape."""
    return _launch_bwd(dout, gate, up, act, None)


@triton_op(f"{LIB}::glu_bwd_recompute", mutates_args={})
def _glu_bwd_recompute(dout: torch.Tensor, x: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed (rows, 2*I) gradient of the packed ``x``, the forward output glu(x) recomputed (..., I))."""
    h = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
    return _launch_bwd(dout, x, None, act, h), h


#: (rows, columns, warps) of the adapter-term kernels' tiles: tl.dot takes 16 rows or more, and a taller tile
#: shares each (r, columns) tile of B.T it loads among more rows.
_TERM_TILE = (32, 128, 4)


def _k_block(r: int) -> int:
    """tl.dot's inner size for a rank r: a power of two, 16 or more (the rest masked)."""
    return max(16, triton.next_power_of_2(max(r, 1)))


def _term_precision(dtype: torch.dtype) -> str:
    """The term kernels' tl.dot precision: :func:`dot_precision`, but fp32 for bf16 under the interpreter."""
    return "upcast" if INTERPRET and dtype == torch.bfloat16 else dot_precision(dtype)


def _term_launch(rows: int, cols: int, r: int, rd: int = 0) -> dict:
    br, bc, warps = _TERM_TILE
    return {"grid": (triton.cdiv(rows, br), triton.cdiv(cols, bc)),
            "meta": {"BLOCK_R": br, "BLOCK_C": bc, "BLOCK_K": _k_block(r), "BLOCK_KD": _k_block(rd),
                     "num_warps": warps}}


def term_halves(term: LowRankTerm, half: int, dtype: torch.dtype) -> tuple[torch.Tensor, int, int] | None:
    """How the GLU kernels add a packed (..., 2*half) gate+up projection's adapter ``term``: (B.T as one
    (r, 2*half) matrix in ``dtype``, the first z column of gate's target, of up's; -1 where that half has no
    target), or None when a target covers anything but exactly one half (then added beforehand in PyTorch)."""
    t_count = len(term.slices)
    r = term.z.shape[-1] // t_count
    offsets = {(0, half): -1, (half, 2 * half): -1}
    bt = torch.empty(r, 2 * half, dtype=dtype, device=term.z.device)
    row = 0
    for t, (s, e) in enumerate(term.slices):
        if (s, e) not in offsets:
            return None
        offsets[(s, e)] = t * r
        bt[:, s:e] = term.b[row:row + e - s].t()
        row += e - s
    return bt, offsets[(0, half)], offsets[(half, 2 * half)]


@triton_op(f"{LIB}::glu_term_fwd", mutates_args={})
def _glu_term_fwd(x: torch.Tensor, z: torch.Tensor, bt: torch.Tensor, zg_off: int, zu_off: int, act: int
                  ) -> torch.Tensor:
    """glu of the packed (..., 2*I) ``x`` with its adapters' term added (:func:`term_halves`): (..., I)."""
    x2 = as_rows(x)
    rows, cols = x2.shape[0], x2.shape[1] // 2
    z2 = z.reshape(rows, z.shape[-1])
    out = torch.empty((*x.shape[:-1], cols), dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        tile = _term_launch(rows, cols, bt.shape[0])
        wrap_triton(_glu_term_fwd_kernel)[tile["grid"]](
            x2, out, z2, bt, x2.stride(0), cols, z2.stride(0), bt.stride(0), rows, cols, max(zg_off, 0),
            max(zu_off, 0), bt.shape[0], ACT=act, HAS_G=zg_off >= 0, HAS_U=zu_off >= 0,
            PRECISION=_term_precision(x.dtype), **tile["meta"])
    return out


@triton_op(f"{LIB}::glu_term_bwd", mutates_args={})
def _glu_term_bwd(dout: torch.Tensor, x: torch.Tensor, z: torch.Tensor | None, bt: torch.Tensor | None, zg_off: int,
                  zu_off: int, dzd: torch.Tensor | None, ad: torch.Tensor | None, act: int, store_h: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of glu of a packed ``x`` with adapter terms: the gate/up term of :func:`_glu_term_fwd` (``z``
    not None) and the down projection's, ``dzd @ ad`` (M, I), added to ``dout`` (``dzd`` not None). Returns
    (packed (M, 2*I) gradient of x, the activation recomputed (..., I) when ``store_h`` else (0,), z's gradient
    in z's dtype (or (0,))): z's comes from one fp32 (M, T*r) slab per column block, summed here."""
    x2, d2 = as_rows(x), as_rows(dout)
    rows, cols = x2.shape[0], x2.shape[1] // 2
    buf = torch.empty(rows, 2 * cols, dtype=x.dtype, device=x.device)
    h = torch.empty((*x.shape[:-1], cols) if store_h else (0,), dtype=x.dtype, device=x.device)
    r, rd = (bt.shape[0] if bt is not None else 0), (ad.shape[0] if ad is not None else 0)
    tile = _term_launch(rows, cols, r, rd)
    width = z.shape[-1] if z is not None else 0
    part = torch.empty(tile["grid"][1], rows, width, dtype=torch.float32, device=x.device)
    z2 = z.reshape(rows, width) if z is not None else x2  # placeholders are never read (the flags are off)
    dzd2 = dzd if dzd is not None else x2
    if rows * cols > 0:
        wrap_triton(_glu_term_bwd_kernel)[tile["grid"]](
            d2, x2, buf, h if store_h else buf, z2, bt if bt is not None else x2, dzd2,
            ad if ad is not None else x2, part, d2.stride(0), x2.stride(0), buf.stride(0), cols, z2.stride(0),
            bt.stride(0) if bt is not None else 0, dzd2.stride(0), ad.stride(0) if ad is not None else 0,
            part.stride(0), width, rows, cols, max(zg_off, 0), max(zu_off, 0), r, rd, ACT=act,
            HAS_G=z is not None and zg_off >= 0, HAS_U=z is not None and zu_off >= 0, HAS_DOWN=dzd is not None,
            STORE_H=store_h, PRECISION=_term_precision(x.dtype), **tile["meta"])
    dz = part.sum(0).to(z.dtype).view(z.shape) if z is not None else x.new_empty(0)
    return buf, h, dz


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
    the same activation feeds W and the stacked A, and in backward dW and dA; without their dropout, the
    backward kernel adds their input gradient ``dz @ A`` to the activation's gradient itself (no (M, I)
    product for cuBLAS to write and read back as C). With the gate+up projection's adapter term
    (``term_z`` not None: :class:`kernels.low_rank.LowRankTerm`, its halves as :func:`term_halves`), the
    GLU kernels add it to their input and compute z's gradient; its B gradient is one GEMM a target.
    A frozen weight (no gradient asked) gets no dW GEMM."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: int,
                keep_activation: bool = False, lora_a=None, lora_b=None, lora_slices=None, lora_scale: float = 1.0,
                lora_dropout: float = 0.0, term_z=None, term_b=None, term_slices=None) -> torch.Tensor:
        halves = None
        if term_z is None:
            h = _glu_fwd(x, None, act)
        else:
            halves = term_halves(LowRankTerm(term_z, term_b, term_slices), x.shape[-1] // 2, term_z.dtype)
            h = _glu_term_fwd(x, term_z, halves[0], halves[1], halves[2], act)
        z = bb = mask = None
        if lora_a is None:
            out = F.linear(h, weight, bias)
        else:
            h2 = h.view(-1, h.shape[-1])
            mask = dropout_mask(h2, lora_dropout)
            lr = LowRank(lora_a, lora_b, lora_slices, lora_scale, lora_dropout)
            out, z, bb = low_rank_linear(h2, weight, bias, lr, mask)
            out = out.view(*h.shape[:-1], weight.shape[0])
            ctx.low_rank = (lora_slices, lora_scale, lora_dropout)
        lora = save_low_rank(lora_a, lora_b, z, bb, mask)
        term = [] if halves is None else [term_z, term_b, halves[0]]
        ctx.save_for_backward(x, weight, *lora, *term, *([h] if keep_activation else []))
        ctx.n_lora, ctx.n_term = len(lora), len(term)
        ctx.term = None if halves is None else (term_slices, halves[1], halves[2])
        ctx.act, ctx.has_bias = act, bias is not None
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        x, weight, *rest = ctx.saved_tensors
        lora_a, lora_b, z, bb, mask = saved_low_rank(rest[:ctx.n_lora])
        term_z, term_b, term_bt = (rest[ctx.n_lora:ctx.n_lora + 3] if ctx.n_term else (None, None, None))
        kept = rest[ctx.n_lora + ctx.n_term] if len(rest) > ctx.n_lora + ctx.n_term else None
        needs_w, needs_b = ctx.needs_input_grad[1:3]
        needs_la, needs_lb = ctx.needs_input_grad[5:7]
        d2 = dout.reshape(-1, dout.shape[-1])
        dla = dlb = dz = None
        # the down adapters' input gradient goes into the GLU kernel unless dropout masks it
        fold_down = lora_a is not None and mask is None
        if lora_a is None:
            dh = d2 @ weight  # (M, I)
        else:
            lr = LowRank(lora_a, lora_b, *ctx.low_rank)
            dz, dlb = low_rank_backward(d2, lr, z, bb, needs_lb)
            dh = d2 @ weight if fold_down else low_rank_input_grad(d2, weight, dz, lr, mask)
        needs_h = needs_w or (lora_a is not None and needs_la)
        dterm_z = dterm_b = None
        if term_z is not None or fold_down:
            _, zg, zu = ctx.term if term_z is not None else (None, -1, -1)
            dx, h, dterm_z = _glu_term_bwd(dh, x, term_z, term_bt, zg, zu, dz if fold_down else None,
                                           lora_a.to(dz.dtype) if fold_down else None, ctx.act,
                                           needs_h and kept is None)
            h = kept if kept is not None else h
            if term_z is not None and ctx.needs_input_grad[11]:
                dterm_b = grad_b(dx, term_z.reshape(-1, term_z.shape[-1]), ctx.term[0], term_b)
            if term_z is None or not ctx.needs_input_grad[10]:
                dterm_z = None
        elif kept is not None or not needs_h:
            h, dx = kept, _glu_bwd(dh, x, None, ctx.act)
        else:
            dx, h = _glu_bwd_recompute(dh, x, ctx.act)
        dw = None
        if needs_h:
            h2 = h.view(n_rows(h), h.shape[-1])
            dw = d2.t() @ h2 if needs_w else None
            dla = low_rank_grad_a(dz, h2, lr, mask) if lora_a is not None and needs_la else None
        db = d2.sum(0) if ctx.has_bias and needs_b else None
        return (dx.view(x.shape), dw, db, None, None, dla, dlb, None, None, None, dterm_z, dterm_b, None)


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
               low_rank: LowRank | None = None, term: LowRankTerm | None = None) -> torch.Tensor:
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
        term: the adapter term of the projection that made ``x`` (:class:`kernels.low_rank.LowRankTerm`, from
            ``rms_norm_linear(..., defer_low_rank=True)``), added to ``x`` here: inside the GLU kernels when
            each target covers one half of x (PEFT's gate_proj / up_proj), else beforehand in PyTorch.
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
    if term is not None:
        check_low_rank_term(term, x, "glu_linear")
        if not use_triton(x) or term_halves(term, x.shape[-1] // 2, term.z.dtype) is None:
            x, term = add_low_rank_term(x, term), None
    if not use_triton(x):
        h = glu_reference(x, None, act)
        out = F.linear(h, weight, bias)
        return out if low_rank is None else low_rank_reference(h, out, low_rank)
    lr = (None, None, None, 1.0, 0.0) if low_rank is None else (
        low_rank.a, low_rank.b, tuple(low_rank.slices), float(low_rank.scale), float(low_rank.dropout))
    tm = (None, None, None) if term is None else (term.z, term.b, tuple(term.slices))
    return GLULinearFunction.apply(x, weight, bias, act, bool(keep_activation), *lr, *tm)


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
