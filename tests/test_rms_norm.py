"""rms_norm / fused_add_rms_norm: forward and every gradient against float64, HF rounding, decoder use."""

import pytest
import torch
import triton

from kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_reference, rms_norm, rms_norm_reference
from tests.utils import DEVICE, assert_rel, assert_triton_runs, assert_unchanged, randn, rel_err, snapshot

EPS = 1e-6
SHAPES = [(2, 3, 5, 777), (3, 7, 1000), (37, 96)]
CASTINGS = [("llama", 0.0), ("llama", 1.0), ("gemma", 1.0), ("gemma", 0.0)]
DTYPES = [torch.float32, torch.bfloat16]


def _float64(x, residual, weight, offset):
    """Plain RMSNorm math in float64 on leaf copies: returns (y, h, leaves); h is None without residual."""
    leaves = [t.detach().double().requires_grad_() for t in (x, residual, weight) if t is not None]
    h = leaves[0] + leaves[1] if residual is not None else leaves[0]
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * (offset + leaves[-1])
    return y, (h if residual is not None else None), leaves


def _eager_bf16(x, weight, offset, casting):
    """What an HF-style module computes in PyTorch eager on bf16 tensors (Llama or Gemma convention)."""
    xf = x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    if casting == "llama":
        return (offset + weight) * n.to(x.dtype)
    return (n * (offset + weight.float())).type_as(x)


def _inputs(shape, dtype, residual: bool):
    x = randn(*shape, dtype=dtype, scale=2.0).requires_grad_()
    r = randn(*shape, dtype=dtype, scale=3.0).requires_grad_() if residual else None
    w = randn(shape[-1], dtype=dtype, scale=0.5).requires_grad_()
    return x, r, w


@pytest.mark.parametrize("casting,offset", CASTINGS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_float64_forward_and_gradients(dtype, shape, casting, offset):
    x, _, w = _inputs(shape, dtype, residual=False)
    dy = randn(*shape, dtype=dtype)
    assert_triton_runs(x)
    before = snapshot(x, w, dy)

    y = rms_norm(x, w, EPS, offset, casting)
    y.backward(dy)
    assert_unchanged(before, x, w, dy)
    assert y.dtype == dtype and w.grad.dtype == dtype
    ref, _, (xd, wd) = _float64(x, None, w, offset)
    ref.backward(dy.double())
    errs = {"y": assert_rel(y, ref, dtype, "y"), "dx": assert_rel(x.grad, xd.grad, dtype, "dx"),
            "dw": assert_rel(w.grad, wd.grad, dtype, "dw")}

    if dtype == torch.bfloat16:  # no worse than eager PyTorch doing the HF-style math in bf16
        xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        ye = _eager_bf16(xe, we, offset, casting)
        ye.backward(dy)
        for what, theirs, ref_ in [("y", ye, ref), ("dx", xe.grad, xd.grad), ("dw", we.grad, wd.grad)]:
            assert errs[what] <= 1.05 * rel_err(theirs, ref_) + 1e-6, f"{what}: worse than eager bf16"


@pytest.mark.parametrize("casting,offset", CASTINGS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_float64_forward_and_gradients(dtype, shape, casting, offset):
    x, r, w = _inputs(shape, dtype, residual=True)
    dy, dh = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    assert_triton_runs(x)
    before = snapshot(x, r, w, dy, dh)

    y, h = fused_add_rms_norm(x, r, w, EPS, offset, casting)
    torch.autograd.backward([y, h], [dy, dh])
    assert_unchanged(before, x, r, w, dy, dh)
    ref_y, ref_h, (xd, rd, wd) = _float64(x, r, w, offset)
    torch.autograd.backward([ref_y, ref_h], [dy.double(), dh.double()])
    errs = {"y": assert_rel(y, ref_y, dtype, "y"), "h": assert_rel(h, ref_h, dtype, "h"),
            "dx": assert_rel(x.grad, xd.grad, dtype, "dx"), "dr": assert_rel(r.grad, rd.grad, dtype, "dresidual"),
            "dw": assert_rel(w.grad, wd.grad, dtype, "dw")}
    assert x.grad.data_ptr() != r.grad.data_ptr(), "x.grad and residual.grad share memory"

    if dtype == torch.bfloat16:
        xe, re_, we = (t.detach().clone().requires_grad_() for t in (x, r, w))
        he = xe + re_
        ye = _eager_bf16(he, we, offset, casting)
        torch.autograd.backward([ye, he], [dy, dh])
        for what, theirs, ref_ in [("y", ye, ref_y), ("h", he, ref_h), ("dx", xe.grad, xd.grad),
                                   ("dr", re_.grad, rd.grad), ("dw", we.grad, wd.grad)]:
            assert errs[what] <= 1.05 * rel_err(theirs, ref_) + 1e-6, f"{what}: worse than eager bf16"


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (same-sign values: bit patterns are ordered)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_bf16_forward_reproduces_transformers_module_rounding(casting):
    """Kernel vs transformers' LlamaRMSNorm / GemmaRMSNorm in bf16 with one random weight.

    Not asserted bit-for-bit: the kernel sums x^2 in another order than PyTorch, so about a quarter
    of the rows get an rstd one fp32 ulp apart, which flips the bf16 rounding of a handful of
    elements (measured: <= 5e-5 of elements, by 1 ulp, 2 for Llama's double rounding). A wrong
    convention (rounding once instead of twice, or weight*x in bf16 for Gemma) changes ~10-40%.
    The pure-PyTorch reference, which sums as PyTorch does, must match bit for bit.
    """
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    H, offset = 1000, (0.0 if casting == "llama" else 1.0)
    x = randn(64, H, dtype=torch.bfloat16, scale=3.0)
    w = randn(H, dtype=torch.bfloat16, scale=0.5)
    assert_triton_runs(x)
    module = (LlamaRMSNorm(H, eps=EPS) if casting == "llama" else GemmaRMSNorm(H, eps=EPS)).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(w)  # Gemma stores w and scales by 1 + w, hence offset=1
        theirs = module(x)
        ours = rms_norm(x, w, EPS, offset, casting)
        ref = rms_norm_reference(x, w, EPS, offset, casting)
        other = rms_norm(x, w, EPS, offset, "gemma" if casting == "llama" else "llama")
    assert ours.dtype == theirs.dtype == torch.bfloat16
    diff = _ulps(ours, theirs)
    assert (diff > 0).float().mean().item() <= 1e-3, f"{(diff > 0).sum().item()} elements differ from transformers"
    assert diff.max().item() <= 2
    if DEVICE.type == "cpu":
        assert torch.equal(ref, theirs), "the PyTorch reference does not reproduce transformers bit for bit"
    assert (_ulps(other, theirs) > 0).float().mean().item() > 0.05, "the casting switch makes no difference"


def test_fused_add_rms_norm_matches_hf_residual_add_then_norm_in_bf16():
    """h is bit for bit HF's ``residual + hidden_states`` in bf16; y is the Llama norm of that h."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, r, w = (t.detach() for t in _inputs((4, 16, 777), torch.bfloat16, residual=True))
    assert_triton_runs(x)
    module = LlamaRMSNorm(777, eps=EPS).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(w)
        y, h = fused_add_rms_norm(x, r, w, EPS)
        h_hf = r + x
        y_hf = module(h_hf)
    assert torch.equal(h, h_hf)
    diff = _ulps(y, y_hf)
    assert (diff > 0).float().mean().item() <= 1e-3 and diff.max().item() <= 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_path_gives_the_kernel_numbers(dtype):
    """The pure-PyTorch fallback (used on CPU without the interpreter) agrees with the kernels,
    forward and gradients: same rounding rules, different summation order only."""
    shape = (3, 5, 777)
    x, r, w = _inputs(shape, dtype, residual=True)
    dy, dh = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    assert_triton_runs(x)
    bound = 1e-6 if dtype == torch.float32 else 2e-3
    for casting, offset in [("llama", 0.0), ("gemma", 1.0)]:
        outs = {}
        for name, fn in [("kernel", fused_add_rms_norm), ("reference", fused_add_rms_norm_reference)]:
            xs, rs, ws = (t.detach().clone().requires_grad_() for t in (x, r, w))
            y, h = fn(xs, rs, ws, EPS, offset, casting)
            torch.autograd.backward([y, h], [dy, dh])
            outs[name] = [y, h, xs.grad, rs.grad, ws.grad]
        for what, a, b in zip(["y", "h", "dx", "dr", "dw"], outs["kernel"], outs["reference"], strict=True):
            assert_rel(a, b, dtype, f"{casting} {what}", bound=bound)
        assert torch.equal(outs["kernel"][1], outs["reference"][1])
        xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y_ref = rms_norm_reference(xs, ws, EPS, offset, casting)
        assert_rel(rms_norm(x.detach(), w.detach(), EPS, offset, casting), y_ref, dtype, "rms_norm y", bound=bound)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs_give_the_contiguous_results(dtype):
    """Row-strided views are read in place, transposed ones copied; results are bit for bit the same."""
    R, H = 24, 777
    x = randn(R, H + 13, dtype=dtype)[:, :H].requires_grad_()  # row stride H + 13
    r = randn(H, R, dtype=dtype).t().requires_grad_()  # column-major: needs a copy
    w = randn(2 * H, dtype=dtype)[::2].requires_grad_()
    dy, dh = randn(H, R, dtype=dtype).t(), randn(R, H + 1, dtype=dtype)[:, 1:]
    assert_triton_runs(x)
    assert not x.is_contiguous() and not r.is_contiguous() and not w.is_contiguous()
    got, want = [], []
    for inputs, out in [((x, r, w), got), ((x.detach().contiguous().requires_grad_(),
                                            r.detach().contiguous().requires_grad_(),
                                            w.detach().contiguous().requires_grad_()), want)]:
        y, h = fused_add_rms_norm(*inputs, EPS, 1.0, "gemma")
        torch.autograd.backward([y, h], [dy, dh])
        y1 = rms_norm(inputs[0], inputs[2], EPS)
        y1.backward(dy)
        out += [y, h, y1] + [t.grad for t in inputs]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("use", ["y_only", "h_only"])
def test_fused_add_rms_norm_with_one_output_unused(use):
    """An unused output's gradient arrives as None; it must count as zero (no materialised zeros needed)."""
    shape = (5, 3, 96)
    x, r, w = _inputs(shape, torch.float32, residual=True)
    g = randn(*shape)
    assert_triton_runs(x)
    y, h = fused_add_rms_norm(x, r, w, EPS, 1.0, "gemma")
    ((y if use == "y_only" else h) * g).sum().backward()
    ref_y, ref_h, (xd, rd, wd) = _float64(x, r, w, 1.0)
    ((ref_y if use == "y_only" else ref_h) * g.double()).sum().backward()
    assert_rel(x.grad, xd.grad, torch.float32, "dx")
    assert_rel(r.grad, rd.grad, torch.float32, "dresidual")
    if use == "y_only":
        assert_rel(w.grad, wd.grad, torch.float32, "dw")
    else:
        assert w.grad is None or not w.grad.any()


@pytest.mark.parametrize("use_last_h", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decoder_chain_of_fused_calls_matches_float64_gradients(dtype, use_last_h):
    """Two decoder layers: h of layer 1 is layer 2's residual, y of each feeds a matmul. x and
    residual get one gradient tensor; this catches aliasing (one in-place accumulation leaking into
    the other) and a dropped or doubled dh."""
    T, H = 12, 96
    emb, attn = randn(T, H, dtype=dtype).requires_grad_(), randn(T, H, dtype=dtype).requires_grad_()
    w1, w2 = (randn(H, dtype=dtype, scale=0.5).requires_grad_() for _ in range(2))
    A, B = (randn(H, H, dtype=dtype, scale=H**-0.5).requires_grad_() for _ in range(2))
    g_out, g_h = randn(T, H, dtype=dtype), randn(T, H, dtype=dtype)
    leaves = [emb, attn, w1, w2, A, B]
    assert_triton_runs(emb)

    def model(emb, attn, w1, w2, A, B, fused):
        y1, h1 = fused(attn, emb, w1)
        y2, h2 = fused(y1 @ A, h1, w2)
        loss = ((y2 @ B) * g_out.to(y2.dtype)).sum()
        return loss + (h2 * g_h.to(h2.dtype)).sum() if use_last_h else loss

    def fused64(x, r, w):
        h = x + r
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w, h

    model(*leaves, lambda x, r, w: fused_add_rms_norm(x, r, w, EPS)).backward()
    ref = [t.detach().double().requires_grad_() for t in leaves]
    model(*ref, fused64).backward()
    for name, t, t64 in zip(["emb", "attn", "w1", "w2", "A", "B"], leaves, ref, strict=True):
        assert_rel(t.grad, t64.grad, dtype, f"d{name}", bound=1e-5 if dtype == torch.float32 else 2e-2)
    assert emb.grad.data_ptr() != attn.grad.data_ptr()


def test_bf16_input_with_fp32_weight_keeps_the_input_dtype():
    """Mixed precision: bf16 activations, fp32 weight -> bf16 output, fp32 weight gradient."""
    x = randn(6, 777, dtype=torch.bfloat16, scale=2.0).requires_grad_()
    w = randn(777, scale=0.5).requires_grad_()
    dy = randn(6, 777, dtype=torch.bfloat16)
    assert_triton_runs(x)
    y = rms_norm(x, w, EPS, 0.0, "gemma")
    y.backward(dy)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    ref, _, (xd, wd) = _float64(x, None, w, 0.0)
    ref.backward(dy.double())
    assert_rel(y, ref, torch.bfloat16, "y")
    assert_rel(x.grad, xd.grad, torch.bfloat16, "dx")
    assert_rel(w.grad, wd.grad, torch.float32, "dw (fp32 weight)", bound=1e-5)


def test_empty_batch():
    x = torch.zeros(0, 96, device=DEVICE, requires_grad=True)
    w = randn(96).requires_grad_()
    assert_triton_runs(x)
    y = rms_norm(x, w)
    y.sum().backward()
    assert y.shape == (0, 96) and x.grad.shape == (0, 96) and not w.grad.any()


def test_rms_norm_rejects_bad_casting_and_shapes():
    x, w = torch.zeros(2, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    for fn in (rms_norm, rms_norm_reference):
        with pytest.raises(ValueError, match="casting.*'mistral'"):
            fn(x, w, 1e-6, 0.0, "mistral")
        with pytest.raises(ValueError, match=r"weight must have shape \(H,\)"):
            fn(x, torch.ones(9, device=DEVICE))
        with pytest.raises(ValueError, match=r"weight must have shape \(H,\)"):
            fn(x, torch.ones(1, 8, device=DEVICE))
    with pytest.raises(ValueError, match="casting"):
        fused_add_rms_norm(x, x, w, casting="Llama")
    with pytest.raises(ValueError, match="one shape and dtype"):
        fused_add_rms_norm(x, torch.zeros(2, 9, device=DEVICE), w)
    with pytest.raises(ValueError, match="one shape and dtype"):
        fused_add_rms_norm(x, x.bfloat16(), w)
    with pytest.raises(ValueError, match="weight"):
        fused_add_rms_norm(x, x, torch.ones(7, device=DEVICE))
    with pytest.raises(ValueError, match="x must be a floating-point tensor"):  # not rounded into int64
        rms_norm(torch.ones(2, 8, dtype=torch.int64, device=DEVICE), w)


def test_weight_gradient_sum_kernel_over_many_partial_rows():
    """The dw kernel sums a (programs, H) fp32 partial buffer over rows in fp32 and rounds once to the
    weight's dtype: several BLOCK_P chunks with a masked tail, a masked last column block."""
    import importlib

    mod = importlib.import_module("kernels.rms_norm")
    n_partial, H = 600, 777
    partial = randn(n_partial, H, scale=3.0)
    assert_triton_runs(partial)
    block_p, block_n, warps = mod._dw_tiling(n_partial, H)
    assert block_p < n_partial and H % block_n != 0 and n_partial % block_p != 0
    want = partial.double().sum(0)
    for dtype in (torch.float32, torch.bfloat16):
        dw = torch.full((H,), float("nan"), dtype=dtype, device=DEVICE)
        mod._rms_norm_dw_kernel[(triton.cdiv(H, block_n),)](partial, dw, n_partial, H, BLOCK_P=block_p,
                                                             BLOCK_N=block_n, num_warps=warps)
        assert_rel(dw, want, torch.float32, f"dw {dtype}", bound=1e-6 if dtype == torch.float32 else 4e-3)
        if dtype == torch.bfloat16:  # one rounding of the fp32 sum: within half a bf16 ulp of the fp64 sum
            assert ((dw.double() - want).abs() <= want.abs() * 2.0**-8 * 1.001 + 1e-6).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_with_many_programs_matches_float64(dtype, monkeypatch):
    """The backward grid as on a GPU (dozens of programs, so dozens of partial-dw rows), here forced."""
    import importlib

    mod = importlib.import_module("kernels.rms_norm")
    monkeypatch.setattr(mod, "_bwd_programs", lambda device, rows, block_m, block_n: triton.cdiv(rows, block_m))
    x, r, w = _inputs((1100, 96), dtype, residual=True)  # 96 columns: 16 rows a program -> 69 programs
    dy, dh = randn(1100, 96, dtype=dtype), randn(1100, 96, dtype=dtype)
    assert_triton_runs(x)
    y, h = fused_add_rms_norm(x, r, w, EPS, 1.0, "gemma")
    torch.autograd.backward([y, h], [dy, dh])
    ref_y, ref_h, (xd, rd, wd) = _float64(x, r, w, 1.0)
    torch.autograd.backward([ref_y, ref_h], [dy.double(), dh.double()])
    assert_rel(x.grad, xd.grad, dtype, "dx")
    assert_rel(w.grad, wd.grad, dtype, "dw")


@pytest.mark.parametrize("prefetch", [True, False])
def test_backward_with_and_without_prefetch_matches_float64(prefetch, monkeypatch):
    """Both loops of the backward kernel (next tile loaded ahead, or not), each program looping over
    several tiles with a masked last tile, with and without the incoming residual gradient."""
    import importlib

    mod = importlib.import_module("kernels.rms_norm")
    tiling = mod._bwd_tiling

    def forced(cols, elem_size):
        block_m, block_n, warps, _ = tiling(cols, elem_size)
        return min(block_m, 4), block_n, warps, prefetch

    monkeypatch.setattr(mod, "_bwd_tiling", forced)
    monkeypatch.setattr(mod, "_bwd_programs", lambda device, rows, block_m, block_n: 3)
    dtype = torch.float32
    x, r, w = _inputs((301, 130), dtype, residual=True)  # 3 programs of 104 rows: 26 tiles each, last short
    dy, dh = randn(301, 130, dtype=dtype), randn(301, 130, dtype=dtype)
    assert_triton_runs(x)
    ref_y, ref_h, (xd, rd, wd) = _float64(x, r, w, 0.0)
    torch.autograd.backward([ref_y, ref_h], [dy.double(), dh.double()])
    y, h = fused_add_rms_norm(x, r, w, EPS)
    torch.autograd.backward([y, h], [dy, dh])
    assert_rel(x.grad, xd.grad, dtype, "dx")
    assert_rel(w.grad, wd.grad, dtype, "dw")
    x.grad = w.grad = None
    y = rms_norm(x, w, EPS)
    y.backward(dy)
    xs, ws = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rms_norm_reference(xs, ws, EPS).backward(dy.double())
    assert_rel(x.grad, xs.grad, dtype, "dx (no dh)")
    assert_rel(w.grad, ws.grad, dtype, "dw (no dh)")


def test_backward_programs_per_sm_env_override(monkeypatch):
    import importlib

    mod = importlib.import_module("kernels.rms_norm")
    assert mod._BWD_PROGRAMS_PER_SM >= 1
    for value, want in [("", 2), (" 3 ", 3), ("1", 1)]:
        monkeypatch.setenv("LIGER_RMS_BWD_PPS", value)
        assert mod._env_positive_int("LIGER_RMS_BWD_PPS", 2) == want
    for bad in ("0", "-1", "two", "1.5"):
        monkeypatch.setenv("LIGER_RMS_BWD_PPS", bad)
        with pytest.raises(ValueError, match="LIGER_RMS_BWD_PPS"):
            mod._env_positive_int("LIGER_RMS_BWD_PPS", 2)


@pytest.mark.parametrize("fused", [False, True])
def test_zero_width_rows_give_empty_outputs_and_a_zero_weight_gradient(fused):
    """H = 0: empty y (and h), empty dx, a 0-size dw, on the kernel path as in the reference."""
    x = torch.zeros(2, 3, 0, device=DEVICE, requires_grad=True)
    w = torch.zeros(0, device=DEVICE, requires_grad=True)
    assert_triton_runs(x)
    if fused:
        y, h = fused_add_rms_norm(x, torch.zeros_like(x), w)
        assert h.shape == (2, 3, 0)
    else:
        y = rms_norm(x, w)
    assert y.shape == (2, 3, 0)
    y.sum().backward()
    assert x.grad.shape == (2, 3, 0) and w.grad.shape == (0,)
