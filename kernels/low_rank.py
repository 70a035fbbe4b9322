"""Low-rank (LoRA) terms on a projection, several targets sharing one input in one pass.

A projection ``out = x @ W.T + b`` (M rows, K -> N) carries T low-rank adapters, each writing its
own block of output columns ``[s_t, e_t)`` (on a fused q/k/v projection: q, k and v are three such
blocks)::

    u = dropout(x)                       (one keep-mask shared by the T targets; none in eval)
    z = scale * u @ A.T                  A: (T*r, K), the T adapters' A matrices stacked: ONE GEMM
    out[:, s_t:e_t] += z_t @ B_t.T       B: (sum_t (e_t - s_t), r), B_t its rows for target t

(``z_t`` is z's columns ``[t*r, (t+1)*r)``.) The T products ``z_t @ B_t.T`` are one GEMM: z times the
block-diagonal (T*r, N) matrix :func:`block_b` holding each ``B_t.T`` in its own rows and output columns,
written first; the projection's own GEMM then accumulates onto it (``out.addmm_(x, W.T)``: cuBLAS reads it
as C, so the adapters cost the output no extra pass however many targets; :func:`low_rank_linear`).
The GEMMs run in the input's dtype for bf16/fp16 (tensor cores, fp32 accumulation; the A and B masters are
cast, as under autocast, so z is rounded to that dtype as PEFT's adapters under a bf16 Trainer round their
output) and in fp32 (fp64) otherwise; the dropout applies to the adapters' input only.
Backward, with ``d = dout``::

    dz  = scale * d @ block_b.T          (M, T*r): every target's d[:, s_t:e_t] @ B_t at once
    dB_t = (z.T @ d)[t*r:(t+1)*r, s_t:e_t].T
    dx  = dropout'(dz @ A) + d @ W       dA = dz.T @ u      (u needs x again: see the callers)

Saved for backward: A, B, z (M x T*r, small), the block matrix (T*r x N, small: built once a step, not
again in backward), the keep-mask when dropping (M x K bool), and
whatever the caller keeps of x. :func:`kernels.rms_norm_linear` and :func:`kernels.glu_linear`
take a :class:`LowRank` and write their input (the norm output, the GLU activation) again in
backward, as they do for the weight gradient, so the adapters keep no (M, K) activation of their
own; :func:`lora_linear` is the same for a plain projection (it keeps x, which dA needs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels._common import LIB
from kernels.fp8 import FP8Recipe, fp8_forward, fp8_input_grad, fp8_linear, fp8_recipe, quantize_rows, weight_grad


class LowRank(NamedTuple):
    """The adapters of one projection (K -> N): see the module docstring."""

    a: torch.Tensor  #: (T*r, K): the T targets' A matrices stacked along dim 0
    b: torch.Tensor  #: (sum of the targets' widths, r): their B matrices stacked along dim 0
    slices: tuple[tuple[int, int], ...]  #: output columns [start, stop) of each target, in A's and B's order
    scale: float  #: alpha / r (alpha / sqrt(r) with rsLoRA)
    dropout: float = 0.0  #: probability of dropping an input element (0 in eval)


def check_low_rank(lr: LowRank, in_features: int, out_features: int, what: str) -> None:
    """ValueError naming ``what`` and the shapes when ``lr`` does not fit a (K=in, N=out) projection."""
    t = len(lr.slices)
    if not t or lr.a.dim() != 2 or lr.b.dim() != 2 or lr.a.shape[0] % t or lr.a.shape[1] != in_features:
        raise ValueError(f"{what}: low-rank A must be ({t} targets * r, {in_features}), got {tuple(lr.a.shape)}")
    r = lr.a.shape[0] // t
    widths = [e - s for s, e in lr.slices]
    if lr.b.shape != (sum(widths), r):
        raise ValueError(f"{what}: low-rank B must be ({sum(widths)}, {r}), got {tuple(lr.b.shape)}")
    ends = [0] + [e for _, e in lr.slices]
    if any(w <= 0 for w in widths) or any(s < prev for (s, _), prev in zip(lr.slices, ends, strict=False)) \
            or ends[-1] > out_features:
        raise ValueError(f"{what}: low-rank slices {lr.slices} must be increasing, disjoint and within "
                         f"[0, {out_features})")
    if not 0.0 <= lr.dropout < 1.0:
        raise ValueError(f"{what}: low-rank dropout must be in [0, 1), got {lr.dropout}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The low-rank GEMMs' dtype for inputs of ``dtype``: bf16 / fp16 themselves, fp64 for fp64, else fp32."""
    return dtype if dtype in (torch.bfloat16, torch.float16, torch.float64) else torch.float32


def dropout_mask(x: torch.Tensor, p: float) -> torch.Tensor | None:
    """Keep-mask (bool, x's shape) of a dropout with probability ``p``; None when ``p`` is 0."""
    if not p:
        return None
    return torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1.0 - p)


def _input(x2: torch.Tensor, mask: torch.Tensor | None, p: float, cd: torch.dtype) -> torch.Tensor:
    """The adapters' input u = dropout(x) in the compute dtype."""
    u = x2.to(cd)
    if mask is not None:
        u = u.masked_fill(~mask.view(u.shape), 0.0).mul_(1.0 / (1.0 - p))
    return u


def _blocks(lr: LowRank):
    """(t, output columns s:e, B's rows) of each target."""
    row = 0
    for t, (s, e) in enumerate(lr.slices):
        yield t, s, e, slice(row, row + e - s)
        row += e - s


def block_b(lr: LowRank, n_out: int, dtype: torch.dtype) -> torch.Tensor:
    """(T*r, N) block-diagonal: target t's ``B_t.T`` in rows [t*r, (t+1)*r) and its output columns
    [s_t, e_t), zeros elsewhere, so ``z @ block_b`` is every target's term in its own columns."""
    r = lr.a.shape[0] // len(lr.slices)
    bb = lr.b.new_zeros((lr.a.shape[0], n_out), dtype=dtype)
    for t, s, e, rows in _blocks(lr):
        bb[t * r:(t + 1) * r, s:e] = lr.b[rows].t()
    return bb


@torch.library.custom_op(f"{LIB}::gemm_accumulate_", mutates_args={"out"})
def gemm_accumulate_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` in place (cuBLAS reads ``out`` as its C operand). One op, so that selective activation
    checkpointing, which keeps the GEMM output ``out`` was, keeps this update with it
    (``ligermodels.train.parallelize.IN_PLACE_OPS``) rather than apply it a second time when it recomputes a layer."""
    out.addmm_(a, b)


@gemm_accumulate_.register_fake
def _(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    return None


def low_rank_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lr: LowRank,
                    mask: torch.Tensor | None, fp8: FP8Recipe | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``F.linear(x2, weight, bias)`` (x2 (M, K), weight (N, K)) plus the low-rank term of x2: returns
    (out (M, N) in x2's dtype, z = scale * dropout(x2) @ A.T (M, T*r) in the compute dtype, and
    :func:`block_b` in that dtype; both for backward, which so builds the block matrix no second time).

    The base GEMM runs last and accumulates onto the low-rank term (``out = z @ block_b (+ bias)``, then
    :func:`gemm_accumulate_` ``(out, x2, W.T)``: the compute-bound GEMM reads out as its C operand), instead of
    adding the term onto the base output afterwards, which read and wrote the (M, N) output once more: Qwen2-7B's
    four projections, batch 4 x 2048, H100: 5.68 ms a layer against 6.22 (5.08 without adapters). With ``fp8`` the
    base GEMM is :mod:`kernels.fp8`'s, on x2 quantised by rows, which takes no C operand: the low-rank GEMM then
    accumulates onto its output."""
    cd = compute_dtype(x2.dtype)
    z = (_input(x2, mask, lr.dropout, cd) @ lr.a.to(cd).t()).mul(lr.scale)
    bb = block_b(lr, weight.shape[0], cd)
    if fp8 is not None:  # the FP8 GEMM takes no C operand: the adapters' term goes onto its output
        out = fp8_forward(*quantize_rows(x2), weight, bias, x2.dtype)
        gemm_accumulate_(out, z, bb)
        return out, z, bb
    out = torch.addmm(bias.to(cd), z, bb) if bias is not None else z @ bb
    gemm_accumulate_(out, x2, weight.t())
    return out, z, bb


def low_rank_backward(d2: torch.Tensor, lr: LowRank, z: torch.Tensor, bb: torch.Tensor, needs_b: bool
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From the output gradient d2 (M, N) and forward's z and block matrix ``bb``: (dz (M, T*r) in the compute
    dtype, for :func:`low_rank_input_grad` and :func:`low_rank_grad_a`; dB in B's dtype, or None)."""
    cd = z.dtype
    r = lr.a.shape[0] // len(lr.slices)
    d2 = d2.to(cd)
    dz = (d2 @ bb.t()).mul_(lr.scale)
    db = None
    if needs_b:
        dbb = z.t() @ d2  # (T*r, N): the blocks on the diagonal are the dB_t.T
        db = torch.cat([dbb[t * r:(t + 1) * r, s:e].t() for t, s, e, _ in _blocks(lr)]).to(lr.b.dtype)
    return dz, db


def low_rank_input_grad(d2: torch.Tensor, weight: torch.Tensor, dz: torch.Tensor, lr: LowRank,
                        mask: torch.Tensor | None, fp8: FP8Recipe | None = None) -> torch.Tensor:
    """dx2 = d2 @ weight + dropout'(dz @ A) (M, K), the base GEMM last, accumulating onto the low-rank part
    (one pass over dx2 fewer, as in :func:`low_rank_linear`); with ``fp8`` the base GEMM is
    :func:`kernels.fp8.fp8_input_grad`, added to the low-rank part."""
    part = dz @ lr.a.to(dz.dtype)
    if mask is not None:
        part.masked_fill_(~mask.view(part.shape), 0.0).mul_(1.0 / (1.0 - lr.dropout))
    if fp8 is not None:
        return part.add_(fp8_input_grad(d2, weight, fp8.grad_dtype))
    return part.addmm_(d2, weight)


def save_low_rank(lora_a: torch.Tensor | None, lora_b: torch.Tensor | None, z: torch.Tensor | None,
                  bb: torch.Tensor | None, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """What a projection's autograd function saves for its adapters: nothing without them, else A, B, z,
    the block matrix and (when dropping) the keep-mask; :func:`saved_low_rank` reads it back."""
    return [] if lora_a is None else [lora_a, lora_b, z, bb] + ([] if mask is None else [mask])


def saved_low_rank(saved: list[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """(A, B, z, block matrix, keep-mask) from :func:`save_low_rank`'s list, None where nothing was saved."""
    return tuple((list(saved) + [None] * 5)[:5])


def low_rank_grad_a(dz: torch.Tensor, x2: torch.Tensor, lr: LowRank, mask: torch.Tensor | None) -> torch.Tensor:
    """dA = dz.T @ dropout(x2), in A's dtype."""
    return (dz.t() @ _input(x2, mask, lr.dropout, dz.dtype)).to(lr.a.dtype)


def low_rank_reference(x: torch.Tensor, out: torch.Tensor, lr: LowRank,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-PyTorch (autograd) ``out`` plus the low-rank term of ``x``, with the keep-``mask`` given (None:
    drawn here when ``lr.dropout`` > 0)."""
    cd = compute_dtype(x.dtype)
    if mask is None:
        mask = dropout_mask(x, lr.dropout)
    u = x.to(cd)
    if mask is not None:
        u = u * mask.view(u.shape) / (1.0 - lr.dropout)
    r = lr.a.shape[0] // len(lr.slices)
    z = F.linear(u, lr.a.to(cd)) * lr.scale
    res = out.clone()
    for t, s, e, rows in _blocks(lr):
        res[..., s:e] = (out[..., s:e].to(cd) + F.linear(z[..., t * r:(t + 1) * r], lr.b[rows].to(cd))).to(out.dtype)
    return res


class LoRALinearFunction(torch.autograd.Function):
    """``forward(x, weight, bias, a, b, slices, scale, dropout)``: ``F.linear(x, weight, bias)`` plus the
    low-rank term; saves x, the weights, z, the block matrix and the keep-mask. No dW when the weight is frozen."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, slices, scale: float, dropout: float, fp8=None):
        lr = LowRank(a, b, slices, scale, dropout)
        x2 = x.reshape(-1, x.shape[-1])
        mask = dropout_mask(x2, dropout)
        out, z, bb = low_rank_linear(x2, weight, bias, lr, mask, fp8)
        ctx.save_for_backward(x, weight, a, b, z, bb, mask)
        ctx.low_rank, ctx.fp8 = (slices, scale, dropout), fp8
        return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, dout):
        x, weight, a, b, z, bb, mask = ctx.saved_tensors
        lr = LowRank(a, b, *ctx.low_rank)
        needs_x, needs_w, needs_bias, needs_a, needs_b = ctx.needs_input_grad[:5]
        d2 = dout.reshape(-1, dout.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        dz, db = low_rank_backward(d2, lr, z, bb, needs_b)
        dx = low_rank_input_grad(d2, weight, dz, lr, mask, ctx.fp8).view(x.shape) if needs_x else None
        dw = weight_grad(d2, x2, ctx.fp8) if needs_w else None
        dbias = d2.sum(0) if needs_bias else None
        da = low_rank_grad_a(dz, x2, lr, mask) if needs_a else None
        return dx, dw, dbias, da, db, None, None, None, None


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                low_rank: LowRank | None = None, fp8: str | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` plus the adapters' term (module docstring); no dW for a frozen weight.

    Args:
        x: (..., K); weight: (N, K); bias: (N,) or None; low_rank: the adapters, or None (plain linear).
        fp8: None, or a mode of :data:`kernels.fp8.FP8_MODES`: the base projection's GEMMs in FP8 (the adapters'
            stay in x's dtype).
    Returns:
        (..., N) in x's dtype.
    """
    recipe = fp8_recipe(fp8, "lora_linear")
    if low_rank is None:
        return F.linear(x, weight, bias) if fp8 is None else fp8_linear(x, weight, bias, fp8)
    check_low_rank(low_rank, weight.shape[1], weight.shape[0], "lora_linear")
    lr = low_rank
    return LoRALinearFunction.apply(x, weight, bias, lr.a, lr.b, tuple(lr.slices), float(lr.scale),
                                    float(lr.dropout), recipe)
