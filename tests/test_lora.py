"""LoRA on the fused blocks (ligermodels.lora, kernels.low_rank), against float64, the unfused path and peft.

Kernel level: rms_norm_linear / glu_linear / lora_linear with adapters against float64 autograd (forward,
every gradient, frozen weights getting none), dropout on the adapters' input only. Model level: the fused
decoder equals the module-by-module path, the base stays frozen in its dtype, the keep flags give the same
numbers, and frozen projections skip their recomputation. PEFT: save_lora -> PeftModel.from_pretrained
on the transformers model gives our logits and LoRA gradients; a PEFT-saved adapter read by load_lora gives
PEFT's logits; merge_lora + save_hf give PEFT's merged model. Errors name their cause.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kernels import glu_linear, rms_norm_linear, swiglu
from kernels.low_rank import LowRank, lora_linear
from kernels.norm_linear import rms_norm_linear_reference
from ligermodels import MLP, AutoLigerModel, CausalLM, DecoderConfig
from ligermodels.lora import (
    LoRAError,
    LoRALinear,
    add_lora,
    export_lora,
    load_lora,
    lora_modules,
    lora_state_dict,
    merge_lora,
    merge_lora_state,
    save_lora,
    trainable_parameters,
)
from tests.test_models import _batch, make_hf_checkpoint
from tests.utils import DEVICE, assert_triton_runs, randn, rel_err

peft = pytest.importorskip("peft")
ALL = ["q", "k", "v", "o", "gate", "up", "down"]


def _low_rank(k, slices, r, dtype=torch.float32, seed=0, dropout=0.0, scale=1.5):
    a = randn(len(slices) * r, k, dtype=dtype, scale=k ** -0.5, seed=seed).requires_grad_()
    b = randn(sum(e - s for s, e in slices), r, dtype=dtype, scale=0.3, seed=seed + 1).requires_grad_()
    return LowRank(a, b, tuple(slices), scale, dropout)


def _reference64(y, w, bias, lr: LowRank):
    """float64 linear + the adapters' term, autograd."""
    out = F.linear(y, w, bias)
    r = lr.a.shape[0] // len(lr.slices)
    z = F.linear(y, lr.a) * lr.scale
    row, res = 0, out.clone()
    for t, (s, e) in enumerate(lr.slices):
        res[..., s:e] = out[..., s:e] + F.linear(z[..., t * r:(t + 1) * r], lr.b[row:row + e - s])
        row += e - s
    return res


def _d64(*ts):
    return [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in ts]


# ------------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trained"])
def test_rms_norm_linear_low_rank_matches_float64(dtype, frozen):
    """q and v of a fused q/k/v (a gap between them), residual, bias: forward and every gradient."""
    h, q, kv, r = 48, 32, 16, 4
    x = randn(2, 5, h, dtype=dtype, seed=1).requires_grad_()
    res = randn(2, 5, h, dtype=dtype, seed=2).requires_grad_()
    nw = randn(h, dtype=dtype, scale=0.5, seed=3).requires_grad_()
    w = randn(q + 2 * kv, h, dtype=dtype, scale=h ** -0.5, seed=4).requires_grad_(not frozen)
    bias = randn(q + 2 * kv, dtype=dtype, seed=5).requires_grad_(not frozen)
    lr = _low_rank(h, [(0, q), (q + kv, q + 2 * kv)], r, seed=6)
    dout, dh = randn(2, 5, q + 2 * kv, dtype=dtype, seed=8), randn(2, 5, h, dtype=dtype, seed=9)
    assert_triton_runs(x)
    out, hs = rms_norm_linear(x, nw, w, bias, res, low_rank=lr)
    torch.autograd.backward([out, hs], [dout, dh])
    x64, r64, nw64, w64, b64, a64, bb64 = _d64(x, res, nw, w, bias, lr.a, lr.b)
    h64 = x64 + r64
    y64 = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6) * nw64
    out64 = _reference64(y64, w64, b64, lr._replace(a=a64, b=bb64))
    torch.autograd.backward([out64, h64], [dout.double(), dh.double()])
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(out, out64) <= bound and out.dtype == dtype
    for name, t, t64 in [("x", x, x64), ("residual", res, r64), ("norm_weight", nw, nw64), ("A", lr.a, a64),
                         ("B", lr.b, bb64)] + ([] if frozen else [("w", w, w64), ("bias", bias, b64)]):
        assert rel_err(t.grad, t64.grad) <= bound, f"d{name}: {rel_err(t.grad, t64.grad):.2e}"
    assert lr.a.grad.dtype == torch.float32
    if frozen:
        assert w.grad is None and bias.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,i,r,keep", [(4, 24, 3, False), (11, 136, 5, True)])
def test_glu_linear_and_lora_linear_low_rank_match_float64(dtype, rows, i, r, keep):
    """glu_linear with adapters on the down projection, with and without the kept activation (12 / 33 rows,
    I = 24 / 136, ranks 3 / 5), and lora_linear with two targets: forward and every gradient."""
    h = 40
    x = randn(3, rows, 2 * i, dtype=dtype, seed=11).requires_grad_()
    w = randn(h, i, dtype=dtype, scale=i ** -0.5, seed=12)  # frozen
    lr = _low_rank(i, [(0, h)], r, seed=13)
    dout = randn(3, rows, h, dtype=dtype, seed=14)
    assert_triton_runs(x)
    out = glu_linear(x, w, None, "silu", keep_activation=keep, low_rank=lr)
    out.backward(dout)
    x64, w64, a64, b64 = _d64(x, w, lr.a, lr.b)
    g, u = x64.chunk(2, -1)
    out64 = _reference64(F.silu(g) * u, w64, None, lr._replace(a=a64, b=b64))
    out64.backward(dout.double())
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(out, out64) <= bound
    for t, t64 in [(x, x64), (lr.a, a64), (lr.b, b64)]:
        assert rel_err(t.grad, t64.grad) <= bound

    # a plain projection (attn.o), two targets
    xo = randn(3, rows, i, dtype=dtype, seed=15).requires_grad_()
    lr2 = _low_rank(i, [(0, 10), (10, h)], r, seed=16)
    wo = randn(h, i, dtype=dtype, seed=17)
    out = lora_linear(xo, wo, None, lr2)
    out.backward(dout)
    xo64, wo64, a64, b64 = _d64(xo, wo, lr2.a, lr2.b)
    out64 = _reference64(xo64, wo64, None, lr2._replace(a=a64, b=b64))
    out64.backward(dout.double())
    assert rel_err(out, out64) <= bound
    for t, t64 in [(xo, xo64), (lr2.a, a64), (lr2.b, b64)]:
        assert rel_err(t.grad, t64.grad) <= bound


def test_low_rank_dropout_applies_to_the_adapter_input_only():
    """With dropout the fused Function draws the same mask as the PyTorch reference (same seed): same output
    and gradients; the base projection never sees the dropout; p = 0 is the no-dropout result."""
    h, n, r = 32, 24, 4
    x = randn(4, 6, h, seed=21).requires_grad_()
    nw = randn(h, scale=0.5, seed=22)
    w = randn(n, h, scale=h ** -0.5, seed=23)
    lr = _low_rank(h, [(0, 8), (8, n)], r, seed=24, dropout=0.5)
    dout = randn(4, 6, n, seed=25)
    results = []
    for fn in (rms_norm_linear, rms_norm_linear_reference):
        torch.manual_seed(7)
        out = fn(x, nw, w, None, low_rank=lr)
        results.append((out, *torch.autograd.grad(out, [x, lr.a, lr.b], dout)))
    for a, b in zip(*results, strict=True):
        assert rel_err(a, b) <= 1e-5
    no_drop = rms_norm_linear(x, nw, w, None, low_rank=lr._replace(dropout=0.0))
    base = rms_norm_linear(x, nw, w, None)
    zero_b = rms_norm_linear(x, nw, w, None, low_rank=lr._replace(b=torch.zeros_like(lr.b)))
    assert not torch.allclose(results[0][0], no_drop)
    assert torch.equal(zero_b, base)  # dropout touches only the adapters' input


# -------------------------------------------------------------------------------------------- model
def _tiny(dtype=torch.float32, **kw) -> CausalLM:
    cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                        num_kv_heads=2, **kw)
    torch.manual_seed(0)
    return CausalLM(cfg).init_weights(0.1).to(dtype).to(DEVICE)


def _randomize_b(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.2)


def _unfused_hidden(model: CausalLM, ids):
    """The decoder module by module: separate norms, LoRALinear.forward, swiglu then down's forward."""
    from ligermodels.attention import AttentionMask

    x = model.embed(ids)
    cos, sin = model.rotary(torch.arange(ids.shape[1], device=ids.device))
    mask, residual = AttentionMask(ids.shape[1]), None
    for layer in model.layers:
        if residual is None:
            y, residual = layer.attn_norm(x), x
        else:
            y, residual = layer.attn_norm(x, residual)
        a = layer.attn(y, cos, sin, mask)
        y, residual = layer.mlp_norm(a, residual)
        x = layer.mlp.down(swiglu(layer.mlp.gate_up(y)))
    return model.norm(x, residual)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_decoder_equals_unfused_and_base_stays_frozen_in_its_dtype(dtype):
    model = _tiny(dtype, qkv_bias=True)
    add_lora(model, r=4, alpha=8, targets=["q_proj", "v", "o", "gate", "up", "down"], use_rslora=True)
    _randomize_b(model)
    lora = dict(lora_state_dict(model))
    assert set(lora) == {f"layers.{i}.{p}.lora_{ab}" for i in range(2) for p in ("attn.qkv", "attn.o",
                                                                                 "mlp.gate_up", "mlp.down")
                         for ab in "AB"}
    trainable = {id(p) for p in trainable_parameters(model)}
    assert {n for n, p in model.named_parameters() if id(p) in trainable} == set(lora)
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if "lora_" in name else dtype), name
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert_triton_runs(model.embed.weight)
    h = model.hidden_states(ids)
    # a random probe, not sum(h**2): the final norm makes that nearly constant, its gradient mostly rounding noise
    probe = randn(*h.shape, seed=7)
    grads = torch.autograd.grad((h.float() * probe).sum(), trainable_parameters(model))
    # the reference: the module-by-module path in fp32 on the same weights (bf16 -> fp32 is exact); in bf16 the
    # fused path is also no worse than the module-by-module path in bf16
    ref_model = model if dtype == torch.float32 else copy.deepcopy(model).float()
    h_ref = _unfused_hidden(ref_model, ids)
    grads_ref = torch.autograd.grad((h_ref * probe).sum(), trainable_parameters(ref_model))
    bound = 1e-5 if dtype == torch.float32 else 8e-2  # bf16: a 2-layer stack's rounding reaches ~5% here
    assert rel_err(h, h_ref) <= bound
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert g.dtype == torch.float32 and rel_err(g, g_ref) <= bound
    if dtype != torch.float32:
        h2 = _unfused_hidden(model, ids)
        grads2 = torch.autograd.grad((h2.float() * probe).sum(), trainable_parameters(model))
        errs = [max(rel_err(a, b) for a, b in zip(gs, grads_ref, strict=True)) for gs in (grads, grads2)]
        assert errs[0] <= 1.5 * errs[1]
        # and the two bf16 paths round alike: the same GEMMs and kernels, composed differently
        assert rel_err(h, h2) <= 2e-2 and all(rel_err(a, b) <= 2e-2 for a, b in zip(grads, grads2, strict=True))
    model.loss(ids, ids).backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == ("lora_" in name), name


def test_keep_flags_give_the_same_numbers_and_frozen_projections_skip_recomputation(monkeypatch):
    import kernels.glu as glu
    import kernels.norm_linear as nl

    calls = {"norm": 0, "glu": 0}
    fwd, rec = nl._rms_norm_fwd, glu._glu_bwd_recompute
    monkeypatch.setattr(nl, "_rms_norm_fwd", lambda *a: calls.__setitem__("norm", calls["norm"] + 1) or fwd(*a))
    monkeypatch.setattr(glu, "_glu_bwd_recompute", lambda *a: calls.__setitem__("glu", calls["glu"] + 1) or rec(*a))
    model = add_lora(_tiny(), r=2, targets=ALL, dropout=0.0)
    _randomize_b(model)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    results = {}
    for keep in (False, True):
        for layer in model.layers:
            layer.attn_norm.keep_output = layer.mlp_norm.keep_output = layer.mlp.keep_activation = keep
        loss = model.loss(ids, ids)
        calls.update(norm=0, glu=0)
        results[keep] = (loss, *torch.autograd.grad(loss, trainable_parameters(model)))
        # backward: each layer's 2 norm outputs and its GLU activation written again for dA, unless kept
        assert calls == ({"norm": 0, "glu": 0} if keep else {"norm": 4, "glu": 2})
    for a, b in zip(results[False], results[True], strict=True):
        assert torch.equal(a, b)
    # adapters only on o: the frozen qkv / gate_up / down projections need their inputs for nothing
    model = add_lora(_tiny(), r=2, targets=["o"])
    loss = model.loss(ids, ids)
    calls.update(norm=0, glu=0)
    loss.backward()
    assert calls == {"norm": 0, "glu": 0}
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


def test_pytorch_fallback_gives_the_kernels_numbers(monkeypatch):
    """Off the Triton path (CPU without the interpreter) the references add the same adapter terms."""
    import kernels.glu as glu
    import kernels.norm_linear as nl

    model = add_lora(_tiny(), r=3, alpha=6, targets=ALL)
    _randomize_b(model)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    results = []
    for fallback in (False, True):
        if fallback:
            monkeypatch.setattr(nl, "use_triton", lambda x: False)
            monkeypatch.setattr(glu, "use_triton", lambda x: False)
        loss = model.loss(ids, ids)
        results.append((loss, *torch.autograd.grad(loss, trainable_parameters(model))))
    for a, b in zip(*results, strict=True):
        assert rel_err(a, b) <= 1e-5


def test_lora_on_a_custom_model_of_blocks_and_eval_mode_has_no_dropout():
    cfg = DecoderConfig(vocab_size=10, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2)
    torch.manual_seed(0)
    net = torch.nn.Sequential(MLP(cfg), MLP(cfg)).to(DEVICE)
    add_lora(net, r=2, alpha=4, dropout=0.3, targets=["gate", "down"])
    assert isinstance(net[0].gate_up, LoRALinear) and isinstance(net[1].down, LoRALinear)
    assert net[0].gate_up.lora_slices == ((0, 24),) and net[0].gate_up.lora_A.shape == (2, 16)
    x = randn(3, 16, seed=1)
    net(x).sum().backward()
    assert all(p.grad is not None for p in trainable_parameters(net)) and len(trainable_parameters(net)) == 8
    net.eval()
    assert torch.equal(net(x), net(x))


def test_adapters_keep_no_activation_of_their_own_for_backward():
    """Without dropout, rms_norm_linear with adapters saves one (M, H) activation (h, as without them) and
    glu_linear none of (M, I): the norm output / activation is written again in backward for dA."""
    from tests.test_norm_linear import _saved_activation_bytes

    x, r = randn(2, 8, 64, seed=31).requires_grad_(), randn(2, 8, 64, seed=32)
    nw, w = randn(64, seed=33), randn(48, 64, seed=34)
    lr = _low_rank(64, [(0, 16), (32, 48)], 4, seed=35)
    act = x.numel() * x.element_size()
    assert _saved_activation_bytes(lambda: rms_norm_linear(x, nw, w, None, r, low_rank=lr), x.numel()) == act
    g = randn(2, 8, 2 * 40, seed=36).requires_grad_()
    lr2 = _low_rank(40, [(0, 64)], 4, seed=37)
    assert _saved_activation_bytes(lambda: glu_linear(g, randn(64, 40), None, low_rank=lr2), 2 * 8 * 40) == 0


def test_generation_uses_the_adapters_and_merge_lora_state_equals_merge_lora():
    model = add_lora(_tiny(), r=4, alpha=4, targets=ALL)
    _randomize_b(model, seed=9)
    model.eval()
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    plain = _tiny().eval()
    out = model.generate(ids, 6)
    assert not torch.equal(out, plain.generate(ids, 6))  # the adapters change the completions
    state = model.state_dict()
    merged_state = merge_lora_state(state, model)
    assert set(merged_state) == set(plain.state_dict())
    merge_lora(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, merged_state[k]), k
    assert torch.equal(model.generate(ids, 6), out)
    assert not torch.equal(merged_state["layers.0.attn.qkv.weight"], plain.state_dict()["layers.0.attn.qkv.weight"])


def test_activation_checkpointed_layers_with_dropout_give_the_same_gradients(tmp_path):
    """The trainer's activation checkpointing (keep flags on, layers wrapped) with adapter dropout: the
    recomputed forward draws the same masks, the gradients are the same, the native names unchanged."""
    from ligermodels.train.parallelize import apply_activation_checkpointing

    model = add_lora(_tiny(), r=2, alpha=4, dropout=0.3, targets=ALL)
    _randomize_b(model)
    model.train()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    names = set(lora_modules(model))
    save_lora(model, str(tmp_path / "plain"))
    grads = {}
    for mode in ("none", "full"):
        apply_activation_checkpointing(model, mode)
        torch.manual_seed(0)
        grads[mode] = torch.autograd.grad(model.loss(ids, ids), trainable_parameters(model))
    assert "_checkpoint_wrapped_module" in dict(model.named_modules()).__repr__()
    assert set(lora_modules(model)) == names
    for a, b in zip(grads["none"], grads["full"], strict=True):
        assert rel_err(a, b) <= 1e-6
    save_lora(model, str(tmp_path / "wrapped"))
    a, b = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("plain", "wrapped"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------------------------- PEFT
PEFT_CASES = {  # case -> (CASES name, targets, alpha, use_rslora)
    "llama_all": ("llama_gqa_untied", ALL, 8, False),
    "qwen2_qv_bias_tied": ("qwen2_bias_tied_sliding", ["q_proj", "v_proj"], 16, False),
    "gemma_o_down_rslora": ("gemma_tied_headdim", ["o", "down", "k"], 6, True),
    "phi3_fused": ("phi3_default", ["qkv_proj", "gate_up_proj", "o_proj", "down_proj"], 8, False),
}


def _peft_grads(model, out_dir):
    """Our LoRA gradients under PEFT's key names (written through save_lora's state argument)."""
    grads = {f"{n}.lora_{ab}": getattr(m, f"lora_{ab}").grad for n, m in lora_modules(model).items() for ab in "AB"}
    save_lora(model, out_dir, state=grads)
    return load_file(os.path.join(out_dir, "adapter_model.safetensors"))


@pytest.mark.parametrize("case", list(PEFT_CASES))
def test_save_lora_loads_in_peft_with_our_logits_and_gradients(case, tmp_path):
    base, targets, alpha, rslora = PEFT_CASES[case]
    hf = make_hf_checkpoint(base, str(tmp_path / "base"))
    ours = AutoLigerModel.from_hf(str(tmp_path / "base"), dtype=torch.float32, device=DEVICE)
    add_lora(ours, r=4, alpha=alpha, targets=targets, use_rslora=rslora)
    _randomize_b(ours)
    save_lora(ours, str(tmp_path / "adapter"))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == alpha and cfg["use_rslora"] == rslora
    pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter"), is_trainable=True)
    ids, labels = _batch(hf.config.vocab_size)
    ref = pm(input_ids=ids, labels=labels)
    ref.loss.backward()
    logits = ours(ids.to(DEVICE))
    assert rel_err(logits, ref.logits) <= 1e-4, f"logits rel err {rel_err(logits, ref.logits):.2e}"
    loss = ours.loss(ids.to(DEVICE), labels.to(DEVICE))
    assert abs(loss.item() - ref.loss.item()) <= 1e-5 * abs(ref.loss.item())
    loss.backward()
    theirs = {n.replace(".default", ""): p.grad for n, p in pm.named_parameters() if p.requires_grad}
    mine = _peft_grads(ours, str(tmp_path / "grads"))
    assert set(mine) == set(theirs) and mine
    for name, g in theirs.items():
        assert rel_err(mine[name], g) <= 1e-4, f"{case}: gradient of {name}: {rel_err(mine[name], g):.2e}"


def _peft_adapter(hf, out_dir, seed=4, **config):
    pm = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    pm.save_pretrained(out_dir)
    return pm.eval()


def test_load_lora_reads_a_peft_adapter_and_merge_matches_peft_merge(tmp_path):
    import transformers

    hf = make_hf_checkpoint("llama_linear_rope_bias", str(tmp_path / "base"))
    pm = _peft_adapter(hf, str(tmp_path / "peft"), r=3, lora_alpha=5, use_rslora=True, lora_dropout=0.1,
                       target_modules=["k_proj", "up_proj", "down_proj", "o_proj"])
    ours = AutoLigerModel.from_hf(str(tmp_path / "base"), dtype=torch.float32, device=DEVICE)
    load_lora(ours, str(tmp_path / "peft"))
    assert lora_modules(ours)["layers.0.attn.qkv"].lora_dropout == 0.1
    ours.eval()
    ids, _ = _batch(hf.config.vocab_size)
    with torch.no_grad():
        ref = pm(input_ids=ids).logits
        logits = ours(ids.to(DEVICE))
    assert rel_err(logits, ref) <= 1e-4, f"{rel_err(logits, ref):.2e}"
    # what we write back is what peft wrote
    save_lora(ours, str(tmp_path / "again"))
    a = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "again" / "adapter_model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # merged: same logits, a plain checkpoint transformers reads as peft's merge_and_unload
    merge_lora(ours)
    assert not lora_modules(ours) and not any("lora" in n for n in ours.state_dict())
    with torch.no_grad():
        assert rel_err(ours(ids.to(DEVICE)), ref) <= 1e-4
    ours.save_hf(str(tmp_path / "merged"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    merged = pm.merge_and_unload()
    with torch.no_grad():
        assert rel_err(back(input_ids=ids).logits, merged(input_ids=ids).logits) <= 1e-5


def test_trainer_flow_meta_model_state_broadcast_and_export(tmp_path):
    """As the trainer builds it: adapters added on the meta device, the model materialised and given a
    host model's state (base + adapters); export_lora writes the adapters (PEFT) or the merged checkpoint."""
    make_hf_checkpoint("qwen2_untied", str(tmp_path / "base"))
    host = AutoLigerModel.from_hf(str(tmp_path / "base"), dtype=torch.float32)
    torch.manual_seed(0)
    add_lora(host, r=2, alpha=4, targets=ALL)
    _randomize_b(host)
    with torch.device("meta"):
        model = type(host)(host.config)
    add_lora(model, r=2, alpha=4, targets=ALL)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device=DEVICE)
    model.load_state_dict(host.state_dict())
    model.init_buffers()
    ids, _ = _batch(101)
    with torch.no_grad():  # the same computation on the same device: the same bits
        ref = host.to(DEVICE)(ids.to(DEVICE))
        assert torch.equal(model(ids.to(DEVICE)), ref)
    host.cpu()
    (tmp_path / "base" / "tokenizer.json").write_text("{}")  # stands for the tokenizer files
    state = model.state_dict()
    export_lora(model, state, str(tmp_path / "final"), tokenizer_from=str(tmp_path / "base"))
    assert sorted(os.listdir(tmp_path / "final")) == ["adapter_config.json", "adapter_model.safetensors",
                                                      "generation_config.json", "tokenizer.json"]
    fresh = AutoLigerModel.from_hf(str(tmp_path / "base"), dtype=torch.float32, device=DEVICE)
    load_lora(fresh, str(tmp_path / "final"))
    with torch.no_grad():
        assert torch.equal(fresh(ids.to(DEVICE)), ref)
    export_lora(model, state, str(tmp_path / "merged"), merge=True, tokenizer_from=str(tmp_path / "base"),
                dtype=torch.bfloat16)
    merged = AutoLigerModel.from_hf(str(tmp_path / "merged"))
    assert merged.embed.weight.dtype == torch.bfloat16 and os.path.exists(tmp_path / "merged" / "tokenizer.json")
    merge_lora(host)
    for k, v in host.state_dict().items():
        assert torch.equal(merged.state_dict()[k], v.to(torch.bfloat16)), k


# ------------------------------------------------------------------------------------------- errors
def test_bad_requests_are_refused_by_name():
    with pytest.raises(LoRAError, match="rank r must be a positive integer, got 0"):
        add_lora(_tiny(), r=0)
    with pytest.raises(LoRAError, match="rank r must be a positive integer, got -2"):
        add_lora(_tiny(), r=-2)
    with pytest.raises(LoRAError, match="'qproj' is not one of"):
        add_lora(_tiny(), targets=["qproj"])
    with pytest.raises(LoRAError, match="dropout"):
        add_lora(_tiny(), dropout=1.0)
    cfg = DecoderConfig(vocab_size=10, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2)
    with pytest.raises(LoRAError, match="no q projection to adapt.*Attention"):
        add_lora(torch.nn.Sequential(MLP(cfg)), targets=["q", "up"])
    with pytest.raises(LoRAError, match="'q' and 'qkv' overlap"):
        add_lora(_tiny(), targets=["q", "qkv"])
    model = add_lora(_tiny(), targets=["q"])
    with pytest.raises(LoRAError, match="already has LoRA adapters"):
        add_lora(model)
    merge_lora(model)
    for fn in (add_lora, merge_lora, lambda m: save_lora(m, "/nonexistent"), lambda m: load_lora(m, "/nonexistent")):
        with pytest.raises(LoRAError, match="already merged"):
            fn(model)
    with pytest.raises(LoRAError, match="no LoRA adapters"):
        merge_lora(_tiny())


def test_save_hf_of_a_model_with_adapters_points_to_merge_lora(tmp_path):
    from checkpoints_tools import CheckpointError

    model = add_lora(_tiny(), targets=["q"])
    with pytest.raises(CheckpointError, match="unexpected tensor.*lora_A.*merge_lora"):
        model.save_hf(str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_phi3_q_alone_cannot_be_saved_for_peft(tmp_path):
    make_hf_checkpoint("phi3_default", str(tmp_path / "base"))
    ours = AutoLigerModel.from_hf(str(tmp_path / "base"), dtype=torch.float32)
    add_lora(ours, targets=["q"])
    with pytest.raises(LoRAError, match="target 'q' of layers.0.attn.qkv has no module of its own.*qkv_proj"):
        save_lora(ours, str(tmp_path / "ad"))


@pytest.mark.parametrize("change,match", [
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save=\\['lm_head'\\] is not supported"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"target_modules": "all-linear"}, "target_modules='all-linear' is not supported"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "\\['embed_tokens'\\] are not projections"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern=.* is not supported"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa' is not supported"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
])
def test_unsupported_peft_configs_are_refused_by_name(change, match, tmp_path):
    hf = make_hf_checkpoint("llama_gqa_untied", str(tmp_path / "base"))
    _peft_adapter(hf, str(tmp_path / "ad"), r=2, target_modules=["q_proj", "v_proj"])
    path = tmp_path / "ad" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    ours = AutoLigerModel.from_hf(str(tmp_path / "base"), dtype=torch.float32)
    with pytest.raises(LoRAError, match=match):
        load_lora(ours, str(tmp_path / "ad"))
    assert not lora_modules(ours) and all(p.requires_grad for p in ours.parameters())  # left unchanged


def test_adapters_for_another_architecture_or_shape_are_refused(tmp_path):
    hf = make_hf_checkpoint("llama_gqa_untied", str(tmp_path / "base"))
    _peft_adapter(hf, str(tmp_path / "ad"), r=2, target_modules=["q_proj", "down_proj"])
    make_hf_checkpoint(("LlamaConfig", dict(vocab_size=101, hidden_size=64, intermediate_size=80,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
                       str(tmp_path / "other"))
    other = AutoLigerModel.from_hf(str(tmp_path / "other"), dtype=torch.float32)
    with pytest.raises(LoRAError, match=r"mlp.down_proj.lora_A.weight has shape \(2, 96\), this model needs "
                                        r"\(2, 80\)"):
        load_lora(other, str(tmp_path / "ad"))
    make_hf_checkpoint(("LlamaConfig", dict(vocab_size=101, hidden_size=64, intermediate_size=96,
                                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)),
                       str(tmp_path / "short"))
    short = AutoLigerModel.from_hf(str(tmp_path / "short"), dtype=torch.float32)
    with pytest.raises(LoRAError, match="1 layers.*unexpected tensors.*layers.1"):
        load_lora(short, str(tmp_path / "ad"))
    make_hf_checkpoint("phi3_default", str(tmp_path / "phi3"))
    phi3 = AutoLigerModel.from_hf(str(tmp_path / "phi3"), dtype=torch.float32)
    with pytest.raises(LoRAError, match=r"\['q_proj'\] are not projections of this phi3 model"):
        load_lora(phi3, str(tmp_path / "ad"))
