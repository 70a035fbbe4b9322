"""One dataclass describes every decoder in the zoo.

A model family (Llama, Qwen2, ...) is this config filled from the family's Hugging Face
``config.json`` plus a checkpoint key map (``checkpoints_tools.keymap``); the model code is shared.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ligermodels.rope import RopeConfig

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
NORM_CASTINGS = ("llama", "gemma")


@dataclass
class DecoderConfig:
    """Shapes and numerics of a pre-norm decoder-only transformer.

    Attributes:
        vocab_size, hidden_size, intermediate_size, num_layers: the usual sizes.
        num_heads, num_kv_heads, head_dim: query heads, key/value heads (grouped-query attention when
            fewer), and the per-head size (need not be hidden_size // num_heads).
        norm_eps, norm_offset, norm_casting: RMSNorm computes ``x * rsqrt(mean(x^2) + eps) * (offset + w)``;
            casting "llama" or "gemma" picks HF's rounding order (see ``kernels.rms_norm``).
        activation: "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU) on the gate of the MLP.
        qkv_bias, o_bias, mlp_bias: biases on the fused q/k/v projection, output projection, MLP projections.
        rope: rotary embedding parameters (theta and scaling).
        sliding_window: attention window in tokens (a query sees keys with q - k < window), or None.
        layer_windows: per-layer window (None = full attention); derived from ``sliding_window`` when omitted.
        tie_embeddings: the output head shares the input embedding's weight.
        embed_scale: multiply embeddings by this (rounded to the compute dtype, as HF Gemma does), or None.
        attn_scale: softmax scale; None means head_dim ** -0.5.
        attention_dropout: dropout on attention probabilities in training mode.
        qk_norm: RMSNorm over each query and key head (weights ``attn.q_norm`` / ``attn.k_norm``, (D,)), with the
            config's eps / offset / casting, before the rotary embedding (Qwen3, Gemma 3).
        post_norms: "sandwich" norms: an RMSNorm on the attention output and on the MLP output before each is
            added to the residual stream (``post_attn_norm`` / ``post_mlp_norm``; Gemma 2 / 3, GLM-4).
        attn_softcap: attention logits become ``cap * tanh(scores / cap)`` before the mask and softmax, or None.
        final_softcap: output logits (``forward`` and the loss) become ``cap * tanh(logits / cap)``, or None.
        rope_interleaved: rotary pairs are interleaved channels (2i, 2i + 1) (GPT-J / GLM) instead of
            rotate-half (i, i + R/2). Partial rotary is ``rope.partial_rotary_factor``.
        local_rope: rotary parameters of the layers with a window (Gemma 3's sliding layers); None means ``rope``
            on every layer.
        num_experts: experts of each sparse layer's mixture-of-experts MLP (:class:`ligermodels.blocks.MoE`); 0 for
            a dense model.
        experts_per_token: experts each token is routed to (top-k).
        moe_intermediate_size: each expert's intermediate size (default ``intermediate_size``).
        norm_topk_prob: the top-k routing weights are renormalised to sum to 1.
        dense_layers: layers with the dense MLP (of ``intermediate_size``) in a mixture-of-experts model.
        output_router_logits: :meth:`CausalLM.loss` adds ``router_aux_loss_coef`` times the load-balancing loss,
            as transformers does when its config says so.
        router_aux_loss_coef: weight of that loss.
        max_position_embeddings: longest sequence the checkpoint was trained for.
        pad_token_id: the embedding's padding row, as HF's ``nn.Embedding(padding_idx=pad_token_id)``:
            it receives no gradient (and starts at zero when training from scratch); None for none.
        model_type: the HF ``model_type`` this config was read from (used when saving back).
        hf_config: the original HF config dict, kept so ``save_hf`` can write it back unchanged. It is
            written only while it still describes this config (``config_to_hf``): after ``replace`` changes a
            field, config.json is built from the fields instead.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    norm_eps: float = 1e-6
    norm_offset: float = 0.0
    norm_casting: str = "llama"
    activation: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope: RopeConfig | None = None
    sliding_window: int | None = None
    layer_windows: tuple[int | None, ...] | None = None
    tie_embeddings: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None
    attention_dropout: float = 0.0
    max_position_embeddings: int = 4096
    pad_token_id: int | None = None
    qk_norm: bool = False
    post_norms: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    rope_interleaved: bool = False
    local_rope: RopeConfig | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.0
    model_type: str = "llama"
    hf_config: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}; "
                                 "give head_dim explicitly")
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not supported; choose one of {ACTIVATIONS}")
        if self.norm_casting not in NORM_CASTINGS:
            raise ValueError(f"norm_casting {self.norm_casting!r} is not supported; choose one of {NORM_CASTINGS}")
        if self.rope is None:
            self.rope = RopeConfig(head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings)
        if self.rope.head_dim != self.head_dim:  # cos/sin are built for the rope's head_dim
            raise ValueError(f"rope.head_dim {self.rope.head_dim} != head_dim {self.head_dim}: give "
                             f"RopeConfig(head_dim={self.head_dim}, ...)")
        if self.local_rope is not None and self.local_rope.head_dim != self.head_dim:
            raise ValueError(f"local_rope.head_dim {self.local_rope.head_dim} != head_dim {self.head_dim}")
        for name in ("attn_softcap", "final_softcap"):
            cap = getattr(self, name)
            if cap is not None and not cap > 0:
                raise ValueError(f"{name} must be > 0 or None, got {cap}")
        self.dense_layers = tuple(self.dense_layers)
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ValueError(f"experts_per_token {self.experts_per_token} must be in 1..num_experts "
                                 f"({self.num_experts})")
            if self.moe_intermediate_size is None:
                self.moe_intermediate_size = self.intermediate_size
            if any(not 0 <= i < self.num_layers for i in self.dense_layers):
                raise ValueError(f"dense_layers {self.dense_layers} name layers outside 0..{self.num_layers - 1}")
        if self.layer_windows is None:
            self.layer_windows = (self.sliding_window,) * self.num_layers
        self.layer_windows = tuple(self.layer_windows)
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")

    @property
    def q_size(self) -> int:
        """Width of the query projection, Hq * D."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection, Hkv * D."""
        return self.num_kv_heads * self.head_dim

    def sparse_layer(self, i: int) -> bool:
        """Whether layer ``i`` has the mixture-of-experts MLP."""
        return self.num_experts > 0 and i not in self.dense_layers

    @property
    def fused_part_sizes(self) -> dict[str, list[int]]:
        """Rows of each part of the fused projections, as the checkpoint key maps split them: ``attn.qkv``
        [q, k, v], ``mlp.gate_up`` [gate, up]; the experts' stacked weights, rows of (E * 2I, H) and (E * H, I):
        ``mlp.experts_gate_up`` [gate, up] per expert, ``mlp.experts_down`` [down] per expert."""
        sizes = {"attn.qkv": [self.q_size, self.kv_size, self.kv_size],
                 "mlp.gate_up": [self.intermediate_size, self.intermediate_size]}
        if self.num_experts:
            sizes["mlp.experts_gate_up"] = [self.moe_intermediate_size] * (2 * self.num_experts)
            sizes["mlp.experts_down"] = [self.hidden_size] * self.num_experts
        return sizes

    def replace(self, **changes) -> DecoderConfig:
        """A copy with some fields changed (derived fields recomputed unless given)."""
        if "num_layers" in changes and "layer_windows" not in changes:
            changes["layer_windows"] = None
        return dataclasses.replace(self, **changes)

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        """Parameter count (the output head counted once when tied); ``active``: a token's, counting the
        ``experts_per_token`` experts it reaches in each sparse layer rather than all of them."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) * self.qkv_bias + h * self.o_bias
        mlp = 3 * h * i + (2 * i + h) * self.mlp_bias
        experts = self.experts_per_token if active else self.num_experts
        moe = self.num_experts * h + experts * 3 * h * (self.moe_intermediate_size or 0)
        per_layer = attn + 2 * h + 2 * h * self.post_norms + 2 * self.head_dim * self.qk_norm
        sparse = sum(self.sparse_layer(j) for j in range(self.num_layers))
        n = self.num_layers * per_layer + (self.num_layers - sparse) * mlp + sparse * moe + h
        if include_embedding:
            n += self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return n
