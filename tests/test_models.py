"""Every family against transformers on tiny random checkpoints: logits, loss, every gradient, save/load.

Checkpoints are made with transformers' ``save_pretrained`` (single file and sharded) in
configurations that exercise GQA, tied and untied heads, q/k/v bias, each rope scaling the family
supports, a sliding window shorter than the sequence, and head_dim != hidden / heads; for Qwen3,
Gemma 2 / 3 and GLM-4 also q/k head norms, sandwich norms, attention and final soft-capping, two
rotary tables, partial and interleaved rotary. Weights, norms included, are randomised so that no
parameter sits at its identity value. The new families also check packed documents, bit-for-bit
saving, configs written from fields, a Gemma 3 image-text checkpoint and the verify command.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from ligermodels import AutoLigerModel, LigerLlama, LigerQwen2, document_ids_from_positions
from ligermodels.hf_io import hf_tensors, load_hf
from tests.utils import DEVICE, assert_triton_runs, rel_err

SMALL = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
HALF = 8  # head_dim 16 -> 8 frequencies


def _longrope(head_dim: int) -> dict:
    g = torch.Generator().manual_seed(3)
    n = head_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": (1 + torch.rand(n, generator=g)).tolist(),
            "long_factor": (1 + 4 * torch.rand(n, generator=g)).tolist()}


# name -> (HF config class name, config kwargs)
CASES = {
    "llama_gqa_untied": ("LlamaConfig", dict(SMALL)),
    "llama3_rope_tied_headdim": ("LlamaConfig", dict(SMALL, tie_word_embeddings=True, head_dim=24,
                                                     rope_parameters=LLAMA3_ROPE)),
    "llama_linear_rope_bias": ("LlamaConfig", dict(SMALL, attention_bias=True, mlp_bias=True,
                                                   rope_parameters={"rope_type": "linear", "rope_theta": 500.0,
                                                                    "factor": 4.0})),
    "qwen2_bias_tied_sliding": ("Qwen2Config", dict(SMALL, tie_word_embeddings=True, use_sliding_window=True,
                                                    sliding_window=5, max_window_layers=1)),
    "qwen2_untied": ("Qwen2Config", dict(SMALL, num_key_value_heads=1)),
    "mistral_sliding_headdim": ("MistralConfig", dict(SMALL, sliding_window=5, head_dim=24)),
    "phi3_longrope": ("Phi3Config", dict(SMALL, num_key_value_heads=4, original_max_position_embeddings=8,
                                          rope_parameters=_longrope(16), pad_token_id=0)),
    "phi3_default": ("Phi3Config", dict(SMALL, pad_token_id=0)),
    "gemma_tied_headdim": ("GemmaConfig", dict(SMALL, head_dim=32, num_key_value_heads=1, pad_token_id=0)),
    "qwen3_untied_headdim": ("Qwen3Config", dict(SMALL, head_dim=24)),
    "qwen3_tied_sliding_bias": ("Qwen3Config", dict(SMALL, head_dim=16, tie_word_embeddings=True, attention_bias=True,
                                                    use_sliding_window=True, sliding_window=5,
                                                    layer_types=["sliding_attention", "full_attention"])),
    "phi3_partial_rotary": ("Phi3Config", dict(SMALL, hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                                               partial_rotary_factor=0.75, pad_token_id=0, sliding_window=5)),
    "phi3_partial_longrope": ("Phi3Config", dict(SMALL, partial_rotary_factor=0.5, original_max_position_embeddings=8,
                                                 rope_parameters={**_longrope(8), "partial_rotary_factor": 0.5},
                                                 pad_token_id=0)),
    "gemma2_tied_softcap_sliding": ("Gemma2Config", dict(SMALL, head_dim=24, sliding_window=5, pad_token_id=0,
                                                         query_pre_attn_scalar=20, attn_logit_softcapping=1.5,
                                                         final_logit_softcapping=2.0)),
    "gemma2_untied_mha": ("Gemma2Config", dict(SMALL, num_key_value_heads=4, tie_word_embeddings=False,
                                               pad_token_id=0, final_logit_softcapping=None)),
    "gemma3_tied_two_ropes": ("Gemma3TextConfig", dict(SMALL, head_dim=24, sliding_window=5, pad_token_id=0,
                                                       query_pre_attn_scalar=20, final_logit_softcapping=3.0,
                                                       layer_types=["sliding_attention", "full_attention"],
                                                       rope_parameters={
                                                           "sliding_attention": {"rope_type": "default",
                                                                                 "rope_theta": 100.0},
                                                           "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                              "rope_theta": 5000.0}})),
    "gemma3_untied": ("Gemma3TextConfig", dict(SMALL, num_key_value_heads=1, tie_word_embeddings=False,
                                               pad_token_id=0, sliding_window=4)),
    "glm4_bias_untied": ("Glm4Config", dict(SMALL, pad_token_id=0)),
    "glm4_tied_headdim": ("Glm4Config", dict(SMALL, head_dim=24, tie_word_embeddings=True, attention_bias=False,
                                             partial_rotary_factor=0.75, pad_token_id=0)),
    # mixture of experts: the load-balancing loss in the loss (output_router_logits), a dense layer (Qwen3-MoE's
    # mlp_only_layers), renormalised top-k weights (Mixtral always, Qwen3-MoE when norm_topk_prob)
    "qwen3_moe_dense_layer": ("Qwen3MoeConfig", dict(SMALL, num_hidden_layers=3, head_dim=16, num_experts=5,
                                                     num_experts_per_tok=2, moe_intermediate_size=24,
                                                     mlp_only_layers=[1], norm_topk_prob=True,
                                                     output_router_logits=True, router_aux_loss_coef=0.3)),
    "qwen3_moe_tied_unnormalised": ("Qwen3MoeConfig", dict(SMALL, head_dim=16, num_experts=4, num_experts_per_tok=3,
                                                           moe_intermediate_size=16, tie_word_embeddings=True,
                                                           decoder_sparse_step=2, norm_topk_prob=False)),
    "mixtral_sliding": ("MixtralConfig", dict(SMALL, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                                              output_router_logits=True, router_aux_loss_coef=0.3)),
}


def make_hf_checkpoint(case: str | tuple[str, dict], directory: str, shard: bool = False, seed: int = 0):
    """A tiny random transformers model saved as safetensors; returns the fp32 HF model.

    ``case`` names one of CASES, or gives (HF config class name, config kwargs) directly.
    """
    cls_name, kwargs = CASES[case] if isinstance(case, str) else case
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory, max_shard_size="40KB" if shard else "5GB")
    return model.eval()


def hub_layout(tensors: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """transformers 5's in-memory names -> the hub's: its stacked experts (``experts.gate_up_proj`` (E, 2I, H),
    ``experts.down_proj`` (E, H, I)) as one tensor per expert and projection, as checkpoints store them."""
    mixtral = model_type == "mixtral"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = {}
    for name, t in tensors.items():
        if mixtral and ".mlp." in name:  # Mixtral's checkpoints call the block block_sparse_moe
            name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith("experts.gate_up_proj"):
            for e, (g, u) in enumerate(zip(*t.chunk(2, dim=1), strict=True)):
                out[f"{name[:-len('gate_up_proj')]}{e}.{gate}.weight"] = g
                out[f"{name[:-len('gate_up_proj')]}{e}.{up}.weight"] = u
        elif name.endswith("experts.down_proj"):
            for e, d in enumerate(t):
                out[f"{name[:-len('down_proj')]}{e}.{down}.weight"] = d
        else:
            out[name] = t
    return out


def _batch(vocab: int, batch: int = 2, seq: int = 12, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, seq // 2] = -100
    return ids, labels


@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_transformers_logits_loss_and_gradients(case, tmp_path):
    shard = case in ("llama_gqa_untied", "qwen2_bias_tied_sliding", "phi3_longrope")
    hf = make_hf_checkpoint(case, str(tmp_path), shard=shard)
    if shard:
        assert os.path.exists(tmp_path / "model.safetensors.index.json")
    ours = AutoLigerModel.from_hf(str(tmp_path), dtype=torch.float32, device=DEVICE)
    assert type(ours).model_type == hf.config.model_type
    ids, labels = _batch(hf.config.vocab_size)
    pad = hf.config.pad_token_id
    if pad is not None:  # HF's embedding gives its padding row no gradient: ours must too
        ids[:, ::4] = pad
    assert_triton_runs(ours.embed.weight)

    hf_out = hf(input_ids=ids, labels=labels)
    hf_out.loss.backward()
    logits = ours(ids.to(DEVICE))
    assert rel_err(logits, hf_out.logits) <= 1e-4, f"logits rel err {rel_err(logits, hf_out.logits):.2e}"
    loss = ours.loss(ids.to(DEVICE), labels.to(DEVICE))
    assert abs(loss.item() - hf_out.loss.item()) <= 1e-5 * abs(hf_out.loss.item())
    loss.backward()

    ours_grads = dict(hf_tensors({n: p.grad for n, p in ours.named_parameters()}, ours.config))
    hf_grads = hub_layout({n: p.grad for n, p in hf.named_parameters()}, hf.config.model_type)
    assert set(ours_grads) == set(hf_grads)
    for name, g in hf_grads.items():
        err = rel_err(ours_grads[name], g)
        assert err <= 1e-3, f"{case}: gradient of {name}: rel err {err:.2e}"
    if pad is not None and ours.head is not None:
        assert not ours.embed.weight.grad[pad].any(), "the padding row of the embedding got a gradient"


def test_long_sequence_switches_longrope_to_long_factors(tmp_path):
    hf = make_hf_checkpoint("phi3_longrope", str(tmp_path))
    ours = AutoLigerModel.from_hf(str(tmp_path), device=DEVICE)
    for seq in (6, 20):  # below and above original_max_position_embeddings = 8
        ids, _ = _batch(hf.config.vocab_size, seq=seq)
        with torch.no_grad():
            assert rel_err(ours(ids.to(DEVICE)), hf(input_ids=ids).logits) <= 1e-4, seq


def test_save_hf_round_trips_bitwise_through_transformers(tmp_path):
    hf = make_hf_checkpoint("qwen2_bias_tied_sliding", str(tmp_path / "src"))
    ours = LigerQwen2.from_hf(str(tmp_path / "src"))
    ours.save_hf(str(tmp_path / "out"), max_shard_bytes=30_000)
    assert os.path.exists(tmp_path / "out" / "model.safetensors.index.json")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    theirs = dict(hf.named_parameters())
    for name, p in back.named_parameters():
        assert torch.equal(p, theirs[name]), name


def test_phi3_fused_checkpoint_round_trips(tmp_path):
    make_hf_checkpoint("phi3_default", str(tmp_path / "src"))
    ours = AutoLigerModel.from_hf(str(tmp_path / "src"))
    ours.save_hf(str(tmp_path / "out"))
    again = AutoLigerModel.from_hf(str(tmp_path / "out"))
    for (n, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


def test_loading_with_the_wrong_family_class_names_both(tmp_path):
    make_hf_checkpoint("qwen2_untied", str(tmp_path))
    with pytest.raises(Exception, match="qwen2.*LigerQwen2"):
        LigerLlama.from_hf(str(tmp_path))


def test_loaded_dtype_and_device(tmp_path):
    make_hf_checkpoint("llama_gqa_untied", str(tmp_path))
    m = load_hf(str(tmp_path), dtype="bf16")
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert not any(p.is_meta for p in m.parameters())


NEW_FAMILY_CASES = [c for c in CASES if c.startswith(("qwen3", "phi3_partial", "gemma2", "gemma3", "glm4", "mixtral"))]


@pytest.mark.parametrize("case", NEW_FAMILY_CASES)
def test_packed_documents_match_transformers_per_document(case, tmp_path):
    """Two documents packed in one row (positions restarting, document_ids) give the logits transformers gives
    each document alone; windows, soft-capping and the local rotary table all act inside a document."""
    hf = make_hf_checkpoint(case, str(tmp_path))
    ours = AutoLigerModel.from_hf(str(tmp_path), dtype=torch.float32, device=DEVICE)
    ids = torch.randint(0, hf.config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(5))
    position_ids = torch.cat([torch.arange(7), torch.arange(6)])[None]
    with torch.no_grad():
        ref = torch.cat([hf(input_ids=ids[:, :7]).logits, hf(input_ids=ids[:, 7:]).logits], dim=1)
        out = ours(ids.to(DEVICE), position_ids.to(DEVICE), document_ids_from_positions(position_ids).to(DEVICE))
    assert rel_err(out, ref) <= 1e-4, f"{case}: packed logits rel err {rel_err(out, ref):.2e}"


@pytest.mark.parametrize("case", NEW_FAMILY_CASES)
def test_new_family_saves_back_bit_for_bit_and_writes_its_config_from_fields(case, tmp_path):
    """save_hf of a loaded checkpoint writes the same config.json and the same tensors, bit for bit; a config
    built from fields (config_to_hf, no hf_config) reads back equal and transformers computes the same model."""
    import json

    from safetensors import safe_open

    from ligermodels import CausalLM, config_from_hf, config_to_hf

    hf = make_hf_checkpoint(case, str(tmp_path / "src"))
    ours = AutoLigerModel.from_hf(str(tmp_path / "src"))
    assert ours.config.num_params() == sum(p.numel() for p in ours.parameters())
    ours.save_hf(str(tmp_path / "out"))

    def tensors(d):
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    src, out = tensors(tmp_path / "src"), tensors(tmp_path / "out")
    assert set(src) == set(out)
    for k, v in src.items():
        assert v.dtype == out[k].dtype and torch.equal(v, out[k]), k
    read = lambda d: json.loads((d / "config.json").read_text())  # noqa: E731
    assert read(tmp_path / "src") == read(tmp_path / "out")

    cfg = ours.config.replace(hf_config={})
    d = config_to_hf(cfg)
    assert config_from_hf(d) == cfg
    scratch = CausalLM(cfg)
    scratch.load_state_dict(ours.state_dict())
    scratch.save_hf(str(tmp_path / "scratch"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "scratch"),
                                                             attn_implementation="eager").eval()
    ids, _ = _batch(hf.config.vocab_size)
    with torch.no_grad():
        assert rel_err(back(input_ids=ids).logits, hf(input_ids=ids).logits) <= 1e-6


def _gemma3_multimodal_checkpoint(directory: str, tie: bool = True):
    """A tiny random Gemma 3 image-text checkpoint (Gemma3ForConditionalGeneration); returns the fp32 HF model."""
    text = dict(SMALL, head_dim=24, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                pad_token_id=0, query_pre_attn_scalar=20, final_logit_softcapping=3.0)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       boi_token_index=97, eoi_token_index=98, image_token_index=99,
                                       tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    return model.eval()


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_gemma3_image_text_checkpoint_loads_its_language_model(tie, tmp_path):
    """A gemma3 (image-text) checkpoint loads as LigerGemma3: the language model matches transformers' logits
    on text, the vision tower and projector are skipped with a warning naming them, and save_hf writes a
    gemma3_text checkpoint that transformers loads as Gemma3ForCausalLM with the same logits."""
    from ligermodels import LigerGemma3

    hf = _gemma3_multimodal_checkpoint(str(tmp_path / "src"), tie)
    with pytest.warns(UserWarning, match="only its language model loads.*(vision_tower|multi_modal_projector)"):
        ours = LigerGemma3.from_hf(str(tmp_path / "src"), dtype=torch.float32, device=DEVICE)
    assert ours.config.model_type == "gemma3_text" and ours.config.tie_embeddings == tie
    ids, _ = _batch(101)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        assert rel_err(ours(ids.to(DEVICE)), ref) <= 1e-4
    ours.save_hf(str(tmp_path / "text"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "text"), attn_implementation="eager")
    assert type(back).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        assert rel_err(back.eval()(input_ids=ids).logits, ref) <= 1e-6


@pytest.mark.parametrize("case", ["qwen3_tied_sliding_bias", "phi3_partial_rotary", "gemma2_tied_softcap_sliding",
                                  "gemma3_tied_two_ropes", "glm4_bias_untied", "gemma3_image_text"])
def test_verify_command_passes_for_the_new_families(case, tmp_path, capsys, reference_kernels):
    """``ligermodels.verify``'s entry point in this process (the command line itself runs in
    tests/test_checkpoints.py), on the PyTorch kernels."""
    from ligermodels.verify import main as verify_main

    if case == "gemma3_image_text":
        _gemma3_multimodal_checkpoint(str(tmp_path))
    else:
        make_hf_checkpoint(case, str(tmp_path))
    code = verify_main([str(tmp_path), "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "(eager attention)" in out, out  # the attention that computes soft-capping (Gemma 2)
    err = float(out.split("relative error vs transformers")[1].split(":")[1])
    assert err < 1e-4, out


def test_selective_activation_checkpointing_keeps_qk_norm_gradients(tmp_path):
    from ligermodels.train.parallelize import apply_activation_checkpointing

    make_hf_checkpoint("qwen3_untied_headdim", str(tmp_path))
    ids = torch.randint(4, 100, (2, 16), generator=torch.Generator().manual_seed(0))

    def grads(ac: str) -> dict[str, torch.Tensor]:
        model = AutoLigerModel.from_hf(str(tmp_path), dtype=torch.float32, device=DEVICE).train()
        apply_activation_checkpointing(model, ac)
        model.loss(ids.to(DEVICE), ids.to(DEVICE)).backward()
        return {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}

    ref, got = grads("none"), grads("selective")
    for k in ref:
        assert rel_err(got[k], ref[k]) <= 1e-6, k


def test_gemma3_old_config_layout_reads_like_transformers(tmp_path):
    """The layout of the hub's Gemma 3 configs: rope_theta + rope_scaling for full layers, rope_local_base_freq for
    sliding ones, sliding_window_pattern instead of layer_types; read as transformers reads it."""
    import json

    hf = make_hf_checkpoint("gemma3_tied_two_ropes", str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["rope_parameters"], cfg["layer_types"]
    cfg.update(rope_theta=5000.0, rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
               sliding_window_pattern=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = AutoLigerModel.from_hf(str(tmp_path), dtype=torch.float32, device=DEVICE)
    assert ours.config.layer_windows == (5, None) and ours.config.local_rope.theta == 100.0
    ids, _ = _batch(hf.config.vocab_size)
    with torch.no_grad():
        assert rel_err(ours(ids.to(DEVICE)), hf(input_ids=ids).logits) <= 1e-4
