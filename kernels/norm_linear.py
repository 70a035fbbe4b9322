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

LoRA adapters on the projection (``low_rank``, :mod:`kernels.low_rank`) ride along: their stacked A
reads the same y in forward, and in backward the y written again for dW also gives dA (when the base
weight is frozen, y is written again for dA alone); the adapters keep only their small (M, T*r)
product, their block matrix and, when dropping, their keep-mask. A weight that needs no gradient
(frozen) gets no dW GEMM; frozen and without adapters, y is not written again at all.

Numbers are those of ``linear(rms_norm(...))`` exactly: the same kernels produce ``y`` both times
and the GEMMs are the ones autograd's linear would run. The kernels live in :mod:`kernels.rms_norm`;
this module only composes them with the two GEMMs in one ``autograd.Function``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._common import use_triton
from kernels.fp8 import fp8_forward, fp8_recipe, input_grad, weight_grad
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
from kernels.rms_norm import (
    _casting_code,
    _check,
    _fused_add_rms_norm_fwd,
    _fused_add_rms_norm_fwd_fp8,
    _rms_norm_bwd,
    _rms_norm_fwd,
    _rms_norm_fwd_fp8,
    fused_add_rms_norm_reference,
    rms_norm_reference,
)


class RMSNormLinearFunction(torch.autograd.Function):
    """``forward(x, residual, norm_weight, weight, bias, eps, offset, casting, keep_output, lora_a, lora_b,
    lora_slices, lora_scale, lora_dropout, fp8)`` -> (out, h); ``fp8``: None, or a :class:`kernels.fp8.FP8Recipe`.

    ``residual`` may be None (first layer: h is x itself and only ``out`` is returned). Saves h,
    the two weights and the per-row rstd; the norm output y too when ``keep_output`` (else backward
    writes it again, only when a weight gradient needs it). With low-rank adapters (``lora_a`` not None,
    :mod:`kernels.low_rank`), the same y feeds W and the stacked A in forward and, written again once,
    dW and dA in backward; the adapters keep only z (M x T*r), their (T*r x N) block matrix and their
    dropout keep-mask. A frozen ``weight`` (no gradient asked) gets no dW GEMM.
    """

    @staticmethod
    def forward(ctx, x, residual, norm_weight, weight, bias, eps: float, offset: float, casting: int,
                keep_output: bool = False, lora_a=None, lora_b=None, lora_slices=None, lora_scale: float = 1.0,
                lora_dropout: float = 0.0, fp8=None):
        z = bb = mask = None
        ctx.fp8 = fp8
        if fp8 is not None and lora_a is None:  # the norm kernel writes y in FP8 with its row scales
            if residual is None:
                (yq, ys, rstd), h = _rms_norm_fwd_fp8(x, norm_weight, eps, offset, casting), x
            else:
                yq, ys, h, rstd = _fused_add_rms_norm_fwd_fp8(x, residual, norm_weight, eps, offset, casting)
            out2, keep_output = fp8_forward(yq, ys, weight, bias, x.dtype), False
        else:
            if residual is None:
                (y, rstd), h = _rms_norm_fwd(x, norm_weight, eps, offset, casting), x
            else:
                y, h, rstd = _fused_add_rms_norm_fwd(x, residual, norm_weight, eps, offset, casting)
            y2 = y.reshape(-1, y.shape[-1])
            if lora_a is None:
                out2 = F.linear(y2, weight, bias)
            else:
                lr = LowRank(lora_a, lora_b, lora_slices, lora_scale, lora_dropout)
                mask = dropout_mask(y2, lora_dropout)
                out2, z, bb = low_rank_linear(y2, weight, bias, lr, mask, fp8)
                ctx.low_rank = (lora_slices, lora_scale, lora_dropout)
        # A 2-D GEMM, then an untracked reshape: the output must not be a view (the rotary
        # embedding rotates the q/k/v projection output in place, which autograd forbids on views).
        out = torch.ops.aten._unsafe_view(out2, (*x.shape[:-1], weight.shape[0]))
        lora = save_low_rank(lora_a, lora_b, z, bb, mask)
        ctx.save_for_backward(h, norm_weight, weight, rstd, *lora, *([y] if keep_output else []))
        ctx.n_lora = len(lora)
        ctx.norm = (eps, offset, casting)
        ctx.has_residual = residual is not None
        if residual is None:
            return out
        if not torch.compiler.is_compiling():  # as FusedAddRMSNormFunction: an unused h gets no zeros
            ctx.set_materialize_grads(False)
        return out, h

    @staticmethod
    def backward(ctx, dout: torch.Tensor | None, dh: torch.Tensor | None = None):
        h, norm_weight, weight, rstd, *rest = ctx.saved_tensors
        lora_a, lora_b, z, bb, mask = saved_low_rank(rest[:ctx.n_lora])
        kept = rest[ctx.n_lora] if len(rest) > ctx.n_lora else None
        eps, offset, casting = ctx.norm
        needs_w, needs_b = ctx.needs_input_grad[3:5]
        needs_la, needs_lb = ctx.needs_input_grad[9:11]
        if dout is None:  # only h was used downstream: the projection contributes nothing
            return (dh, dh) + (None,) * 13
        d2 = dout.reshape(-1, dout.shape[-1])
        dw = dla = dlb = None
        if lora_a is None:
            dy = input_grad(d2, weight, ctx.fp8).view(*dout.shape[:-1], weight.shape[1])
        else:
            lr = LowRank(lora_a, lora_b, *ctx.low_rank)
            dz, dlb = low_rank_backward(d2, lr, z, bb, needs_lb)
            dy = low_rank_input_grad(d2, weight, dz, lr, mask, ctx.fp8).view(*dout.shape[:-1], weight.shape[1])
        if needs_w or (lora_a is not None and needs_la):
            # the norm output: kept from forward, or written again
            y = kept if kept is not None else _rms_norm_fwd(h, norm_weight, eps, offset, casting)[0]
            y2 = y.reshape(-1, y.shape[-1])
            dw = weight_grad(d2, y2, ctx.fp8) if needs_w else None
            dla = low_rank_grad_a(dz, y2, lr, mask) if lora_a is not None and needs_la else None
            del y, y2
        db = d2.sum(0) if needs_b else None
        del kept
        dx, dnw = _rms_norm_bwd(dy, dy if dh is None else dh, h, norm_weight, rstd, offset, dh is not None)
        return (dx, (dx if ctx.has_residual else None), dnw, dw, db, None, None, None, None, dla, dlb,
                None, None, None, None)


def rms_norm_linear_reference(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                              eps: float = 1e-6, offset: float = 0.0, casting: str = "llama",
                              low_rank: LowRank | None = None):
    """Pure-PyTorch ``linear(rms_norm(x [+ residual]))`` (+ the new residual stream when one is given),
    plus the adapters' term of the norm output when ``low_rank`` is given (:func:`low_rank_reference`)."""
    if residual is None:
        y, h = rms_norm_reference(x, norm_weight, eps, offset, casting), None
    else:
        y, h = fused_add_rms_norm_reference(x, residual, norm_weight, eps, offset, casting)
    out = F.linear(y, weight, bias)
    if low_rank is not None:
        out = low_rank_reference(y, out, low_rank)
    return out if residual is None else (out, h)


def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None, eps: float = 1e-6, offset: float = 0.0,
                    casting: str = "llama", keep_output: bool = False, low_rank: LowRank | None = None,
                    fp8: str | None = None):
    """``linear(rms_norm(x + residual), weight, bias)`` without keeping the norm output for backward.

    Args:
        x: (..., H); residual: (..., H) like x, or None.
        norm_weight, eps, offset, casting: the norm's, as in :func:`kernels.rms_norm`.
        weight: (N, H) projection; bias: (N,) or None.
        keep_output: keep the (..., H) norm output for backward instead of writing it again there
            (inside an activation-checkpointed layer, where it is kept only through that layer's backward).
        low_rank: LoRA adapters on the projection (:class:`kernels.low_rank.LowRank`), or None: their
            term of the norm output is added (in fp32) to the projection's, with their dropout on their
            input only; backward writes the norm output again once for both dW and dA. A weight or bias
            that needs no gradient (frozen) gets none computed.
        fp8: None (bf16 GEMMs), or a mode of :data:`kernels.fp8.FP8_MODES`: the norm kernel writes its output in
            FP8 with row scales for the forward GEMM, the gradients' GEMMs run in FP8 as the mode says
            (:mod:`kernels.fp8`); ``keep_output`` is then ignored. With ``low_rank`` the norm output is written in
            x's dtype for the adapters and quantised for the base GEMMs by a pass of its own.
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
    if low_rank is not None:
        check_low_rank(low_rank, weight.shape[1], weight.shape[0], "rms_norm_linear")
    recipe = fp8_recipe(fp8, "rms_norm_linear")
    if fp8 is not None and not use_triton(x):  # the norm output materialised, then the same quantised GEMMs
        if residual is None:
            return lora_linear(rms_norm_reference(x, norm_weight, eps, offset, casting), weight, bias, low_rank,
                               fp8)
        y, h = fused_add_rms_norm_reference(x, residual, norm_weight, eps, offset, casting)
        return lora_linear(y, weight, bias, low_rank, fp8), h
    if not use_triton(x):
        return rms_norm_linear_reference(x, norm_weight, weight, bias, residual, eps, offset, casting, low_rank)
    lr = (None, None, None, 1.0, 0.0) if low_rank is None else (
        low_rank.a, low_rank.b, tuple(low_rank.slices), float(low_rank.scale), float(low_rank.dropout))
    return RMSNormLinearFunction.apply(x, residual, norm_weight, weight, bias, float(eps), float(offset), code,
                                       bool(keep_output), *lr, recipe)
