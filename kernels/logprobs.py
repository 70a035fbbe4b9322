"""Log-probabilities of given next tokens under a linear head, per token and summed per sequence, without the
(N, V) logits: what preference objectives (DPO, ORPO, SimPO, KTO) need from a language model.

For hidden states ``h`` (N, H), head ``W`` (V, H) and targets ``y`` (N,)::

    logp[t] = z[t, y[t]] - logsumexp(z[t, :]),   z = h @ W.T (+ b), soft-capped when ``softcap`` is set
    seq[s]  = sum over t with segments[t] == s of weights[t] * logp[t]

``logp`` is minus the per-token loss of :func:`kernels.cross_entropy.fused_linear_cross_entropy` with
``reduction="none"``, so it runs on the same chunked loop: the forward computes each chunk's logits into a reused
buffer and keeps one fp32 log-sum-exp per token; the backward recomputes the chunk's logits and turns the
per-token upstream gradient into ``dh`` and an fp32-accumulated ``dW`` (4 GEMMs of the head in all: the gradient of a
preference loss with respect to a token's log-probability is known only once every sequence of the batch is summed,
so the logits cannot be released with their gradient already taken, as the mean cross-entropy's are).
Extra memory: the chunk buffer, the fp32 (V, H) accumulator and N fp32 lse; never N x V.

The per-sequence sum is an ``index_add`` (its backward a gather), so the upstream gradient of each sequence reaches
each of its tokens exactly. Everything is fp32 from the log-probabilities on, whatever the compute dtype.

:func:`fused_linear_logprob_loss` takes the loss itself, as a function of the per-token log-probabilities that is a
sum over groups of tokens (a preference pair, a KTO example), each group's term depending on that group's tokens
only. Then a chunk of whole groups knows its tokens' gradient as soon as its logits are computed: the loop writes the
chunk's log-probs, asks autograd for the loss's gradient at them (the groups of later chunks hold placeholders,
which the separability keeps out of this chunk's gradient), and turns the logits into their gradient in place:
3 GEMMs of the head, as the mean cross-entropy's, instead of 4. Chunks stay within the logits budget of
:func:`kernels.cross_entropy.flce_chunk_tokens`; a group longer than that, the "vocab" strategy, no gradient, or the
PyTorch fallback take the per-token head and autograd through the loss instead, with the same result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kernels._common import use_triton
from kernels.cross_entropy import (
    _flce_loop,
    _scale_cast,
    check_head_inputs,
    flce_chunk_tokens,
    fused_linear_cross_entropy,
    head_operands,
)


def fused_linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                          bias: torch.Tensor | None = None, ignore_index: int = -100, softcap: float | None = None,
                          strategy: str = "tokens") -> torch.Tensor:
    """fp32 log-probabilities (N,) of ``target`` (N,) under ``hidden @ weight.T (+ bias)``; 0 where the target is
    ``ignore_index``. hidden (N, H), weight (V, H): as :func:`kernels.cross_entropy.fused_linear_cross_entropy`."""
    return -fused_linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index, softcap=softcap,
                                       reduction="none", strategy=strategy)


def sequence_sums(values: torch.Tensor, segments: torch.Tensor, num_segments: int,
                  weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sums (num_segments,) of ``values * weights`` (N,) over the tokens of each segment id in ``segments`` (N,)."""
    if segments.shape != values.shape or (weights is not None and weights.shape != values.shape):
        raise ValueError(f"sequence_sums: values {tuple(values.shape)}, segments {tuple(segments.shape)} and weights "
                         f"{None if weights is None else tuple(weights.shape)} must have one shape")
    v = values if weights is None else values * weights.to(values.dtype)
    return torch.zeros(num_segments, dtype=values.dtype, device=values.device).index_add(0, segments, v)


def fused_linear_sequence_logprobs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                   segments: torch.Tensor, num_segments: int, weights: torch.Tensor | None = None,
                                   bias: torch.Tensor | None = None, ignore_index: int = -100,
                                   softcap: float | None = None, strategy: str = "tokens") -> torch.Tensor:
    """fp32 (num_segments,): each segment's summed ``weights * logp`` (module docstring); ``segments`` (N,) int64
    in [0, num_segments), ``weights`` (N,) (e.g. 1 on completion tokens, 0 on the prompt) or None (all 1)."""
    logp = fused_linear_logprobs(hidden, weight, target, bias, ignore_index, softcap, strategy)
    return sequence_sums(logp, segments, num_segments, weights)


def fused_linear_sequence_logprobs_reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                             segments: torch.Tensor, num_segments: int,
                                             weights: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                                             ignore_index: int = -100, softcap: float | None = None
                                             ) -> torch.Tensor:
    """Pure PyTorch, materialising the logits in the inputs' dtype (fp64 inputs: the test oracle)."""
    z = torch.nn.functional.linear(hidden, weight, bias)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    keep = target != ignore_index
    logp = torch.log_softmax(z.double() if z.dtype == torch.float64 else z.float(), dim=-1)
    logp = logp.gather(-1, torch.where(keep, target, 0).unsqueeze(-1)).squeeze(-1) * keep
    return sequence_sums(logp, segments, num_segments, weights)


# ------------------------------------------------------------------------------- a separable loss in the forward
def group_chunks(group_ends: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """Token ranges [start, end) covering [0, group_ends[-1]) in order, each of whole groups (group g spans
    [group_ends[g - 1], group_ends[g])) and at most ``limit`` tokens, unless one group alone is longer."""
    chunks, start, last = [], 0, 0
    for end in group_ends:
        if end - start > limit and last > start:
            chunks.append((start, last))
            start = last
        last = end
    if last > start:
        chunks.append((start, last))
    return chunks


class _LogprobLossFunction(torch.autograd.Function):
    """Forward: the chunk loop with the loss's gradient taken per chunk (module docstring), returning the loss and
    the detached log-probs (N,); backward scales the gradients the forward computed by the upstream one."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, loss_fn, chunks, ignore_index, softcap, want_h, want_w, want_b):
        # the log-probs so far; -1 (a finite log-prob) where a later chunk has not written them yet
        logp = torch.full(target.shape, -1.0, dtype=torch.float32, device=hidden.device)
        value = []  # the loss at the last chunk's call, when every log-prob is written: the loss itself

        def chunk_grad(start: int, end: int, loss: torch.Tensor) -> torch.Tensor:
            torch.neg(loss, out=logp[start:end])
            with torch.enable_grad():
                x = logp.detach().requires_grad_()
                y = _scalar(loss_fn(x))
                (grad,) = torch.autograd.grad(y, x, allow_unused=True)
            value[:] = [y.detach().float()]
            if grad is None:
                return torch.zeros(end - start, dtype=torch.float32, device=logp.device)
            return grad[start:end].neg()  # fp32, contiguous: the gradient of -logp, the loop's per-token loss

        _, _, dh, dw, db = _flce_loop(hidden, weight, bias, target, None, None, ignore_index, 0.0, 0.0, softcap,
                                      want_h, want_w, want_b, chunks=chunks, chunk_grad=chunk_grad)
        ctx.save_for_backward(dh, dw, db)
        ctx.wants = (want_h, want_w, want_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.mark_non_differentiable(logp)
        return value[0], logp

    @staticmethod
    def backward(ctx, grad, _grad_logp):
        g = grad.reshape(())
        out = [_scale_cast(t, g, dtype) if want else None
               for t, want, dtype in zip(ctx.saved_tensors, ctx.wants, ctx.dtypes, strict=True)]
        return (*out, None, None, None, None, None, None, None, None)


def _scalar(value: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        raise ValueError("fused_linear_logprob_loss: loss_fn must return a 0-dim tensor, got "
                         f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}")
    return value


def fused_linear_logprob_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                              loss_fn: Callable[[torch.Tensor], torch.Tensor], group_ends: Sequence[int],
                              bias: torch.Tensor | None = None, ignore_index: int = -100,
                              softcap: float | None = None, strategy: str = "tokens"
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``loss_fn(logp)``, ``logp`` detached) for the log-probabilities ``logp`` (N,) of :func:`fused_linear_logprobs`,
    with the head's gradients taken in the forward (module docstring): 3 GEMMs of the head instead of 4.

    ``loss_fn`` maps fp32 log-probs (N,) to a 0-dim loss that is a sum of terms, one per group of tokens, each
    depending on its own group's tokens only; ``group_ends`` (host ints, increasing, the last N) are the token offsets
    where groups end. A loss that is not separable that way gets wrong gradients. The log-probs come back without
    gradient (for metrics). hidden (N, H), weight (V, H), target (N,), bias (V,) or None, as
    :func:`kernels.cross_entropy.fused_linear_cross_entropy`.
    """
    check_head_inputs("fused_linear_logprob_loss", hidden, weight, bias, target)
    n = target.numel()
    ends = [int(e) for e in group_ends]
    if not ends or ends[-1] != n or any(b < a for a, b in zip([0, *ends], ends, strict=False)):
        raise ValueError(f"fused_linear_logprob_loss: group_ends must increase from 0 and end at the {n} tokens, got "
                         f"{ends[:4]}{'...' if len(ends) > 4 else ''} (last {ends[-1] if ends else None})")
    fused = (strategy == "tokens" and n > 0 and use_triton(hidden) and hidden.dtype != torch.float64
             and torch.is_grad_enabled() and not torch.compiler.is_compiling())
    if fused:
        h2, w, b, t, wants = head_operands("fused_linear_logprob_loss", hidden, weight, bias, target)
        limit = flce_chunk_tokens(w.shape[0], h2.dtype)
        chunks = group_chunks(ends, limit)
        fused = any(wants) and max(e - s for s, e in chunks) <= limit
    if not fused:
        logp = fused_linear_logprobs(hidden, weight, target, bias, ignore_index, softcap, strategy).reshape(-1)
        return _scalar(loss_fn(logp)), logp.detach()
    return _LogprobLossFunction.apply(h2, w, b, t, loss_fn, chunks, ignore_index, float(softcap or 0.0), *wants)
