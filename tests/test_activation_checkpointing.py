"""Activation checkpointing modes (``--ac``): the gradients of every mode equal those of no checkpointing, and each
mode runs again in backward exactly the GEMMs it should: "selective" none, "lean" the gate/up projections, "full"
every one. Dense, Qwen3-style (q/k head norms), mixture-of-experts, LoRA (with dropout) and FP8 layers."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ligermodels.config import DecoderConfig
from ligermodels.lora import add_lora, trainable_parameters
from ligermodels.model import CausalLM
from ligermodels.train.parallelize import apply_activation_checkpointing, gate_up_widths, output_width
from tests.utils import DEVICE, assert_triton_runs

DENSE = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_layers=2, num_heads=4, num_kv_heads=2)
MODELS = {
    "dense": DENSE,
    "qwen3": {**DENSE, "qk_norm": True, "qkv_bias": True},
    "moe": {**DENSE, "num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 12, "dense_layers": (1,)},
    "qwen3-1-layer": {**DENSE, "qk_norm": True, "qkv_bias": True, "num_layers": 1},  # FP8 in the interpreter: slow
}
ALL = ["q", "k", "v", "o", "gate", "up", "down"]


class GemmCount(TorchDispatchMode):
    """Counts the GEMMs (and the in-place updates of their outputs) that run, and those of the gate/up width."""

    def __init__(self, widths: frozenset[int]):
        super().__init__()
        self.widths, self.all, self.gate_up = widths, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        width = output_width(func, args)
        if width is not None:
            self.all += 1
            self.gate_up += width in self.widths
        return func(*args, **(kwargs or {}))


def _model(kind: str, mode: str, lora: bool, fp8: bool) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(DecoderConfig(**MODELS[kind])).init_weights(0.2).to(DEVICE)
    if lora:
        experts = kind == "moe"  # the experts' adapters are added to their weights: no dropout there (as PEFT)
        model = add_lora(model, r=2, alpha=4, dropout=0.0 if experts else 0.25, targets=ALL + ["experts"] * experts)
        for p in trainable_parameters(model):  # B starts at zero: give the adapters a term to get wrong
            torch.nn.init.normal_(p, std=0.3)
    if fp8:
        model.use_fp8("rowwise")
    apply_activation_checkpointing(model, mode)
    return model.train()


def _run(kind: str, mode: str, lora: bool = False, fp8: bool = False):
    """(gradients, GEMMs in forward, GEMMs in backward, of which of the gate/up width) of one step."""
    model = _model(kind, mode, lora, fp8)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert_triton_runs(model.embed.weight)  # the kernels' custom ops, not their PyTorch references
    params = trainable_parameters(model) if lora else list(model.parameters())
    widths = gate_up_widths(model.config)
    torch.manual_seed(2)  # the adapters' dropout masks: the same draws in every mode
    with GemmCount(widths) as fwd:
        loss = model.loss(ids, ids)
    with GemmCount(widths) as bwd:
        grads = torch.autograd.grad(loss, params)
    return grads, fwd, bwd


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("kind,lora,fp8", [("dense", False, False), ("dense", True, False), ("qwen3", True, False),
                                           ("moe", False, False), ("moe", True, False), ("qwen3-1-layer", True, True)])
def test_each_checkpointing_mode_gives_the_gradients_of_none_and_recomputes_only_its_gemms(kind, lora, fp8):
    """With FP8 the bias and the adapters' term are added in place onto the FP8 GEMM's output, and the rotary
    embedding rotates it in place: each must be kept with it (recomputing the bias add alone lost the rotation)."""
    ref, fwd, bwd_none = _run(kind, "none", lora, fp8)
    layer_gemms, layer_gate_up = fwd.all, fwd.gate_up
    assert layer_gate_up > 0
    for mode in ("selective", "lean") + ("full",) * (kind == "dense"):  # full's recomputation: the dense case
        grads, _, bwd = _run(kind, mode, lora, fp8)
        for g, r in zip(grads, ref, strict=True):
            assert _rel(g, r) <= 1e-6, (mode, _rel(g, r))
        again = bwd.all - bwd_none.all  # GEMMs of the forward run a second time in backward
        if mode == "selective":
            assert again == 0, mode
        elif mode == "lean":
            assert again == bwd.gate_up - bwd_none.gate_up == layer_gate_up, (again, layer_gate_up)
        else:  # full: every GEMM of the layers (the loss head's, outside them, are not run again)
            assert layer_gate_up < again <= layer_gemms, (again, layer_gemms)


def test_an_unknown_checkpointing_mode_is_refused_by_name():
    model = CausalLM(DecoderConfig(**DENSE))
    with pytest.raises(ValueError, match="none, selective, lean, full, got 'partial'"):
        apply_activation_checkpointing(model, "partial")
