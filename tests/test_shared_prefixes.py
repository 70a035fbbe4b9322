"""Shared prefixes (``--prompt-pass once``): a pair's prompt stored once in the model's row while attention sees both
sequences whole. The log-probs and every gradient equal those of packing each sequence in full, for the families'
attention variants (windows, soft-capping, two rotary tables, q/k norms, partial rotary)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels._common import use_triton
from ligermodels import AutoLigerModel
from ligermodels.attention import SharedPrefixes
from ligermodels.train.preference import (
    PackedSequences,
    PreferenceExample,
    Sequence,
    SharedRoom,
    head_row_count,
)
from tests.test_models import make_hf_checkpoint
from tests.utils import DEVICE, rel_err

transformers = pytest.importorskip("transformers")


def _pairs(vocab: int, seed: int = 0) -> list[Sequence]:
    """Three pairs (chosen, rejected): prompts longer than the test models' window of 5, completions of odd
    lengths; the last pair's completions begin with the same two tokens (shared beyond the prompt)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, c, r) in enumerate(((7, 4, 6), (9, 5, 3), (6, 7, 5))):
        prompt = torch.randint(1, vocab, (p,), generator=g).tolist()
        chosen, rejected = (torch.randint(1, vocab, (n,), generator=g).tolist() for n in (c, r))
        if i == 2:
            rejected[:2] = chosen[:2]
        out += [Sequence(prompt + chosen, p), Sequence(prompt + rejected, p)]
    return out


def test_a_shared_row_stores_each_pairs_common_prefix_once_and_attends_over_whole_sequences():
    seqs = [Sequence([1, 2, 3, 4], 2), Sequence([1, 2, 5], 2), Sequence([7, 8], 1), Sequence([7, 9, 9], 1)]
    p = PackedSequences.pack(seqs, group=2, share_prefixes=True, head="completion")
    assert p.input_ids.tolist() == [[1, 2, 3, 4, 5, 7, 8, 9, 9]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 1, 2]]  # the rejected rest continues the prompt
    shared = p.documents
    assert isinstance(shared, SharedPrefixes)
    # the attention row is every sequence whole, each position taken from the model's row
    assert p.input_ids[0, shared.gather].tolist() == [t for s in seqs for t in s.ids]
    assert shared.documents.cu_seqlens.tolist() == [0, 4, 7, 9, 12]
    assert shared.scatter.tolist() == [0, 1, 2, 3, 6, 7, 8, 10, 11]  # each token's first occurrence
    assert shared.repeats.tolist() == [4, 5, 9] and shared.repeat_rows.tolist() == [0, 1, 5]
    # the head: the prompt's last token (rows 1 and 5) predicts both completions' first tokens
    assert p.head_rows.tolist() == [1, 2, 1, 5, 5, 7]
    assert p.targets.tolist() == [3, 4, 5, 8, 9, 9]
    assert p.segment.tolist() == [0, 0, 1, 2, 3, 3] and p.completion.all()
    assert p.group_ends == (3, 6)
    # ORPO's head adds the chosen sequences' prompt positions (its NLL), not the rejected ones'
    orpo = PackedSequences.pack(seqs, group=2, share_prefixes=True, head="first")
    assert orpo.head_rows.tolist() == [0, 1, 2, 1, 5, 5, 7] and orpo.group_ends == (4, 7)
    assert orpo.targets.tolist() == [2, 3, 4, 5, 8, 9, 9]
    # nothing shared: the plain row
    plain = PackedSequences.pack([Sequence([1, 2], 1), Sequence([3, 4], 1)], group=2, share_prefixes=True)
    assert not isinstance(plain.documents, SharedPrefixes) and plain.input_ids.tolist() == [[1, 2, 3, 4]]


def _logprobs_and_grads(model, rows: PackedSequences, weights: torch.Tensor):
    model.zero_grad(set_to_none=True)
    rows = rows.to(DEVICE)
    logp = model.token_logprobs(rows.input_ids, rows.targets.to(DEVICE), rows.position_ids, rows.documents,
                                head_rows=rows.head_rows)
    (logp * weights).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", ["llama_gqa_untied", "mistral_sliding_headdim", "qwen3_tied_sliding_bias",
                                  "phi3_partial_rotary", "gemma2_tied_softcap_sliding", "gemma3_tied_two_ropes",
                                  "glm4_tied_headdim"])
def test_shared_prompts_give_the_whole_sequences_logprobs_and_gradients_in_float64(case, tmp_path, reference_kernels):
    make_hf_checkpoint(case, str(tmp_path))
    model = AutoLigerModel.from_hf(str(tmp_path), dtype=torch.float64, device=DEVICE)
    seqs = _pairs(model.config.vocab_size)
    whole = PackedSequences.pack(seqs, group=2, head="completion")
    shared = PackedSequences.pack(seqs, group=2, share_prefixes=True, head="completion")
    assert shared.input_ids.shape[1] < whole.input_ids.shape[1]
    assert torch.equal(whole.targets, shared.targets) and torch.equal(whole.segment, shared.segment)
    weights = torch.randn(whole.targets.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref, ref_grads = _logprobs_and_grads(model, whole, weights.to(DEVICE))
    out, grads = _logprobs_and_grads(model, shared, weights.to(DEVICE))
    assert rel_err(out, ref) <= 1e-12
    assert set(grads) == set(ref_grads)
    # The prompt's two gradients are summed before a kernel's backward instead of after, so a kernel that computes in
    # fp32 rounds differently: the Triton kernels on a GPU (fp32 inside, whatever the input), and the soft-capped
    # attention's fp32 softmax (HF's arithmetic) on the CPU.
    bound = 1e-6 if use_triton(model.embed.weight) else 1e-7 if model.config.attn_softcap else 1e-10
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) <= bound, (name, rel_err(grads[name], g))


@pytest.mark.parametrize("case", ["llama_gqa_untied", "gemma2_tied_softcap_sliding"])
def test_a_shared_row_padded_to_fixed_sizes_keeps_its_logprobs_and_gradients_in_float64(case, tmp_path,
                                                                                       reference_kernels):
    """``--cuda-graph`` with each prompt once (:meth:`PackedSequences.padded_shared`, rebuilt from its flat tensors
    as a captured step does): every real head row's log-prob and every gradient are the unpadded row's, though the
    room adds filler tokens beyond the attention row's filler, padding repeats and head rows in slots, and the
    filler's own head rows carry weights (they read nothing: log-prob 0, no gradient)."""
    make_hf_checkpoint(case, str(tmp_path))
    model = AutoLigerModel.from_hf(str(tmp_path), dtype=torch.float64, device=DEVICE)
    seqs = _pairs(model.config.vocab_size)
    examples = [PreferenceExample((seqs[i], seqs[i + 1]), "x") for i in range(0, len(seqs), 2)]
    rows = PackedSequences.pack(seqs, group=2, share_prefixes=True, head="completion")
    room = SharedRoom.of(examples, 3, "completion")
    slot = room.head_slot or -(-max(head_row_count(e, "completion") for e in examples) // 16) * 16 + 16
    room = dataclasses.replace(room, tokens=room.tokens + 7, repeats=room.repeats + 5, head_slot=slot, head=3 * slot)
    padded = rows.padded_shared(room, seq_len=16)
    flat = padded.flat()
    assert [t.numel() for t in flat[:3]] == [room.tokens, room.tokens, room.head]
    assert [t.numel() for t in flat[-4:]] == [room.attention, room.tokens, room.repeats, room.repeats]
    rebuilt = PackedSequences.from_flat(flat, 16)
    assert padded.group_ends == (slot, 2 * slot, 3 * slot)

    g = torch.Generator().manual_seed(3)
    weights = torch.randn(rows.targets.shape, generator=g, dtype=torch.float64)
    padded_weights = torch.randn(room.head, generator=g, dtype=torch.float64)  # the filler's too
    real = torch.cat([torch.arange(start, start + b - a) for start, a, b in zip(
        range(0, room.head, slot), (0, *rows.group_ends[:-1]), rows.group_ends, strict=True)])
    padded_weights[real] = weights
    ref, ref_grads = _logprobs_and_grads(model, rows, weights.to(DEVICE))
    out, grads = _logprobs_and_grads(model, rebuilt, padded_weights.to(DEVICE))
    triton = use_triton(model.embed.weight)  # on a GPU: fp32 inside the kernels, GEMMs of other sizes
    assert rel_err(out[real.to(DEVICE)], ref) <= (1e-9 if triton else 1e-12)
    filler = torch.ones(room.head, dtype=torch.bool)
    filler[real] = False
    assert filler.sum() > 0 and out[filler.to(DEVICE)].abs().max() == 0
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) <= (1e-6 if triton else 1e-10), (name, rel_err(grads[name], g))
    # a micro-batch longer than the room (an example twice across an epoch boundary) does not pad
    assert rows.padded_shared(dataclasses.replace(room, attention=rows.documents.length), 16) is None


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the bf16 attention kernels need CUDA")
@pytest.mark.parametrize("head_dim", [64, 96])
def test_shared_prompts_in_bf16_stay_within_rounding_of_whole_sequences_on_the_attention_kernels(head_dim, tmp_path,
                                                                                                   monkeypatch):
    """bf16 on a GPU: the Triton document kernel (head dim 64) and FlashAttention's variable-length one (96) take
    the gathered rows (each call counted, so no other path stands in); log-probs and gradients within bf16 rounding
    of the whole sequences' (the prompt's work summed once instead of twice)."""
    import ligermodels.attention as attention

    kernel = "document_attention" if head_dim == 64 else "flash_varlen_attention"
    calls = []
    real = getattr(attention, kernel)
    monkeypatch.setattr(attention, kernel, lambda q, *a, **k: calls.append(q.shape[1]) or real(q, *a, **k))
    cfg = dict(vocab_size=96, hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=256)
    make_hf_checkpoint(("LlamaConfig", cfg), str(tmp_path))
    model = AutoLigerModel.from_hf(str(tmp_path), dtype=torch.bfloat16, device=DEVICE)
    seqs = _pairs(96, seed=1)
    weights = torch.randn(PackedSequences.pack(seqs, group=2, head="completion").targets.shape,
                          generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ref, ref_grads = _logprobs_and_grads(model, PackedSequences.pack(seqs, group=2, head="completion"), weights)
    shared = PackedSequences.pack(seqs, 2, True, "completion")
    out, grads = _logprobs_and_grads(model, shared, weights)
    whole_len = sum(len(s.ids) for s in seqs)  # every layer's call, both runs: attention on whole sequences
    assert calls == [whole_len] * 4 and shared.input_ids.shape[1] < whole_len, calls
    assert rel_err(out, ref) <= 1e-2
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) <= 3e-2, (name, rel_err(grads[name], g))
