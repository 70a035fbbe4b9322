"""rms_norm_linear: linear(rms_norm(x + residual)) with the norm output recomputed in backward.

Forward and every gradient (x, residual, norm weight, projection weight, bias) against float64, the
same numbers as the unfused composition, the activation it keeps for backward, and partial use."""

import pytest
import torch
import torch.nn.functional as F

from kernels import fused_add_rms_norm, rms_norm, rms_norm_linear
from tests.utils import DEVICE, assert_rel, assert_triton_runs, assert_unchanged, randn, snapshot

EPS = 1e-6


def _inputs(shape, n_out, dtype, residual: bool, bias: bool, seed: int):
    h = shape[-1]
    x = randn(*shape, dtype=dtype, scale=2.0, seed=seed).requires_grad_()
    r = randn(*shape, dtype=dtype, scale=3.0, seed=seed + 1).requires_grad_() if residual else None
    nw = randn(h, dtype=dtype, scale=0.5, seed=seed + 2).requires_grad_()
    w = randn(n_out, h, dtype=dtype, scale=h ** -0.5, seed=seed + 3).requires_grad_()
    b = randn(n_out, dtype=dtype, seed=seed + 4).requires_grad_() if bias else None
    return x, r, nw, w, b


def _leaves(*ts):
    return [t for t in ts if t is not None]


@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "first_layer"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_linear_matches_float64_forward_and_gradients(dtype, bias, residual, casting, offset):
    shape, n_out = ((3, 7, 1000), 333) if residual else ((2, 5, 777), 96)
    seed = hash((dtype, bias, residual, casting)) % 1000
    x, r, nw, w, b = _inputs(shape, n_out, dtype, residual, bias, seed)
    dout = randn(*shape[:-1], n_out, dtype=dtype, seed=seed + 5)
    dh = randn(*shape, dtype=dtype, seed=seed + 6)
    assert_triton_runs(x)
    before = snapshot(*_leaves(x, r, nw, w, b, dout, dh))

    res = rms_norm_linear(x, nw, w, b, r, EPS, offset, casting)
    out, h = res if residual else (res, None)
    outs, grads_in = ([out, h], [dout, dh]) if residual else ([out], [dout])
    torch.autograd.backward(outs, grads_in)
    assert_unchanged(before, *_leaves(x, r, nw, w, b, dout, dh))

    leaves64 = [t.detach().double().requires_grad_() for t in _leaves(x, r, nw, w, b)]
    it = iter(leaves64)
    x64, r64, nw64, w64 = next(it), (next(it) if residual else None), next(it), next(it)
    b64 = next(it) if bias else None
    h64 = x64 + r64 if residual else x64
    y64 = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + EPS) * (offset + nw64)
    out64 = F.linear(y64, w64, b64)
    torch.autograd.backward([out64, h64] if residual else [out64],
                            [dout.double(), dh.double()] if residual else [dout.double()])
    assert_rel(out, out64, dtype, "out")
    if residual:
        assert_rel(h, h64, dtype, "h")
    names = ["dx", "dresidual", "dnorm_weight", "dweight", "dbias"]
    names = [n for n, t in zip(names, (x, r, nw, w, b), strict=True) if t is not None]
    for name, ours, ref in zip(names, _leaves(x, r, nw, w, b), leaves64, strict=True):
        assert ours.grad.dtype == dtype
        assert_rel(ours.grad, ref.grad, dtype, name)


def test_rms_norm_linear_equals_unfused_composition():
    """Same values and gradients as rms_norm / fused_add_rms_norm followed by F.linear, on the kernels."""
    x, r, nw, w, b = _inputs((4, 9, 320), 200, torch.bfloat16, True, True, seed=3)
    dout = randn(4, 9, 200, dtype=torch.bfloat16, seed=9)
    dh = randn(4, 9, 320, dtype=torch.bfloat16, seed=10)
    assert_triton_runs(x)
    out, h = rms_norm_linear(x, nw, w, b, r)
    ours = torch.autograd.grad([out, h], [x, r, nw, w, b], [dout, dh])
    y, h2 = fused_add_rms_norm(x, r, nw)
    out2 = F.linear(y, w, b)
    theirs = torch.autograd.grad([out2, h2], [x, r, nw, w, b], [dout, dh])
    assert torch.equal(out, out2) and torch.equal(h, h2)
    for name, a, c in zip(["dx", "dr", "dnw", "dw", "db"], ours, theirs, strict=True):
        assert_rel(a, c, torch.bfloat16, name, bound=1e-6)
    out3 = rms_norm_linear(x, nw, w, None)
    assert torch.equal(out3, F.linear(rms_norm(x, nw), w))


def _saved_activation_bytes(fn, numel: int) -> int:
    """Bytes of distinct activation-sized tensors (``numel`` elements) autograd keeps for backward."""
    sizes = {}

    def pack(t):
        if t.numel() == numel:
            sizes[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(sizes.values())


def test_rms_norm_linear_keeps_only_the_residual_stream_for_backward():
    """The norm output is not saved: one (B, S, H) activation (h) instead of two (h and y)."""
    x, r, nw, w, _ = _inputs((2, 8, 256), 128, torch.bfloat16, True, False, seed=4)
    act = x.numel() * x.element_size()
    fused = _saved_activation_bytes(lambda: rms_norm_linear(x, nw, w, None, r), x.numel())
    unfused = _saved_activation_bytes(lambda: F.linear(fused_add_rms_norm(x, r, nw)[0], w), x.numel())
    assert fused == act, f"saved {fused} bytes, expected only h ({act})"
    assert unfused == 2 * act


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "first_layer"])
def test_rms_norm_linear_keep_output_gives_the_same_numbers_and_saves_the_norm_output(residual, monkeypatch):
    """keep_output=True (inside checkpointed layers): bitwise the same output and gradients, and the
    norm output saved for backward next to h instead of written again there."""
    import kernels.norm_linear as nl

    calls = []
    fwd = nl._rms_norm_fwd
    monkeypatch.setattr(nl, "_rms_norm_fwd", lambda *a: calls.append(1) or fwd(*a))
    x, r, nw, w, b = _inputs((3, 7, 320), 96, torch.bfloat16, residual, True, seed=12)
    dout = randn(3, 7, 96, dtype=torch.bfloat16, seed=13)
    dh = randn(3, 7, 320, dtype=torch.bfloat16, seed=14)
    assert_triton_runs(x)
    act = x.numel() * x.element_size()
    results = {}
    for keep in (False, True):
        def run(keep=keep):
            return rms_norm_linear(x, nw, w, b, r, keep_output=keep)
        res = run()
        outs, grads_in = ([res[0], res[1]], [dout, dh]) if residual else ([res], [dout])
        calls.clear()
        grads = torch.autograd.grad(outs, _leaves(x, r, nw, w, b), grads_in)
        assert len(calls) == (0 if keep else 1)  # the norm forward runs again in backward only without keep
        results[keep] = (*outs, *grads, _saved_activation_bytes(run, x.numel()))
    assert results[False][-1] == act and results[True][-1] == 2 * act
    for a, c in zip(results[False][:-1], results[True][:-1], strict=True):
        assert torch.equal(a, c)


def test_rms_norm_linear_partial_use():
    """Only the projection used (h's gradient absent), or only h used (the projection's absent)."""
    x, r, nw, w, b = _inputs((2, 5, 128), 64, torch.float32, True, True, seed=6)
    out, h = rms_norm_linear(x, nw, w, b, r)
    g_out = torch.autograd.grad(out.sum(), [x, r, nw, w, b])
    y2, _ = fused_add_rms_norm(x, r, nw)
    ref = torch.autograd.grad(F.linear(y2, w, b).sum(), [x, r, nw, w, b])
    for a, c in zip(g_out, ref, strict=True):
        assert_rel(a, c, torch.float32, "out only", bound=1e-6)
    out, h = rms_norm_linear(x, nw, w, b, r)
    gx, gr = torch.autograd.grad(h.sum(), [x, r])
    assert torch.equal(gx, torch.ones_like(x)) and torch.equal(gr, torch.ones_like(r))


def test_rms_norm_linear_rejects_bad_shapes():
    x = torch.zeros(2, 5, 64, device=DEVICE)
    nw = torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight must be \(N, H\)"):
        rms_norm_linear(x, nw, torch.zeros(32, 63, device=DEVICE))
    with pytest.raises(ValueError, match="bias"):
        rms_norm_linear(x, nw, torch.zeros(32, 64, device=DEVICE), torch.zeros(31, device=DEVICE))
    with pytest.raises(ValueError, match="rms_norm"):
        rms_norm_linear(x, torch.ones(63, device=DEVICE), torch.zeros(32, 64, device=DEVICE))
