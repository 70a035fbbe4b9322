"""Mixture-of-experts MLP: top-k routing, the experts' gated MLPs, the weighted combine; and the load-balancing loss.

Shapes: x (T, H) tokens; router weight (E, H); experts' gate_up (E, 2*I, H) (each expert's gate rows, then its up
rows, as ``nn.Linear`` weights) and down (E, H, I).

Per token (as transformers' Qwen3-MoE / Mixtral blocks compute it): router logits ``x @ Wr.T`` in x's dtype;
probabilities ``softmax`` in fp32 (float64 for float64 inputs); the ``top_k`` largest, renormalised to sum 1 when
``norm_topk``; the token's output ``sum_j p_j * down_e(act(gate_e(x)) * up_e(x))`` over its k experts e_j. Every
token reaches its k experts: no capacity, nothing dropped. The weighted sum is taken in fp32 and rounded to x's
dtype once (transformers' Qwen3-MoE rounds the weights to x's dtype first; Mixtral's keeps them in fp32).

This file holds the PyTorch reference (CPU path and test oracle, float64-capable): tokens are sorted by expert and
each expert's rows run as one matmul; the per-expert row counts are read on the host. The Triton routing,
permutation and grouped-GEMM kernels are not written yet: every device runs this path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._common import compute_dtype

_ACT = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, norm_topk: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(router logits (T, E) in x's dtype, top-k weights (T, k) fp32 (float64 for float64 x), top-k expert ids
    (T, k) int64)."""
    logits = F.linear(x, router_weight)
    probs = torch.softmax(logits, dim=-1, dtype=compute_dtype(x.dtype))
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights, experts


def moe_mlp_reference(x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                      top_k: int, norm_topk: bool, activation: str = "silu"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (T, H) in x's dtype, router logits (T, E)) of the MoE MLP on tokens ``x`` (T, H).

    The (token, expert) pairs are sorted by expert (a stable sort of the flattened top-k ids), each expert's
    contiguous rows go through its gate_up, GLU and down as one matmul each, and the rows, scaled by their
    routing weight in fp32, are summed back per token. Differentiable in x, the router and the experts."""
    t, h = x.shape
    e_count = gate_up.shape[0]
    logits, weights, experts = route(x, router_weight, top_k, norm_topk)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // top_k  # the token each sorted row comes from
    counts = torch.bincount(flat, minlength=e_count).tolist()
    rows = x[token]
    act = _ACT[activation]
    outs = []
    start = 0
    for e, n in enumerate(counts):
        if n:
            g, u = F.linear(rows[start:start + n], gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(act(g) * u, down[e]))
        start += n
    y = torch.cat(outs) if outs else rows.new_zeros(0, h)
    scaled = y.to(weights.dtype) * weights.reshape(-1)[order, None]
    out = torch.zeros(t, h, dtype=weights.dtype, device=x.device).index_add_(0, token, scaled)
    return out.to(x.dtype), logits


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss over the sparse layers, as transformers' ``load_balancing_loss_func``
    without an attention mask: ``E * sum_e f_e * P_e``, with f_e the share of (token, layer) top-k picks that go to
    expert e and P_e its mean routing probability, both over every token of every layer. Gradients flow through the
    probabilities. ``router_logits``: one (T, E) tensor per sparse layer."""
    counts = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    prob_sum = torch.zeros_like(counts)
    rows = 0
    for logits in router_logits:
        probs = torch.softmax(logits, dim=-1)
        picks = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        counts = counts.index_add(0, picks, torch.ones_like(picks, dtype=counts.dtype))
        prob_sum = prob_sum + probs.float().sum(dim=0)
        rows += logits.shape[0]
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


__all__ = ["route", "moe_mlp_reference", "load_balancing_loss"]
