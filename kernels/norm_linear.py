"""RMSNorm followed by the linear projection that reads it, with the norm output recomputed in backward.

In a pre-norm decoder every norm output ``y = rms_norm(x + residual)`` feeds exactly one projection
(q/k/v or gate+up). Autograd would keep ``y`` alive until the backward pass for that projection's
weight gradient, next to ``h = x + residual``, which the norm's own backward needs: two (M, H)
activations per norm. ``rms_norm_linear`` keeps only ``h``; the backward pass writes ``y`` again
from ``h`` with the forward kernel (one read of h and one write of y, M*H*s bytes each way)
right before the weight gradient needs it. At Llama-3.2-1B, batch 8 x 2048 tokens, that is
2 norms x 16 layers x 64 MiB = 2.1 GB less activation memory for about 1.5 ms more per step.

Forward:   (y, h) = fused_add_rms_norm(x, residual, w_norm);   out = y @ W.T (+ b)
Backward:  y = rms_norm(h, w_norm) again;  dW = dout.T @ y;  db = sum(dout);  dy = dout @ W;
           (dx, dw_norm) = the norm's backward with the residual stream's own gradient dh added.

Inside an activation-checkpointed layer the trade is the other way round: nothing the layer saves
outlives its own backward (the checkpoint recomputes the layer's forward first), so writing ``y``
again mostly costs time. ``keep_output=True`` keeps ``y`` for backward instead (set by
``ligermodels.train.apply_activation_checkpointing`` on the layers it wraps); the price is that the
recomputed ``y`` then lives through the rest of that one layer's backward, at most two (M, H)
tensors per layer, one layer at a time (0.12 GB at Qwen2-7B, batch 4 x 2048).

Numbers are those of ``linear(rms_norm(...))`` exactly: the same kernels produce ``y`` both times
and the GEMMs are the ones autograd's linear would run. The kernels live in :mod:`kernels.rms_norm`;
this module only composes them with the two GEMMs in one ``autograd.Function``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._common import use_triton
from kernels.rms_norm import (
    _casting_code,
    _check,
    _fused_add_rms_norm_fwd,
    _rms_norm_bwd,
    _rms_norm_fwd,
    fused_add_rms_norm_reference,
    rms_norm_reference,
)


def _linear_backward(dout: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, needs_w: bool, needs_b: bool):
    """(dy, dW, db) of ``out = y @ W.T + b``; dW and db only where autograd asks for them."""
    d2 = dout.reshape(-1, dout.shape[-1])
    dw = d2.t().mm(y.reshape(-1, y.shape[-1])) if needs_w else None
    db = d2.sum(0) if needs_b else None
    return dout.matmul(weight), dw, db


class RMSNormLinearFunction(torch.autograd.Function):
    """``forward(x, residual, norm_weight, weight, bias, eps, offset, casting, keep_output)`` -> (out, h).

    ``residual`` may be None (first layer: h is x itself and only ``out`` is returned). Saves h,
    the two weights and the per-row rstd; the norm output y too when ``keep_output`` (else backward
    writes it again).
    """

    @staticmethod
    def forward(ctx, x, residual, norm_weight, weight, bias, eps: float, offset: float, casting: int,
                keep_output: bool = False):
        if residual is None:
            y, rstd = _rms_norm_fwd(x, norm_weight, eps, offset, casting)
            h = x
        else:
            y, h, rstd = _fused_add_rms_norm_fwd(x, residual, norm_weight, eps, offset, casting)
        # A 2-D GEMM, then an untracked reshape: the output must not be a view (the rotary
        # embedding rotates the q/k/v projection output in place, which autograd forbids on views).
        out = torch.ops.aten._unsafe_view(F.linear(y.reshape(-1, y.shape[-1]), weight, bias),
                                          (*y.shape[:-1], weight.shape[0]))
        ctx.save_for_backward(h, norm_weight, weight, rstd, *([y] if keep_output else []))
        ctx.norm = (eps, offset, casting)
        ctx.has_residual = residual is not None
        if residual is None:
            return out
        if not torch.compiler.is_compiling():  # as FusedAddRMSNormFunction: an unused h gets no zeros
            ctx.set_materialize_grads(False)
        return out, h

    @staticmethod
    def backward(ctx, dout: torch.Tensor | None, dh: torch.Tensor | None = None):
        h, norm_weight, weight, rstd, *kept = ctx.saved_tensors
        eps, offset, casting = ctx.norm
        needs_w, needs_b = ctx.needs_input_grad[3:5]
        if dout is None:  # only h was used downstream: the projection contributes nothing
            return dh, dh, None, None, None, None, None, None, None
        # the norm output: kept from forward, or written again
        y = kept[0] if kept else _rms_norm_fwd(h, norm_weight, eps, offset, casting)[0]
        dy, dw, db = _linear_backward(dout, y, weight, needs_w, needs_b)
        del y, kept
        dx, dnw = _rms_norm_bwd(dy, dy if dh is None else dh, h, norm_weight, rstd, offset, dh is not None)
        return dx, (dx if ctx.has_residual else None), dnw, dw, db, None, None, None, None


def rms_norm_linear_reference(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                              eps: float = 1e-6, offset: float = 0.0, casting: str = "llama"):
    """Pure-PyTorch ``linear(rms_norm(x [+ residual]))`` (+ the new residual stream when one is given)."""
    if residual is None:
        return F.linear(rms_norm_reference(x, norm_weight, eps, offset, casting), weight, bias)
    y, h = fused_add_rms_norm_reference(x, residual, norm_weight, eps, offset, casting)
    return F.linear(y, weight, bias), h


def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None, eps: float = 1e-6, offset: float = 0.0,
                    casting: str = "llama", keep_output: bool = False):
    """``linear(rms_norm(x + residual), weight, bias)`` without keeping the norm output for backward.

    Args:
        x: (..., H); residual: (..., H) like x, or None.
        norm_weight, eps, offset, casting: the norm's, as in :func:`kernels.rms_norm`.
        weight: (N, H) projection; bias: (N,) or None.
        keep_output: keep the (..., H) norm output for backward instead of writing it again there
            (inside an activation-checkpointed layer, where it is kept only through that layer's backward).
    Returns:
        (..., N) projection output; with a residual, ``(out, h)`` where h = x + residual (..., H) is
        the new residual stream, as :func:`kernels.fused_add_rms_norm` returns it.
    """
    code = _casting_code(casting)
    _check(x, norm_weight, residual)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"rms_norm_linear: weight must be (N, H) with H = x.shape[-1] = {x.shape[-1]}, "
                         f"got {tuple(weight.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"rms_norm_linear: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not use_triton(x):
        return rms_norm_linear_reference(x, norm_weight, weight, bias, residual, eps, offset, casting)
    return RMSNormLinearFunction.apply(x, residual, norm_weight, weight, bias, float(eps), float(offset), code,
                                       bool(keep_output))
