"""swiglu / geglu: forward and both gradients against float64, separate and packed inputs."""

import pytest
import torch
import torch.nn.functional as F

from kernels import geglu, glu_linear, swiglu
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


@pytest.mark.parametrize("packed", [False, True])
def test_glu_tiles_of_several_column_blocks_and_a_partial_row_block(packed):
    """Rows of 1280 split into 256-wide column blocks (a tile of 32 rows), 37 rows leave a partial row tile."""
    from kernels.glu import launch_config

    rows, cols = 37, 1280
    tile = launch_config(rows, cols)
    assert tile["grid"] == (2, 5) and tile["meta"]["BLOCK_R"] == 32, tile  # what this test relies on
    op, act = ACTS["swiglu"]
    x = randn(rows, 2 * cols, scale=2.0).requires_grad_()
    assert_triton_runs(x)  # the tiles exist only on the kernel path
    gate, up = (x, None) if packed else (x[:, :cols], x[:, cols:])  # separate: strided views keep their rows
    dout = randn(rows, cols)
    out = op(gate, up)
    out.backward(dout)
    ref, ref_dg, ref_du = _float64_reference(x.detach()[:, :cols], x.detach()[:, cols:], dout, act)
    assert_rel(out, ref, torch.float32, "out")
    assert_rel(x.grad, torch.cat([ref_dg, ref_du], dim=-1), torch.float32, "d(gate, up)")


@pytest.mark.parametrize("contiguous", [True, False])
def test_separate_contiguous_operands_run_as_flat_rows_with_the_same_numbers(contiguous):
    """Contiguous (4, 48, 96) operands (numel 18432 = 9 * 2048) run as 2048-wide rows, across the ends of
    their 96-wide rows; a gate of another layout keeps the rows. Both match float64, forward and gradients."""
    from kernels.glu import flat_width

    op, act = ACTS["geglu_tanh"]
    shape = (4, 48, 96)
    gate, up, dout = randn(*shape, scale=2.0), randn(*shape), randn(*shape)
    if not contiguous:  # same values, (48, 4, 96) memory order
        gate = gate.transpose(0, 1).contiguous().transpose(0, 1)
    assert flat_width(gate, up, dout) == (2048 if contiguous else 0)
    gate.requires_grad_()
    up.requires_grad_()
    assert_triton_runs(gate)
    out = op(gate, up)
    out.backward(dout)
    assert out.shape == shape and gate.grad.shape == shape and up.grad.shape == shape
    ref, ref_dg, ref_du = _float64_reference(gate, up, dout, act)
    assert_rel(out, ref, torch.float32, "out")
    assert_rel(gate.grad, ref_dg, torch.float32, "dgate")
    assert_rel(up.grad, ref_du, torch.float32, "dup")


def test_glu_column_block_leaves_fewest_masked_lanes():
    from kernels.glu import col_block

    assert col_block(8960) == 256  # Qwen2-1.5B: 35 full blocks, not 8192 + a 91%-masked second block
    assert col_block(18944) == 512  # Qwen2-7B: 37 full blocks
    assert col_block(8192) == 8192 and col_block(14336) == 2048
    assert col_block(96) == 128 and col_block(1000) == 1024


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
    with pytest.raises(ValueError, match="gate must be a floating-point tensor"):
        swiglu(torch.ones(6, 80, dtype=torch.int64, device=DEVICE))
    x = torch.zeros(5, 80, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight must be \(H, I\)"):  # a 1-D weight used to fail in backward
        glu_linear(x, torch.zeros(40, device=DEVICE))
    with pytest.raises(ValueError, match="bias must be"):
        glu_linear(x, torch.zeros(8, 40, device=DEVICE), torch.zeros(7, device=DEVICE))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glu_linear_matches_float64_and_the_unfused_ops(activation, bias, dtype):
    """glu_linear = F.linear(glu(x), W, b): forward and the gradients of x, W and b, with the activation
    recomputed in backward instead of saved."""
    acts = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "gelu": F.gelu}
    x = randn(3, 5, 2 * 389, dtype=dtype, scale=2.0).requires_grad_()
    w = randn(77, 389, dtype=dtype, scale=0.05).requires_grad_()
    b = randn(77, dtype=dtype).requires_grad_() if bias else None
    dout = randn(3, 5, 77, dtype=dtype)
    assert_triton_runs(x)
    before = snapshot(x, w, dout)
    out = glu_linear(x, w, b, activation)
    out.backward(dout)
    assert_unchanged(before, x, w, dout)

    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if bias else None
    g, u = x64.chunk(2, dim=-1)
    ref = F.linear(acts[activation](g) * u, w64, b64)
    ref.backward(dout.double())
    errs = [assert_rel(out, ref, dtype, "out"), assert_rel(x.grad, x64.grad, dtype, "dx"),
            assert_rel(w.grad, w64.grad, dtype, "dweight")]
    if bias:
        errs.append(assert_rel(b.grad, b64.grad, dtype, "dbias"))

    if dtype == torch.bfloat16:  # no worse than the unfused ops (glu kernel, then F.linear) in bf16
        xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        bs = b.detach().clone().requires_grad_() if bias else None
        h = swiglu(xs) if activation == "silu" else geglu(xs, approximate="tanh" if activation == "gelu_tanh"
                                                            else "none")
        F.linear(h, ws, bs).backward(dout)
        unfused = [rel_err(F.linear(h, ws, bs), ref), rel_err(xs.grad, x64.grad), rel_err(ws.grad, w64.grad)]
        if bias:
            unfused.append(rel_err(bs.grad, b64.grad))
        for ours, theirs, what in zip(errs, unfused, ["out", "dx", "dweight", "dbias"][:len(errs)], strict=True):
            assert ours <= 1.05 * theirs + 1e-6, f"{what}: {ours:.2e} worse than unfused {theirs:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glu_linear_keep_activation_gives_the_same_numbers_and_saves_the_activation(dtype, monkeypatch):
    """keep_activation=True (inside checkpointed layers): bitwise the same output and gradients, the
    (..., I) activation saved for backward, and the backward kernel that does not write it again."""
    import kernels.glu as glu

    recomputes = []
    recompute = glu._glu_bwd_recompute
    monkeypatch.setattr(glu, "_glu_bwd_recompute", lambda *a: recomputes.append(1) or recompute(*a))
    x = randn(3, 7, 2 * 389, dtype=dtype, scale=2.0, seed=21).requires_grad_()
    w = randn(77, 389, dtype=dtype, scale=0.05, seed=22).requires_grad_()
    b = randn(77, dtype=dtype, seed=23).requires_grad_()
    dout = randn(3, 7, 77, dtype=dtype, seed=24)
    assert_triton_runs(x)
    results = {}
    for keep in (False, True):
        out = glu_linear(x, w, b, "gelu_tanh", keep_activation=keep)
        saved = {tuple(t.shape) for t in out.grad_fn.saved_tensors}
        recomputes.clear()
        results[keep] = (out, *torch.autograd.grad(out, [x, w, b], dout), saved)
        assert len(recomputes) == (0 if keep else 1)
    assert results[True][-1] == results[False][-1] | {(3, 7, 389)}
    for a, c in zip(results[False][:-1], results[True][:-1], strict=True):
        assert torch.equal(a, c)


def test_glu_linear_keeps_only_the_packed_input_for_backward():
    """The saved tensors are x and the weight: no (..., I) activation stays alive until backward."""
    x = randn(4, 2 * 64).requires_grad_()
    w = randn(8, 64).requires_grad_()
    out = glu_linear(x, w)
    saved = [t for t in (out.grad_fn.saved_tensors if hasattr(out.grad_fn, "saved_tensors") else [])]
    assert {tuple(t.shape) for t in saved} == {(4, 128), (8, 64)}
    with pytest.raises(ValueError, match="twice"):
        glu_linear(x, randn(8, 63))
    with pytest.raises(ValueError, match="activation"):
        glu_linear(x, w, activation="relu")


@pytest.mark.parametrize("case", ["separate", "packed", "glu_linear"])
def test_zero_width_inputs_give_empty_outputs_and_gradients(case):
    """A last dim of 0 (I = 0) gives the empty result of the reference, forward and backward, on the
    kernel path too (a view with -1 beside a 0-size dim used to raise)."""
    gate = torch.zeros(3, 0, device=DEVICE, requires_grad=True)
    assert_triton_runs(gate)
    if case == "glu_linear":
        weight = torch.zeros(5, 0, device=DEVICE, requires_grad=True)
        out = glu_linear(gate, weight)
        assert out.shape == (3, 5) and not out.any()
    else:
        up = torch.zeros(3, 0, device=DEVICE, requires_grad=True) if case == "separate" else None
        out = swiglu(gate, up)
        assert out.shape == (3, 0)
    out.sum().backward()
    assert gate.grad.shape == (3, 0)
