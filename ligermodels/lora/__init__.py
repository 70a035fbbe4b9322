"""LoRA adapters on the fused projections, saved and loaded in PEFT's format.

``add_lora(model, r, alpha, dropout, targets)`` freezes every parameter of ``model`` (kept in its
dtype, no fp32 copy) and replaces each targeted projection by a :class:`LoRALinear`: the same
weight and bias Parameters (so the native names do not change) plus two fp32 adapter Parameters,
``lora_A`` (T*r, in) and ``lora_B`` (sum of the targets' widths, r). Our projections are fused:
``attn.qkv`` holds q, k, v (stacked along its output), ``mlp.gate_up`` gate then up; an adapter on
q is a LoRA on qkv's output rows ``[0, q_size)``. All targets of one projection share its input,
so their A's are stacked and run as one GEMM (N, H) -> (N, T*r); each B writes its own output slice
(:mod:`kernels.low_rank`). Inside a decoder layer the adapters run inside the fused kernels' autograd
Functions (:func:`kernels.rms_norm_linear` for qkv and gate_up, :func:`kernels.glu_linear` for down),
which write the norm output / GLU activation again in backward for dA as they do for dW, and skip dW
for the frozen base weights.

Targets: ``q, k, v, o, gate, up, down`` (PEFT's ``q_proj`` ... ``down_proj`` accepted), and ``qkv`` /
``gate_up`` (a LoRA on the whole fused projection, as PEFT does on Phi-3's ``qkv_proj`` /
``gate_up_proj``). The math is PEFT's: ``out = base(x) + B(A(dropout(x))) * alpha / r`` (``alpha /
sqrt(r)`` with ``use_rslora``), dropout on the adapters' input only (one keep-mask shared by the targets
of one fused projection, where PEFT draws one per target), the low-rank term in fp32.

Mixture-of-experts blocks take the target ``experts`` (``experts_gate_up``, ``experts_down``): a
:class:`LoRAExperts` per stacked expert weight (E, out, in), PEFT's ``target_parameters`` LoRA on transformers'
stacked experts (``mlp.experts.gate_up_proj`` / ``down_proj``), in its layout: each expert's update ``B_e @ A_e``
is added to its weight before the experts' kernels run (no dropout there, as in PEFT).

``save_lora`` / ``load_lora`` write and read PEFT's ``adapter_config.json`` +
``adapter_model.safetensors`` (keys ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``
...), so ``peft.PeftModel.from_pretrained(hf_model, dir)`` loads what ``save_lora`` wrote and
``load_lora`` reads what PEFT saved; ``merge_lora`` folds the adapters into the base weights (then
``save_hf`` writes a plain checkpoint).
"""

from ligermodels.lora.adapters import (
    EXPERT_TARGETS,
    PEFT_NAMES,
    TARGETS,
    LoRAError,
    LoRAExperts,
    LoRALinear,
    adapters_disabled,
    add_lora,
    expert_lora_modules,
    lora_modules,
    lora_state_dict,
    merge_lora,
    merge_lora_state,
    normalize_targets,
    trainable_parameters,
)
from ligermodels.lora.peft_format import export_lora, load_lora, save_lora

__all__ = ["LoRAError", "LoRALinear", "LoRAExperts", "TARGETS", "EXPERT_TARGETS", "PEFT_NAMES", "add_lora",
           "normalize_targets", "merge_lora", "merge_lora_state", "export_lora", "save_lora", "load_lora",
           "lora_modules", "expert_lora_modules", "lora_state_dict", "trainable_parameters", "adapters_disabled"]
