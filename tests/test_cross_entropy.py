"""cross_entropy / fused_linear_cross_entropy against float64 autograd of the plain math.

Every option (ignore_index, label_smoothing, z-loss, softcap), each reduction ("none" with a random
upstream gradient) and their combination, in fp32 and bf16; V is no multiple of any block and N no
multiple of the chunk: the row block and the FLCE chunk are forced small so that several blocks
and several chunks run on small shapes. The FLCE tests run both strategies: "tokens" (token chunks)
and "vocab" (vocabulary windows, forced to 300 columns: V = 1000 / 777 is no multiple of it, and each
window spans two row blocks).
"""

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.cross_entropy import (
    cross_entropy,
    cross_entropy_reference,
    flce_chunk_plan,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)
from tests.utils import DEVICE, assert_rel, assert_triton_runs, assert_unchanged, randn, rel_err, snapshot

ce = importlib.import_module("kernels.cross_entropy")  # the module (``kernels.cross_entropy`` is also a function)

DTYPES = [torch.float32, torch.bfloat16]
REDUCTIONS = ["mean", "sum", "none"]
#: name -> (options, ignore a quarter of the targets?)
OPTIONS = {
    "plain": ({}, False),
    "ignore_index": ({}, True),
    "label_smoothing": ({"label_smoothing": 0.1}, False),
    "z_loss": ({"lse_square_scale": 1e-2}, False),
    "softcap": ({"softcap": 4.0}, False),
    "all": ({"label_smoothing": 0.2, "lse_square_scale": 1e-3, "softcap": 3.0, "ignore_index": -1}, True),
}
N_TOKENS, HIDDEN = 45, 48
CHUNK = 16  # 45 tokens -> chunks of 16, 16, 13
WINDOW = 300  # V = 1000 -> windows of 300, 300, 300, 100; V = 777 -> 300, 300, 177
STRATEGIES = ["tokens", "vocab"]


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    """Rows of V = 777 / 1000 span 4 blocks of 256 (last one partial); FLCE runs 3 chunks ("tokens")
    or 3-4 windows of up to 2 blocks each ("vocab")."""
    monkeypatch.setattr(ce, "CE_MAX_BLOCK", 256)
    monkeypatch.setattr(ce, "FLCE_CHUNK_SIZE", CHUNK)
    monkeypatch.setattr(ce, "FLCE_VOCAB_CHUNK", WINDOW)


def _targets(n, v, ignore, ignore_index=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, v, (n,), generator=g)
    if ignore:
        t[torch.randperm(n, generator=g)[: n // 4]] = ignore_index
    return t.to(DEVICE)


def _math64(logits, target, ignore_index=-100, label_smoothing=0.0, lse_square_scale=0.0, softcap=None,
            reduction="mean", num_items=None):
    """The loss written plainly, in float64 (differentiable)."""
    z = logits.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, dim=-1)
    valid = target != ignore_index
    z_y = z.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    eps = label_smoothing
    per = (1 - eps) * (lse - z_y) + eps * (lse - z.mean(-1)) + lse_square_scale * lse**2
    per = torch.where(valid, per, 0.0)
    if reduction == "none":
        return per
    if reduction == "sum":
        return per.sum()
    denom = valid.sum().clamp_min(1).double() if num_items is None else torch.as_tensor(num_items).double()
    return per.sum() / denom


def _upstream(reduction, n, seed=1):
    if reduction == "none":
        return randn(n, seed=seed)
    return torch.tensor(0.7, device=DEVICE)


def _v_for(name):
    return 1000 if list(OPTIONS).index(name) % 2 == 0 else 777


# ---------------------------------------------------------------------------------- cross_entropy
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_matches_float64(dtype, name, reduction):
    opts, ignore = OPTIONS[name]
    v = _v_for(name)
    logits = randn(N_TOKENS, v, dtype=dtype, scale=3.0, seed=2).requires_grad_()
    target = _targets(N_TOKENS, v, ignore, opts.get("ignore_index", -100))
    dout = _upstream(reduction, N_TOKENS)
    assert_triton_runs(logits)
    before = snapshot(logits, target, dout)

    loss = cross_entropy(logits, target, reduction=reduction, **opts)
    loss.backward(dout)
    assert_unchanged(before, logits, target, dout)
    assert loss.dtype == torch.float32

    x64 = logits.detach().double().requires_grad_()
    ref = _math64(x64, target, reduction=reduction, **opts)
    ref.backward(dout.double())
    assert_rel(loss, ref, dtype, "loss")
    assert_rel(logits.grad, x64.grad, dtype, "dlogits")
    if dtype == torch.bfloat16:  # no worse than eager PyTorch computing the same fp32 math on bf16 logits
        x = logits.detach().clone().requires_grad_()
        cross_entropy_reference(x, target, reduction=reduction, **opts).backward(dout)
        assert rel_err(logits.grad, x64.grad) <= 1.05 * rel_err(x.grad, x64.grad) + 1e-6


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_agrees_with_torch(dtype, reduction):
    """F.cross_entropy on the fp32-upcast logits, for the options it has (ignore_index, label_smoothing)."""
    v = 777
    logits = randn(N_TOKENS, v, dtype=dtype, scale=2.0, seed=3).requires_grad_()
    target = _targets(N_TOKENS, v, True, seed=4)
    dout = _upstream(reduction, N_TOKENS)
    assert_triton_runs(logits)
    loss = cross_entropy(logits, target, label_smoothing=0.15, reduction=reduction)
    loss.backward(dout)
    x = logits.detach().clone().requires_grad_()
    theirs = F.cross_entropy(x.float(), target, label_smoothing=0.15, reduction=reduction)
    theirs.backward(dout)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_rel(loss, theirs.detach(), dtype, "loss vs F.cross_entropy", bound=tol)
    assert_rel(logits.grad, x.grad, dtype, "dlogits vs F.cross_entropy", bound=tol)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_all_ignored_is_zero(reduction):
    logits = randn(9, 300, seed=5).requires_grad_()
    target = torch.full((9,), -100, device=DEVICE)
    assert_triton_runs(logits)
    loss = cross_entropy(logits, target, label_smoothing=0.1, lse_square_scale=1e-3, reduction=reduction)
    loss.backward(torch.ones_like(loss))
    assert torch.equal(loss.detach(), torch.zeros_like(loss))
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_cross_entropy_leading_dims_and_expanded_upstream_gradient():
    """(B, T, V) logits, (B, T) targets; "none" then .sum() sends a stride-0 gradient back."""
    logits = randn(3, 5, 333, seed=6).requires_grad_()
    target = _targets(15, 333, True).view(3, 5)
    assert_triton_runs(logits)
    loss = cross_entropy(logits, target, reduction="none")
    assert loss.shape == (3, 5)
    loss.sum().backward()
    x64 = logits.detach().double().requires_grad_()
    _math64(x64.view(15, 333), target.view(15), reduction="sum").backward()
    assert_rel(logits.grad, x64.grad, torch.float32, "dlogits")


@pytest.mark.parametrize("rows", [1, 4])
def test_cross_entropy_rows_per_program(monkeypatch, rows):
    """One row per program (the GPU layout for large V) and a row count that does not divide N."""
    monkeypatch.setattr(ce, "CE_ROWS", rows)
    opts, _ = OPTIONS["all"]
    logits = randn(10, 777, seed=11).requires_grad_()
    target = _targets(10, 777, True, opts["ignore_index"])
    dout = randn(10, seed=12)
    assert_triton_runs(logits)
    cross_entropy(logits, target, reduction="none", **opts).backward(dout)
    x64 = logits.detach().double().requires_grad_()
    _math64(x64, target, reduction="none", **opts).backward(dout.double())
    assert_rel(logits.grad, x64.grad, torch.float32, "dlogits")


def test_masked_leading_columns_give_finite_loss_and_gradients():
    """Rows whose first blocks are all -inf (a masked vocabulary): the online logsumexp must not take
    exp(-inf - -inf) = NaN while its running max is still -inf (the first 300 columns span a whole
    256-wide block)."""
    logits = randn(10, 777, seed=14)
    logits[:, :300] = -float("inf")
    logits.requires_grad_()
    target = torch.randint(300, 777, (10,), generator=torch.Generator().manual_seed(15)).to(DEVICE)
    assert_triton_runs(logits)
    loss = cross_entropy(logits, target)
    loss.backward()
    x64 = logits.detach().double().requires_grad_()
    F.cross_entropy(x64, target).backward()
    assert_rel(loss, F.cross_entropy(x64.detach(), target), torch.float32, "loss")
    assert_rel(logits.grad, x64.grad, torch.float32, "dlogits")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_flce_with_a_masked_first_window_is_finite(strategy):
    """A bias of -inf over the first 300 columns: the first vocabulary window ("vocab") and the first
    blocks of every chunk row ("tokens") are all -inf."""
    hidden, weight, b = _flce_case(torch.float32, 1000, True, seed=16)
    with torch.no_grad():
        b[:300] = -float("inf")
    target = torch.randint(300, 1000, (N_TOKENS,), generator=torch.Generator().manual_seed(17)).to(DEVICE)
    assert_triton_runs(hidden)
    loss = fused_linear_cross_entropy(hidden, weight, target, b, strategy=strategy)
    loss.backward()
    h, w, b64 = (t.detach().double().requires_grad_() for t in (hidden, weight, b))
    ref = F.cross_entropy(h @ w.T + b64, target)
    ref.backward()
    assert_rel(loss, ref.detach(), torch.float32, "loss")
    for name, ours, theirs in (("dhidden", hidden.grad, h.grad), ("dweight", weight.grad, w.grad),
                               ("dbias", b.grad, b64.grad)):
        assert_rel(ours, theirs, torch.float32, name)


def test_out_of_range_target_is_poisoned_not_silent():
    """A target outside [0, V) (not ignore_index) yields NaN for that token instead of a wrong number."""
    logits = randn(4, 50, seed=7)
    target = torch.tensor([1, 2, 50, -100], device=DEVICE)
    assert_triton_runs(logits)
    loss = cross_entropy(logits, target, reduction="none")
    assert torch.isnan(loss[2]) and torch.isfinite(loss[[0, 1, 3]]).all()
    assert torch.isnan(cross_entropy(logits, target))
    w = randn(50, 8, seed=8)
    for strategy in STRATEGIES:
        loss = fused_linear_cross_entropy(randn(4, 8, seed=9), w, target, reduction="none", strategy=strategy)
        assert torch.isnan(loss[2]) and torch.isfinite(loss[[0, 1, 3]]).all(), strategy
    with pytest.raises((IndexError, RuntimeError)):  # the PyTorch reference raises (on CPU; CUDA device-asserts)
        cross_entropy_reference(logits.cpu(), target.cpu())


# ------------------------------------------------------------------------------------------- FLCE
def _flce_case(dtype, v, bias, seed=10):
    hidden = randn(N_TOKENS, HIDDEN, dtype=dtype, seed=seed).requires_grad_()
    weight = randn(v, HIDDEN, dtype=dtype, scale=0.3, seed=seed + 1).requires_grad_()
    b = randn(v, dtype=dtype, scale=0.5, seed=seed + 2).requires_grad_() if bias else None
    return hidden, weight, b


def _flce64(hidden, weight, bias, target, dout, **kw):
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    b = bias.detach().double().requires_grad_() if bias is not None else None
    logits = h @ w.T + (b if b is not None else 0.0)
    loss = _math64(logits, target, **kw)
    loss.backward(dout.double())
    return loss, h.grad, w.grad, (b.grad if b is not None else None)


def _check_flce(dtype, hidden, weight, bias, target, dout, strategy="tokens", **kw):
    before = snapshot(*(t for t in (hidden, weight, bias, target, dout) if t is not None))
    loss = fused_linear_cross_entropy(hidden, weight, target, bias, strategy=strategy, **kw)
    loss.backward(dout)
    assert_unchanged(before, *(t for t in (hidden, weight, bias, target, dout) if t is not None))
    assert loss.dtype == torch.float32
    assert weight.grad.dtype == weight.dtype and hidden.grad.dtype == hidden.dtype
    ref, dh, dw, db = _flce64(hidden, weight, bias, target, dout, **kw)
    errs = {"loss": assert_rel(loss, ref, dtype, "loss"), "dhidden": assert_rel(hidden.grad, dh, dtype, "dhidden"),
            "dweight": assert_rel(weight.grad, dw, dtype, "dweight")}
    if bias is not None:
        errs["dbias"] = assert_rel(bias.grad, db, dtype, "dbias")
    return errs


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_flce_matches_float64(dtype, name, reduction, strategy):
    opts, ignore = OPTIONS[name]
    v = _v_for(name)
    bias = list(OPTIONS).index(name) % 3 != 0  # with and without bias
    hidden, weight, b = _flce_case(dtype, v, bias)
    target = _targets(N_TOKENS, v, ignore, opts.get("ignore_index", -100))
    assert_triton_runs(hidden)
    _check_flce(dtype, hidden, weight, b, target, _upstream(reduction, N_TOKENS), reduction=reduction,
                strategy=strategy, **opts)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_flce_num_items(dtype, as_tensor, strategy):
    """mean divides by num_items (int or 0-dim tensor): e.g. the token count over all micro-batches."""
    opts, _ = OPTIONS["all"]
    hidden, weight, b = _flce_case(dtype, 777, True, seed=20)
    target = _targets(N_TOKENS, 777, True, opts["ignore_index"])
    num_items = torch.tensor(123, device=DEVICE) if as_tensor else 123
    assert_triton_runs(hidden)
    _check_flce(dtype, hidden, weight, b, target, _upstream("mean", N_TOKENS), num_items=num_items,
                strategy=strategy, **opts)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_flce_all_ignored_is_zero(reduction, strategy):
    hidden, weight, b = _flce_case(torch.float32, 300, True, seed=30)
    target = torch.full((N_TOKENS,), -100, device=DEVICE)
    assert_triton_runs(hidden)
    loss = fused_linear_cross_entropy(hidden, weight, target, b, label_smoothing=0.1, reduction=reduction,
                                      strategy=strategy)
    loss.backward(torch.ones_like(loss))
    assert torch.equal(loss.detach(), torch.zeros_like(loss))
    for t in (hidden, weight, b):
        assert torch.equal(t.grad, torch.zeros_like(t)), "gradient of an all-ignored batch must be 0"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_flce_with_zero_hidden_size_is_the_uniform_loss(strategy):
    """H = 0: every logit is 0, so the loss is log V and every gradient is empty or zero, as in the reference."""
    hidden = torch.zeros(3, 0, device=DEVICE, requires_grad=True)
    weight = torch.zeros(5, 0, device=DEVICE, requires_grad=True)
    assert_triton_runs(hidden)
    loss = fused_linear_cross_entropy(hidden, weight, torch.tensor([1, 2, 3], device=DEVICE), strategy=strategy)
    loss.backward()
    assert torch.allclose(loss.detach().cpu(), torch.tensor(5.0).log())
    assert hidden.grad.shape == (3, 0) and weight.grad.shape == (5, 0)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_flce_agrees_with_torch(dtype, reduction, strategy):
    """F.linear + F.cross_entropy on fp32-upcast logits (the Hugging Face recipe)."""
    hidden, weight, b = _flce_case(dtype, 1000, True, seed=40)
    target = _targets(N_TOKENS, 1000, True, seed=41)
    dout = _upstream(reduction, N_TOKENS)
    assert_triton_runs(hidden)
    loss = fused_linear_cross_entropy(hidden, weight, target, b, label_smoothing=0.05, reduction=reduction,
                                      strategy=strategy)
    loss.backward(dout)
    h, w, bb = (t.detach().clone().requires_grad_() for t in (hidden, weight, b))
    theirs = F.cross_entropy(F.linear(h, w, bb).float(), target, label_smoothing=0.05, reduction=reduction)
    theirs.backward(dout)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for ours, ref, what in [(loss, theirs.detach(), "loss"), (hidden.grad, h.grad, "dhidden"),
                            (weight.grad, w.grad, "dweight"), (b.grad, bb.grad, "dbias")]:
        assert_rel(ours, ref, dtype, f"{what} vs torch", bound=tol)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_flce_tied_embedding_leading_dims_and_partial_grads(strategy):
    """weight tied to the input embedding: both gradient paths add up; (B, T, H) hidden; frozen bias."""
    v, h = 500, 24
    emb = torch.nn.Embedding(v, h).to(DEVICE)
    with torch.no_grad():
        emb.weight.copy_(randn(v, h, scale=0.5, seed=50))
    ids = _targets(2 * 11, v, False, seed=51).view(2, 11)
    target = _targets(2 * 11, v, True, seed=52).view(2, 11)
    bias = randn(v, seed=53)  # requires_grad False: no bias gradient is computed
    assert_triton_runs(emb.weight)

    hidden = torch.tanh(emb(ids))
    loss = fused_linear_cross_entropy(hidden, emb.weight, target, bias, lse_square_scale=1e-2, strategy=strategy)
    loss.backward()
    ours = emb.weight.grad.clone()
    emb.weight.grad = None
    hidden = torch.tanh(emb(ids))
    w64 = emb.weight.detach().double().requires_grad_()
    h64 = torch.tanh(F.embedding(ids, w64))
    _math64(h64 @ w64.T + bias.double(), target, lse_square_scale=1e-2).backward()
    assert_rel(ours, w64.grad, torch.float32, "tied embedding gradient")

    out = fused_linear_cross_entropy(hidden, emb.weight, target, reduction="none", strategy=strategy)
    assert out.shape == (2, 11)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_flce_retain_graph_backward_twice_and_no_grad(strategy):
    hidden, weight, b = _flce_case(torch.float32, 777, True, seed=60)
    target = _targets(N_TOKENS, 777, True, seed=61)
    assert_triton_runs(hidden)
    loss = fused_linear_cross_entropy(hidden, weight, target, b, softcap=5.0, strategy=strategy)
    loss.backward(retain_graph=True)
    once = weight.grad.clone()
    loss.backward()
    assert_rel(weight.grad, 2 * once, torch.float32, "second backward of a retained graph")
    with torch.no_grad():
        again = fused_linear_cross_entropy(hidden, weight, target, b, softcap=5.0, strategy=strategy)
    assert torch.equal(again, loss.detach())


def test_flce_chunk_size_does_not_change_the_result(monkeypatch):
    hidden, weight, b = _flce_case(torch.float32, 1000, True, seed=70)
    target = _targets(N_TOKENS, 1000, True, seed=71)
    assert_triton_runs(hidden)
    grads = []
    for chunk in (7, N_TOKENS):
        monkeypatch.setattr(ce, "FLCE_CHUNK_SIZE", chunk)
        hidden.grad = weight.grad = b.grad = None
        loss = fused_linear_cross_entropy(hidden, weight, target, b, label_smoothing=0.1)
        loss.backward()
        grads.append((loss.detach(), hidden.grad, weight.grad, b.grad))
    for a, c in zip(*grads, strict=True):
        assert rel_err(a, c) <= 1e-6


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flce_split_weight_gradient_matches_float64(dtype, reduction, monkeypatch):
    """"tokens" with a 16-bit weight and the split accumulator (two fp32 row halves, the first cast into the chunk
    buffer before dW is allocated): an odd vocabulary (unequal halves), several chunks, bias, forward and every
    gradient against float64; the gradient comes back in the weight's dtype."""
    monkeypatch.setattr(ce, "FLCE_SPLIT_MIN_CHUNK", 1)
    v = 1001
    plan = flce_chunk_plan(N_TOKENS, HIDDEN, v, dtype)
    assert plan.split and plan.n_chunks > 1 and plan.chunk_bytes >= (v + 1) // 2 * HIDDEN * 2
    hidden, weight, b = _flce_case(dtype, v, True, seed=75)
    target = _targets(N_TOKENS, v, True, seed=76)
    assert_triton_runs(hidden)
    _check_flce(dtype, hidden, weight, b, target, _upstream(reduction, N_TOKENS), reduction=reduction)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures CUDA memory")
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_flce_forward_peak_is_the_plans_and_frees_its_chunk_buffer(split, monkeypatch):
    """"tokens", bf16, "mean": the forward's peak above its inputs is the plan's loop (chunk buffer + fp32
    accumulators + held dh) or, unsplit, the accumulator next to dW at its cast, never the chunk buffer as well
    (a lingering view of it once kept it alive there); afterwards only dW, dh and the per-token vectors remain."""
    monkeypatch.setattr(ce, "FLCE_SPLIT_MIN_CHUNK", 256 if split else 1 << 30)
    monkeypatch.setattr(ce, "FLCE_CHUNK_SIZE", None)  # the planned chunk: 4096 tokens whole, 512 split
    n, h, v = 4096, 1024, 50000
    slack = 64 << 20  # cuBLAS workspaces and the loss kernel's small buffers, against a 620 / 260 MB plan
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, v, (n,), device="cuda")
    plan = flce_chunk_plan(n, h, v, torch.bfloat16)
    assert plan.split == split
    dw_bytes = v * h * 2
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = fused_linear_cross_entropy(hidden, weight, target)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    loop = plan.chunk_bytes + plan.accum_bytes + plan.held_grad_hidden_bytes + plan.per_token_bytes
    cast = plan.accum_bytes + dw_bytes + plan.held_grad_hidden_bytes + plan.per_token_bytes
    assert peak <= (loop if split else max(loop, cast)) + slack, (peak, loop, cast)
    kept = torch.cuda.memory_allocated() - base
    assert kept <= dw_bytes + plan.held_grad_hidden_bytes + plan.per_token_bytes + slack, kept
    loss.backward()
    assert weight.grad.dtype == torch.bfloat16


def test_flce_vocab_window_does_not_change_the_result(monkeypatch):
    """"vocab" with windows of 40 columns (25 windows), 256, and one window of all V = 1000 columns; and
    "tokens" against them."""
    hidden, weight, b = _flce_case(torch.float32, 1000, True, seed=72)
    target = _targets(N_TOKENS, 1000, True, seed=73)
    assert_triton_runs(hidden)
    results = []
    for strategy, window in (("vocab", 40), ("vocab", 256), ("vocab", 1000), ("tokens", None)):
        monkeypatch.setattr(ce, "FLCE_VOCAB_CHUNK", window)
        hidden.grad = weight.grad = b.grad = None
        loss = fused_linear_cross_entropy(hidden, weight, target, b, label_smoothing=0.1, lse_square_scale=1e-3,
                                          softcap=4.0, strategy=strategy)
        loss.backward()
        results.append((loss.detach(), hidden.grad, weight.grad, b.grad))
    for other in results[1:]:
        for a, c in zip(results[0], other, strict=True):
            assert rel_err(a, c) <= 1e-6


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_flce_under_autocast_runs_in_the_autocast_dtype(strategy):
    """fp32 parameters under autocast: the matmuls run in bf16 (as F.linear would), grads come back fp32."""
    hidden, weight, b = _flce_case(torch.float32, 777, True, seed=75)
    target = _targets(N_TOKENS, 777, True, seed=76)
    assert_triton_runs(hidden)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(hidden, weight, target, b, strategy=strategy)
    loss.backward()
    assert weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.float32
    ref, dh, dw, db = _flce64(hidden, weight, b, target, torch.tensor(1.0))
    for ours, r, what in [(loss, ref, "loss"), (hidden.grad, dh, "dhidden"), (weight.grad, dw, "dweight"),
                          (b.grad, db, "dbias")]:
        assert_rel(ours, r, torch.bfloat16, what)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the out_dtype overload exists on CUDA only")
def test_addmm_out_dtype_accumulates_in_place_in_fp32():
    """The weight-gradient accumulation relies on addmm(acc_fp32, bf16, bf16, out_dtype=fp32, out=acc)."""
    a, b = randn(64, 32, dtype=torch.bfloat16, seed=1), randn(32, 48, dtype=torch.bfloat16, seed=2)
    acc = torch.full((64, 48), float("nan"), device=DEVICE)
    ce._accumulate_fp32(acc, a, b, beta=0.0)  # the first chunk ignores the (uninitialised) accumulator
    want = a.double() @ b.double()
    assert_rel(acc, want, torch.float32, "first chunk (beta = 0)")
    c = randn(32, 64, dtype=torch.bfloat16, seed=4).T  # a transposed view, as dlogits.T is
    ce._accumulate_fp32(acc, c, b)
    assert ce._ADDMM_OUT_DTYPE_OK, "torch.addmm(..., out_dtype=float32, out=acc) is refused: slow fallback in use"
    assert_rel(acc, want + c.double() @ b.double(), torch.float32, "fp32 accumulation")


def test_chunk_plan_bounds_memory_independently_of_tokens(monkeypatch):
    monkeypatch.setattr(ce, "FLCE_CHUNK_SIZE", None)
    gib = 1 << 30
    plan = flce_chunk_plan(16384, 4096, 152064, torch.bfloat16)
    assert plan.chunk_bytes <= gib and plan.chunk_size % 256 == 0 and plan.chunk_size >= 2048
    assert plan.n_chunks * plan.chunk_size >= 16384
    assert plan.accum_bytes == 4 * 152064 * 4096
    big = flce_chunk_plan(1 << 20, 4096, 152064, torch.bfloat16)
    assert big.chunk_bytes <= gib and big.accum_bytes == plan.accum_bytes
    small = flce_chunk_plan(100, 4096, 152064, torch.bfloat16)
    assert small.chunk_size == 100 and small.n_chunks == 1
    assert flce_chunk_plan(16384, 4096, 128256, torch.bfloat16).chunk_bytes <= gib
    assert flce_chunk_plan(100, 16, 1000, chunk_size=16).n_chunks == 7
    # Gemma's 256000 x 2048 head: the split accumulator, chunks of H/2 = 1024 tokens whose buffer holds half of dW,
    # so the loss head peaks at 4VH + VH bytes (fp32 halves + the buffer), not 4VH + 2VH (+ the bf16 dW at its cast)
    gemma = flce_chunk_plan(8192, 2048, 256000, torch.bfloat16)
    assert gemma.split and gemma.chunk_size == 1024 and gemma.chunk_bytes == 128000 * 2048 * 2
    assert not flce_chunk_plan(8192, 1536, 151936, torch.bfloat16).split  # H/2 = 768 tokens: too short a chunk
    assert not flce_chunk_plan(8192, 2048, 256000, torch.float32).split  # fp32: dW is the accumulator itself
    assert not flce_chunk_plan(8192, 2048, 256000, torch.bfloat16, grad_weight=False).split


def test_vocab_plan_has_no_weight_sized_accumulator(monkeypatch):
    """"vocab": an (N, Vc) window within its budget, a 4*N*H hidden-gradient accumulator, nothing of V*H."""
    monkeypatch.setattr(ce, "FLCE_VOCAB_CHUNK", None)
    monkeypatch.setattr(ce, "FLCE_CHUNK_SIZE", None)
    mib = 1 << 20
    n, h, v = 16384, 4096, 152064
    plan = flce_chunk_plan(n, h, v, torch.bfloat16, strategy="vocab", bias=True)
    assert plan.strategy == "vocab" and plan.chunk_size % 256 == 0 and plan.chunk_size * n * 2 <= 256 * mib
    assert plan.n_chunks * plan.chunk_size >= v and (plan.n_chunks - 1) * plan.chunk_size < v
    assert plan.chunk_bytes == n * plan.chunk_size * 2 and plan.held_grad_hidden_bytes == 0
    assert plan.accum_bytes == 4 * n * h + 4 * plan.chunk_size
    assert plan.extra_bytes + 4 * v * h <= flce_chunk_plan(n, h, v, torch.bfloat16).extra_bytes  # saves dW's fp32
    assert plan.extra_bytes <= 600 * mib
    # fp32 hidden: its gradient is the accumulator; a small batch: one window of all V; windows of 256 at least
    assert flce_chunk_plan(n, h, v, torch.float32, strategy="vocab").accum_bytes == 0
    one = flce_chunk_plan(64, h, 1000, strategy="vocab")
    assert (one.chunk_size, one.n_chunks) == (1000, 1)
    huge = flce_chunk_plan(1 << 22, h, v, strategy="vocab")
    assert huge.chunk_size == 256 and huge.n_chunks == -(-v // 256)
    assert flce_chunk_plan(100, 16, 1000, strategy="vocab", chunk_size=300).n_chunks == 4
    with pytest.raises(ValueError, match="'vocabulary'"):
        flce_chunk_plan(100, 16, 1000, strategy="vocabulary")


class _AllocSpy(TorchDispatchMode):
    """Records (shape, dtype) of every tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.seen.append((tuple(t.shape), t.dtype))
        return out


def test_vocab_allocates_no_weight_sized_fp32_tensor():
    """bf16 inputs: "vocab" creates no fp32 tensor of V*H elements (or more), forward or backward; the
    "tokens" loop does (its fp32 weight-gradient accumulator), which shows the spy sees allocations."""
    v = 1000
    hidden, weight, b = (t.detach() for t in _flce_case(torch.bfloat16, v, True, seed=85))
    target = _targets(N_TOKENS, v, True, seed=86)
    opts = (-100, 0.1, 1e-3, 3.0)
    assert_triton_runs(hidden)

    def big_fp32(seen):
        return [s for s, dt in seen if dt == torch.float32 and torch.Size(s).numel() >= v * HIDDEN]

    half = torch.tensor(0.5, device=DEVICE)
    with _AllocSpy() as spy:
        _, lse = ce._vocab_forward(hidden, weight, b, target, *opts)
        dh, dw, db = ce._vocab_backward(hidden, weight, b, target, lse, half, *opts, True, True, True)
    assert (dh.dtype, dw.dtype, db.dtype) == (torch.bfloat16,) * 3
    assert big_fp32(spy.seen) == [], "vocab allocated a (V, H)-sized fp32 tensor"
    with _AllocSpy() as spy:
        ce._flce_loop(hidden, weight, b, target, half, None, *opts, True, True, True)
    assert (v, HIDDEN) in big_fp32(spy.seen)


# --------------------------------------------------------------------------------- misc behaviour
def test_reference_path_is_used_without_triton(monkeypatch):
    """use_triton False (CPU without the interpreter): the public functions are the references."""
    monkeypatch.setattr(ce, "use_triton", lambda x: False)
    opts = OPTIONS["all"][0]
    logits = randn(10, 77, seed=80)
    target = _targets(10, 77, True, opts["ignore_index"], seed=81)
    assert torch.equal(cross_entropy(logits, target, **opts), cross_entropy_reference(logits, target, **opts))
    x64 = logits.double()
    assert_rel(cross_entropy_reference(logits, target, reduction="none", **opts),
               _math64(x64, target, reduction="none", **opts), torch.float32, "reference")
    h, w = randn(10, 8, seed=82), randn(77, 8, seed=83)
    assert torch.equal(fused_linear_cross_entropy(h, w, target, num_items=4, **opts),
                       fused_linear_cross_entropy_reference(h, w, target, num_items=4, **opts))


def test_bad_arguments_raise():
    x, t = torch.zeros(3, 10, device=DEVICE), torch.zeros(3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap"):
        cross_entropy(x, t, softcap=0.0)
    with pytest.raises(ValueError, match="target shape"):
        cross_entropy(x, t[:2])
    with pytest.raises(TypeError, match="int64"):
        cross_entropy(x, t.float())
    with pytest.raises(ValueError, match="logits must be a floating-point tensor"):
        cross_entropy(x.long(), t)
    with pytest.raises(ValueError, match="hidden must be a floating-point tensor"):
        fused_linear_cross_entropy(torch.zeros(3, 4, dtype=torch.int32, device=DEVICE),
                                   torch.zeros(10, 4, dtype=torch.int32, device=DEVICE), t)
    with pytest.raises(ValueError, match="do not fit"):
        fused_linear_cross_entropy(torch.zeros(3, 4, device=DEVICE), torch.zeros(10, 5, device=DEVICE), t)
    with pytest.raises(TypeError, match="one dtype"):
        fused_linear_cross_entropy(torch.zeros(3, 4, device=DEVICE),
                                   torch.zeros(10, 4, device=DEVICE, dtype=torch.bfloat16), t)
    with pytest.raises(ValueError, match="strategy.*'vocabulary'"):
        fused_linear_cross_entropy(torch.zeros(3, 4, device=DEVICE), torch.zeros(10, 4, device=DEVICE), t,
                                   strategy="vocabulary")


def test_flce_custom_ops_trace_with_fake_tensors():
    """Schema, fake (meta) implementations and AOT tracing of the FLCE chunk-loop ops (torch.compile's view)."""
    hidden, weight, b = (t.detach() for t in _flce_case(torch.float32, 300, True, seed=90))
    hidden, weight = hidden[:20], weight
    target = _targets(20, 300, True, seed=91)
    scale = torch.tensor(0.1, device=DEVICE)
    torch.library.opcheck(torch.ops.ligermodels.flce_fwd.default,
                          (hidden, weight, b, target, scale, -100, 0.1, 1e-3, 3.0, True, True, True))
    lse, g = randn(20, seed=92), randn(20, seed=93)
    torch.library.opcheck(torch.ops.ligermodels.flce_bwd.default,
                          (hidden, weight, None, target, lse, g, -100, 0.1, 1e-3, 3.0, True, True, False))
    torch.library.opcheck(torch.ops.ligermodels.flce_vocab_fwd.default,
                          (hidden, weight, b, target, -100, 0.1, 1e-3, 3.0))
    torch.library.opcheck(torch.ops.ligermodels.flce_vocab_bwd.default,
                          (hidden, weight, None, target, lse, g, -100, 0.1, 1e-3, 3.0, True, True, False))
    torch.library.opcheck(torch.ops.ligermodels.flce_vocab_bwd.default,
                          (hidden, weight, b, target, lse, scale, -100, 0.0, 0.0, 0.0, False, True, True))


@pytest.mark.parametrize("strategy,reduction", [("tokens", "none"), ("vocab", "none"), ("vocab", "mean")])
def test_flce_compiles_fullgraph_through_the_custom_ops(strategy, reduction):
    """Dynamo + AOTAutograd trace the public function, its autograd.Function and the FLCE custom ops with
    fake tensors, no graph break. ("tokens" "none" and "vocab" only: their forward and backward are custom
    ops with fake implementations; triton_ops cannot be traced while the interpreter runs the kernels.)"""
    hidden, weight, b = _flce_case(torch.float32, 300, True, seed=95)
    target = _targets(N_TOKENS, 300, True, seed=96)
    w_tok = torch.linspace(0, 1, N_TOKENS, device=DEVICE)
    assert_triton_runs(hidden)

    def f(h, w, bb):
        loss = fused_linear_cross_entropy(h, w, target, bb, softcap=3.0, reduction=reduction, strategy=strategy)
        return (loss * w_tok).sum()

    results = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        hidden.grad = weight.grad = b.grad = None
        out = fn(hidden, weight, b)
        out.backward()
        results.append([out.detach(), hidden.grad, weight.grad, b.grad])
    for e, c in zip(*results, strict=True):
        assert rel_err(c, e) <= 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the interpreter cannot take fake tensors")
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_compile_fullgraph_and_no_host_sync(dtype, strategy):
    """torch.compile(fullgraph=True) traces both losses (no graph break) and matches eager; and no op
    synchronises the host with the device (CUDA sync debug mode turns any sync into an error)."""
    hidden, weight, b = _flce_case(dtype, 1000, True, seed=100)
    target = _targets(N_TOKENS, 1000, True, seed=101)
    logits = randn(N_TOKENS, 777, dtype=dtype, seed=102).requires_grad_()
    t2 = _targets(N_TOKENS, 777, True, seed=103)
    n_items = torch.tensor(40, device=DEVICE)

    def f(h, w, bb, x):
        a = fused_linear_cross_entropy(h, w, target, bb, softcap=5.0, label_smoothing=0.1, num_items=n_items,
                                       strategy=strategy)
        c = fused_linear_cross_entropy(h, w, target, bb, lse_square_scale=1e-3, reduction="none", strategy=strategy)
        d = cross_entropy(x, t2, label_smoothing=0.1, reduction="none")
        return a + (c * torch.linspace(0, 1, c.numel(), device=DEVICE)).sum() + cross_entropy(x, t2) + d.sum()

    def run(fn):
        for t in (hidden, weight, b, logits):
            t.grad = None
        out = fn(hidden, weight, b, logits)
        out.backward()
        return [out.detach()] + [t.grad.clone() for t in (hidden, weight, b, logits)]

    eager = run(f)
    compiled = run(torch.compile(f, fullgraph=True))
    for e, c in zip(eager, compiled, strict=True):
        assert rel_err(c, e) <= (1e-5 if dtype == torch.float32 else 1e-2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(f)
    finally:
        torch.cuda.set_sync_debug_mode("default")
