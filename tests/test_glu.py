"""swiglu / geglu: forward and both gradients against float64, separate and packed inputs."""

import pytest
import torch
import torch.nn.functional as F

from kernels import geglu, swiglu
from tests.utils import DEVICE, assert_rel, assert_triton_runs, assert_unchanged, randn, rel_err, snapshot

SHAPES = [(3, 5, 777), (2, 3, 4, 1000), (7, 96)]
ACTS = {
    "swiglu": (lambda g, u: swiglu(g, u), lambda g: F.silu(g)),
    "geglu_tanh": (lambda g, u: geglu(g, u, approximate="tanh"), lambda g: F.gelu(g, approximate="tanh")),
    "geglu_none": (lambda g, u: geglu(g, u, approximate="none"), lambda g: F.gelu(g)),
}


def _float64_reference(gate, up, dout, act):
    g = gate.detach().double().requires_grad_()
    u = up.detach().double().requires_grad_()
    out = act(g) * u
    out.backward(dout.double())
    return out, g.grad, u.grad


@pytest.mark.parametrize("name", list(ACTS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glu_matches_float64_forward_and_gradients(name, shape, dtype):
    op, act = ACTS[name]
    gate = randn(*shape, dtype=dtype, scale=2.0).requires_grad_()
    up = randn(*shape, dtype=dtype).requires_grad_()
    dout = randn(*shape, dtype=dtype)
    assert_triton_runs(gate)
    before = snapshot(gate, up, dout)

    out = op(gate, up)
    out.backward(dout)
    assert_unchanged(before, gate, up, dout)
    ref, ref_dg, ref_du = _float64_reference(gate, up, dout, act)
    e_out = assert_rel(out, ref, dtype, "out")
    e_dg = assert_rel(gate.grad, ref_dg, dtype, "dgate")
    e_du = assert_rel(up.grad, ref_du, dtype, "dup")

    if dtype == torch.bfloat16:  # no worse than eager PyTorch doing the same math in bf16
        g = gate.detach().clone().requires_grad_()
        u = up.detach().clone().requires_grad_()
        eager = act(g) * u
        eager.backward(dout)
        for ours, theirs, ref_, what in [(e_out, eager, ref, "out"), (e_dg, g.grad, ref_dg, "dgate"),
                                         (e_du, u.grad, ref_du, "dup")]:
            assert ours <= 1.05 * rel_err(theirs, ref_) + 1e-6, f"{what}: worse than eager bf16"


@pytest.mark.parametrize("name", list(ACTS))
def test_glu_packed_input_gives_packed_gradient(name):
    op, act = ACTS[name]
    x = randn(4, 9, 2 * 333, scale=2.0).requires_grad_()
    dout = randn(4, 9, 333)
    before = snapshot(x)
    out = op(x, None) if name == "swiglu" else op(x, None)
    out.backward(dout)
    assert_unchanged(before, x)
    g, u = x.detach().chunk(2, dim=-1)
    ref, ref_dg, ref_du = _float64_reference(g, u, dout, act)
    assert_rel(out, ref, torch.float32, "out")
    assert_rel(x.grad, torch.cat([ref_dg, ref_du], dim=-1), torch.float32, "dx (packed)")


def test_glu_rejects_mismatched_shapes_and_bad_modes():
    with pytest.raises(ValueError, match="one shape"):
        swiglu(torch.zeros(2, 3, device=DEVICE), torch.zeros(2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="even last dim"):
        swiglu(torch.zeros(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="approximate"):
        geglu(torch.zeros(2, 4, device=DEVICE), approximate="erf")
