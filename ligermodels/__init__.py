"""ligermodels: decoder LLMs (Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 1-3, GLM-4) built directly on Triton
kernels.

    from ligermodels import LigerQwen2
    model = LigerQwen2.from_hf("Qwen/Qwen2-7B", dtype="bf16", device="cuda")
    loss = model.loss(input_ids, labels)
    out = model.generate(input_ids, max_new_tokens=32)   # static KV cache; see ligermodels.generation

The building kit (``RMSNorm``, ``Attention``, ``MLP``, ``DecoderLayer``, ``CausalLM``, ``DecoderConfig``)
composes custom models from the same kernel blocks. Training: :mod:`ligermodels.train`.
"""

from ligermodels.dependencies import require_runtime_dependencies

require_runtime_dependencies()  # names a missing package before torch or triton is imported

from ligermodels.attention import AttentionMask, Documents, causal_attention
from ligermodels.blocks import MLP, Attention, DecoderLayer, MoE, RMSNorm, RotaryEmbedding
from ligermodels.config import DecoderConfig
from ligermodels.families import (
    FAMILIES,
    AutoLigerModel,
    LigerGemma,
    LigerGemma2,
    LigerGemma3,
    LigerGlm4,
    LigerLlama,
    LigerMistral,
    LigerMixtral,
    LigerPhi3,
    LigerQwen2,
    LigerQwen3,
    LigerQwen3Moe,
    UnsupportedConfigError,
    config_from_hf,
    config_to_hf,
)
from ligermodels.generation import KVCache, generate, sample_next
from ligermodels.model import CausalLM, document_ids_from_positions
from ligermodels.rope import RopeConfig
from ligermodels.tokenizer import load_tokenizer

__all__ = [
    "AttentionMask", "Documents", "causal_attention", "MLP", "MoE", "Attention", "DecoderLayer", "RMSNorm",
    "RotaryEmbedding",
    "DecoderConfig", "CUDAGraphStep", "FAMILIES", "AutoLigerModel", "LigerGemma", "LigerLlama", "LigerMistral",
    "LigerPhi3", "LigerQwen2", "LigerQwen3", "LigerGemma2", "LigerGemma3", "LigerGlm4",
    "LigerQwen3Moe", "LigerMixtral",
    "UnsupportedConfigError", "config_from_hf", "config_to_hf", "CausalLM",
    "document_ids_from_positions", "RopeConfig", "KVCache", "generate", "sample_next", "load_tokenizer",
]


def __getattr__(name: str):
    """``ligermodels.CUDAGraphStep``, imported on first use: it lives with the trainer (ligermodels.train), which
    ``import ligermodels`` does not load."""
    if name == "CUDAGraphStep":
        from ligermodels.train.cuda_graph import CUDAGraphStep

        return CUDAGraphStep
    raise AttributeError(f"module 'ligermodels' has no attribute {name!r}")
