"""The building kit: RMSNorm, RotaryEmbedding, Attention, MLP, DecoderLayer.

Each block is a small ``nn.Module`` on the project's kernels (``kernels``). Shapes use
B = batch, S = sequence, H = hidden size, Hq / Hkv = query / key-value heads, D = head_dim,
I = intermediate size.

The residual stream is carried between blocks by ``fused_add_rms_norm``: every block returns its
output *before* the residual add, and the next norm adds it to the stream and normalises it in
one kernel pass, which is the same arithmetic (and rounding) as HF's ``residual + x`` then norm.

Inside a decoder layer each norm feeds one projection, and the two run as
``RMSNorm.project(linear, x, residual)`` (:func:`kernels.rms_norm_linear`): the norm output is
written again in backward instead of being kept, so a layer keeps one copy of the residual stream
per norm, not two. The rotary embedding is applied in place to the q/k/v projection output
(:func:`kernels.apply_rope_qkv_`), so attention saves views of that one buffer, not rotated copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels import (
    apply_qk_norm_rope_qkv_,
    apply_rope_qkv_,
    fp8_linear,
    fused_add_rms_norm,
    glu_linear,
    moe_mlp,
    rms_norm,
    rms_norm_linear,
)
from ligermodels.attention import AttentionMask, causal_attention
from ligermodels.config import DecoderConfig
from ligermodels.rope import RopeConfig, inv_freq, rope_cos_sin

if TYPE_CHECKING:
    from ligermodels.generation import LayerKVCache


def low_rank_of(linear: nn.Module):
    """The LoRA adapters of a projection (``ligermodels.lora.LoRALinear.low_rank()``), or None for a plain one."""
    low_rank = getattr(linear, "low_rank", None)
    return None if low_rank is None else low_rank()


def fp8_of(linear: nn.Module) -> str | None:
    """The FP8 mode of a projection (its ``fp8`` attribute, set by :meth:`CausalLM.use_fp8`), or None (bf16)."""
    return getattr(linear, "fp8", None)


def project(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` (its hooks run), or :func:`kernels.fp8_linear` for a plain projection with an FP8 mode (a LoRA
    projection applies its own, ``LoRALinear.forward``)."""
    mode = fp8_of(linear)
    if mode is None or hasattr(linear, "low_rank"):
        return linear(x)
    return fp8_linear(x, linear.weight, linear.bias, mode)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, optionally fused with the residual add.

    ``forward(x)`` -> normalised x; ``forward(x, residual)`` -> (norm(x + residual), x + residual).
    """

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0, casting: str = "llama"):
        super().__init__()
        self.eps, self.offset, self.casting = eps, offset, casting
        #: ``project`` keeps the norm output for backward instead of writing it again there: set on
        #: the norms of activation-checkpointed layers, whose saved tensors never outlive the layer's backward.
        self.keep_output = False
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # (offset + weight) starts at 1: Gemma-style norms store weight = 0.
        nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(..., H) -> (..., H); with a residual, ((..., H) normalised sum, (..., H) sum)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.offset, self.casting)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, self.offset, self.casting)

    def project(self, linear: nn.Linear, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``linear(self(x, residual))`` without keeping the norm output for backward.

        (..., H) -> (..., N); with a residual, ((..., N) projection, (..., H) new residual stream).
        """
        return rms_norm_linear(x, self.weight, linear.weight, linear.bias, residual, self.eps, self.offset,
                               self.casting, self.keep_output, low_rank_of(linear), fp8_of(linear))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}, casting={self.casting}"


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotary position embedding, from a :class:`RopeConfig`.

    ``forward(position_ids)`` -> (cos, sin), each (S, D) for (S,) positions or (B, S, D) for (B, S)
    positions, in fp32 (the rope kernel computes in fp32; keeping the tables in fp32 is slightly
    more exact than HF's bf16 tables). Length-dependent scalings (dynamic NTK, longrope) pick their
    frequencies from ``max(position_ids) + 1`` on the device, as HF does, without a host sync.
    """

    def __init__(self, rope: RopeConfig):
        super().__init__()
        self.rope = rope
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.attention_scaling = 1.0
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re)compute the static frequencies; called again after a model is materialised from meta."""
        device = self.inv_freq.device if self.inv_freq.device.type != "meta" else None
        freq, self.attention_scaling = inv_freq(self.rope, seq_len=None, device=device)
        self.inv_freq = freq.to(self.inv_freq.device) if device is not None else freq

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freq, scaling = self.inv_freq, self.attention_scaling
        if self.rope.rope_type in ("dynamic", "longrope"):
            # The frequencies depend on max(position_ids) + 1, as in HF; a 0-d tensor: no host sync.
            freq, scaling = inv_freq(self.rope, seq_len=position_ids.max() + 1, device=position_ids.device)
        return rope_cos_sin(freq, scaling, position_ids, torch.float32)


class Attention(nn.Module):
    """Grouped-query causal self-attention with one fused q/k/v projection and rotary embedding.

    (B, S, H) -> (B, S, H). ``forward(x)`` is ``attend(qkv(x))``; a decoder layer calls ``attend``
    on the projection it computed together with its norm. The q/k/v projection output
    (B, S, (Hq + 2*Hkv) * D) gets its q and k heads rotated in place, and is then viewed as
    (B, S, Hq + 2*Hkv, D) and split along heads (views, no copies). With ``config.qk_norm`` each q and k
    head is first normalised (``q_norm`` / ``k_norm``, (D,) weights) in the same in-place pass
    (:func:`kernels.apply_qk_norm_rope_qkv_`). ``config.attn_softcap`` soft-caps the attention logits.
    With a ``cache`` (generation), the new k/v are written into it and attention reads it instead.
    """

    def __init__(self, config: DecoderConfig, window: int | None = None):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.window, self.scale, self.dropout = window, c.attn_scale, c.attention_dropout
        self.softcap, self.interleaved = c.attn_softcap, c.rope_interleaved
        self.qkv = nn.Linear(c.hidden_size, c.q_size + 2 * c.kv_size, bias=c.qkv_bias)
        self.o = nn.Linear(c.q_size, c.hidden_size, bias=c.o_bias)
        norm = dict(eps=c.norm_eps, offset=c.norm_offset, casting=c.norm_casting)
        self.q_norm = RMSNorm(c.head_dim, **norm) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, **norm) if c.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: AttentionMask | None = None, cache: LayerKVCache | None = None) -> torch.Tensor:
        """(B, S, H) normalised input -> (B, S, H)."""
        return self.attend(project(self.qkv, x), cos, sin, mask, cache)

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               mask: AttentionMask | None = None, cache: LayerKVCache | None = None) -> torch.Tensor:
        """(B, S, (Hq + 2*Hkv) * D) q/k/v projection output (rotated in place) -> (B, S, H). With shared prefixes
        (``mask.shared``, :class:`ligermodels.attention.SharedPrefixes`) attention runs on the row of whole
        sequences: q/k/v gathered into it, each token's output taken back from its first occurrence."""
        # reuse_grad: qkv's gradient reaches these ops only as the concatenation of q's, k's and v's (the split
        # below), a buffer nothing else reads, so their backward rotates it back in place.
        if self.q_norm is not None:
            qn, kn = self.q_norm, self.k_norm
            qkv = apply_qk_norm_rope_qkv_(qkv, cos, sin, self.num_heads, self.num_kv_heads, qn.weight, kn.weight,
                                          qn.eps, qn.offset, qn.casting, self.interleaved, reuse_grad=True)
        else:
            qkv = apply_rope_qkv_(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.interleaved, reuse_grad=True)
        shared = None if mask is None else mask.shared
        if shared is not None:
            if cache is not None:
                raise ValueError("attention with shared prefixes takes no KV cache (training rows only)")
            qkv = shared.to_attention(qkv)
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        if cache is not None:  # generation: store k/v in the cache, attend over it
            o = cache.attend(q, k, v, mask, self.window, self.scale, self.softcap)
        else:
            o = causal_attention(q, k, v, mask, self.window, self.scale, self.dropout if self.training else 0.0,
                                 self.softcap)
        o = o.reshape(b, s, self.num_heads * self.head_dim)
        return project(self.o, o if shared is None else shared.from_attention(o))


class MLP(nn.Module):
    """Gated MLP: one fused gate+up projection (H -> 2*I), SwiGLU or GeGLU, down projection (I -> H).

    The GLU and the down projection run as one :func:`kernels.glu_linear`, which does not keep the
    (B, S, I) activation for backward (the backward kernel writes it again). ``forward(x)`` is
    ``glu_down(gate_up(x))``; a decoder layer computes ``gate_up`` together with its norm.
    """

    def __init__(self, config: DecoderConfig):
        super().__init__()
        c = config
        self.activation = c.activation
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        #: ``glu_down`` keeps the (B, S, I) activation for backward instead of writing it again there
        #: (set, like ``RMSNorm.keep_output``, inside activation-checkpointed layers).
        self.keep_activation = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, H) normalised input -> (B, S, H)."""
        return self.glu_down(project(self.gate_up, x))

    def glu_down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(B, S, 2*I) packed gate+up projection output -> (B, S, H)."""
        return glu_linear(gate_up, self.down.weight, self.down.bias, self.activation, self.keep_activation,
                          low_rank_of(self.down), fp8_of(self.down))


class MoE(nn.Module):
    """Mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks ``experts_per_token`` of ``num_experts`` gated
    MLPs per token and their outputs are summed with the routing weights (:mod:`kernels.moe`).

    Parameters: ``router.weight`` (E, H); ``experts_gate_up`` (E, 2*I, H), each expert's gate rows then its up
    rows; ``experts_down`` (E, H, I). ``forward(x)`` (B, S, H) -> (B, S, H) keeps the router logits (B*S, E) of
    the last call in ``router_logits``, for the load-balancing loss (:meth:`CausalLM.router_aux_loss`). LoRA on the
    experts (:func:`ligermodels.lora.add_lora`, target ``experts``) adds each expert's low-rank update to its
    weights before the experts run, as PEFT's ``target_parameters`` does."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        c = config
        if c.mlp_bias:
            raise ValueError("the mixture-of-experts MLP has no biases (mlp_bias)")
        self.activation, self.top_k, self.norm_topk = c.activation, c.experts_per_token, c.norm_topk_prob
        self.router = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size))
        self.experts_down = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, c.moe_intermediate_size))
        # LoRA adapters on the stacked experts (ligermodels.lora.LoRAExperts: ``adapted(weight)``), or None
        self.experts_gate_up_lora: nn.Module | None = None
        self.experts_down_lora: nn.Module | None = None
        self.router_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.experts_gate_up, self.experts_down
        if self.experts_gate_up_lora is not None:
            gate_up = self.experts_gate_up_lora.adapted(gate_up)
        if self.experts_down_lora is not None:
            down = self.experts_down_lora.adapted(down)
        out, self.router_logits = moe_mlp(x.reshape(-1, x.shape[-1]), self.router.weight, gate_up, down, self.top_k,
                                          self.norm_topk, self.activation)
        return out.view(x.shape)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: attention then MLP, each behind an RMSNorm on the residual stream.

    ``forward(x, residual, ...)`` takes the previous block's output ``x`` and the residual stream
    (None for the first layer, where ``x`` is the embedding) and returns (mlp output, residual);
    the caller's next norm adds the two. ``cache`` is this layer's KV cache during generation.
    Each norm runs together with the projection it feeds (:meth:`RMSNorm.project`). With
    ``config.post_norms`` ("sandwich" norms: Gemma 2 / 3, GLM-4) the attention and MLP outputs are
    normalised again (``post_attn_norm``, ``post_mlp_norm``) before they join the residual stream.
    """

    def __init__(self, config: DecoderConfig, layer_idx: int = 0):
        super().__init__()
        c = config
        norm = dict(eps=c.norm_eps, offset=c.norm_offset, casting=c.norm_casting)
        self.attn_norm = RMSNorm(c.hidden_size, **norm)
        self.attn = Attention(c, window=c.layer_windows[layer_idx])
        self.mlp_norm = RMSNorm(c.hidden_size, **norm)
        self.mlp = MoE(c) if c.sparse_layer(layer_idx) else MLP(c)
        self.post_attn_norm = RMSNorm(c.hidden_size, **norm) if c.post_norms else None
        self.post_mlp_norm = RMSNorm(c.hidden_size, **norm) if c.post_norms else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                mask: AttentionMask | None = None, cache: LayerKVCache | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # first layer: x is the embedding and starts the residual stream
            residual, qkv = x, self.attn_norm.project(self.attn.qkv, x)
        else:
            qkv, residual = self.attn_norm.project(self.attn.qkv, x, residual)
        a = self.attn.attend(qkv, cos, sin, mask, cache)
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        if isinstance(self.mlp, MoE):
            h, residual = self.mlp_norm(a, residual)
            out = self.mlp(h)
        else:
            gate_up, residual = self.mlp_norm.project(self.mlp.gate_up, a, residual)
            out = self.mlp.glu_down(gate_up)
        if self.post_mlp_norm is not None:
            out = self.post_mlp_norm(out)
        return out, residual


def init_linear_(module: nn.Module, std: float) -> None:
    """Normal(0, std) weights and zero biases for every Linear/Embedding; norms to their identity."""
    for m in module.modules():
        if isinstance(m, MoE):
            nn.init.normal_(m.experts_gate_up, std=std)
            nn.init.normal_(m.experts_down, std=std)
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
            if getattr(m, "padding_idx", None) is not None:  # as HF: the padding row starts at zero
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif isinstance(m, (RMSNorm, RotaryEmbedding)):
            m.reset_parameters()


__all__ = ["RMSNorm", "RotaryEmbedding", "Attention", "MLP", "MoE", "DecoderLayer", "AttentionMask"]
