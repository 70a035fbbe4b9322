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
"""

from __future__ import annotations

import torch

from kernels.cross_entropy import fused_linear_cross_entropy


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
