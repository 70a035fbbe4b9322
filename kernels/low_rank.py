"""Low-rank (LoRA) terms on a projection, several targets sharing one input in one pass.

A projection ``out = x @ W.T + b`` (M rows, K -> N) carries T low-rank adapters, each writing its
own block of output columns ``[s_t, e_t)`` (on a fused q/k/v projection: q, k and v are three such
blocks)::

    u = dropout(x)                       (one keep-mask shared by the T targets; none in eval)
    z = scale * u @ A.T                  A: (T*r, K), the T adapters' A matrices stacked: ONE GEMM
    out[:, s_t:e_t] += z_t @ B_t.T       B: (sum_t (e_t - s_t), r), B_t its rows for target t

(``z_t`` is z's columns ``[t*r, (t+1)*r)``.) As PEFT does, the low-rank term is computed in fp32
(fp64 for fp64 inputs) and added to the projection output before it is rounded to its dtype, and
the dropout applies to the adapters' input only. Backward, with ``d = dout``::

    dB_t = d[:, s_t:e_t].T @ z_t         dz_t = scale * d[:, s_t:e_t] @ B_t
    dx  += dropout'(dz @ A)              dA = dz.T @ u      (u needs x again: see the callers)

Saved for backward: A, B, z (M x T*r, small), the keep-mask when dropping (M x K bool), and
whatever the caller keeps of x. :func:`kernels.rms_norm_linear` and :func:`kernels.glu_linear`
take a :class:`LowRank` and write their input (the norm output, the GLU activation) again in
backward, as they do for the weight gradient, so the adapters keep no (M, K) activation of their
own; :func:`lora_linear` is the same for a plain projection (it keeps x, which dA needs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


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
    return torch.float64 if dtype == torch.float64 else torch.float32


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


def low_rank_add_(out2: torch.Tensor, x2: torch.Tensor, lr: LowRank, mask: torch.Tensor | None) -> torch.Tensor:
    """Add the low-rank term of x2 (M, K) to out2 (M, N) in place (each block rounded once to out2's dtype);
    returns z = scale * dropout(x2) @ A.T (M, T*r) in the compute dtype, for backward."""
    cd = compute_dtype(x2.dtype)
    r = lr.a.shape[0] // len(lr.slices)
    z = (_input(x2, mask, lr.dropout, cd) @ lr.a.to(cd).t()).mul_(lr.scale)
    b = lr.b.to(cd)
    for t, s, e, rows in _blocks(lr):
        out2[:, s:e] = torch.addmm(out2[:, s:e].to(cd), z[:, t * r:(t + 1) * r], b[rows].t())
    return z


def low_rank_backward(d2: torch.Tensor, lr: LowRank, z: torch.Tensor, mask: torch.Tensor | None,
                      needs_b: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """From the output gradient d2 (M, N): (the input's gradient (M, K) in the compute dtype, dz (M, T*r)
    for :func:`low_rank_grad_a`, dB in B's dtype or None)."""
    cd = z.dtype
    r = lr.a.shape[0] // len(lr.slices)
    b = lr.b.to(cd)
    dz = torch.empty_like(z)
    db = torch.empty(lr.b.shape, dtype=cd, device=z.device) if needs_b else None
    for t, s, e, rows in _blocks(lr):
        dt = d2[:, s:e].to(cd)
        if needs_b:
            db[rows] = dt.t() @ z[:, t * r:(t + 1) * r]
        dz[:, t * r:(t + 1) * r] = dt @ b[rows]
    dz.mul_(lr.scale)
    dx = dz @ lr.a.to(cd)
    if mask is not None:
        dx = dx.masked_fill_(~mask.view(dx.shape), 0.0).mul_(1.0 / (1.0 - lr.dropout))
    return dx, dz, (None if db is None else db.to(lr.b.dtype))


def low_rank_grad_a(dz: torch.Tensor, x2: torch.Tensor, lr: LowRank, mask: torch.Tensor | None) -> torch.Tensor:
    """dA = dz.T @ dropout(x2), in A's dtype."""
    return (dz.t() @ _input(x2, mask, lr.dropout, dz.dtype)).to(lr.a.dtype)


def add_input_grad(dx: torch.Tensor, dx_low_rank: torch.Tensor) -> torch.Tensor:
    """dx (in the input dtype) + the low-rank part (compute dtype), rounded once to dx's dtype."""
    return dx.to(dx_low_rank.dtype).add_(dx_low_rank.view(dx.shape)).to(dx.dtype)


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
    low-rank term; saves x, the weights, z and the keep-mask. No dW when the weight is frozen."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, slices, scale: float, dropout: float):
        lr = LowRank(a, b, slices, scale, dropout)
        x2 = x.reshape(-1, x.shape[-1])
        out = F.linear(x2, weight, bias)
        mask = dropout_mask(x2, dropout)
        z = low_rank_add_(out, x2, lr, mask)
        ctx.save_for_backward(x, weight, a, b, z, mask)
        ctx.low_rank = (slices, scale, dropout)
        return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, dout):
        x, weight, a, b, z, mask = ctx.saved_tensors
        lr = LowRank(a, b, *ctx.low_rank)
        needs_x, needs_w, needs_bias, needs_a, needs_b = ctx.needs_input_grad[:5]
        d2 = dout.reshape(-1, dout.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        dx_lr, dz, db = low_rank_backward(d2, lr, z, mask, needs_b)
        dx = add_input_grad(d2 @ weight, dx_lr).view(x.shape) if needs_x else None
        dw = d2.t() @ x2 if needs_w else None
        dbias = d2.sum(0) if needs_bias else None
        da = low_rank_grad_a(dz, x2, lr, mask) if needs_a else None
        return dx, dw, dbias, da, db, None, None, None


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                low_rank: LowRank | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` plus the adapters' term (module docstring); no dW for a frozen weight.

    Args:
        x: (..., K); weight: (N, K); bias: (N,) or None; low_rank: the adapters, or None (plain linear).
    Returns:
        (..., N) in x's dtype.
    """
    if low_rank is None:
        return F.linear(x, weight, bias)
    check_low_rank(low_rank, weight.shape[1], weight.shape[0], "lora_linear")
    lr = low_rank
    return LoRALinearFunction.apply(x, weight, bias, lr.a, lr.b, tuple(lr.slices), float(lr.scale),
                                    float(lr.dropout))
