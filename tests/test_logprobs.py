"""kernels.logprobs and CausalLM.token_logprobs against float64 autograd of the plain math.

The head: ``fused_linear_logprobs`` (per token) and ``fused_linear_sequence_logprobs`` (summed per segment) against
``fused_linear_sequence_logprobs_reference`` run on float64 copies of the inputs, forward and the gradients of
hidden, weight and bias, in fp32 and bf16, for both strategies of the chunked cross-entropy loop they run on, with
and without soft-capping. Shapes are odd (N = 45 tokens, H = 40, V = 777) and the loop is forced small: "tokens"
runs chunks of 16, 16, 13 tokens, "vocab" windows of 300, 300, 177 columns, each row spanning several 256-wide
blocks. The upstream gradient is random per segment, and segments interleave, so each token's gradient differs
from its neighbours'. A spy checks that the Triton loop of the requested strategy ran, forward and backward, and
the PyTorch fallback is made to raise.

The model: a tiny Llama (untied head) and a tiny Gemma 2 (tied head, final soft-capping) on two rows of packed
sequences (positions restarting at 0, ``Documents.from_positions``), the head's loop again forced into 3 chunks or
windows: each entry equals transformers' float64 log-softmax of the same sequence run alone (so attention across
sequences, a missed soft-cap or a misaligned label would show), and the gradient of a weighted sum of the entries
with respect to every parameter equals autograd's through that float64 path.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.logprobs import (
    fused_linear_logprob_loss,
    fused_linear_logprobs,
    fused_linear_sequence_logprobs,
    fused_linear_sequence_logprobs_reference,
    group_chunks,
    sequence_sums,
)
from ligermodels import CausalLM
from ligermodels.attention import Documents
from ligermodels.hf_io import hf_tensors
from tests.utils import DEVICE, assert_rel, assert_triton_runs, assert_unchanged, randn, rel_err, snapshot

ce = importlib.import_module("kernels.cross_entropy")  # the module (``kernels.cross_entropy`` is also a function)

DTYPES = [torch.float32, torch.bfloat16]
STRATEGIES = ["tokens", "vocab"]
N_TOKENS, HIDDEN, VOCAB = 45, 40, 777
N_SEGMENTS = 6  # tokens go to segments 0..4; segment 5 stays empty
CHUNK = 16  # 45 tokens -> chunks of 16, 16, 13
WINDOW = 300  # V = 777 -> windows of 300, 300, 177
#: the custom ops each strategy's forward and backward must run ("none" reduction: backward reruns the loop)
OPS = {"tokens": ("_flce_fwd", "_flce_bwd"), "vocab": ("_flce_vocab_fwd", "_flce_vocab_bwd")}


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    """Several chunks / windows on small shapes; the PyTorch fallback raises, so only the kernels can answer."""
    monkeypatch.setattr(ce, "CE_MAX_BLOCK", 256)
    monkeypatch.setattr(ce, "FLCE_CHUNK_SIZE", CHUNK)
    monkeypatch.setattr(ce, "FLCE_VOCAB_CHUNK", WINDOW)

    def _no_fallback(*args, **kwargs):
        raise AssertionError("fused_linear_cross_entropy fell back to its PyTorch reference")

    monkeypatch.setattr(ce, "fused_linear_cross_entropy_reference", _no_fallback)


@pytest.fixture
def op_calls(monkeypatch):
    """Counts the calls of the FLCE loop ops (forward and backward of both strategies)."""
    calls = {name: 0 for pair in OPS.values() for name in pair}
    for name in calls:
        original = getattr(ce, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(ce, name, counted)
    return calls


def _assert_ran(calls, strategy):
    fwd, bwd = OPS[strategy]
    assert calls[fwd] == 1 and calls[bwd] == 1, f"{strategy}: loop ops called {calls}"
    other = [n for s, pair in OPS.items() if s != strategy for n in pair]
    assert all(calls[n] == 0 for n in other), f"{strategy}: the other strategy's loop ran: {calls}"


def _case(dtype, bias, seed):
    """hidden (N, H), weight (V, H), bias (V,) or None, leaves in ``dtype``; logits of a few units."""
    hidden = randn(N_TOKENS, HIDDEN, dtype=dtype, seed=seed).requires_grad_()
    weight = randn(VOCAB, HIDDEN, dtype=dtype, scale=0.4, seed=seed + 1).requires_grad_()
    b = randn(VOCAB, dtype=dtype, scale=0.5, seed=seed + 2).requires_grad_() if bias else None
    return hidden, weight, b


def _targets(n, ignore_index=-100, seed=0):
    """Targets in [0, V) with a quarter of them ``ignore_index``."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, VOCAB, (n,), generator=g)
    t[torch.randperm(n, generator=g)[: n // 4]] = ignore_index
    return t.to(DEVICE)


def _segments_and_mask(n, seed=0):
    """Interleaved segment ids in [0, N_SEGMENTS - 1) (the last segment is empty) and a 0/1 float mask."""
    g = torch.Generator().manual_seed(seed)
    seg = torch.randint(0, N_SEGMENTS - 1, (n,), generator=g)
    mask = (torch.rand(n, generator=g) < 0.7).float()
    return seg.to(DEVICE), mask.to(DEVICE)


def _leaves64(*tensors):
    return [t.detach().double().requires_grad_() if t is not None else None for t in tensors]


# -------------------------------------------------------------------------------- sequence sums of the head
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["no_softcap", "softcap"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_sequence_logprobs_and_every_gradient_match_float64(dtype, strategy, softcap, op_calls):
    bias = softcap is None or strategy == "vocab"  # with and without bias, across the cases
    hidden, weight, b = _case(dtype, bias, seed=10)
    target = _targets(N_TOKENS, seed=11)
    seg, mask = _segments_and_mask(N_TOKENS, seed=12)
    dout = randn(N_SEGMENTS, seed=13)  # one random upstream gradient per segment
    plan = ce.flce_chunk_plan(N_TOKENS, HIDDEN, VOCAB, dtype, strategy=strategy, reduction="none", bias=bias)
    assert plan.n_chunks >= 3, plan
    assert_triton_runs(hidden)
    before = snapshot(*(t for t in (hidden, weight, b, target, seg, mask) if t is not None))

    out = fused_linear_sequence_logprobs(hidden, weight, target, seg, N_SEGMENTS, mask, b, softcap=softcap,
                                         strategy=strategy)
    out.backward(dout)
    _assert_ran(op_calls, strategy)
    assert_unchanged(before, *(t for t in (hidden, weight, b, target, seg, mask) if t is not None))
    assert out.dtype == torch.float32 and out.shape == (N_SEGMENTS,)
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
    assert out[-1].item() == 0.0, "an empty segment sums to 0"

    h, w, bb = _leaves64(hidden, weight, b)
    ref = fused_linear_sequence_logprobs_reference(h, w, target, seg, N_SEGMENTS, mask, bb, softcap=softcap)
    assert ref.dtype == torch.float64
    ref.backward(dout.double())
    assert_rel(out, ref, dtype, "sequence log-probabilities")
    assert_rel(hidden.grad, h.grad, dtype, "dhidden")
    assert_rel(weight.grad, w.grad, dtype, "dweight")
    if bias:
        assert b.grad.dtype == dtype
        assert_rel(b.grad, bb.grad, dtype, "dbias")
    # tokens that carry no log-probability (ignored target or mask 0) send no gradient back to their hidden state
    dead = (target == -100) | (mask == 0)
    assert dead.any() and (~dead).any()
    assert torch.equal(hidden.grad[dead], torch.zeros_like(hidden.grad[dead]))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sequence_logprobs_without_weights_sum_every_token(strategy):
    """weights None: every token counts (the reference with all-ones weights); soft-capped, no bias."""
    hidden, weight, _ = _case(torch.float32, False, seed=20)
    target = _targets(N_TOKENS, seed=21)
    seg, _ = _segments_and_mask(N_TOKENS, seed=22)
    dout = randn(N_SEGMENTS, seed=23)
    assert_triton_runs(hidden)
    out = fused_linear_sequence_logprobs(hidden, weight, target, seg, N_SEGMENTS, softcap=2.5, strategy=strategy)
    out.backward(dout)
    h, w = _leaves64(hidden, weight)
    ones = torch.ones(N_TOKENS, device=DEVICE)
    ref = fused_linear_sequence_logprobs_reference(h, w, target, seg, N_SEGMENTS, ones, softcap=2.5)
    ref.backward(dout.double())
    for what, ours, theirs in (("sums", out, ref), ("dhidden", hidden.grad, h.grad), ("dweight", weight.grad, w.grad)):
        assert_rel(ours, theirs, torch.float32, what)


# ------------------------------------------------------------------------------------- per-token log-probs
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_token_logprobs_match_float64_and_are_zero_at_ignored_targets(dtype, strategy, op_calls):
    """Per token against the float64 reference (one segment per token); exactly 0 at ignored targets (here
    ``ignore_index=-1``, passed through); fp32 output for bf16 inputs; a random upstream gradient per token."""
    hidden, weight, b = _case(dtype, True, seed=30)
    target = _targets(N_TOKENS, ignore_index=-1, seed=31)
    dout = randn(N_TOKENS, seed=32)
    assert_triton_runs(hidden)
    out = fused_linear_logprobs(hidden, weight, target, b, ignore_index=-1, softcap=4.0, strategy=strategy)
    out.backward(dout)
    _assert_ran(op_calls, strategy)
    assert out.dtype == torch.float32 and out.shape == (N_TOKENS,)
    ignored = target == -1
    assert torch.equal(out[ignored].detach(), torch.zeros(int(ignored.sum()), device=DEVICE))
    assert (out[~ignored] < 0).all(), "a log-probability over 777 classes is negative"

    h, w, bb = _leaves64(hidden, weight, b)
    per_token = torch.arange(N_TOKENS, device=DEVICE)
    ref = fused_linear_sequence_logprobs_reference(h, w, target, per_token, N_TOKENS, None, bb, ignore_index=-1,
                                                   softcap=4.0)
    ref.backward(dout.double())
    assert_rel(out, ref, dtype, "per-token log-probabilities")
    assert_rel(hidden.grad, h.grad, dtype, "dhidden")
    assert_rel(weight.grad, w.grad, dtype, "dweight")
    assert_rel(b.grad, bb.grad, dtype, "dbias")


def test_token_logprobs_are_log_softmax_of_the_logits():
    """Independent of the module's own reference: log_softmax of float64 logits, gathered; (B, T, H) hidden gives
    (B, T) log-probabilities."""
    hidden = randn(3, 7, HIDDEN, seed=40)
    weight = randn(VOCAB, HIDDEN, scale=0.4, seed=41)
    target = _targets(21, seed=42).view(3, 7)
    assert_triton_runs(hidden)
    out = fused_linear_logprobs(hidden, weight, target)
    assert out.shape == (3, 7)
    z = torch.log_softmax(hidden.double() @ weight.double().T, dim=-1)
    keep = target != -100
    ref = torch.where(keep, z.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1), 0.0)
    assert_rel(out, ref, torch.float32, "log-probabilities")


# ------------------------------------------------------------------------- a separable loss taken in the forward
#: groups of tokens (ends) and their pairs of segments: every group fits a 16-token chunk, several share one
GROUP_ENDS = [7, 15, 16, 30, 41, 45]


class HeadGemms(TorchDispatchMode):
    """Counts the matrix products that run."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default,
                               torch.ops.aten.addmm.out, torch.ops.aten.addmm.dtype_out)
        return func(*args, **(kwargs or {}))


def _pair_loss(seg: torch.Tensor, mask: torch.Tensor):
    """A DPO-shaped loss of per-token log-probs: -logsigmoid of each pair's masked sum difference (segments 2g and
    2g + 1 form pair g), plus a masked per-token term, as ORPO's NLL adds."""
    def loss_fn(logp: torch.Tensor) -> torch.Tensor:
        sums = sequence_sums(logp, seg, 12, mask)
        return -F.logsigmoid(0.7 * (sums[0::2] - sums[1::2])).sum() - 0.05 * (logp * mask).sum()
    return loss_fn


def _grouped_case(n_tokens=N_TOKENS):
    """Segments 2g, 2g + 1 split each group's tokens in two halves (group g: tokens [ends[g - 1], ends[g]))."""
    seg = torch.empty(n_tokens, dtype=torch.long)
    for g, (start, end) in enumerate(zip([0, *GROUP_ENDS], GROUP_ENDS, strict=False)):
        mid = (start + end + 1) // 2
        seg[start:mid], seg[mid:end] = 2 * g, 2 * g + 1
    g = torch.Generator().manual_seed(60)
    mask = (torch.rand(n_tokens, generator=g) < 0.8).float()
    return seg.to(DEVICE), mask.to(DEVICE)


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["no_softcap", "softcap"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_a_loss_of_whole_groups_takes_three_head_gemms_and_matches_float64(dtype, softcap):
    """``fused_linear_logprob_loss``: the loss, the log-probs and the gradients of hidden, weight and bias against
    float64 autograd through the materialised logits, with 3 chunks of whole groups (16, 14, 15 tokens) and 3 GEMMs
    a chunk, all in the forward: the backward runs none."""
    hidden, weight, b = _case(dtype, softcap is None, seed=61)
    target = _targets(N_TOKENS, seed=62)
    seg, mask = _grouped_case()
    loss_fn = _pair_loss(seg, mask)
    assert_triton_runs(hidden)
    with HeadGemms() as forward:
        loss, logp = fused_linear_logprob_loss(hidden, weight, target, loss_fn, GROUP_ENDS, b, softcap=softcap)
    assert forward.count == 3 * 3, forward.count
    assert not logp.requires_grad and logp.dtype == torch.float32 and loss.dtype == torch.float32
    with HeadGemms() as backward:
        (1.5 * loss).backward()
    assert backward.count == 0

    h, w, bb = _leaves64(hidden, weight, b)
    ref_logp = fused_linear_sequence_logprobs_reference(h, w, target, torch.arange(N_TOKENS, device=DEVICE),
                                                        N_TOKENS, None, bb, softcap=softcap)
    ref = loss_fn(ref_logp)
    (1.5 * ref).backward()
    assert_rel(loss, ref, dtype, "loss")
    assert_rel(logp, ref_logp.detach(), dtype, "log-probabilities")
    assert_rel(hidden.grad, h.grad, dtype, "dhidden")
    assert_rel(weight.grad, w.grad, dtype, "dweight")
    if b is not None:
        assert_rel(b.grad, bb.grad, dtype, "dbias")


def test_groups_that_do_not_fit_a_chunk_take_the_per_token_head_with_the_same_result(op_calls):
    """A group longer than the chunk budget (one group of all 45 tokens against chunks of 16), the "vocab" strategy
    or no gradient: the per-token head (its 4 GEMMs a chunk) and autograd through the loss, the same numbers."""
    seg, mask = _grouped_case()
    loss_fn = _pair_loss(seg, mask)
    target = _targets(N_TOKENS, seed=63)
    results = {}
    for name, ends, strategy in (("fused", GROUP_ENDS, "tokens"), ("long group", [N_TOKENS], "tokens"),
                                 ("vocab", GROUP_ENDS, "vocab")):
        hidden, weight, _ = _case(torch.float32, False, seed=64)
        loss, logp = fused_linear_logprob_loss(hidden, weight, target, loss_fn, ends, strategy=strategy)
        loss.backward()
        results[name] = (loss, logp, hidden.grad, weight.grad)
    assert op_calls == {"_flce_fwd": 1, "_flce_bwd": 1, "_flce_vocab_fwd": 1, "_flce_vocab_bwd": 1}, op_calls
    for name in ("long group", "vocab"):
        for ours, theirs in zip(results[name], results["fused"], strict=True):
            assert rel_err(ours, theirs) <= 1e-5, name
    hidden, weight, _ = _case(torch.float32, False, seed=64)
    with torch.no_grad():
        loss, _ = fused_linear_logprob_loss(hidden, weight, target, loss_fn, GROUP_ENDS)
    assert rel_err(loss, results["fused"][0]) <= 1e-6


def test_chunks_take_whole_groups_up_to_the_limit_and_a_longer_group_alone():
    assert group_chunks([7, 15, 16, 30, 41, 45], 16) == [(0, 16), (16, 30), (30, 45)]
    assert group_chunks([5, 30, 33], 16) == [(0, 5), (5, 30), (30, 33)]  # 25 tokens: a chunk of its own
    assert group_chunks([4, 4, 8], 8) == [(0, 8)]  # an empty group changes nothing
    assert group_chunks([10], 4) == [(0, 10)]


@pytest.mark.parametrize("ends, message", [([7, 15, 44], "end at the 45 tokens"), ([7, 5, 45], "must increase"),
                                           ([], "end at the 45")])
def test_group_ends_that_do_not_cover_the_tokens_in_order_are_refused(ends, message):
    hidden, weight, _ = _case(torch.float32, False, seed=65)
    with pytest.raises(ValueError, match=message):
        fused_linear_logprob_loss(hidden, weight, _targets(N_TOKENS), lambda logp: logp.sum(), ends)


# ------------------------------------------------------------------------------------------- sequence_sums
def test_sequence_sums_adds_weighted_values_per_segment_and_routes_gradients_back():
    values = randn(9, seed=50).requires_grad_()
    seg = torch.tensor([2, 0, 2, 1, 0, 2, 1, 1, 0], device=DEVICE)
    weights = torch.tensor([1.0, 0.0, 0.5, 1.0, 2.0, 1.0, 0.0, 1.0, 1.0], device=DEVICE)
    out = sequence_sums(values, seg, 4, weights)
    want = torch.zeros(4, dtype=torch.float64)
    for v, s, wt in zip(values.tolist(), seg.tolist(), weights.tolist(), strict=True):
        want[s] += v * wt
    assert_rel(out, want, torch.float32, "sums")
    g = randn(4, seed=51)
    out.backward(g)
    assert_rel(values.grad, g.double()[seg] * weights.double(), torch.float32, "gradient")
    assert_rel(sequence_sums(values, seg, 4), sequence_sums(values, seg, 4, torch.ones(9, device=DEVICE)),
               torch.float32, "weights None")
    assert_rel(sequence_sums(values, seg, 4, weights > 0), sequence_sums(values, seg, 4, (weights > 0).float()),
               torch.float32, "bool weights")


def test_sequence_sums_rejects_mismatched_shapes():
    values = torch.zeros(6, device=DEVICE)
    seg = torch.zeros(6, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="must have one shape"):
        sequence_sums(values, seg[:5], 2)
    with pytest.raises(ValueError, match="must have one shape"):
        sequence_sums(values, seg.view(2, 3), 2)
    with pytest.raises(ValueError, match="must have one shape"):
        sequence_sums(values, seg, 2, torch.ones(5, device=DEVICE))
    with pytest.raises(ValueError, match="must have one shape"):
        sequence_sums(values, seg, 2, torch.ones(6, 1, device=DEVICE))
    hidden, weight = randn(6, 8, seed=52), randn(30, 8, seed=53)
    with pytest.raises(ValueError, match="must have one shape"):
        fused_linear_sequence_logprobs(hidden, weight, torch.zeros_like(seg), seg[:4], 2)


# ------------------------------------------------------------------------------------ CausalLM.token_logprobs
SMALL = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
MODELS = {
    "llama_untied": ("LlamaConfig", dict(SMALL)),
    "gemma2_tied_softcap": ("Gemma2Config", dict(SMALL, head_dim=16, pad_token_id=0, query_pre_attn_scalar=16,
                                                 final_logit_softcapping=2.0, attn_logit_softcapping=None,
                                                 sliding_window=32)),
}
#: the sequences packed in each of two rows: row 0 holds three, row 1 two
LENGTHS = [(5, 7, 4), (9, 7)]


def _tiny_models(case, directory):
    """A tiny random transformers model saved as safetensors: (ours in fp32, transformers' in float64)."""
    cls_name, kwargs = MODELS[case]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**kwargs),
                                                      attn_implementation="eager").float()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(directory)
    ours = CausalLM.from_hf(directory, dtype=torch.float32, device=DEVICE)
    return ours, hf.double().eval()


def _packed_batch(vocab):
    """ids, labels (-100 at each sequence's first token and at one more token), positions restarting per sequence."""
    g = torch.Generator().manual_seed(7)
    s = sum(LENGTHS[0])
    ids = torch.randint(1, vocab, (len(LENGTHS), s), generator=g)
    labels = ids.clone()
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LENGTHS])
    labels[positions == 0] = -100
    labels[1, 3] = -100
    return ids, labels, positions


def _reference_logprobs(hf, ids, labels):
    """(B * S,) float64: each sequence run alone through transformers, log_softmax of its logits gathered at its
    next labels; 0 at ignored labels and at each sequence's last token. Differentiable."""
    rows = []
    for b, row in enumerate(LENGTHS):
        start = 0
        for n in row:
            x, y = ids[b, start:start + n], labels[b, start:start + n]
            logp = torch.log_softmax(hf(input_ids=x[None]).logits[0].double(), dim=-1)[:-1]
            nxt = y[1:]
            keep = nxt != -100
            tok = torch.where(keep, logp.gather(-1, nxt.clamp_min(0)[:, None])[:, 0], 0.0)
            rows.append(torch.cat([tok, tok.new_zeros(1)]))
            start += n
    return torch.cat(rows)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", list(MODELS))
def test_causal_lm_token_logprobs_match_transformers_per_sequence(case, strategy, tmp_path, monkeypatch,
                                                                   op_calls):
    monkeypatch.setattr(ce, "FLCE_CHUNK_SIZE", 12)  # 32 tokens -> chunks of 12, 12, 8
    monkeypatch.setattr(ce, "FLCE_VOCAB_CHUNK", 40)  # V = 101 -> windows of 40, 40, 21
    ours, hf = _tiny_models(case, str(tmp_path))
    assert (ours.head is None) == (case == "gemma2_tied_softcap")
    ids, labels, positions = _packed_batch(hf.config.vocab_size)
    docs = Documents.from_positions(positions)
    assert_triton_runs(ours.embed.weight)

    out = ours.token_logprobs(ids.to(DEVICE), labels.to(DEVICE), positions.to(DEVICE), docs.to(DEVICE),
                              strategy=strategy)
    assert out.dtype == torch.float32 and out.shape == (ids.numel(),)
    plan = ce.flce_chunk_plan(ids.numel(), SMALL["hidden_size"], SMALL["vocab_size"], torch.float32, strategy=strategy,
                              reduction="none")
    assert plan.n_chunks == 3, plan
    ref = _reference_logprobs(hf, ids, labels)
    assert_rel(out, ref, torch.float32, "token log-probabilities")
    s = ids.shape[1]
    zero = torch.zeros_like(labels, dtype=torch.bool)
    zero[:, :-1] = labels[:, 1:] == -100  # the next label is ignored (each sequence's last token among them)
    zero[:, -1] = True  # the row's last position has no next token
    zero = zero.flatten()
    assert zero[[s - 1, 4, 11, s + 8, 2 * s - 1]].all()
    assert torch.equal(out[zero].detach(), torch.zeros(int(zero.sum()), device=DEVICE))
    assert (out[~zero] < 0).all()

    # gradient of a weighted sum of the entries against autograd through the float64 path
    weights = randn(ids.numel(), seed=60)
    (out * weights.to(out.device)).sum().backward()
    (ref * weights.to(ref.device, torch.float64)).sum().backward()
    ours_grads = dict(hf_tensors({n: p.grad for n, p in ours.named_parameters()}, ours.config))
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(ours_grads) == set(hf_grads)
    for name, g in hf_grads.items():
        assert_rel(ours_grads[name], g, torch.float32, f"gradient of {name}")
    _assert_ran(op_calls, strategy)

    # the comparison sees attention across sequences: without the documents the later sequences' entries change
    with torch.no_grad():
        leaky = ours.token_logprobs(ids.to(DEVICE), labels.to(DEVICE), positions.to(DEVICE), strategy=strategy)
    assert rel_err(leaky, ref) > 1e-2
