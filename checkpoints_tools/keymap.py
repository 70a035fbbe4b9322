"""Checkpoint key maps: Hugging Face tensor names <-> native parameter names, as data.

A map is a table from a native name template to the HF name templates it is made of, with
``{i}`` standing for the layer index. A native tensor with several HF parts is their
concatenation along dim 0 in the listed order (q, k, v -> the fused qkv projection; gate, up ->
the fused gate_up projection); a 3-D native tensor (a mixture-of-experts layer's stacked experts) is that
concatenation viewed as (experts, rows, columns). The inverse (native -> HF parts, for saving) is derived from the
same table and the part sizes the caller gives; nothing is written twice.

A map works on names and plain sizes only: the model's config is read by ``ligermodels``, which passes
the part sizes of its fused tensors (:func:`part_sizes`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

_L = "model.layers.{i}"

STANDARD: dict[str, tuple[str, ...]] = {
    "embed.weight": ("model.embed_tokens.weight",),
    "norm.weight": ("model.norm.weight",),
    "head.weight": ("lm_head.weight",),
    "layers.{i}.attn_norm.weight": (f"{_L}.input_layernorm.weight",),
    "layers.{i}.mlp_norm.weight": (f"{_L}.post_attention_layernorm.weight",),
    "layers.{i}.attn.qkv.weight": tuple(f"{_L}.self_attn.{p}_proj.weight" for p in "qkv"),
    "layers.{i}.attn.qkv.bias": tuple(f"{_L}.self_attn.{p}_proj.bias" for p in "qkv"),
    "layers.{i}.attn.o.weight": (f"{_L}.self_attn.o_proj.weight",),
    "layers.{i}.attn.o.bias": (f"{_L}.self_attn.o_proj.bias",),
    "layers.{i}.mlp.gate_up.weight": (f"{_L}.mlp.gate_proj.weight", f"{_L}.mlp.up_proj.weight"),
    "layers.{i}.mlp.gate_up.bias": (f"{_L}.mlp.gate_proj.bias", f"{_L}.mlp.up_proj.bias"),
    "layers.{i}.mlp.down.weight": (f"{_L}.mlp.down_proj.weight",),
    "layers.{i}.mlp.down.bias": (f"{_L}.mlp.down_proj.bias",),
}

# Phi-3 checkpoints store the projections already fused.
PHI3 = {
    **STANDARD,
    "layers.{i}.attn.qkv.weight": (f"{_L}.self_attn.qkv_proj.weight",),
    "layers.{i}.mlp.gate_up.weight": (f"{_L}.mlp.gate_up_proj.weight",),
}

# Qwen3: an RMSNorm over each q and k head.
_QK_NORMS = {
    "layers.{i}.attn.q_norm.weight": (f"{_L}.self_attn.q_norm.weight",),
    "layers.{i}.attn.k_norm.weight": (f"{_L}.self_attn.k_norm.weight",),
}
QWEN3 = {**STANDARD, **_QK_NORMS}

# Gemma 2: "sandwich" norms; the MLP's input norm is pre_feedforward_layernorm, post_attention_layernorm
# normalises the attention output.
GEMMA2 = {
    **STANDARD,
    "layers.{i}.post_attn_norm.weight": (f"{_L}.post_attention_layernorm.weight",),
    "layers.{i}.mlp_norm.weight": (f"{_L}.pre_feedforward_layernorm.weight",),
    "layers.{i}.post_mlp_norm.weight": (f"{_L}.post_feedforward_layernorm.weight",),
}
GEMMA3 = {**GEMMA2, **_QK_NORMS}

# GLM-4: post_attention_layernorm is the MLP's input norm, as in Llama; two more norms on the block outputs;
# gate_up_proj fused as Phi-3's.
GLM4 = {
    **STANDARD,
    "layers.{i}.post_attn_norm.weight": (f"{_L}.post_self_attn_layernorm.weight",),
    "layers.{i}.post_mlp_norm.weight": (f"{_L}.post_mlp_layernorm.weight",),
    "layers.{i}.mlp.gate_up.weight": (f"{_L}.mlp.gate_up_proj.weight",),
}


# Mixture-of-experts layers: the router, and each expert's projections stacked into (E, 2I, H) and (E, H, I)
# tensors; ``{e}`` in a part stands for the expert index, and the parts repeat for every expert in order.
_Q3M = f"{_L}.mlp"
QWEN3_MOE = {
    **QWEN3,
    "layers.{i}.mlp.router.weight": (f"{_Q3M}.gate.weight",),
    "layers.{i}.mlp.experts_gate_up": (f"{_Q3M}.experts.{{e}}.gate_proj.weight",
                                       f"{_Q3M}.experts.{{e}}.up_proj.weight"),
    "layers.{i}.mlp.experts_down": (f"{_Q3M}.experts.{{e}}.down_proj.weight",),
}
_MIX = f"{_L}.block_sparse_moe"
MIXTRAL = {
    **STANDARD,
    "layers.{i}.mlp.router.weight": (f"{_MIX}.gate.weight",),
    "layers.{i}.mlp.experts_gate_up": (f"{_MIX}.experts.{{e}}.w1.weight", f"{_MIX}.experts.{{e}}.w3.weight"),
    "layers.{i}.mlp.experts_down": (f"{_MIX}.experts.{{e}}.w2.weight",),
}


def _prefixed(table: dict[str, tuple[str, ...]], model: str, head: str) -> dict[str, tuple[str, ...]]:
    """``table`` with ``model.`` replaced by ``model`` and ``lm_head.`` by ``head`` (a tower of a larger model)."""
    def rename(name: str) -> str:
        return model + name[len("model."):] if name.startswith("model.") else head + name[len("lm_head."):]

    return {native: tuple(rename(p) for p in parts) for native, parts in table.items()}


# Gemma 3 image-text checkpoints (Gemma3ForConditionalGeneration, as transformers 5 saves them): the language
# model under language_model.*; the vision tower and projector are skipped (the family's ``skipped``).
GEMMA3_MULTIMODAL = _prefixed(GEMMA3, "language_model.model.", "language_model.lm_head.")

KEYMAPS = {"standard": STANDARD, "phi3": PHI3, "qwen3": QWEN3, "gemma2": GEMMA2, "gemma3": GEMMA3, "glm4": GLM4,
           "gemma3_multimodal": GEMMA3_MULTIMODAL, "qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL}

#: The native modules whose weights fuse several HF tensors; the caller gives each one's part sizes along dim 0
#: (``attn.qkv``: [q, k, v] rows; ``mlp.gate_up``: [gate, up] rows).
FUSED_MODULES = ("attn.qkv", "mlp.gate_up", "mlp.experts_gate_up", "mlp.experts_down")

#: HF tensors that carry no parameters (recomputed buffers) and are skipped when present.
IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")


def expand(table: dict[str, tuple[str, ...]], num_layers: int, num_experts: int = 0) -> dict[str, tuple[str, ...]]:
    """Concrete native name -> HF names, with ``{i}`` expanded over the layers and parts holding ``{e}`` repeated
    for each of ``num_experts`` experts (all of an expert's parts, then the next expert's)."""
    out = {}
    for native, parts in table.items():
        layers = range(num_layers) if "{i}" in native else [None]
        experts = range(num_experts) if any("{e}" in p for p in parts) else [None]
        for i in layers:
            out[native.format(i=i)] = tuple(p.format(i=i, e=e) for e in experts for p in parts)
    return out


def part_sizes(native: str, fused: Mapping[str, Sequence[int]], n_parts: int, total: int) -> list[int]:
    """Dim-0 sizes of the HF parts of native tensor ``native`` (of ``total`` rows): the whole tensor when it has
    one part, else ``fused[module]`` for the fused module it belongs to (see :data:`FUSED_MODULES`)."""
    if n_parts == 1:
        return [total]
    for module in FUSED_MODULES:
        if (f".{module}." in native or native.endswith(f".{module}")) and module in fused:
            return list(fused[module])
    raise KeyError(f"no part sizes known for fused tensor {native}")


def native_to_hf(native_names: list[str], num_layers: int, keymap: str, num_experts: int = 0
                 ) -> dict[str, tuple[str, ...]]:
    """For the model's own parameter names, the HF names each is made of (inverse of loading)."""
    table = expand(KEYMAPS[keymap], num_layers, num_experts)
    missing = [n for n in native_names if n not in table]
    if missing:
        raise KeyError(f"no checkpoint key mapping for native parameter(s) {missing[:5]}")
    return {n: table[n] for n in native_names}
