"""QLoRA: ``from_hf(..., quantize="nf4")`` and ``ligermodels.train --quantize nf4`` against transformers +
bitsandbytes + PEFT, training, resume and ``--merge``, and the refusals.

The CLI runs are subprocesses with the PyTorch path (``TRITON_INTERPRET=0``, as in test_train): the kernels
themselves are test_nf4's."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from checkpoints_tools import CheckpointError
from ligermodels import AutoLigerModel, LigerLlama
from ligermodels.lora import add_lora, load_lora, merge_lora, save_lora
from ligermodels.train import parse_args
from tests.test_train import _cut_back_to_step_2, _flags, _metrics, _rel, _train, one_rank_and_two

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes (test-only) is the QLoRA reference")
# the PyTorch path: the kernels themselves are test_nf4's (the interpreter would run them here for minutes)
pytestmark = pytest.mark.usefixtures("reference_kernels")


def _bnb_model(path: str, dtype: torch.dtype, device: str = "cpu"):
    """transformers' QLoRA base: NF4, block 64, double quantisation, computing in ``dtype``, on ``device``."""
    import transformers

    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    return transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=dtype,
                                                             device_map=device).eval()


@pytest.fixture(scope="module")
def wide_checkpoint(workdir) -> str:
    """A tiny random bf16 Llama whose projections' widths are multiples of 64 (bitsandbytes' CPU 4-bit matmul
    needs whole blocks per row)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    path = str(workdir / "wide-llama")
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(4, vocab, (2, 16), generator=torch.Generator().manual_seed(0))


def test_from_hf_nf4_quantises_the_projections_and_keeps_the_rest(checkpoint):
    q = AutoLigerModel.from_hf(checkpoint, dtype=torch.float32, quantize="nf4")
    dense = AutoLigerModel.from_hf(checkpoint, dtype=torch.float32)
    kinds = {n: type(p).__name__ for n, p in q.named_parameters()}
    assert {n for n, k in kinds.items() if k == "NF4Tensor"} == {
        f"layers.{i}.{p}.weight" for i in range(2) for p in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")}
    for name, p in dense.named_parameters():  # embeddings, norms, head: the checkpoint's values
        if kinds[name] != "NF4Tensor":
            assert torch.equal(q.get_parameter(name), p), name
    ids = _ids(q.config.vocab_size)
    with torch.no_grad():
        assert 1e-3 < _rel(q(ids), dense(ids)) < 0.3  # 4-bit weights: near the dense logits, not equal


def _dequantised_twin(model, path: str, dtype: torch.dtype):
    """transformers' dense model of ``path`` holding the dequantised weights of bitsandbytes' 4-bit ``model``
    (``bitsandbytes.functional.dequantize_4bit`` of each Linear4bit, read before any forward)."""
    import transformers

    dense = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        for name, m in model.named_modules():
            if type(m).__name__ == "Linear4bit":
                w = bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state).to(dtype)
                dense.get_submodule(name).weight.copy_(w)
    return dense


def test_an_adapter_trained_on_nf4_gives_peft_on_bitsandbytes_the_same_logits(wide_checkpoint, workdir):
    """Our NF4 base + adapters (B non-zero) saved in PEFT's format and loaded by peft onto transformers' bitsandbytes
    4-bit model of the same checkpoint: the same logits. The bound, 1e-4 relative in fp32, covers the GEMMs' order
    of summation; the 4-bit rounding itself moves these logits by over 1e-2 (checked), so a difference in
    quantisation would show. On CUDA the Linear4bit modules run; on the CPU, where bitsandbytes repacks a 4-bit
    weight for its CPU kernels with the block maxima in bf16 and searches the 8-bit map approximately (test_nf4),
    its dequantised weights stand in, in transformers' dense model, and the bound is 2e-3."""
    import peft

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ours = AutoLigerModel.from_hf(wide_checkpoint, dtype=torch.float32, device=device, quantize="nf4")
    torch.manual_seed(1)
    add_lora(ours, r=4, alpha=8, targets=["q", "k", "v", "o", "gate", "up", "down"])
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.5)
    out = workdir / "nf4-adapter"
    save_lora(ours, str(out))
    four_bit = _bnb_model(wide_checkpoint, torch.float32, device)
    base = four_bit if device == "cuda" else _dequantised_twin(four_bit, wide_checkpoint, torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, str(out)).eval()
    ids = _ids(ours.config.vocab_size).to(device)
    with torch.no_grad():
        mine, ref = ours(ids), theirs(ids).logits
        assert _rel(mine, ref) <= (1e-4 if device == "cuda" else 2e-3)
        plain = AutoLigerModel.from_hf(wide_checkpoint, dtype=torch.float32, device=device)
        assert _rel(mine, AutoLigerModel.from_hf(wide_checkpoint, dtype=torch.float32, device=device,
                                                 quantize="nf4")(ids)) > 1e-2
        assert _rel(mine, load_lora(plain, str(out))(ids)) > 1e-2


def test_lora_on_an_nf4_base_trains_as_on_its_dequantised_weights(checkpoint):
    """The same adapters on the NF4 model and on a dense model holding its dequantised weights: equal loss and
    adapter gradients (the GEMMs read the same values); merge_lora dequantises and folds them in."""
    q = AutoLigerModel.from_hf(checkpoint, dtype=torch.float32, quantize="nf4")
    dense = AutoLigerModel.from_hf(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        for name, p in q.named_parameters():
            dense.get_parameter(name).copy_(p.dequantize() if hasattr(p, "dequantize") else p)
    for m in (q, dense):
        torch.manual_seed(2)
        add_lora(m, r=4, alpha=8, targets=["q", "v", "gate", "down"])
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("lora_B"):
                    p.fill_(0.01)
    ids = _ids(q.config.vocab_size)
    losses = [m.loss(ids, ids) for m in (q, dense)]
    assert losses[0].item() == losses[1].item()
    for loss in losses:
        loss.backward()
    for (name, a), (_, b) in zip(q.named_parameters(), dense.named_parameters(), strict=True):
        if a.requires_grad:
            assert torch.equal(a.grad, b.grad), name
    with torch.no_grad():
        adapted = q(ids)
        merge_lora(q)
        assert _rel(q(ids), adapted) <= 1e-6
        kinds = {n: type(p).__name__ for n, p in q.named_parameters()}
        assert kinds["layers.0.attn.qkv.weight"] == "Parameter" and kinds["layers.0.attn.o.weight"] == "NF4Tensor"


@pytest.fixture(scope="module")
def runs_qlora(checkpoint, data, workdir):
    """--quantize nf4 with LoRA (rank 4, all seven projections): one rank with grad-accum 2, checkpoints at steps
    2 and 4 and --merge; the run resumed from its step-2 checkpoint; two ranks with grad-accum 1 (the same global
    batches) and full activation checkpointing (the recomputed forward reads the regathered 4-bit bytes)."""
    flags = ["--quantize", "nf4", "--lora-rank", "4", "--lora-alpha", "8", "--save-every", "2"]
    out = workdir / "qlora"
    res = _train([*_flags(checkpoint, data, out), *flags, "--grad-accum", "2", "--merge"])
    assert res.returncode == 0, res.stderr[-4000:]
    resumed = _cut_back_to_step_2(out, workdir / "qlora-resumed")
    res = _train([*_flags(checkpoint, data, resumed), *flags, "--grad-accum", "2", "--merge", "--resume"])
    assert res.returncode == 0 and "(step 2)" in res.stdout, res.stderr[-4000:]
    two = workdir / "qlora-two"
    res = _train([*_flags(checkpoint, data, two), *flags, "--grad-accum", "1", "--ac", "full", "--merge"], nproc=2)
    assert res.returncode == 0, res.stderr[-4000:]
    return out, resumed, two


def test_qlora_training_exports_an_adapter_peft_loads_on_bitsandbytes_and_a_merged_bf16_model(runs_qlora,
                                                                                              checkpoint):
    out, resumed, _ = runs_qlora
    metrics = _metrics(out)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    final = out / "final"
    with open(final / "adapter_config.json") as f:
        assert json.load(f)["r"] == 4
    adapted = load_lora(AutoLigerModel.from_hf(checkpoint, dtype=torch.float32, quantize="nf4"), str(final))
    ids = _ids(adapted.config.vocab_size)
    merged = AutoLigerModel.from_hf(str(out / "merged"), dtype=torch.float32)
    assert not any(type(p).__name__ == "NF4Tensor" for p in merged.parameters())
    with torch.no_grad():
        assert _rel(adapted(ids), merged(ids)) <= 1e-5  # the merged checkpoint: dequantised base + adapters
    assert [(m["loss"], m["grad_norm"]) for m in metrics] == [(m["loss"], m["grad_norm"]) for m in _metrics(resumed)]
    assert (resumed / "final" / "adapter_model.safetensors").read_bytes() == \
        (final / "adapter_model.safetensors").read_bytes()


def test_fsdp2_shards_the_4bit_base_as_bf16_storage_and_computes_the_same_loss(checkpoint, data, workdir,
                                                                                 monkeypatch):
    """Each layer is sharded as soon as it is read, before the next layer's weights exist (so a rank never holds the
    whole 4-bit base); each NF4 weight is kept as a flat bf16 Parameter of its bytes (``weight_nf4``), sharded by
    FSDP2 like any frozen weight; the layer's hook reads the gathered bytes back as the NF4 weight: the same loss and
    adapter gradients as the unsharded model (one rank, gloo)."""
    from torch.distributed.tensor import DTensor

    import ligermodels.train.parallelize as parallelize
    from ligermodels.train.data import load_inputs
    from ligermodels.train.parallelize import build_quantized_model

    order, shard_layer = [], parallelize.shard_layer

    def spy(model, i, config, mesh):
        later = [model.layers[j].attn.qkv.weight for j in range(i + 1, len(model.layers))]
        order.append((i, all(w.numel() == 0 for w in later)))  # later layers: still empty placeholders
        shard_layer(model, i, config, mesh)

    monkeypatch.setattr(parallelize, "shard_layer", spy)

    args = parse_args([*_flags(checkpoint, data, workdir / "qlora-shard"), "--quantize", "nf4", "--lora-rank", "4"])
    torch.distributed.init_process_group("gloo", init_method=f"file://{workdir / 'qlora-shard.store'}", rank=0,
                                         world_size=1)
    try:
        inputs = load_inputs(args)
        plain = build_quantized_model(inputs, args, 1, torch.device("cpu"))
        assert not order
        sharded = build_quantized_model(inputs, args, 1, torch.device("cpu"), sharded=True)
        assert order == [(i, True) for i in range(len(plain.layers))] and len(order) > 1
        storage = sharded.layers[0].attn.qkv.weight_nf4
        assert isinstance(storage, DTensor) and storage.dtype == torch.bfloat16 and storage.dim() == 1
        assert "weight" not in dict(sharded.layers[0].attn.qkv.named_parameters(recurse=False))
        ids = _ids(plain.config.vocab_size)
        losses = [m.loss(ids, ids) for m in (plain, sharded)]
        for loss in losses:
            loss.backward()
        assert losses[0].item() == losses[1].item()
        grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in (plain, sharded)]
        assert grads[0].keys() == grads[1].keys()
        for name, g in grads[0].items():
            other = grads[1][name]
            assert torch.equal(g, other.full_tensor() if isinstance(other, DTensor) else other), name
    finally:
        torch.distributed.destroy_process_group()


def test_qlora_on_two_ranks_matches_one_rank(runs_qlora, checkpoint):
    """Two ranks (FSDP2 sharding the 4-bit base's bytes, the adapters and the rest) give the one-rank run's losses
    on the same global batches, an adapter that loads onto the 4-bit base, and a merged checkpoint of the gathered
    4-bit base plus the adapters."""
    one, _, two = runs_qlora
    for a, b in zip(_metrics(one), _metrics(two), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
    adapted = load_lora(AutoLigerModel.from_hf(checkpoint, dtype=torch.float32, quantize="nf4"), str(two / "final"))
    reference = load_lora(AutoLigerModel.from_hf(checkpoint, dtype=torch.float32, quantize="nf4"), str(one / "final"))
    merged = AutoLigerModel.from_hf(str(two / "merged"), dtype=torch.float32)  # the gathered 4-bit bytes, dequantised
    ids = _ids(adapted.config.vocab_size)
    with torch.no_grad():
        assert _rel(adapted(ids), reference(ids)) <= 1e-4
        assert _rel(merged(ids), adapted(ids)) <= 1e-5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL)")
def test_qlora_on_two_gpus_with_nccl_takes_the_steps_of_one_gpu(checkpoint, data, workdir):
    """The CUDA path of the two-rank run: the NF4 kernels on the GPU, FSDP2 gathering the 4-bit bytes over NCCL and
    the recomputed forward (--ac full) reading them again. fp32 compute; NCCL's reduce-scatter sums in another order
    than one GPU's accumulation, so the bounds are 10x the CPU's."""
    from safetensors.torch import load_file

    one, two = one_rank_and_two(checkpoint, data, workdir / "qlora-nccl", ["--quantize", "nf4", "--lora-rank", "4",
                                "--lora-alpha", "8", "--save-every", "0", "--device", "cuda"], ["--ac", "full"],
                                (1e-4, 1e-3))
    assert len(_metrics(one)) == 4
    w1, w2 = (load_file(os.path.join(run, "final", "adapter_model.safetensors")) for run in (one, two))
    assert w1.keys() == w2.keys() and w1
    for k in w1:
        assert _rel(w2[k], w1[k]) <= 1e-4, k


@pytest.mark.parametrize("flags,message", [
    (["--quantize", "nf4"], "--quantize nf4 freezes the base in 4 bits: it trains LoRA adapters on it and needs "
                            "--lora-rank"),
    (["--quantize", "nf4", "--lora-rank", "4", "--fp8", "rowwise"], "--quantize nf4 with --fp8: not supported"),
    (["--quantize", "nf8", "--lora-rank", "4"], "--quantize"),
])
def test_bad_quantize_flags_are_refused_by_name(capsys, flags, message):
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--data", "d.jsonl", "--out", "o", *flags])
    assert message in capsys.readouterr().err


def test_a_checkpoint_stored_quantised_is_refused_naming_its_scheme(checkpoint, workdir):
    path = workdir / "gptq"
    shutil.copytree(checkpoint, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="stored quantised \\('gptq'"):
        LigerLlama.from_hf(str(path), quantize="nf4")


def test_nf4_refuses_a_mixture_of_experts_model():
    from ligermodels import DecoderConfig, LigerQwen3Moe
    from ligermodels.hf_io import quantize_model

    cfg = DecoderConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=4, num_kv_heads=2, num_experts=4, experts_per_token=2)
    with torch.device("meta"):
        model = LigerQwen3Moe(cfg)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        quantize_model(model)


@pytest.mark.parametrize("case", ["phi3_default", "gemma2_untied_mha", "glm4_bias_untied"])
def test_every_family_loads_in_nf4_as_transformers_and_bitsandbytes_quantise_it(case, tmp_path):
    """Families with biases, fused Hugging Face projections (Phi-3's qkv_proj and gate_up_proj, GLM-4's
    gate_up_proj: one part each), offset norms and soft-capping: our NF4 model's logits against transformers'
    bitsandbytes 4-bit model of the same checkpoint (its dequantised weights in transformers' dense model on the CPU,
    as in the PEFT test), and far from the dense logits."""
    from tests.test_models import CASES, make_hf_checkpoint

    cls_name, kwargs = CASES[case]
    make_hf_checkpoint((cls_name, {**kwargs, "intermediate_size": 128}), str(tmp_path))
    ours = AutoLigerModel.from_hf(str(tmp_path), dtype=torch.float32, quantize="nf4")
    twin = _dequantised_twin(_bnb_model(str(tmp_path), torch.float32), str(tmp_path), torch.float32)
    ids = _ids(ours.config.vocab_size)
    with torch.no_grad():
        mine = ours(ids)
        assert _rel(mine, twin(ids).logits) <= 2e-3
        assert _rel(mine, AutoLigerModel.from_hf(str(tmp_path), dtype=torch.float32)(ids)) > 1e-2
