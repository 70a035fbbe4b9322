"""Triton kernels of ligermodels, one op family per module.

Every public op runs its Triton kernels on CUDA tensors, and on CPU tensors runs the pure-PyTorch
reference, or the Triton kernels through the interpreter when ``TRITON_INTERPRET=1``
(see :mod:`kernels._common`). Every op is a ``torch.library`` custom op, so it composes with
``torch.compile`` without graph breaks. Inputs are never modified, except by ``apply_rope_qkv_`` and
``apply_qk_norm_rope_qkv_``, the in-place forms for blocks that own their projection buffer.

- :mod:`kernels.rms_norm`: ``rms_norm``, ``fused_add_rms_norm``
- :mod:`kernels.norm_linear`: ``rms_norm_linear`` (norm + the projection reading it, norm output recomputed)
- :mod:`kernels.rope`: ``apply_rope``, ``apply_rope_qkv_`` (in place on a packed q/k/v projection; partial and
  interleaved rotary), ``apply_qk_norm_rope_qkv_`` (q/k head RMSNorm + RoPE, in place)
- :mod:`kernels.attention`: ``document_attention`` (causal attention within packed documents and a window),
  ``document_bounds``
- :mod:`kernels.decode_attention`: ``decode_attention`` (one query token per row over a key/value cache, split
  over the cache length)
- :mod:`kernels.glu`: ``swiglu``, ``geglu``, ``glu_linear`` (GLU + down projection, activation recomputed)
- :mod:`kernels.fp8`: ``fp8_linear`` (forward and input-gradient GEMMs in FP8 with row scales; ``rms_norm_linear``
  and ``glu_linear`` take ``fp8=`` and write their GEMM input quantised)
- :mod:`kernels.low_rank`: ``LowRank``, ``lora_linear`` (LoRA adapters; ``rms_norm_linear`` and ``glu_linear``
  take a ``LowRank`` too)
- :mod:`kernels.cross_entropy`: ``cross_entropy``, ``fused_linear_cross_entropy``
- :mod:`kernels.logprobs`: ``fused_linear_logprobs``, ``fused_linear_sequence_logprobs`` (next-token
  log-probabilities, per token and summed per sequence, on the chunked cross-entropy loop),
  ``fused_linear_logprob_loss`` (a loss of them that sums per-group terms, its gradient taken in the forward)
- :mod:`kernels.moe`: ``moe_mlp`` (mixture-of-experts MLP: fused routing, permutation, grouped GEMMs, scaled GLU,
  combine), ``moe_mlp_reference``, ``load_balancing_loss``
- :mod:`kernels.adamw`: ``AdamW`` (``torch.optim.AdamW`` with a Triton update kernel; an optimiser, not an op)
"""

from kernels._common import INTERPRET, kernels_found_on_first_read, use_triton

with kernels_found_on_first_read():  # the ops register without reading their kernels' sources (see there)
    from kernels import nf4  # noqa: F401  (not re-exported; its ops register here too)
    from kernels.adamw import AdamW
    from kernels.attention import document_attention, document_bounds
    from kernels.cross_entropy import cross_entropy, fused_linear_cross_entropy
    from kernels.decode_attention import decode_attention
    from kernels.fp8 import fp8_linear
    from kernels.glu import geglu, glu_linear, swiglu
    from kernels.logprobs import fused_linear_logprob_loss, fused_linear_logprobs, fused_linear_sequence_logprobs
    from kernels.low_rank import LowRank, lora_linear
    from kernels.moe import load_balancing_loss, moe_mlp, moe_mlp_reference
    from kernels.norm_linear import rms_norm_linear
    from kernels.rms_norm import fused_add_rms_norm, rms_norm
    from kernels.rope import apply_qk_norm_rope_qkv_, apply_rope, apply_rope_qkv_

__all__ = ["INTERPRET", "use_triton", "rms_norm", "fused_add_rms_norm", "rms_norm_linear", "apply_rope",
           "apply_rope_qkv_", "apply_qk_norm_rope_qkv_", "swiglu", "geglu", "glu_linear", "fp8_linear", "LowRank",
           "lora_linear",
           "cross_entropy", "fused_linear_cross_entropy", "fused_linear_logprobs",
           "fused_linear_sequence_logprobs", "fused_linear_logprob_loss", "AdamW", "document_attention",
           "document_bounds", "decode_attention", "moe_mlp", "moe_mlp_reference", "load_balancing_loss"]
