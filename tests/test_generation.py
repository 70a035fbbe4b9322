"""Generation with the static KV cache against transformers' greedy ``generate``, token for token.

Every family runs on a tiny random checkpoint (``make_hf_checkpoint``), several with a left-padded batch
of prompts of different lengths. The cases cover sliding windows shorter than the generated sequence
(Mistral, Qwen2), Phi-3 longrope crossing ``original_max_position_embeddings`` during decode (HF drops
and recomputes its cache there), and, on Llama, longrope and dynamic-NTK rope whose frequencies change
during decode while cached keys keep theirs. Then EOS handling, sampling, the cache attention, the
compiled decode step and ``load_tokenizer``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from checkpoints_tools.hub import CheckpointError
from ligermodels import AutoLigerModel, DecoderConfig, LigerLlama, load_tokenizer, sample_next
from ligermodels.generation import KVCache, cached_attention, decode_step, prefill
from tests.test_models import CASES, SMALL, _longrope, make_hf_checkpoint
from tests.utils import DEVICE, assert_triton_runs

NEW = 8
PAD = 0
BATCHED = ("llama_gqa_untied", "qwen2_bias_tied_sliding", "mistral_sliding_headdim", "phi3_longrope",
           "gemma_tied_headdim", "qwen3_tied_sliding_bias", "phi3_partial_rotary", "gemma2_tied_softcap_sliding",
           "gemma3_tied_two_ropes", "glm4_bias_untied")


def _prompts(vocab: int, batched: bool, seq: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask): one prompt, or two left-padded ones of lengths ``seq`` and ``seq - 2``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2 if batched else 1, seq), generator=g)
    mask = torch.ones_like(ids)
    if batched:
        ids[1, :2], mask[1, :2] = PAD, 0
    return ids, mask


def _hf_greedy(hf, ids, mask, new=NEW, eos=None, use_cache=True):
    hf.generation_config.eos_token_id = None  # the checkpoints' default EOS ids must not stop HF only
    return hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, eos_token_id=eos,
                       pad_token_id=PAD, use_cache=use_cache)


#: transformers versions whose Phi-3 generation drops its cache at the longrope switch (to recompute it with the
#: long factors) but then runs only the newest token, without the earlier ones: 5.23 also resets the length it
#: slices the inputs to (``next_sequence_length``) there. Generating without a cache recomputes every step on
#: the whole sequence, which is what the cache drop means, on any version.
PHI3_SWITCH_FIXED = (5, 23)


def _check(ours, hf, ids, mask, new=NEW, eos=None):
    expected = _hf_greedy(hf, ids, mask, new, eos)
    out = ours.generate(ids.to(DEVICE), new, attention_mask=mask.to(DEVICE), eos_token_id=eos, pad_token_id=PAD)
    assert out.shape == expected.shape and torch.equal(out.cpu(), expected), f"\nours {out}\nHF   {expected}"
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(case, tmp_path):
    import transformers

    hf = make_hf_checkpoint(case, str(tmp_path))
    ours = AutoLigerModel.from_hf(str(tmp_path), dtype=torch.float32, device=DEVICE)
    assert_triton_runs(ours.embed.weight)
    ids, mask = _prompts(hf.config.vocab_size, batched=case in BATCHED)
    switch = case in ("phi3_longrope", "phi3_partial_longrope")  # the sequence crosses the long-factor switch
    if switch:
        expected = _hf_greedy(hf, ids, mask, use_cache=False)
        out = ours.generate(ids.to(DEVICE), NEW, attention_mask=mask.to(DEVICE), pad_token_id=PAD)
        assert torch.equal(out.cpu(), expected), f"\nours {out}\nHF without a cache {expected}"
        assert ids.shape[1] <= ours.config.rope.original_max < out.shape[1]
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    if not switch or version >= PHI3_SWITCH_FIXED:
        out = _check(ours, hf, ids, mask)
    assert out.shape == (ids.shape[0], ids.shape[1] + NEW)
    if case.startswith(("mistral", "qwen2_bias", "qwen3_tied", "gemma2_tied", "gemma3")):  # window < sequence
        assert min(w for w in ours.config.layer_windows if w) < out.shape[1]


def _hf_model(cls_name: str, kwargs: dict, directory: str, seed: int = 0):
    """make_hf_checkpoint for configs that are not among the model tests' cases."""
    return make_hf_checkpoint((cls_name, kwargs), directory, seed=seed)


@pytest.mark.parametrize("rope", [
    dict(_longrope(16), original_max_position_embeddings=8),  # switches to long factors at length 9
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},  # grows past max_position_embeddings=10
], ids=["longrope", "dynamic"])
def test_length_dependent_rope_keeps_cached_keys_like_transformers(rope, tmp_path):
    # Outside Phi-3, HF rotates each call's tokens with the frequencies of max(position_ids) + 1 of that
    # call; cached keys keep the rotation they were stored with.
    hf = _hf_model("LlamaConfig", dict(SMALL, max_position_embeddings=10, rope_parameters=rope), str(tmp_path))
    ours = AutoLigerModel.from_hf(str(tmp_path), dtype=torch.float32, device=DEVICE)
    ids, mask = _prompts(hf.config.vocab_size, batched=False, seq=5)
    _check(ours, hf, ids, mask, new=10)


def test_eos_per_row_then_padding_and_early_stop(tmp_path):
    hf = make_hf_checkpoint("llama_gqa_untied", str(tmp_path))
    ours = AutoLigerModel.from_hf(str(tmp_path), dtype=torch.float32, device=DEVICE)
    ids, mask = _prompts(hf.config.vocab_size, batched=True)
    s = ids.shape[1]
    free = ours.generate(ids.to(DEVICE), NEW, attention_mask=mask.to(DEVICE)).cpu()
    # row 0 stops at its 2nd new token, row 1 at its 4th (ids chosen where each first appears in its row)
    e0 = free[0, s + 1].item()
    e1 = next(t for t in free[1, s + 3:].tolist() if t not in free[0, s:s + 2].tolist() and t != e0)
    out = _check(ours, hf, ids, mask, eos=[e0, e1])
    row0 = out[0, s:].tolist()
    assert e0 in row0 and all(t == PAD for t in row0[row0.index(e0) + 1:])
    assert out.shape[1] <= s + NEW
    one = ours.generate(ids[:1].to(DEVICE), NEW, eos_token_id=e0, pad_token_id=PAD)  # int id, stops early
    assert one.shape[1] == s + free[0, s:].tolist().index(e0) + 1


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    # head_dim 16: Inductor's attention lowering (compiled decode on CUDA) needs at least 16.
    cfg = DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, max_position_embeddings=64)
    return LigerLlama(cfg).init_weights(std=0.2).to(DEVICE).eval()


def test_sampling_is_reproducible_and_top_k_1_is_greedy(tiny):
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0)).to(DEVICE)

    def gen(seed):
        return torch.Generator(device=DEVICE).manual_seed(seed)

    a = tiny.generate(ids, 4, temperature=1.5, top_p=0.95, generator=gen(3))
    b = tiny.generate(ids, 4, temperature=1.5, top_p=0.95, generator=gen(3))
    assert torch.equal(a, b)
    greedy = tiny.generate(ids, 4)
    assert torch.equal(tiny.generate(ids, 4, temperature=2.0, top_k=1, generator=gen(5)), greedy)
    assert torch.equal(tiny.generate(ids, 4, temperature=2.0, top_p=1e-6, generator=gen(5)), greedy)


def test_sample_next_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(logits[:3]), torch.zeros(3, dtype=torch.long))
    k2 = sample_next(logits, 1.0, top_k=2, generator=g)
    assert set(k2.tolist()) == {0, 1} and abs((k2 == 0).float().mean().item() - 0.5 / 0.8) < 0.05
    p = sample_next(logits, 1.0, top_p=0.85, generator=g)  # 0.5 + 0.3 < 0.85: the third token stays
    assert set(p.tolist()) == {0, 1, 2}
    p = sample_next(logits, 1.0, top_p=0.8, generator=g)  # 0.5 + 0.3 reaches 0.8
    assert set(p.tolist()) == {0, 1}
    hot = sample_next(logits, 100.0, generator=g)  # high temperature flattens towards uniform
    assert abs((hot == 3).float().mean().item() - 0.25) < 0.05


@pytest.mark.parametrize("top_p", [0.0, 0.3, 0.5, 0.6, 0.75, 0.8, 0.875, 0.9375, 1.0])
def test_top_p_keeps_the_smallest_set_reaching_top_p_like_transformers(top_p):
    """At an exact boundary (the most likely tokens sum to top_p) the next token is dropped, as in HF."""
    from transformers.generation.logits_process import TopPLogitsWarper

    probs = torch.tensor([0.125, 0.5, 0.0625, 0.25, 0.03125, 0.03125])  # exact in binary: ties are real ties
    logits = probs.log()[None]
    hf_kept = set(torch.isfinite(TopPLogitsWarper(top_p)(None, logits.clone())[0]).nonzero().flatten().tolist())
    drawn = sample_next(logits.repeat(2000, 1), 1.0, top_p=top_p, generator=torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == hf_kept


def test_sampling_arguments_out_of_range_raise(tiny):
    logits = torch.log(torch.tensor([[0.97, 0.01, 0.01, 0.01]]))
    for kwargs, name in [(dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
                         (dict(temperature=1.0, top_p=-0.1), "top_p"), (dict(temperature=1.0, top_p=1.5), "top_p"),
                         (dict(temperature=1.0, top_k=-1), "top_k")]:
        with pytest.raises(ValueError, match=f"^{name} must be"):
            sample_next(logits, **kwargs)
        with pytest.raises(ValueError, match=f"^{name} must be"):
            tiny.generate(torch.ones(1, 3, dtype=torch.long, device=DEVICE), 2, **kwargs)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    greedy = tiny.generate(ids, 3)  # temperature 0 and None stay greedy; top_k 0 and top_p 1 are "off"
    assert torch.equal(tiny.generate(ids, 3, temperature=None, top_k=0, top_p=1.0), greedy)


@pytest.mark.parametrize("seed", range(4))
def test_top_p_keeps_transformers_set_with_tied_and_bf16_rounded_logits(seed):
    """Ties and rounding near the cut: the kept set is TopPLogitsWarper's, token for token (the filter
    itself is compared; sampling draws only from what it keeps)."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from ligermodels.generation import filtered_logits

    g = torch.Generator().manual_seed(seed)
    tied = torch.tensor([[2.0, 0.0, 2.0, 1.0, 2.0, 1.0, 1.0, 0.0]])  # tied maxima and ties across the cut
    wide = (3 * torch.randn(3, 32000, generator=g)).to(torch.bfloat16).float()  # bf16 rounding: many ties
    for logits in (tied, wide):
        for top_p in (0.2, 0.3, 0.5, 0.9, 0.99):
            hf = torch.isfinite(TopPLogitsWarper(top_p)(None, logits.clone()))
            assert torch.equal(torch.isfinite(filtered_logits(logits, None, top_p)), hf), f"top_p={top_p}"
        hf = torch.isfinite(TopPLogitsWarper(0.9)(None, TopKLogitsWarper(3)(None, logits.clone())))
        assert torch.equal(torch.isfinite(filtered_logits(logits, 3, 0.9)), hf), "top_k then top_p"


def test_generate_arguments_of_the_wrong_type_or_range_raise_before_any_work(tiny, monkeypatch):
    import numpy as np

    import ligermodels.generation as generation

    ids = torch.ones(2, 3, dtype=torch.long, device=DEVICE)
    monkeypatch.setattr(generation, "prefill", lambda *a, **k: pytest.fail("the prefill ran"))
    for kwargs, name in [(dict(max_new_tokens=-3), "max_new_tokens"), (dict(max_new_tokens=2.5), "max_new_tokens"),
                         (dict(max_new_tokens=True), "max_new_tokens"),
                         (dict(max_new_tokens=2, temperature=1.0, top_k=2.5), "top_k"),
                         (dict(max_new_tokens=2, temperature="hot"), "temperature")]:
        with pytest.raises(ValueError, match=f"^{name} must be"):
            tiny.generate(ids, **kwargs)
    with pytest.raises(ValueError, match="attention_mask"):  # checked even when nothing is generated
        tiny.generate(ids, 0, attention_mask=torch.ones(2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="input_ids must be"):
        tiny.generate(ids[0], 2)
    monkeypatch.undo()
    assert tiny.generate(ids, 2, eos_token_id=np.int64(5)).shape[0] == 2  # a numpy integer id is an id
    greedy = tiny.generate(ids, 3)  # 0-dim tensors and numpy scalars stand for numbers, as in transformers
    assert torch.equal(tiny.generate(ids, torch.tensor(3), temperature=torch.tensor(0.0)), greedy)
    assert torch.equal(tiny.generate(ids, np.int64(3), temperature=2.0, top_k=torch.tensor(1),
                                     top_p=np.float32(0.9), generator=torch.Generator(device=DEVICE)), greedy)


def test_a_right_padded_attention_mask_is_refused(tiny):
    ids = torch.ones(2, 4, dtype=torch.long, device=DEVICE)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], device=DEVICE)
    with pytest.raises(ValueError, match="left-padded"):
        tiny.generate(ids, 2, attention_mask=mask)


def test_a_row_of_padding_only_generates_like_transformers(tmp_path):
    hf = make_hf_checkpoint("llama_gqa_untied", str(tmp_path))
    ours = AutoLigerModel.from_hf(str(tmp_path), dtype=torch.float32, device=DEVICE)
    ids, mask = _prompts(hf.config.vocab_size, batched=True)
    mask[1] = 0
    ids[1] = PAD
    _check(ours, hf, ids, mask)


def test_cached_attention_matches_masked_softmax():
    torch.manual_seed(0)
    b, s, hq, hkv, d, length = 2, 3, 6, 2, 8, 7
    q = torch.randn(b, s, hq, d)
    k, v = torch.randn(b, length, hkv, d), torch.randn(b, length, hkv, d)
    allowed = torch.rand(b, 1, s, length) > 0.4
    allowed[..., 0] = True
    out = cached_attention(q, k, v, allowed, scale=0.3)
    kr, vr = k.repeat_interleave(hq // hkv, dim=2), v.repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("bshd,blhd->bhsl", q, kr) * 0.3
    ref = torch.einsum("bhsl,blhd->bshd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vr)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    one = cached_attention(q[:, :1].contiguous(), k, v, allowed[:, :, :1], scale=0.3)
    torch.testing.assert_close(one, ref[:, :1], rtol=1e-5, atol=1e-5)


def test_cache_shapes_and_decode_logits_match_full_forward(tiny):
    cache = KVCache(tiny.config, 2, 9, torch.float32, DEVICE)
    assert cache.k[0].shape == (2, 9, 2, tiny.config.head_dim) and len(cache.v) == 2
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    pos = torch.arange(9, device=DEVICE).expand(2, 9)
    steps = [prefill(tiny, cache, ids[:, :5], pos[:, :5])]
    steps += [decode_step(tiny, cache, ids[:, j:j + 1], pos[:, j:j + 1], cache.slots[j:j + 1]) for j in range(5, 9)]
    with torch.no_grad():
        full = tiny(ids)[:, 4:].float()
    torch.testing.assert_close(torch.stack(steps, 1), full, rtol=1e-4, atol=1e-4)


def test_load_tokenizer_from_checkpoint_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(str(tmp_path)).encode("hello world").ids == [1, 2]
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=str(tmp_path)):
        load_tokenizer(str(tmp_path))


_COMPILE_SCRIPT = """
import torch
from ligermodels import DecoderConfig, LigerMistral
torch.manual_seed(0)
cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    sliding_window=4, model_type="mistral")
model = LigerMistral(cfg).init_weights(std=0.2).eval()
ids = torch.randint(1, 64, (2, 5))
mask = torch.ones_like(ids)
mask[1, :2] = 0
eager = model.generate(ids, 6, attention_mask=mask)
first = model.generate(ids, 6, attention_mask=mask, compile=True)
frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
again = model.generate(ids, 6, attention_mask=mask, compile=True)
assert torch.equal(first, eager) and torch.equal(again, eager), (eager, first, again)
assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames, "the second call recompiled"
print("OK", frames)
"""


def test_compiled_decode_matches_eager_and_is_reused():
    if torch.cuda.is_available():
        pytest.skip("covered by the CUDA test below")
    # The interpreter cannot run under torch.compile's fake tensors: compile with the reference kernels.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_compiled_decode_matches_eager_cuda(tiny):
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    eager = tiny.generate(ids, 6, attention_mask=mask)
    for _ in range(2):  # the second call replays the captured graphs
        assert torch.equal(tiny.generate(ids, 6, attention_mask=mask, compile=True), eager)
