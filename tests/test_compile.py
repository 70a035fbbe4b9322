"""Every kernel op inside torch.compile(fullgraph=True): no graph break, same numbers as eager.

CUDA only: the Triton interpreter cannot run on the fake tensors torch.compile traces with.
"""

import pytest
import torch

from kernels import (
    apply_rope,
    apply_rope_qkv_,
    cross_entropy,
    fused_add_rms_norm,
    fused_linear_cross_entropy,
    geglu,
    glu_linear,
    moe_mlp,
    rms_norm,
    rms_norm_linear,
    swiglu,
)
from tests.utils import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile of Triton ops needs CUDA")


def _r(*shape, dtype=torch.bfloat16, scale=1.0):
    return (scale * torch.randn(*shape, device="cuda", dtype=dtype)).requires_grad_()


CASES = {
    "rms_norm": (lambda x, w: rms_norm(x, w) * 2, lambda: [_r(3, 37, 1000), _r(1000)]),
    "fused_add_rms_norm": (lambda x, r, w: sum(t.float().sum() for t in fused_add_rms_norm(x, r, w, offset=1.0,
                                                                                           casting="gemma")),
                           lambda: [_r(3, 37, 777), _r(3, 37, 777), _r(777)]),
    "apply_rope": (lambda q, k, c, s: apply_rope(q, k, c, s), lambda: [_r(2, 37, 6, 96), _r(2, 37, 2, 96),
                                                                       torch.randn(37, 96, device="cuda"),
                                                                       torch.randn(37, 96, device="cuda")]),
    "apply_rope_qkv_": (lambda x, c, s: apply_rope_qkv_(x * 2, c, s, 6, 2), lambda: [_r(2, 37, 10 * 96),
                                                                                 torch.randn(37, 96, device="cuda"),
                                                                                 torch.randn(37, 96, device="cuda")]),
    "rms_norm_linear": (lambda x, r, nw, w, b: rms_norm_linear(x, nw, w, b, r),
                        lambda: [_r(3, 37, 777), _r(3, 37, 777), _r(777), _r(96, 777), _r(96)]),
    "rms_norm_linear_keep_output": (lambda x, r, nw, w: rms_norm_linear(x, nw, w, None, r, keep_output=True),
                                    lambda: [_r(3, 37, 777), _r(3, 37, 777), _r(777), _r(96, 777)]),
    "swiglu": (lambda x: swiglu(x) + 1, lambda: [_r(5, 2 * 1000)]),
    "geglu": (lambda g, u: geglu(g, u), lambda: [_r(5, 777), _r(5, 777)]),
    "glu_linear": (lambda x, w: glu_linear(x, w, None, "gelu_tanh"), lambda: [_r(5, 2 * 777), _r(96, 777)]),
    "glu_linear_keep_activation": (lambda x, w, b: glu_linear(x, w, b, "silu", keep_activation=True),
                                   lambda: [_r(5, 2 * 777), _r(96, 777), _r(96)]),
    "cross_entropy": (lambda z, t: cross_entropy(z, t, label_smoothing=0.1),
                      lambda: [_r(37, 1000), torch.randint(0, 1000, (37,), device="cuda")]),
    "fused_linear_cross_entropy": (lambda h, w, t: fused_linear_cross_entropy(h, w, t, lse_square_scale=1e-4),
                                   lambda: [_r(37, 64), _r(1000, 64), torch.randint(0, 1000, (37,), device="cuda")]),
    "moe_mlp": (lambda x, r, gu, d: moe_mlp(x, r, gu, d, 2, True),
                lambda: [_r(37, 256), _r(8, 256), _r(8, 2 * 128, 256, scale=0.05), _r(8, 256, 128, scale=0.05)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_op_compiles_without_graph_break_and_matches_eager(name):
    fn, make = CASES[name]
    torch._dynamo.reset()
    inputs = make()
    eager_out = fn(*inputs)
    eager_out = eager_out if isinstance(eager_out, tuple) else (eager_out,)
    eager_grads = torch.autograd.grad([o.float().sum() for o in eager_out], [t for t in inputs if t.requires_grad])
    compiled = torch.compile(fn, fullgraph=True)
    out = compiled(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    grads = torch.autograd.grad([o.float().sum() for o in out], [t for t in inputs if t.requires_grad])
    for a, b in zip(out + grads, eager_out + eager_grads, strict=True):
        assert rel_err(a, b) <= 1e-2


@pytest.mark.parametrize("model_type", ["llama", "gemma", "llama+lora", "llama+qlora", "qwen3", "qwen3_moe",
                                        pytest.param(
    "llama+fp8", marks=pytest.mark.xfail(strict=True, reason="the FP8 norm kernel fails to compile under Inductor "
                                                            "(torch 2.11, H100): ligermodels.train refuses "
                                                            "--fp8 with --compile"))])
def test_whole_model_loss_compiles_without_graph_break_and_matches_eager(model_type):
    """The decoder's loss (attention with its SDPA backend choice, every custom op, the loss head) in one graph;
    "+lora": adapters on all seven projections (inside the fused norm/GLU/linear Functions), their gradients;
    "+fp8": the projections in FP8 (use_fp8("rowwise"): the quantising norm/GLU kernels, torch._scaled_mm);
    "+qlora": the adapters on NF4 projections (kernels.nf4's tensor, dequantised by its custom op)."""
    from ligermodels.families import config_from_hf, family_of
    from ligermodels.hf_io import quantize_model
    from ligermodels.lora import add_lora, lora_modules

    model_type, fp8, nf4 = model_type.split("+")[0], model_type.endswith("+fp8"), model_type.endswith("+qlora")
    lora = nf4 or model_type.endswith("+lora")

    hf = dict(model_type=model_type, vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
              rms_norm_eps=1e-6, tie_word_embeddings=model_type == "gemma",
              hidden_act="gelu_pytorch_tanh" if model_type == "gemma" else "silu")
    if model_type == "qwen3_moe":
        # every token to every expert: a top-k pick flipped by bf16 rounding between the two graphs would move a
        # token's output and gradients far past the bound (flips moved the embedding gradient by 6e-2 on an H200)
        hf.update(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True,
                  output_router_logits=True, router_aux_loss_coef=0.01)
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = family_of(model_type).cls(config_from_hf(hf)).to(torch.bfloat16).init_weights()
        if nf4:
            quantize_model(model)
        if lora:
            add_lora(model, r=16, alpha=32, targets=["q", "k", "v", "o", "gate", "up", "down"])
            for m in lora_modules(model).values():
                torch.nn.init.normal_(m.lora_B, std=0.02)
        if fp8:
            model.use_fp8("rowwise")
    ids = torch.randint(0, 1000, (2, 304), device="cuda")  # 608 tokens: a multiple of 16, as FP8 GEMMs need

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(ids, ids)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.requires_grad]

    eager = loss_and_grads(model.loss)
    compiled = loss_and_grads(torch.compile(model.loss, fullgraph=True))
    # bf16 rounding between the eager and compiled graphs; Qwen3's k-norm weight gradient (a sum over every token
    # and head, rounded to bf16) differed by 1.2e-2 on an H200
    # (FP8: a value rounded otherwise in bf16 may land on the other side of an fp8 rounding boundary)
    bound = 2e-2 if model_type.startswith("qwen3") or fp8 else 1e-2
    for i, (a, b) in enumerate(zip(compiled, eager, strict=True)):
        assert rel_err(a, b) <= bound, f"tensor {i} (0 = loss, then parameter gradients): {rel_err(a, b):.2e}"
