"""NF4 weights (kernels.nf4): bitsandbytes' bits, the dequantisation kernel bit for bit against its PyTorch
reference, projections on an NF4 weight against a float64 reference of dequant(W) @ x, and the tensor's guards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import glu_linear, lora_linear, rms_norm_linear
from kernels.low_rank import LowRank
from kernels.nf4 import NF4_VALUES, NF4Tensor, dequantize_reference, dynamic_map, quantize_nf4
from tests.utils import DEVICE, assert_rel, assert_triton_runs, randn

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes (test-only) is the reference of the NF4 format")


def _ref(t: NF4Tensor, dtype=torch.float32) -> torch.Tensor:
    return dequantize_reference(t.packed, t.qabs, t.absmax2, t.offset, t.starts, t.tables, *t.shape, dtype)


def test_the_code_tables_are_bitsandbytes():
    assert torch.equal(dynamic_map(), bnb.functional.create_dynamic_map(signed=True))
    assert torch.equal(torch.tensor(NF4_VALUES), bnb.functional.get_4bit_type("nf4", device="cpu"))


@pytest.mark.parametrize("shape,parts", [((96, 128), None), ((224, 320), [128, 64, 32]), ((600, 1024), [512, 88])])
def test_each_part_is_quantised_as_bitsandbytes_quantises_it(shape, parts):
    """Each part's 4-bit codes, group maxima and offset equal bitsandbytes' quantize_4bit(nf4, blocksize 64, double
    quantisation) of that part alone, and each block maximum's 8-bit code is the nearest value of the dynamic map.
    bitsandbytes' CUDA kernel picks the nearest value too: there the codes are equal. Its CPU backend searches the
    map approximately and picks the farther neighbour for about 0.1% of values; on the CPU a differing code must be
    its neighbour and the nearer of the two."""
    w = (randn(*shape, seed=1, scale=0.02)).to(torch.bfloat16)
    t = quantize_nf4(w, parts)
    dyn = dynamic_map().double()
    row = 0
    for i, rows in enumerate(parts or [shape[0]]):
        q, st = bnb.functional.quantize_4bit(w[row:row + rows], blocksize=64, compress_statistics=True,
                                             quant_type="nf4")
        e0, b0, g0 = t.starts[i].tolist()
        assert torch.equal(q.view(-1), t.packed[e0 // 2:e0 // 2 + q.numel()])
        assert torch.equal(st.state2.absmax, t.absmax2[g0:g0 + st.state2.absmax.numel()])
        assert st.offset.item() == t.offset[i].item()
        ours, theirs = t.qabs[b0:b0 + st.absmax.numel()].long().cpu(), st.absmax.long().cpu()
        amax = w[row:row + rows].float().reshape(-1, 64).abs().amax(1).cpu()  # (whole blocks in these shapes)
        centred = amax - st.offset.cpu()
        scale = st.state2.absmax.cpu().repeat_interleave(256)[:centred.numel()]
        scaled = (centred * (1.0 / scale)).double()
        nearest = (scaled[:, None] - dyn).abs().argmin(1)
        assert torch.equal(ours, nearest)
        if w.is_cuda:
            assert torch.equal(ours, theirs)
        else:
            differ = ours != theirs
            assert ((ours - theirs).abs() <= 1).all() and differ.float().mean() <= 0.005
            assert ((scaled - dyn[ours]).abs() <= (scaled - dyn[theirs]).abs())[differ].all()
        row += rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,parts", [((6, 74), None), ((67, 130), [33, 20, 14]), ((130, 2049), [64, 66])])
def test_the_dequantisation_kernel_equals_its_reference_bit_for_bit(shape, parts, dtype):
    w = randn(*shape, seed=2, dtype=torch.float32)
    t = quantize_nf4(w, parts, dtype=dtype)
    assert_triton_runs(t.packed)
    out = t.dequantize()
    assert out.dtype == dtype and out.shape == shape
    assert torch.equal(out, _ref(t).to(dtype))
    assert torch.equal(t.dequantize(torch.float64), _ref(t).double())


def test_dequantised_weights_are_the_nf4_values_times_each_blocks_maximum():
    """Independent of the reference: every dequantised value is an NF4 value times its block's maximum (recovered
    within the double quantisation's error), and the error to the original is within half an NF4 step."""
    w = randn(32, 128, seed=3)
    d = quantize_nf4(w).dequantize(torch.float64).cpu()
    w = w.double().cpu().view(-1, 64)
    amax = w.abs().amax(1, keepdim=True)
    ratio = d.view(-1, 64) / amax
    nf4 = torch.tensor(NF4_VALUES, dtype=torch.float64)
    assert ((ratio[..., None] - nf4).abs().amin(-1) <= 0.01).all()
    assert ((d.view(-1, 64) - w).abs() <= amax * 0.2).all()  # the widest NF4 gap, 0.304, halved, with margin


def _projection_cases(dtype):
    x = randn(3, 7, 96, seed=4, dtype=dtype).requires_grad_()
    w = randn(80, 96, seed=5, scale=0.1)
    return x, w, quantize_nf4(w.to(dtype), [48, 16, 16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projections_on_an_nf4_weight_match_a_float64_reference(dtype):
    """F.linear, lora_linear (adapters on two of three parts), rms_norm_linear and glu_linear read an NF4 weight as
    its dequantised values: output and every input gradient against float64 on dequant(W)."""
    x, _, t = _projection_cases(dtype)
    wd = _ref(t).double()
    a, b = randn(8, 96, seed=6).requires_grad_(), randn(64, 4, seed=7).requires_grad_()
    lr = LowRank(a, b, ((0, 48), (64, 80)), 0.5)
    dout = randn(3, 7, 80, seed=8, dtype=dtype)
    for name, run, ref in [
        ("linear", lambda x: F.linear(x, t), lambda x: x @ wd.t()),
        ("lora", lambda x: lora_linear(x, t, None, lr),
         lambda x: x @ wd.t() + 0.5 * torch.cat([(x @ a[:4].double().t()) @ b[:48].double().t(),
                                                 torch.zeros(3, 7, 16, dtype=torch.float64, device=DEVICE),
                                                 (x @ a[4:].double().t()) @ b[48:].double().t()], -1)),
        ("norm", lambda x: rms_norm_linear(x, torch.ones(96, dtype=dtype, device=DEVICE), t),
         lambda x: (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) @ wd.t()),
    ]:
        out = run(x)
        (gx,) = torch.autograd.grad(out, x, dout)
        x64 = x.detach().double().requires_grad_()
        ref = ref(x64)
        (gx64,) = torch.autograd.grad(ref, x64, dout.double())
        assert_rel(out, ref, dtype, f"{name} forward")
        assert_rel(gx, gx64, dtype, f"{name} dx")
    gu = randn(3, 7, 160, seed=9, dtype=dtype).requires_grad_()
    down = quantize_nf4(randn(80, 80, seed=10, scale=0.1).to(dtype))
    out = glu_linear(gu, down)
    g64 = gu.detach().double().requires_grad_()
    gate, up = g64.chunk(2, -1)
    ref = (F.silu(gate) * up) @ _ref(down).double().t()
    assert_rel(out, ref, dtype, "glu forward")
    assert_rel(torch.autograd.grad(out, gu, dout)[0], torch.autograd.grad(ref, g64, dout.double())[0], dtype,
               "glu dx")


def test_autograd_keeps_the_4bit_weight_not_a_dense_copy():
    """Saved for backward: the NF4 tensor itself (its packed bytes), not a dense dequantised weight."""
    x, _, t = _projection_cases(torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
        F.linear(x, t).sum().backward()
    assert not any(s.shape == t.shape and not isinstance(s, NF4Tensor) for s in saved)


def test_an_nf4_weight_refuses_writes_and_casts_but_moves_and_detaches():
    t = quantize_nf4(randn(64, 64, seed=11))
    with pytest.raises(RuntimeError, match="cannot be written in place"):
        with torch.no_grad():
            t.mul_(2)
    with pytest.raises(TypeError, match=r"dequantize\(torch.float64\)"):
        t.to(torch.float64)
    for same in (t.detach(), t.to(t.device), torch.nn.Parameter(t, requires_grad=False)):
        assert isinstance(same, NF4Tensor) and torch.equal(same.dequantize(), t.dequantize())
    big = quantize_nf4(randn(512, 1024, seed=12))
    assert big.nbytes_stored() * 8 / big.numel() <= 4.15  # 4.127 bits a value, plus the code tables


@pytest.mark.parametrize("bad,message", [(lambda: quantize_nf4(torch.randn(3, 5)), "odd"),
                                         (lambda: quantize_nf4(torch.randn(4, 6), [3, 3, 3]), "part_rows"),
                                         (lambda: quantize_nf4(torch.randn(8)), "2-D float")])
def test_bad_quantisation_requests_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


def test_a_gpu_without_bf16_triton_support_is_refused_by_name(monkeypatch):
    """NF4 (and FP8) name the GPU they cannot run on, from its compute capability."""
    from kernels.fp8 import fp8_supported
    from kernels.nf4 import nf4_supported

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    cuda = torch.device("cuda")
    assert "Tesla T4 is 7.5" in nf4_supported(cuda) and "8.0" in nf4_supported(cuda)
    assert "Tesla T4 is 7.5" in fp8_supported(cuda)
    assert nf4_supported(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert nf4_supported(cuda) is None and "8.9" in fp8_supported(cuda)
