"""Mixture-of-experts: kernels.moe's kernel path and its reference against a float64 per-token loop (output and every
gradient), the routing kernel's picks against torch.topk, the kernel path without host synchronisation, the
load-balancing loss against transformers', generation against transformers, the trainer on a Qwen3-MoE checkpoint,
and the config fields refused by name. (The families' logits, loss and gradients against transformers are in
tests/test_models.py, cases qwen3_moe_* and mixtral_*.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import kernels.moe
from kernels.moe import load_balancing_loss, moe_mlp, moe_mlp_reference
from ligermodels import AutoLigerModel, MoE, UnsupportedConfigError, config_from_hf
from tests.test_models import make_hf_checkpoint
from tests.test_train import ENV, ROOT, TIMEOUT
from tests.utils import DEVICE, assert_triton_runs, rel_err

transformers = pytest.importorskip("transformers")


def _per_token(x, router, gate_up, down, k, norm_topk):
    """Each token alone: its k experts' SwiGLU MLPs, weighted by the softmax probabilities (renormalised)."""
    out = []
    for t in range(x.shape[0]):
        probs = torch.softmax(router @ x[t], dim=-1)
        w, e = torch.topk(probs, k)
        if norm_topk:
            w = w / w.sum()
        y = 0
        for wj, ej in zip(w, e.tolist(), strict=True):
            g, u = (gate_up[ej] @ x[t]).chunk(2)
            y = y + wj * (down[ej] @ (F.silu(g) * u))
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("k, norm_topk", [(2, True), (3, False), (1, True)])
def test_moe_reference_matches_a_float64_per_token_loop_with_every_gradient(k, norm_topk):
    g = torch.Generator().manual_seed(k)
    t, h, i, e = 13, 24, 10, 5
    args = [torch.randn(t, h, generator=g, dtype=torch.float64), torch.randn(e, h, generator=g, dtype=torch.float64),
            0.3 * torch.randn(e, 2 * i, h, generator=g, dtype=torch.float64),
            0.3 * torch.randn(e, h, i, generator=g, dtype=torch.float64)]
    ours = [a.clone().requires_grad_() for a in args]
    ref = [a.clone().requires_grad_() for a in args]
    out, logits = moe_mlp_reference(*ours, k, norm_topk)
    expected = _per_token(*ref, k, norm_topk)
    assert out.dtype == torch.float64 and rel_err(out, expected) <= 1e-12
    assert torch.equal(logits, args[0] @ args[1].T)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(grad)
    expected.backward(grad)
    for name, a, b in zip(("x", "router", "gate_up", "down"), ours, ref, strict=True):
        if name == "router" and k == 1 and norm_topk:  # the one weight is p / p = 1: no gradient reaches the router
            assert a.grad.abs().max() <= 1e-12 and b.grad.abs().max() <= 1e-12
        else:
            assert rel_err(a.grad, b.grad) <= 1e-12, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_logits_are_fp32_products_of_the_inputs_with_gradients_rounded_once(dtype):
    """The router's logits are the fp32-accumulated product of x and the router weight, returned in fp32 (not
    rounded to x's dtype, where bf16 ties experts apart by less than its step), and their gradients are the
    float64 products rounded once to the inputs' dtypes."""
    g = torch.Generator().manual_seed(3)
    x64 = torch.randn(37, 52, generator=g, dtype=torch.float64)
    w64 = torch.randn(7, 52, generator=g, dtype=torch.float64)
    x, w = (a.to(dtype).to(DEVICE).requires_grad_() for a in (x64, w64))
    logits = kernels.moe.router_logits(x, w)
    exact = x.detach().double().cpu() @ w.detach().double().cpu().T  # the product of the rounded inputs
    assert logits.dtype == torch.float32 and rel_err(logits, exact) <= 1e-6
    grad = torch.randn(logits.shape, generator=g, dtype=torch.float64)
    logits.backward(grad.float().to(DEVICE))
    bound = 5e-3 if dtype == torch.bfloat16 else 1e-6
    assert x.grad.dtype == dtype and rel_err(x.grad, grad @ w.detach().double().cpu()) <= bound
    assert w.grad.dtype == dtype and rel_err(w.grad, grad.T @ x.detach().double().cpu()) <= bound


def _moe_args(t, h, i, e, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, generator=g, dtype=torch.float64), torch.randn(e, h, generator=g, dtype=torch.float64),
            0.3 * torch.randn(e, 2 * i, h, generator=g, dtype=torch.float64),
            0.3 * torch.randn(e, h, i, generator=g, dtype=torch.float64)]


def _kernel_vs_per_token(dtype, t, h, i, e, k, norm_topk, seed=0):
    """Relative errors (output, then the gradients of x, router, gate_up, down) of moe_mlp in ``dtype`` against the
    float64 per-token loop, for a fresh random output gradient."""
    args = _moe_args(t, h, i, e, seed)
    ours = [a.to(dtype).to(DEVICE).clone().requires_grad_() for a in args]
    ref = [a.clone().requires_grad_() for a in args]
    assert_triton_runs(ours[0])
    out, logits = moe_mlp(*ours, k, norm_topk)
    expected = _per_token(*ref, k, norm_topk)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    out.backward(grad.to(dtype).to(DEVICE))
    expected.backward(grad)
    assert out.dtype == dtype and logits.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    return [rel_err(out, expected)] + [rel_err(a.grad, b.grad) for a, b in zip(ours, ref, strict=True)]


@pytest.mark.skipif(DEVICE.type == "cuda", reason="float64 through the interpreter; the GPU runs the fp32/bf16 cases")
@pytest.mark.parametrize("t, h, i, e, k, norm_topk", [
    (13, 24, 10, 5, 2, True), (13, 24, 10, 5, 3, False), (9, 20, 6, 7, 1, True), (3, 12, 6, 6, 1, False)])
def test_moe_kernels_match_a_float64_per_token_loop_with_every_gradient(t, h, i, e, k, norm_topk):
    """The kernel path (routing, permutation, scaled GLU, combine; grouped GEMMs by the per-expert fallback in
    float64) in float64 through the interpreter; the last shape leaves experts without tokens."""
    errs = _kernel_vs_per_token(torch.float64, t, h, i, e, k, norm_topk)
    if k == 1 and norm_topk:  # the one weight is p / p = 1: no gradient reaches the router
        errs.pop(2)
    assert max(errs) <= 1e-12, errs


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_kernels_on_grouped_gemms_match_a_float64_per_token_loop(dtype, bound, norm_topk, monkeypatch):
    """Aligned sizes take ``torch._grouped_mm`` for every GEMM (bf16 on a GPU; fp32 and bf16 on the CPU)."""
    calls = []
    grouped = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or grouped(*a, **kw))
    errs = _kernel_vs_per_token(dtype, 37, 64, 32, 6, 2, norm_topk)
    assert max(errs) <= bound, errs
    if DEVICE.type == "cpu" or dtype == torch.bfloat16:
        assert len(calls) == 6  # gate/up and down forward; their input and weight gradients


def test_routing_kernel_picks_what_torch_topk_picks_and_breaks_ties_to_the_lower_expert():
    logits = torch.randn(50, 13, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    logits[0] = 0.0  # all tied: experts 0..k-1
    logits[1, 5] = logits[1, 9] = 4.0  # a tie at the top: 5 then 9
    assert_triton_runs(logits)
    for norm_topk in (True, False):
        weights, ids = kernels.moe.RouteFunction.apply(logits, 3, norm_topk)
        probs = torch.softmax(logits, dim=-1)
        top = torch.topk(probs, 3, dim=-1)
        expected = top.values / top.values.sum(-1, keepdim=True) if norm_topk else top.values
        assert ids.dtype == torch.int32 and torch.equal(ids[2:].long(), top.indices[2:])
        assert ids[0].tolist() == [0, 1, 2] and ids[1, :2].tolist() == [5, 9]
        assert rel_err(weights, expected) <= 1e-6


@pytest.mark.parametrize("t, k, e, skew, tile", [
    (1, 1, 1, False, None), (7, 2, 8, False, None), (300, 3, 5, False, None), (100, 8, 128, True, None),
    (64, 4, 60, False, None), (120, 4, 37, False, {"BLOCK": 16, "BLOCK_S": 4}),
    (301, 3, 8, True, {"BLOCK": 32, "BLOCK_S": 8})])
def test_placement_kernels_give_the_rows_of_torchs_stable_sort_by_expert(t, k, e, skew, tile, monkeypatch):
    """Positions, weights in row order and group ends equal ``torch.sort``'s (stable) exactly, with the weights'
    gradient: one pick, experts without picks (skew: every pick among the first 3 experts), E not a power of two,
    several chunks, the last one partial; with small chunks, more chunks than one load of their counts."""
    if tile:
        pick = kernels.moe._place_tile
        monkeypatch.setattr(kernels.moe, "_place_tile", lambda picks, experts: {**pick(picks, experts), **tile})
    g = torch.Generator().manual_seed(t)
    if skew:
        ids = torch.stack([torch.randperm(3, generator=g)[:k] if k <= 3 else torch.randint(0, 3, (k,), generator=g)
                           for _ in range(t)])
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids = ids.to(torch.int32).to(DEVICE)
    weights = torch.rand(t, k, generator=g).to(DEVICE).requires_grad_()
    assert_triton_runs(weights)
    pos, w_sorted, offs = kernels.moe.PlaceFunction.apply(ids, weights, e)
    order, expected_pos, expected_offs = kernels.moe.sort_picks(ids, e)
    assert pos.dtype == offs.dtype == torch.int32
    assert torch.equal(pos.long(), expected_pos) and torch.equal(offs, expected_offs)
    assert torch.equal(w_sorted, weights.detach().reshape(-1)[order])
    dw = torch.randn(t * k, generator=g).to(DEVICE)
    w_sorted.backward(dw)
    assert torch.equal(weights.grad.reshape(-1)[order], dw)


def test_placement_chunks_are_the_sizes_measured_fastest_at_the_benchmark_shapes():
    """docs/moe.md's chunk sweep (bench_moe, H200): 512 picks at Qwen3-30B-A3B's 8192 x 8 picks over 128 experts,
    256 at Mixtral-8x7B's 8192 x 2 over 8; never more chunk than picks."""
    assert kernels.moe._place_tile(8192 * 8, 128)["BLOCK"] == 512
    assert kernels.moe._place_tile(8192 * 2, 8)["BLOCK"] == 256
    assert kernels.moe._place_tile(40, 128)["BLOCK"] == 64


@pytest.mark.skipif(DEVICE.type != "cuda", reason="host synchronisation is a CUDA notion")
def test_moe_kernel_path_never_synchronises_with_the_host():
    args = [a.to(torch.bfloat16).cuda().requires_grad_() for a in _moe_args(300, 256, 128, 16, 0)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, logits = moe_mlp(*args, 4, True)
        (out.float().sum() + logits.float().sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(a.grad is not None for a in args)


def test_load_balancing_loss_and_its_gradient_match_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(17, 6, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    ours = load_balancing_loss(logits, 6, 2)
    theirs = load_balancing_loss_func(tuple(logits), 6, 2)
    assert rel_err(ours, theirs) <= 1e-12
    a = torch.autograd.grad(ours, logits)
    b = torch.autograd.grad(theirs, logits)
    assert all(rel_err(x, y) <= 1e-12 for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("case", ["qwen3_moe_dense_layer", "mixtral_sliding"])
def test_moe_model_generates_what_transformers_generates(case, tmp_path):
    hf = make_hf_checkpoint(case, str(tmp_path))
    ours = AutoLigerModel.from_hf(str(tmp_path), dtype=torch.float32)
    ids = torch.randint(0, hf.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    # transformers 5.17's generate fails computing the load-balancing loss of a decode step against the whole
    # attention mask (a shape error in load_balancing_loss_func); generation does not use that loss
    hf.config.output_router_logits = False
    theirs = hf.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    eos = hf.generation_config.eos_token_id  # transformers stops a row there and pads it
    assert torch.equal(ours.generate(ids, max_new_tokens=6, eos_token_id=eos, pad_token_id=0), theirs)


@pytest.mark.parametrize("case", ["qwen3_moe_dense_layer", "mixtral_sliding"])
def test_expert_lora_matches_peft_target_parameters_and_its_adapters_cross_both_ways(case, tmp_path):
    """LoRA on q, v and every expert's weights, as PEFT's ``target_parameters`` puts it on transformers' stacked
    experts: a PEFT adapter loads here with the same logits, loss and adapter gradients (fp32), and the adapter
    save_lora writes loads in PEFT with the same logits; folded into the weights, the same logits again."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    from ligermodels.lora import expert_lora_modules, load_lora, merge_lora, merge_lora_state, save_lora

    base = tmp_path / "base"
    hf = make_hf_checkpoint(case, str(base))
    torch.manual_seed(0)
    config = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "v_proj"],
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    theirs = peft.get_peft_model(hf, config)
    with torch.no_grad():  # B starts at zero: give every adapter an effect
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    theirs.save_pretrained(str(tmp_path / "peft"))
    ours = AutoLigerModel.from_hf(str(base), dtype=torch.float32)
    load_lora(ours, str(tmp_path / "peft"))
    assert len(expert_lora_modules(ours)) == 2 * sum(isinstance(layer.mlp, MoE) for layer in ours.layers)
    ids = torch.randint(0, hf.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    out = theirs(input_ids=ids, labels=ids)
    logits = ours(ids)
    assert rel_err(logits, out.logits) <= 1e-5
    loss = ours.loss(ids, ids)
    assert loss.item() == pytest.approx(out.loss.item(), rel=1e-5)
    out.loss.backward()
    loss.backward()
    save_lora(ours, str(tmp_path / "grads"), state={n: p.grad for n, p in ours.named_parameters() if p.requires_grad})
    ours_grads = load_file(str(tmp_path / "grads" / "adapter_model.safetensors"))
    peft_grads = {n.replace(".default", ""): p.grad for n, p in theirs.named_parameters() if "lora_" in n}
    assert set(ours_grads) == set(peft_grads) and any(".experts.base_layer.lora_A" in k for k in ours_grads)
    for key, grad in peft_grads.items():
        assert rel_err(ours_grads[key], grad) <= 1e-4, key
    save_lora(ours, str(tmp_path / "ours"))
    again = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(str(base)),
                                           str(tmp_path / "ours"))
    with torch.no_grad():
        assert rel_err(again(input_ids=ids).logits, logits) <= 1e-5
        # folded into the weights: the trainer's --merge (from a state dict) and merge_lora (in place)
        plain = AutoLigerModel.from_hf(str(base), dtype=torch.float32)
        plain.load_state_dict(merge_lora_state(ours.state_dict(), ours))
        assert rel_err(plain(ids), logits) <= 1e-5
        assert rel_err(merge_lora(ours)(ids), logits) <= 1e-5 and not expert_lora_modules(ours)


def _moe_run_inputs(tmp_path):
    """A tiny Qwen3-MoE checkpoint (with a tokenizer) whose config asks for the load-balancing loss, and data."""
    from tests.test_chat import _checkpoint_dir

    d = _checkpoint_dir(tmp_path, "llama3")
    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1],
                                      output_router_logits=True, router_aux_loss_coef=0.5,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"what is {i}+{i}? it is {2 * i}."}) + "\n" for i in range(16)))
    return d, data


def _train(args: list[str], nproc: int = 1) -> subprocess.CompletedProcess:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                if nproc > 1 else [sys.executable])
    return subprocess.run([*launcher, "-m", "ligermodels.train", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=TIMEOUT)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-experts"])
def test_two_fsdp_ranks_take_the_steps_of_one_rank_with_gradient_accumulation(tmp_path, lora):
    """FSDP2 shards the stacked experts (and their adapters) as any weight, and the load-balancing term is the mean
    over a step's micro-batches whether they are split over ranks or accumulated on one: 2 ranks x 1 micro-batch and
    1 rank x 2 micro-batches log the same losses and end in the same weights, or adapters (fp32, gloo); with LoRA on
    the experts, the one-rank run resumed from its step-2 checkpoint ends in its adapters exactly."""
    from safetensors.torch import load_file

    d, data = _moe_run_inputs(tmp_path)
    outs = {}
    extra = ["--lora-rank", "4", "--lora-targets", "q,experts", "--lr", "1e-2"] if lora else ["--lr", "1e-3"]

    def flags(out, accum):
        return ["--model", d, "--data", str(data), "--out", str(out), "--steps", "3", "--batch-size", "1",
                "--grad-accum", accum, "--seq-len", "32", "--dtype", "fp32", "--device", "cpu", "--save-every", "2",
                *extra]

    for name, nproc, accum in (("one", 1, "2"), ("two", 2, "1")):
        outs[name] = tmp_path / name
        res = _train(flags(outs[name], accum), nproc)
        assert res.returncode == 0, res.stderr[-3000:]
    losses = {n: [json.loads(line)["loss"] for line in (o / "metrics.jsonl").read_text().splitlines()]
              for n, o in outs.items()}
    assert losses["one"] == pytest.approx(losses["two"], rel=1e-5)
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    a, b = (load_file(str(o / "final" / weights)) for o in outs.values())
    assert set(a) == set(b) and any(".experts." in k for k in a)
    assert all(rel_err(a[k], b[k]) <= 1e-5 for k in a)
    if not lora:  # a plain run's resume is tested in test_train.py; here the experts' adapters are restored
        return
    # resumed from its step-2 checkpoint, the one-rank run ends in the same adapters, bit for bit
    resumed = tmp_path / "resumed"
    shutil.copytree(outs["one"], resumed)
    shutil.rmtree(resumed / "final")
    for ckpt in (resumed / "checkpoints").iterdir():
        if ckpt.name != "step_00000002":
            shutil.rmtree(ckpt)
    res = _train([*flags(resumed, "2"), "--resume"])
    assert res.returncode == 0 and "(step 2)" in res.stdout, res.stderr[-3000:]
    again = load_file(str(resumed / "final" / weights))
    assert set(again) == set(a) and all(torch.equal(again[k], a[k]) for k in a)


def test_trainer_runs_qwen3_moe_with_the_aux_loss_under_activation_checkpointing(tmp_path):
    """``python -m ligermodels.train`` on a Qwen3-MoE checkpoint whose config asks for the load-balancing loss:
    checkpointing every layer takes the same steps, LoRA trains and exports its adapter, and the model's loss is
    the cross-entropy plus ``router_aux_loss_coef`` times the load-balancing loss."""
    d, data = _moe_run_inputs(tmp_path)
    losses = {}
    for name, extra in (("none", ["--ac", "none"]), ("full", ["--ac", "full"]),
                        ("lora", ["--ac", "full", "--lora-rank", "4", "--lora-targets", "q,v,gate,down,experts"])):
        out = tmp_path / f"out-{name}"
        res = _train(["--model", d, "--data", str(data), "--out", str(out), "--steps", "2", "--batch-size", "2",
                      "--seq-len", "64", "--dtype", "fp32", "--device", "cpu", "--save-every", "0", "--lr", "1e-3",
                      *extra])
        assert res.returncode == 0, res.stderr[-3000:]
        losses[name] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses["none"] == pytest.approx(losses["full"], rel=1e-6)
    # LoRA: the adapters start as a no-op (the first loss is the base's); gate and down on the dense layer's MLP,
    # experts on the others' stacked experts
    assert losses["lora"][0] == pytest.approx(losses["none"][0], rel=1e-6)
    adapter = json.loads((tmp_path / "out-lora" / "final" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["down_proj", "gate_proj", "q_proj", "v_proj"]
    assert adapter["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    model = AutoLigerModel.from_hf(d, dtype=torch.float32)
    assert model.config.output_router_logits and model.config.router_aux_loss_coef == 0.5
    plain = type(model)(model.config.replace(output_router_logits=False))
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        total, cross_entropy = model.loss(ids, ids), plain.loss(ids, ids)
        aux = model.router_aux_loss()
    assert aux.item() > 0 and total.item() == pytest.approx(cross_entropy.item() + 0.5 * aux.item(), rel=1e-6)
    with torch.no_grad():  # the trainer's share of one micro-batch of several
        quarter = model.loss(ids, ids, router_aux_scale=0.25)
    assert quarter.item() == pytest.approx(cross_entropy.item() + 0.25 * 0.5 * aux.item(), rel=1e-6)
    with torch.no_grad():  # per-token losses are the cross-entropy alone: the aux term is the batch's, not a token's
        assert torch.equal(model.loss(ids, ids, reduction="none"), plain.loss(ids, ids, reduction="none"))


@pytest.mark.parametrize("model_type, field, value", [
    ("mixtral", "router_jitter_noise", 0.01),
    ("qwen3_moe", "use_sliding_window", True),
])
def test_moe_config_fields_we_do_not_implement_are_refused_by_name(model_type, field, value):
    d = {"model_type": model_type, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, field: value}
    with pytest.raises(UnsupportedConfigError, match=field):
        config_from_hf(d)


def test_expert_lora_refuses_dropout_and_a_model_without_experts_by_name():
    from ligermodels.families import family_of
    from ligermodels.lora import LoRAError, add_lora

    def build(config):
        return family_of(config.model_type).cls(config)

    moe = config_from_hf({"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
    with pytest.raises(LoRAError, match="dropout"):
        add_lora(build(moe), r=2, dropout=0.1, targets=["q", "experts"])
    dense = config_from_hf({"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
    with pytest.raises(LoRAError, match="experts_gate_up / experts_down projection to adapt .*MoE"):
        add_lora(build(dense), r=2, targets=["experts"])


def test_cuda_graph_refuses_a_mixture_of_experts_model_without_sm90_grouped_gemms_by_name(monkeypatch):
    from types import SimpleNamespace

    import ligermodels.train.cuda_graph as cuda_graph
    from ligermodels.train.config import TrainError
    from ligermodels.train.cuda_graph import check_cuda_graph

    model = config_from_hf({"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
    config = SimpleNamespace(cuda_graph=True, dtype="bf16", attention="causal")  # the flags it reads
    monkeypatch.setattr(cuda_graph, "grouped_gemm_device", lambda device: False)
    with pytest.raises(TrainError, match="mixture-of-experts"):
        check_cuda_graph(config, model, 1, torch.device("cuda"))
    monkeypatch.setattr(cuda_graph, "grouped_gemm_device", lambda device: True)
    check_cuda_graph(config, model, 1, torch.device("cuda"))  # sm90: the grouped GEMMs never sync
