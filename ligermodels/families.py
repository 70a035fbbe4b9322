"""Model families: each is a reading of its Hugging Face ``config.json`` into a :class:`DecoderConfig`
(plus a checkpoint key map in ``checkpoints_tools.keymap``). The model code is shared.

Every HF config field that changes the math is either honoured or refused with an error naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ligermodels.config import DecoderConfig
from ligermodels.model import CausalLM
from ligermodels.rope import RopeConfig

# HF activation names -> ours. Gemma maps its legacy "gelu" to the tanh approximation (as HF does).
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                "gelu": "gelu"}


class UnsupportedConfigError(ValueError):
    """A config.json field has a value this library does not implement (the message names it)."""


def _refuse_unless(d: dict, key: str, ok: Callable[[object], bool], what: str, model_type: str) -> None:
    if key in d and d[key] is not None and not ok(d[key]):
        raise UnsupportedConfigError(f"{model_type}: config field {key}={d[key]!r} is not supported ({what})")


def _activation(d: dict, model_type: str, gelu_means_tanh: bool = False) -> str:
    name = d.get("hidden_activation") or d.get("hidden_act") or "silu"
    if gelu_means_tanh and name == "gelu":
        name = "gelu_pytorch_tanh"
    if name not in _ACTIVATIONS:
        raise UnsupportedConfigError(f"{model_type}: config field hidden_act={name!r} is not supported; "
                                     f"supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _head_dim(d: dict) -> int:
    return d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]


def _padding_idx(d: dict) -> int | None:
    """HF builds the embedding with ``padding_idx=pad_token_id`` (its row gets no gradient); out-of-range ids
    (some configs carry one past the vocabulary) are refused there too, so they are dropped here."""
    pad = d.get("pad_token_id")
    return pad if isinstance(pad, int) and 0 <= pad < d["vocab_size"] else None


#: What each family's transformers config class (v5) uses for a field that config.json omits. Applied
#: before reading (an explicit ``null`` in config.json is kept: transformers treats it differently, e.g.
#: num_key_value_heads null means num_attention_heads), so a sparse config.json means the same model here
#: as in transformers. rope_theta is 10000 and rms_norm_eps 1e-6 unless listed (RopeConfig / below).
HF_DEFAULTS: dict[str, dict[str, object]] = {
    "llama": dict(rms_norm_eps=1e-6, max_position_embeddings=2048, tie_word_embeddings=False, hidden_act="silu",
                  attention_bias=False, mlp_bias=False, rope_theta=10000.0),
    "qwen2": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
                  num_key_value_heads=32, use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                  rope_theta=10000.0),
    "mistral": dict(rms_norm_eps=1e-6, max_position_embeddings=131072, tie_word_embeddings=False,
                    hidden_act="silu", num_key_value_heads=8, sliding_window=4096, rope_theta=10000.0),
    "phi3": dict(rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False, hidden_act="silu",
                 sliding_window=None, pad_token_id=32000, rope_theta=10000.0),
    "gemma": dict(rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=True,
                  hidden_act="gelu_pytorch_tanh", num_key_value_heads=16, head_dim=256, attention_bias=False,
                  pad_token_id=0, rope_theta=10000.0),
    "qwen3": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
                  num_key_value_heads=32, head_dim=128, attention_bias=False, use_sliding_window=False,
                  sliding_window=4096, max_window_layers=28, rope_theta=10000.0),
    "gemma2": dict(rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=True,
                   hidden_activation="gelu_pytorch_tanh", num_key_value_heads=4, head_dim=256, attention_bias=False,
                   pad_token_id=0, query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0, rope_theta=10000.0),
    "qwen3_moe": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
                      num_key_value_heads=4, attention_bias=False, use_sliding_window=False, decoder_sparse_step=1,
                      moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128, norm_topk_prob=False,
                      output_router_logits=False, router_aux_loss_coef=0.001, mlp_only_layers=[],
                      rope_theta=10000.0),
    "mixtral": dict(rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False, hidden_act="silu",
                    num_key_value_heads=8, sliding_window=None, num_experts_per_tok=2, num_local_experts=8,
                    output_router_logits=False, router_aux_loss_coef=0.001, router_jitter_noise=0.0,
                    rope_theta=1_000_000.0),
    "gemma3_text": dict(rms_norm_eps=1e-6, max_position_embeddings=131072, tie_word_embeddings=True,
                        hidden_activation="gelu_pytorch_tanh", num_key_value_heads=4, head_dim=256,
                        attention_bias=False, pad_token_id=0, query_pre_attn_scalar=256, sliding_window=4096,
                        final_logit_softcapping=None, attn_logit_softcapping=None, rope_theta=1_000_000.0,
                        rope_local_base_freq=10_000.0),
    "glm4": dict(rms_norm_eps=1.5625e-07, max_position_embeddings=131072, tie_word_embeddings=False,
                 hidden_act="silu", num_key_value_heads=2, head_dim=128, attention_bias=True, pad_token_id=151329,
                 partial_rotary_factor=0.5, rope_theta=10000.0),
}


def _with_defaults(d: dict, model_type: str) -> dict:
    """``d`` with the family's transformers defaults filled in for the fields it omits (see HF_DEFAULTS);
    the size fields have no default anyone should rely on and are required."""
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in d]
    if missing:
        raise UnsupportedConfigError(f"{model_type}: config.json lacks required field(s) {missing}")
    return {**HF_DEFAULTS[model_type], **d}


def _refuse_partial_rotary(d: dict, model_type: str) -> None:
    """Partial rotary embeddings are refused wherever config.json puts the factor: top level (old layout)
    or inside ``rope_parameters`` / ``rope_scaling`` (transformers v5 layout), which HF honours equally."""
    _refuse_unless(d, "partial_rotary_factor", lambda v: float(v) == 1.0, "rotary on part of the head", model_type)
    for key in ("rope_parameters", "rope_scaling"):
        params = d.get(key)
        if not isinstance(params, dict):
            continue
        nested = [p for p in params.values() if isinstance(p, dict)]  # nested by layer type
        for p in [params, *nested]:
            v = p.get("partial_rotary_factor")
            if v is not None and float(v) != 1.0:
                raise UnsupportedConfigError(f"{model_type}: config field {key}.partial_rotary_factor={v!r} is not "
                                             "supported (rotary on part of the head)")


def _base(d: dict, model_type: str, partial_rotary: bool = False, **overrides) -> DecoderConfig:
    """Fields every family shares, read the way transformers reads them.

    ``d`` already holds the family's defaults (:meth:`Family.read_config` fills them in and keeps the
    original dict as ``hf_config``). ``partial_rotary``: the family's transformers code rotates only the first
    ``head_dim * partial_rotary_factor`` channels (read into the RopeConfig); otherwise the factor is refused.
    A ``rope`` override replaces the one read from ``d``.
    """
    _refuse_unless(d, "use_bidirectional_attention", lambda v: not v, "only causal attention", model_type)
    if not partial_rotary:
        _refuse_partial_rotary(d, model_type)
    head_dim = _head_dim(d)
    try:
        rope = overrides.pop("rope") if "rope" in overrides else RopeConfig.from_hf(
            {**d, "model_type": model_type, "head_dim": head_dim})
        fields = dict(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"], num_heads=d["num_attention_heads"],
            num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"], head_dim=head_dim,
            norm_eps=d.get("rms_norm_eps", 1e-6), activation=_activation(d, model_type),
            rope=rope,
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_dropout=float(d.get("attention_dropout") or 0.0),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            pad_token_id=_padding_idx(d), model_type=model_type,
        )
        fields.update(overrides)
        return DecoderConfig(**fields)
    except ValueError as e:  # e.g. num_attention_heads not a multiple of (the default) num_key_value_heads
        if isinstance(e, UnsupportedConfigError):
            raise
        raise UnsupportedConfigError(f"{model_type}: config.json describes no valid model: {e}") from e


def llama_config(d: dict) -> DecoderConfig:
    """Llama 2 / 3 / 3.1 / 3.2: attention_bias (q/k/v and o), mlp_bias, rope scaling, head_dim, tying."""
    bias = bool(d["attention_bias"])
    return _base(d, "llama", qkv_bias=bias, o_bias=bias, mlp_bias=bool(d["mlp_bias"]))


def _windows(d: dict, model_type: str, window: int | None, default_types: list[str]) -> tuple[int | None, ...]:
    """Per-layer windows from ``layer_types`` (else ``default_types``): ``window`` on "sliding_attention" layers."""
    types = d.get("layer_types") or default_types
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if bad:
        raise UnsupportedConfigError(f"{model_type}: config field layer_types holds unsupported {bad}")
    if len(types) != d["num_hidden_layers"]:
        raise UnsupportedConfigError(f"{model_type}: config field layer_types has {len(types)} entries for "
                                     f"num_hidden_layers={d['num_hidden_layers']}")
    if window is None and "sliding_attention" in types:  # transformers refuses this config too
        raise UnsupportedConfigError(f"{model_type}: config field layer_types marks sliding_attention layers, but "
                                     "there is no window (use_sliding_window false or sliding_window null)")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _qwen_windows(d: dict, model_type: str) -> tuple[int | None, tuple[int | None, ...]]:
    """Qwen2 / Qwen3: the window (when use_sliding_window) on layers >= max_window_layers, or as layer_types says."""
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    default = ["sliding_attention" if window is not None and i >= d["max_window_layers"] else "full_attention"
               for i in range(d["num_hidden_layers"])]
    return window, _windows(d, model_type, window, default)


def qwen2_config(d: dict) -> DecoderConfig:
    """Qwen2 / Qwen2.5: q/k/v bias, optional sliding window on the layers HF marks "sliding_attention"."""
    window, windows = _qwen_windows(d, "qwen2")
    return _base(d, "qwen2", qkv_bias=True, sliding_window=window, layer_windows=windows)


def qwen3_config(d: dict) -> DecoderConfig:
    """Qwen3: RMSNorm over each q and k head before RoPE, attention_bias (q/k/v and o, default off), explicit
    head_dim, sliding windows as Qwen2."""
    window, windows = _qwen_windows(d, "qwen3")
    bias = bool(d["attention_bias"])
    return _base(d, "qwen3", qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_window=window, layer_windows=windows)


def mistral_config(d: dict) -> DecoderConfig:
    """Mistral: sliding window on every layer (or none), explicit head_dim."""
    return _base(d, "mistral", sliding_window=d.get("sliding_window"))


def _moe_fields(d: dict, num_experts: int, dense: tuple[int, ...]) -> dict:
    """The DecoderConfig fields of a mixture-of-experts config.json (``num_experts`` read by the caller)."""
    return dict(num_experts=int(num_experts), experts_per_token=int(d["num_experts_per_tok"]),
                moe_intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]),
                dense_layers=dense, output_router_logits=bool(d["output_router_logits"]),
                router_aux_loss_coef=float(d["router_aux_loss_coef"]))


def qwen3_moe_config(d: dict) -> DecoderConfig:
    """Qwen3-MoE: Qwen3's attention; a mixture-of-experts MLP on the layers where ``decoder_sparse_step`` divides
    the layer number (from 1) and ``mlp_only_layers`` does not list it, the dense MLP elsewhere; top-k weights
    renormalised when ``norm_topk_prob``. ``num_experts`` (``num_local_experts`` as transformers 5 writes it)."""
    _refuse_unless(d, "use_sliding_window", lambda v: not v, "sliding windows in a MoE model", "qwen3_moe")
    n, step = d.get("num_local_experts") or d["num_experts"], int(d["decoder_sparse_step"])
    only = set(d["mlp_only_layers"] or [])
    dense = tuple(i for i in range(d["num_hidden_layers"]) if i in only or n == 0 or (i + 1) % step)
    bias = bool(d["attention_bias"])
    return _base(d, "qwen3_moe", qkv_bias=bias, o_bias=bias, qk_norm=True, norm_topk_prob=bool(d["norm_topk_prob"]),
                 **_moe_fields(d, n, dense))


def mixtral_config(d: dict) -> DecoderConfig:
    """Mixtral: Mistral's attention (an optional window on every layer), a mixture-of-experts MLP on every layer
    (``num_local_experts``, top-k weights always renormalised). Router jitter noise is refused."""
    _refuse_unless(d, "router_jitter_noise", lambda v: float(v) == 0.0, "router jitter noise", "mixtral")
    return _base(d, "mixtral", sliding_window=d.get("sliding_window"), norm_topk_prob=True,
                 **_moe_fields(d, d["num_local_experts"], ()))


def phi3_config(d: dict) -> DecoderConfig:
    """Phi-3 / Phi-4-mini: fused qkv_proj / gate_up_proj in the checkpoint, longrope scaling, optional sliding
    window, partial rotary (``partial_rotary_factor``, top level or in rope_parameters)."""
    for key in ("resid_pdrop", "embd_pdrop"):
        _refuse_unless(d, key, lambda v: float(v) == 0.0, "dropout on residuals/embeddings", "phi3")
    return _base(d, "phi3", partial_rotary=True, sliding_window=d.get("sliding_window"))


def gemma_config(d: dict) -> DecoderConfig:
    """Gemma: GeGLU (tanh), norms scaled by (1 + weight) in fp32, sqrt(hidden) embedding scale, tied head."""
    return _base(d, "gemma", activation=_activation(d, "gemma", gelu_means_tanh=True), norm_offset=1.0,
                 norm_casting="gemma", embed_scale=math.sqrt(d["hidden_size"]),
                 qkv_bias=bool(d["attention_bias"]), o_bias=bool(d["attention_bias"]))


def _gemma_common(d: dict, model_type: str) -> dict:
    """What Gemma 2 and Gemma 3 share: Gemma's norms, GeGLU and embedding scale, sandwich norms, the attention
    scale ``query_pre_attn_scalar ** -0.5``, final-logit soft-capping, and windows from ``layer_types``."""
    window = d.get("sliding_window")
    return dict(activation=_activation(d, model_type, gelu_means_tanh=True), norm_offset=1.0, norm_casting="gemma",
                embed_scale=math.sqrt(d["hidden_size"]), qkv_bias=bool(d["attention_bias"]),
                o_bias=bool(d["attention_bias"]), post_norms=True,
                attn_scale=float(d["query_pre_attn_scalar"]) ** -0.5,
                final_softcap=None if d.get("final_logit_softcapping") is None
                else float(d["final_logit_softcapping"]), sliding_window=window)


def gemma2_config(d: dict) -> DecoderConfig:
    """Gemma 2: Gemma's numerics plus sandwich norms, attention-logit and final-logit soft-capping,
    query_pre_attn_scalar as the attention scale, sliding window on alternate layers (even ones by default)."""
    common = _gemma_common(d, "gemma2")
    default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(d["num_hidden_layers"])]
    cap = d.get("attn_logit_softcapping")
    return _base(d, "gemma2", **common, layer_windows=_windows(d, "gemma2", common["sliding_window"], default),
                 attn_softcap=None if cap is None else float(cap))


def _gemma3_ropes(d: dict, head_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """Gemma 3's two rotary tables, (full-attention layers, sliding layers), read as transformers does:
    ``rope_parameters`` nested by layer type, or the old ``rope_theta`` (+ ``rope_scaling``, full layers
    only) and ``rope_local_base_freq``."""
    params = d.get("rope_parameters")
    nested = isinstance(params, dict) and bool(params) and all(
        isinstance(v, dict) or v is None for v in params.values())
    full = dict((params.get("full_attention") if nested else params) or {})
    local = dict((params.get("sliding_attention") or {}) if nested else {})
    if d.get("rope_scaling"):
        full.update(d["rope_scaling"])
    full.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", d.get("rope_local_base_freq", 10_000.0))
    base = {k: v for k, v in d.items() if k not in ("rope_scaling", "rope_parameters", "rope_theta")}
    base.update(model_type="gemma3_text", head_dim=head_dim)
    return (RopeConfig.from_hf({**base, "rope_parameters": full}),
            RopeConfig.from_hf({**base, "rope_parameters": local}))


def gemma3_config(d: dict) -> DecoderConfig:
    """Gemma 3 (text): Gemma 2's sandwich norms, Gemma-rounded (1 + w) q/k head norms, a local rotary table
    (``rope_local_base_freq``) on sliding layers and the global one (``rope_theta`` with its scaling) on full
    layers, windows from ``layer_types`` (5 sliding : 1 full by default), no attention soft-capping (transformers
    reads attn_logit_softcapping but never applies it)."""
    common = _gemma_common(d, "gemma3_text")
    pattern = int(d.get("sliding_window_pattern") or 6)
    default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(d["num_hidden_layers"])]
    rope, local = _gemma3_ropes(d, _head_dim(d))
    return _base(d, "gemma3_text", **common, qk_norm=True, rope=rope, local_rope=local,
                 layer_windows=_windows(d, "gemma3_text", common["sliding_window"], default))


def glm4_config(d: dict) -> DecoderConfig:
    """GLM-4: partial rotary (``partial_rotary_factor``, 0.5 by default) on interleaved pairs, norms after the
    attention and the MLP too, q/k/v bias (``attention_bias``), fused gate_up_proj in the checkpoint."""
    return _base(d, "glm4", partial_rotary=True, rope_interleaved=True, post_norms=True,
                 qkv_bias=bool(d["attention_bias"]))


# ------------------------------------------------------------------------------ family classes
class LigerLlama(CausalLM):
    """Llama 2, 3, 3.1, 3.2 (``model_type`` "llama")."""

    model_type = "llama"


class LigerQwen2(CausalLM):
    """Qwen2 and Qwen2.5 (``model_type`` "qwen2")."""

    model_type = "qwen2"


class LigerMistral(CausalLM):
    """Mistral (``model_type`` "mistral")."""

    model_type = "mistral"


class LigerPhi3(CausalLM):
    """Phi-3 (``model_type`` "phi3")."""

    model_type = "phi3"


class LigerGemma(CausalLM):
    """Gemma (``model_type`` "gemma")."""

    model_type = "gemma"


class LigerQwen3(CausalLM):
    """Qwen3 (``model_type`` "qwen3")."""

    model_type = "qwen3"


class LigerGemma2(CausalLM):
    """Gemma 2 (``model_type`` "gemma2")."""

    model_type = "gemma2"


class LigerGemma3(CausalLM):
    """Gemma 3 text model (``model_type`` "gemma3_text")."""

    model_type = "gemma3_text"


class LigerQwen3Moe(CausalLM):
    """Qwen3-MoE (``model_type`` "qwen3_moe")."""

    model_type = "qwen3_moe"


class LigerMixtral(CausalLM):
    """Mixtral (``model_type`` "mixtral")."""

    model_type = "mixtral"


class LigerGlm4(CausalLM):
    """GLM-4 (``model_type`` "glm4")."""

    model_type = "glm4"


@dataclass(frozen=True)
class Family:
    """A family: how to read its config.json, its model class, and the name of its checkpoint key map."""

    model_type: str
    reader: Callable[[dict], DecoderConfig]  # reads a config.json dict that holds the family's defaults
    cls: type[CausalLM]
    keymap: str = "standard"
    #: Multimodal checkpoints: the ``model_type`` of the language model in ``text_config`` (read as that
    #: family; the model saves back as a text-only checkpoint of it), and a regex of the checkpoint tensors
    #: that belong to other towers and are skipped on load (named in a warning).
    text_family: str | None = None
    skipped: str | None = None
    #: text_config fields the multimodal model's transformers code overrides (or ignores), as (name, value).
    text_overrides: tuple[tuple[str, object], ...] = ()

    def read_config(self, d: dict) -> DecoderConfig:
        """The DecoderConfig of an HF config.json dict: the fields it omits take the family's transformers
        defaults (HF_DEFAULTS), and the dict as given is kept as ``hf_config`` (written back by save_hf).
        A multimodal family reads its ``text_config`` as ``text_family`` and keeps that as ``hf_config``."""
        if self.text_family is not None:
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise UnsupportedConfigError(f"{self.model_type}: config.json lacks a text_config object")
            inner = {**text, "model_type": self.text_family, "architectures": [_ARCH[self.text_family]],
                     **dict(self.text_overrides)}
            if "tie_word_embeddings" in d:  # the outer config's decides, in transformers
                inner["tie_word_embeddings"] = d["tie_word_embeddings"]
            for key in _CARRIED_TOKEN_IDS:
                if key in d and key not in text:
                    inner[key] = d[key]
            return FAMILIES[self.text_family].read_config(inner)
        return self.reader(_with_defaults(d, self.model_type)).replace(hf_config=dict(d))


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", llama_config, LigerLlama),
    "qwen2": Family("qwen2", qwen2_config, LigerQwen2),
    "mistral": Family("mistral", mistral_config, LigerMistral),
    "phi3": Family("phi3", phi3_config, LigerPhi3, keymap="phi3"),
    "gemma": Family("gemma", gemma_config, LigerGemma),
    "qwen3": Family("qwen3", qwen3_config, LigerQwen3, keymap="qwen3"),
    "gemma2": Family("gemma2", gemma2_config, LigerGemma2, keymap="gemma2"),
    "gemma3_text": Family("gemma3_text", gemma3_config, LigerGemma3, keymap="gemma3"),
    # Gemma 3 image-text checkpoints: the language model loads (saved back as gemma3_text); the SigLIP vision
    # tower and the projector are skipped.
    "gemma3": Family("gemma3", gemma3_config, LigerGemma3, keymap="gemma3_multimodal", text_family="gemma3_text",
                     skipped=r"^(model\.)?(vision_tower|multi_modal_projector)\.",
                     # Gemma3ForConditionalGeneration never soft-caps its logits (Gemma3ForCausalLM does)
                     text_overrides=(("final_logit_softcapping", None),)),
    "glm4": Family("glm4", glm4_config, LigerGlm4, keymap="glm4"),
    "qwen3_moe": Family("qwen3_moe", qwen3_moe_config, LigerQwen3Moe, keymap="qwen3_moe"),
    "mixtral": Family("mixtral", mixtral_config, LigerMixtral, keymap="mixtral"),
}


def family_of(model_type: str | None) -> Family:
    """The family for an HF ``model_type``; a clear error listing the supported ones otherwise."""
    if model_type not in FAMILIES:
        raise UnsupportedConfigError(f"model_type {model_type!r} is not supported; supported model types: "
                                     f"{', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def config_from_hf(d: dict) -> DecoderConfig:
    """Read an HF config.json dict into a DecoderConfig, picking the family from ``model_type``."""
    return family_of(d.get("model_type")).read_config(d)


#: config.json fields that do not change the model's math and are carried over from ``hf_config`` when a
#: changed config is written from its fields (token ids are kept only while inside the vocabulary).
_CARRIED_TOKEN_IDS = ("bos_token_id", "eos_token_id")


def config_to_hf(config: DecoderConfig) -> dict:
    """An HF config.json dict that describes ``config``; ``read_config(config_to_hf(c)) == c`` always.

    The original ``hf_config`` (kept verbatim, with HF-only fields such as token ids and rope details) is
    returned only while reading it back still gives ``config``: a config changed with ``replace`` (fewer
    layers, tied head, ...) keeps the dict it was read from, and writing that stale dict would describe
    another model. Otherwise -- and for models built from scratch -- the fields the family's transformers
    config reads are written from the config, plus the bos/eos token ids of ``hf_config``.
    """
    family = family_of(config.model_type)
    if config.hf_config:
        try:
            if family.read_config(config.hf_config) == config:
                return dict(config.hf_config)
        except ValueError:  # the stored dict is not readable any more: build from the fields
            pass
    c = config
    act = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}[c.activation]
    d = {
        "model_type": c.model_type, "architectures": [_ARCH[c.model_type]],
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.norm_eps, "hidden_act": act,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_embeddings,
        "attention_dropout": c.attention_dropout, "pad_token_id": c.pad_token_id, **c.rope.to_hf(),
    }
    layer_types = ["full_attention" if w is None else "sliding_attention" for w in c.layer_windows]
    if c.num_experts:
        d.update(num_experts_per_tok=c.experts_per_token, moe_intermediate_size=c.moe_intermediate_size,
                 output_router_logits=c.output_router_logits, router_aux_loss_coef=c.router_aux_loss_coef)
    if c.model_type == "qwen3_moe":
        d.update(num_experts=c.num_experts, norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1,
                 mlp_only_layers=list(c.dense_layers), use_sliding_window=False)
    if c.model_type == "mixtral":
        d.update(num_local_experts=c.num_experts, sliding_window=c.sliding_window)
        del d["moe_intermediate_size"]  # Mixtral's experts are intermediate_size wide
    if c.model_type in ("llama", "gemma", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "glm4"):
        d["attention_bias"] = c.qkv_bias
    if c.model_type == "llama":
        d["mlp_bias"] = c.mlp_bias
    if c.model_type in ("mistral", "phi3"):
        d["sliding_window"] = c.sliding_window
    if c.model_type in ("qwen2", "qwen3"):
        d["use_sliding_window"] = c.sliding_window is not None
        d["sliding_window"] = c.sliding_window
        d["layer_types"] = layer_types
    if c.model_type == "glm4":  # its transformers config defaults the factor to 0.5: always written
        d["partial_rotary_factor"] = c.rope.partial_rotary_factor
    if c.model_type in ("gemma2", "gemma3_text"):
        del d["hidden_act"]
        d["hidden_activation"] = act
        d["sliding_window"] = c.sliding_window
        d["layer_types"] = layer_types
        d["query_pre_attn_scalar"] = _pre_attn_scalar(c)
        d["final_logit_softcapping"] = c.final_softcap
        d["attn_logit_softcapping"] = c.attn_softcap
    if c.model_type == "gemma3_text":  # v5 layout: one rope dict per layer type
        for key in ("rope_theta", "rope_scaling", "original_max_position_embeddings"):
            d.pop(key, None)
        d["rope_parameters"] = {"full_attention": _rope_parameters(c.rope),
                                "sliding_attention": _rope_parameters(c.local_rope or c.rope)}
    for key in _CARRIED_TOKEN_IDS:
        tok = c.hf_config.get(key)
        if isinstance(tok, int) and 0 <= tok < c.vocab_size or (
                isinstance(tok, list) and all(isinstance(t, int) and 0 <= t < c.vocab_size for t in tok)):
            d[key] = tok
    if family.read_config(d) != c:
        raise UnsupportedConfigError(f"this config cannot be written as an HF {c.model_type!r} config.json "
                                     f"(it differs from what that family can express): {c}")
    return d


def _pre_attn_scalar(c: DecoderConfig) -> float | int:
    """Gemma's query_pre_attn_scalar q for the config's attention scale (q ** -0.5), an int when it is one."""
    if c.attn_scale is None:
        return c.head_dim
    q = c.attn_scale ** -2
    return round(q) if abs(q - round(q)) <= 1e-9 * q and round(q) ** -0.5 == c.attn_scale else q


def _rope_parameters(r: RopeConfig) -> dict:
    """One v5 ``rope_parameters`` dict (rope_type, rope_theta and the type's scaling fields) of ``r``."""
    out = r.to_hf()
    params = dict(out["rope_scaling"] or {"rope_type": "default"})
    params["rope_theta"] = r.theta
    return params


_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
         "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "glm4": "Glm4ForCausalLM",
         "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


class AutoLigerModel:
    """Picks the family class from ``config.json``'s ``model_type``: ``AutoLigerModel.from_hf(path)``."""

    @staticmethod
    def from_hf(repo_or_dir: str, dtype=None, device=None, revision: str | None = None,
                quantize: str | None = None) -> CausalLM:
        """Load any supported checkpoint; the class (LigerLlama, LigerQwen2, ...) comes from its model_type."""
        from ligermodels.hf_io import load_hf  # (hf_io imports this module)

        return load_hf(repo_or_dir, dtype=dtype, device=device, revision=revision, quantize=quantize)
