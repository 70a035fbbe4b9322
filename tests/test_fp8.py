"""FP8 linear layers: the row quantisation, the norm and GLU kernels that write their outputs quantised, and the
projections' forward and gradients against a float64 oracle of the quantised math (:mod:`kernels.fp8`)."""

import pytest
import torch
import torch.nn.functional as F

import kernels.fp8
from kernels import LowRank, glu_linear, lora_linear, rms_norm_linear
from kernels.fp8 import (
    E4M3,
    E5M2,
    FP8_MAX,
    FP8_MODES,
    dequantize,
    fp8_linear,
    quantize_cols_t,
    quantize_rows,
    quantize_rows_reference,
)
from kernels.low_rank import low_rank_reference
from tests.utils import DEVICE, assert_triton_runs, randn, rel_err


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).cpu()


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape, dtype, block", [((37, 300), torch.float32, 4096), ((5, 900), torch.bfloat16, 128),
                                                 ((3, 4, 17), torch.bfloat16, 4096)])
def test_row_quantisation_kernel_equals_the_reference_bit_for_bit(fp8_dtype, shape, dtype, block, monkeypatch):
    """Each row's scale is the least power of two at or above amax / FMAX, and its fp8 values are the row divided
    by it, rounded once: the kernel (one block per row, or two passes over rows wider than a block) gives the
    reference's bits. A zero row gets the smallest normal scale and zeros; values round to subnormals too."""
    monkeypatch.setattr(kernels.fp8, "_BLOCK", block)
    monkeypatch.setattr(kernels.fp8, "_WIDE_BLOCK", block)
    x = randn(*shape, dtype=dtype, scale=3.0)
    x.view(-1, shape[-1])[2, :5] = torch.tensor([1e-4, -3e-3, 40.0, 1e-6, -2e-5], dtype=dtype)
    x.view(-1, shape[-1])[1] = 0.0
    assert_triton_runs(x)
    q, s = quantize_rows(x, fp8_dtype)
    rq, rs = quantize_rows_reference(x.cpu(), fp8_dtype)
    assert q.dtype == fp8_dtype and q.shape == (x.numel() // shape[-1], shape[-1]) and s.shape == (q.shape[0], 1)
    assert torch.equal(s.cpu(), rs) and torch.equal(_bits(q), _bits(rq))
    amax = x.reshape(q.shape).abs().amax(dim=1, keepdim=True).float().cpu()
    live = amax[:, 0] > 0
    ratio = (amax / s.cpu())[live]
    assert (ratio <= FP8_MAX[fp8_dtype]).all() and (ratio > FP8_MAX[fp8_dtype] / 2).all()
    assert torch.equal(torch.log2(s.cpu()), torch.log2(s.cpu()).round())
    assert rel_err(dequantize(q, s).cpu(), x.reshape(q.shape)) <= (0.04 if fp8_dtype == E4M3 else 0.08)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape, dtype", [((150, 70), torch.bfloat16), ((33, 16), torch.float32)])
def test_column_quantisation_writes_the_transpose_of_the_columns_quantised_as_rows(fp8_dtype, shape, dtype):
    """quantize_cols_t(x) is quantize_rows(x.T) bit for bit: the columns' maxima folded across row chunks (three
    of them at 150 rows) and column blocks, the values written transposed."""
    x = randn(*shape, dtype=dtype, scale=3.0)
    x[:, 3] = 0.0
    assert_triton_runs(x)
    q, s = quantize_cols_t(x, fp8_dtype)
    rq, rs = quantize_rows_reference(x.t().cpu(), fp8_dtype)
    assert q.shape == (shape[1], shape[0]) and torch.equal(s.cpu(), rs) and torch.equal(_bits(q), _bits(rq))


class _QuantisedLinear64(torch.autograd.Function):
    """float64 oracle of an FP8 projection: forward deq(q(y)) @ deq(q(W)).T, input gradient deq(q(dout)) @
    deq(q(W.T)).T, weight gradient deq(q(dout.T)) @ deq(q(y.T)).T (each operand quantised along the product's
    reduction dim), or dout.T @ y unquantised when the recipe keeps it in bf16."""

    @staticmethod
    def forward(ctx, y, weight, recipe):
        ctx.save_for_backward(y, weight)
        ctx.recipe = recipe
        return F.linear(_deq(y), _deq(weight)).view(*y.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dout):
        y, weight = ctx.saved_tensors
        d2, y2 = dout.reshape(-1, dout.shape[-1]), y.reshape(-1, y.shape[-1])
        g = ctx.recipe.grad_dtype
        dy = _deq(d2, g) @ _deq(weight.t()).t()
        dw = _deq(d2.t(), g) @ _deq(y2.t()).t() if ctx.recipe.weight_grad else d2.t() @ y2
        return dy.view(y.shape), dw, None


def _deq(x: torch.Tensor, fp8_dtype=E4M3) -> torch.Tensor:
    """x's rows quantised and dequantised, in float64."""
    return dequantize(*quantize_rows_reference(x.contiguous(), fp8_dtype), torch.float64)


MODES = FP8_MODES
#: On the GPU the norm's rsqrt and the GLU's exp are approximate: a few of the fp32 values then sit on the other
#: side of an fp8 rounding boundary than the float64 oracle's, and each such element moves by one fp8 step (1/8 of
#: its magnitude in e4m3); the bound takes in a few such elements.
BOUND = 1e-5 if DEVICE.type == "cpu" else 3e-3


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("residual", [False, True])
def test_norm_projection_in_fp8_matches_the_float64_quantised_math_with_every_gradient(mode, residual):
    """rms_norm_linear with fp8: the norm kernel's quantised output through the FP8 GEMM, and the input gradient
    through the FP8 GEMM of the quantised output gradient, as the float64 oracle computes them (fp32 inputs,
    through the interpreter on the CPU)."""
    m, h, n = 37, 48, 80
    x, w_norm = randn(3, m // 3 + 1, h, scale=2.0), 1.0 + 0.1 * randn(h)
    r, weight = randn(*x.shape), 0.2 * randn(n, h)
    dout, dh = randn(*x.shape[:-1], n), randn(*x.shape)
    assert_triton_runs(x)
    ours = [t.clone().requires_grad_() for t in (x, r, w_norm, weight)]
    res = rms_norm_linear(ours[0], ours[2], ours[3], residual=ours[1] if residual else None, fp8=mode)
    ref = [t.detach().double().cpu().requires_grad_() for t in (x, r, w_norm, weight)]
    hr = ref[0] + ref[1] if residual else ref[0]
    yr = hr * torch.rsqrt(hr.pow(2).mean(-1, keepdim=True) + 1e-6) * ref[2]
    out_r = _QuantisedLinear64.apply(yr, ref[3], MODES[mode])
    if residual:
        out, hh = res
        assert rel_err(hh, hr) <= 1e-7
        outs, grads, outs_r = (out, hh), (dout, dh), (out_r, hr)
    else:
        out, outs, grads, outs_r = res, (res,), (dout,), (out_r,)
    assert rel_err(out, out_r) <= BOUND
    wrt = ours if residual else [ours[0], *ours[2:]]
    wrt_r = ref if residual else [ref[0], *ref[2:]]
    got = torch.autograd.grad(outs, wrt, grads)
    want = torch.autograd.grad(outs_r, wrt_r, [g.double().cpu() for g in grads])
    for name, a, b in zip(("x", "residual", "norm", "weight") if residual else ("x", "norm", "weight"), got, want,
                          strict=True):
        assert rel_err(a, b) <= BOUND, name


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("act, fn", [("silu", F.silu), ("gelu_tanh", lambda g: F.gelu(g, approximate="tanh"))])
@pytest.mark.parametrize("block", [4096, 16])
def test_glu_projection_in_fp8_matches_the_float64_quantised_math_with_every_gradient(mode, act, fn, block,
                                                                                      monkeypatch):
    """glu_linear with fp8: the GLU kernel's quantised activation (one block per row, or two passes over rows
    wider than a block) through the FP8 GEMM, gradients as the float64 oracle computes them."""
    monkeypatch.setattr(kernels.fp8, "_GLU_BLOCK", block)
    monkeypatch.setattr(kernels.fp8, "_WIDE_BLOCK", block)
    inter = 40
    x, weight = randn(2, 7, 2 * inter, scale=2.0), 0.1 * randn(32, inter)
    dout = randn(2, 7, 32)
    assert_triton_runs(x)
    xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = glu_linear(xs, ws, activation=act, fp8=mode)
    xr, wr = x.double().cpu().requires_grad_(), weight.double().cpu().requires_grad_()
    g, u = xr.chunk(2, dim=-1)
    out_r = _QuantisedLinear64.apply(fn(g) * u, wr, MODES[mode])
    assert rel_err(out, out_r) <= BOUND
    got = torch.autograd.grad(out, [xs, ws], dout)
    want = torch.autograd.grad(out_r, [xr, wr], dout.double().cpu())
    for name, a, b in zip(("x", "weight"), got, want, strict=True):
        assert rel_err(a, b) <= BOUND, name


#: fp32 output on the GPU: Hopper's FP8 tensor cores add products at less than fp32's precision between the
#: promotions of partial sums to fp32 (4.5e-5 measured at K = 64 on an H200).
FP32_GPU_BOUND = 2e-4


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5 if DEVICE.type == "cpu" else FP32_GPU_BOUND),
                                          (torch.bfloat16, 8e-3)])
def test_fp8_linear_matches_the_float64_quantised_math_with_every_gradient(dtype, bound):
    """fp8_linear (the o projection's path: the input quantised by its own pass) with a bias; bf16 adds one
    rounding of the output and of each gradient."""
    x, weight, bias = randn(5, 11, 64, dtype=dtype), (0.1 * randn(48, 64)).to(dtype), randn(48, dtype=dtype)
    dout = randn(5, 11, 48, dtype=dtype)
    assert_triton_runs(x)
    ours = [t.clone().requires_grad_() for t in (x, weight, bias)]
    out = fp8_linear(*ours)
    ref = [t.detach().double().cpu().requires_grad_() for t in (x, weight, bias)]
    out_r = _QuantisedLinear64.apply(ref[0], ref[1], FP8_MODES["rowwise"]) + ref[2]
    assert out.dtype == dtype and rel_err(out, out_r) <= bound
    got = torch.autograd.grad(out, ours, dout)
    want = torch.autograd.grad(out_r, ref, dout.double().cpu())
    for name, a, b in zip(("x", "weight", "bias"), got, want, strict=True):
        assert a.dtype == dtype and rel_err(a, b) <= bound, name


def test_fp8_projections_refuse_an_unknown_mode_and_adapters_by_name():
    x, w = randn(3, 16), randn(8, 16)
    with pytest.raises(ValueError, match="fp8_linear: mode must be one of"):
        fp8_linear(x, w, mode="tensorwise-e3m4")
    with pytest.raises(ValueError, match="glu_linear: fp8 must be None or one of"):
        glu_linear(randn(3, 32), w, fp8="e4m3")


def test_fp8_gemm_on_the_gpu_equals_the_dequantised_product():
    """On CUDA the forward GEMM is ``torch._scaled_mm`` (rowwise scales, fp32 accumulation); it gives the
    dequantised operands' product up to fp32 summation order."""
    if DEVICE.type != "cuda":
        pytest.skip("torch._scaled_mm with rowwise scales is the CUDA path")
    x, w = randn(256, 512, dtype=torch.bfloat16, scale=3.0), randn(384, 512, dtype=torch.bfloat16)
    out = fp8_linear(x, w)
    xq, xs = quantize_rows_reference(x.double().cpu())
    wq, ws = quantize_rows_reference(w.double().cpu())
    assert rel_err(out, dequantize(xq, xs, torch.float64) @ dequantize(wq, ws, torch.float64).t()) <= 4e-3


def _adapters(k: int, n: int, targets: int = 2, r: int = 4):
    """A two-target LowRank on an (n, k) projection (the halves of its output) with nonzero B, and its float64
    copy, both with gradients."""
    a, b = 0.1 * randn(targets * r, k), 0.1 * randn(n, r)
    slices = ((0, n // 2), (n // 2, n))
    ours = [t.clone().requires_grad_() for t in (a, b)]
    ref = [t.detach().double().cpu().requires_grad_() for t in (a, b)]
    return (LowRank(ours[0], ours[1], slices, 2.0, 0.0), ours), (LowRank(ref[0], ref[1], slices, 2.0, 0.0), ref)


@pytest.mark.parametrize("op", ["rms_norm_linear", "glu_linear", "lora_linear"])
def test_adapters_on_a_frozen_fp8_base_match_the_float64_quantised_math(op):
    """LoRA over an FP8 base: the frozen base's GEMMs on quantised operands, the adapters' on the unquantised
    input; the output and the gradients of the input and of both adapter matrices as the float64 oracle's (base
    through _QuantisedLinear64, adapters through low_rank_reference)."""
    m, k, n = 26, 48, 64
    width = 2 * k if op == "glu_linear" else k
    x, weight, w_norm = randn(2, m // 2, width, scale=2.0), 0.2 * randn(n, k), 1.0 + 0.1 * randn(k)
    dout = randn(2, m // 2, n)
    assert_triton_runs(x)
    (lr, lr_params), (lr64, lr64_params) = _adapters(k, n)
    xs = x.clone().requires_grad_()
    if op == "rms_norm_linear":
        out = rms_norm_linear(xs, w_norm, weight, low_rank=lr, fp8="rowwise")
    elif op == "glu_linear":
        out = glu_linear(xs, weight, low_rank=lr, fp8="rowwise")
    else:
        out = lora_linear(xs, weight, low_rank=lr, fp8="rowwise")
    xr = x.double().cpu().requires_grad_()
    if op == "rms_norm_linear":
        y = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * w_norm.double().cpu()
    elif op == "glu_linear":
        g, u = xr.chunk(2, dim=-1)
        y = F.silu(g) * u
    else:
        y = xr
    base = _QuantisedLinear64.apply(y, weight.double().cpu(), FP8_MODES["rowwise"])
    out_r = low_rank_reference(y, base, lr64)
    assert rel_err(out, out_r) <= BOUND
    got = torch.autograd.grad(out, [xs, *lr_params], dout)
    want = torch.autograd.grad(out_r, [xr, *lr64_params], dout.double().cpu())
    for name, a, b in zip(("x", "A", "B"), got, want, strict=True):
        assert rel_err(a, b) <= BOUND, name


def test_use_fp8_switches_every_dense_projection_and_back_and_keeps_lora_adapters_training():
    """CausalLM.use_fp8: the logits move by FP8's rounding (a few percent, not zero), use_fp8(None) gives the bf16
    path's logits back exactly, an unknown mode is refused by name, and under LoRA the adapters still get
    gradients while the frozen base's GEMMs run in FP8."""
    from ligermodels.families import config_from_hf, family_of
    from ligermodels.lora import add_lora

    torch.manual_seed(0)
    hf = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    model = family_of("llama").cls(config_from_hf(hf)).init_weights().to(DEVICE)
    ids = torch.randint(0, 64, (2, 16), device=DEVICE)
    assert_triton_runs(ids)
    with torch.no_grad():
        plain = model(ids)
        fp8 = model.use_fp8("rowwise")(ids)
        again = model.use_fp8(None)(ids)
    assert torch.equal(again, plain) and 1e-4 < rel_err(fp8, plain) < 0.1
    with pytest.raises(ValueError, match="use_fp8: mode must be None or one of"):
        model.use_fp8("e4m3")
    add_lora(model, r=4, alpha=8, targets=["q", "k", "v", "o", "gate", "up", "down"])
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    model.use_fp8("rowwise").loss(ids, ids).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL)")
def test_fp8_training_on_two_gpus_with_nccl_takes_the_steps_of_one_gpu(checkpoint, data, workdir):
    """``--fp8 rowwise`` under FSDP2: each rank quantises the gathered weights and its own rows, so two GPUs (one
    row each) quantise what one GPU with --grad-accum 2 does. fp32 master weights; the bounds allow NCCL's other
    summation order, which moves the updated weights by fp32 rounding and can carry a value across an FP8 rounding
    boundary in a later step."""
    from tests.test_train import _metrics, _rel, _weights, one_rank_and_two

    one, two = one_rank_and_two(checkpoint, data, workdir / "fp8-nccl", ["--fp8", "rowwise", "--batch-size", "1",
                                "--steps", "3", "--save-every", "0", "--device", "cuda"], [], (1e-3, 1e-2))
    assert len(_metrics(one)) == 3
    w1, w2 = _weights(one), _weights(two)
    assert w1.keys() == w2.keys()
    for k in w1:
        assert _rel(w2[k], w1[k]) <= 1e-3, k
