"""apply_rope: forward and both gradients against float64, layouts (fused qkv views, GQA, per-token or shared
cos/sin, head_dim 64 / 96 / 128), agreement with transformers' apply_rotary_pos_emb, and shape errors."""

import zlib

import pytest
import torch

import kernels.rope as rope_mod
from kernels.rope import apply_qk_norm_rope_qkv_, apply_rope, apply_rope_qkv_, rope_reference
from tests.utils import DEVICE, assert_rel, assert_triton_runs, assert_unchanged, randn, rel_err, snapshot


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _cos_sin(positions: torch.Tensor, head_dim: int, dtype: torch.dtype, theta: float = 10000.0):
    """cos/sin (positions.shape..., head_dim) from integer positions, computed in float64, cast to dtype."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    emb = positions.double()[..., None] * inv
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


def _positions(batch: int, seq: int, per_token: bool, seed: int) -> torch.Tensor:
    """Random positions: per token (B, S), packed sequences restarting at 0, or one (S,) row shared by the batch."""
    g = torch.Generator().manual_seed(seed)
    if not per_token:
        return torch.randint(0, 8192, (seq,), generator=g)
    pos = torch.empty(batch, seq, dtype=torch.int64)
    for b in range(batch):  # a few packed documents per row, each starting at a random offset or 0
        cut = int(torch.randint(1, seq, (1,), generator=g))
        start = int(torch.randint(0, 4096, (1,), generator=g))
        pos[b, :cut] = torch.arange(start, start + cut)
        pos[b, cut:] = torch.arange(0, seq - cut)
    return pos


def _qk(batch, seq, hq, hkv, d, dtype, fused: bool, seed: int):
    """q, k leaves requiring grad: separate tensors, or strided slices of one fused (B, S, Hq + 2*Hkv, D) leaf."""
    if fused:
        qkv = randn(batch, seq, hq + 2 * hkv, d, dtype=dtype, seed=seed).requires_grad_()
        return qkv, qkv[:, :, :hq], qkv[:, :, hq:hq + hkv]
    q = randn(batch, seq, hq, d, dtype=dtype, seed=seed).requires_grad_()
    k = randn(batch, seq, hkv, d, dtype=dtype, seed=seed + 1).requires_grad_()
    return None, q, k


def _eager(q, k, cos, sin):
    """The Hugging Face formula on the (B, S, H, D) layout, in the tensors' own dtype."""
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def _float64(q, k, cos, sin, dq_rot, dk_rot):
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    qr, kr = _eager(q64, k64, cos.double(), sin.double())
    torch.autograd.backward((qr, kr), (dq_rot.double(), dk_rot.double()))
    return qr, kr, q64.grad, k64.grad


CASES = [  # (batch, seq, q_heads, kv_heads, head_dim)
    (2, 7, 6, 2, 96),
    (3, 5, 6, 2, 64),
    (2, 6, 4, 4, 128),
    (1, 3, 40, 8, 128),  # more q heads than one tile holds: the head loop runs twice
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused_qkv"])
@pytest.mark.parametrize("per_token", [True, False], ids=["cos_BSD", "cos_SD"])
@pytest.mark.parametrize("dtype,cos_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)], ids=["fp32", "bf16_cos32", "bf16"])
def test_rope_matches_float64_forward_and_gradients(case, fused, per_token, dtype, cos_dtype):
    B, S, hq, hkv, d = case
    seed = zlib.crc32(repr((case, fused, per_token, dtype, cos_dtype)).encode()) % 10_000
    leaf, q, k = _qk(B, S, hq, hkv, d, dtype, fused, seed)
    if fused:
        assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = _cos_sin(_positions(B, S, per_token, seed), d, cos_dtype)
    dq_rot = randn(B, S, hq, d, dtype=dtype, seed=seed + 2)
    dk_rot = randn(B, S, hkv, d, dtype=dtype, seed=seed + 3)
    assert_triton_runs(q)
    before = snapshot(q, k, cos, sin, dq_rot, dk_rot)

    q_rot, k_rot = apply_rope(q, k, cos, sin)
    assert q_rot.dtype == dtype and k_rot.dtype == dtype
    assert q_rot.is_contiguous() and k_rot.is_contiguous()
    dq, dk = torch.autograd.grad((q_rot, k_rot), (q, k), (dq_rot, dk_rot))
    assert_unchanged(before, q, k, cos, sin, dq_rot, dk_rot)

    ref = _float64(q, k, cos, sin, dq_rot, dk_rot)
    errs = [assert_rel(ours, theirs, dtype, what)
            for ours, theirs, what in zip((q_rot, k_rot, dq, dk), ref, ("q_rot", "k_rot", "dq", "dk"), strict=True)]

    if dtype == torch.bfloat16:  # no worse than eager PyTorch doing the same op in bf16 (cos/sin in the model dtype)
        qe, ke = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        eq, ek = _eager(qe, ke, cos.to(dtype), sin.to(dtype))
        eager = (eq, ek, *torch.autograd.grad((eq, ek), (qe, ke), (dq_rot, dk_rot)))
        for ours, theirs, ref_, what in zip(errs, eager, ref, ("q_rot", "k_rot", "dq", "dk"), strict=True):
            assert ours <= 1.05 * rel_err(theirs, ref_) + 1e-6, f"{what}: worse than eager bf16"


@pytest.mark.parametrize("case", CASES[:2] + CASES[3:], ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_qkv_inplace_matches_float64_and_leaves_v(case, dtype):
    """The in-place packed form rotates q and k inside the projection buffer (same values as float64),
    leaves v alone, and its backward gives the packed gradient: rotated back for q / k, v's passed on."""
    B, S, hq, hkv, d = case
    heads = hq + 2 * hkv
    seed = zlib.crc32(repr(("inplace", case, dtype)).encode()) % 10_000
    x = randn(B, S, heads * d, dtype=dtype, seed=seed).requires_grad_()
    cos, sin = _cos_sin(_positions(B, S, True, seed), d, torch.float32)
    dqkv = randn(B, S, heads * d, dtype=dtype, seed=seed + 1)
    assert_triton_runs(x)
    before_grad = snapshot(dqkv)

    qkv = x * 1  # a non-leaf buffer the "block" owns, as a projection output is
    ptr = qkv.data_ptr()
    out = apply_rope_qkv_(qkv, cos, sin, hq, hkv)
    assert out is qkv and out.data_ptr() == ptr, "not in place"
    (dx,) = torch.autograd.grad(out, x, dqkv)
    assert_unchanged(before_grad, dqkv)

    x4 = x.detach().view(B, S, heads, d)
    q, k, v = x4[:, :, :hq], x4[:, :, hq:hq + hkv], x4[:, :, hq + hkv:]
    dq_rot, dk_rot, dv = dqkv.view(B, S, heads, d).split([hq, hkv, hkv], dim=2)
    qr, kr, dq, dk = _float64(q, k, cos, sin, dq_rot, dk_rot)
    o4, dx4 = out.detach().view(B, S, heads, d), dx.view(B, S, heads, d)
    assert_rel(o4[:, :, :hq], qr, dtype, "q_rot")
    assert_rel(o4[:, :, hq:hq + hkv], kr, dtype, "k_rot")
    assert torch.equal(o4[:, :, hq + hkv:], v), "v heads changed"
    assert_rel(dx4[:, :, :hq], dq, dtype, "dq")
    assert_rel(dx4[:, :, hq:hq + hkv], dk, dtype, "dk")
    assert torch.equal(dx4[:, :, hq + hkv:], dv), "v gradient changed"
    # Same numbers as the out-of-place op on views of the unrotated buffer.
    ref_q, ref_k = apply_rope(q, k, cos, sin)
    assert torch.equal(o4[:, :, :hq], ref_q) and torch.equal(o4[:, :, hq:hq + hkv], ref_k)


def test_rope_qkv_inplace_reference_path_agrees(monkeypatch):
    """Without Triton (CPU fallback) the packed form gives the kernel's values and gradients."""
    B, S, hq, hkv, d = 2, 5, 4, 2, 96
    x = randn(B, S, (hq + 2 * hkv) * d, seed=11).requires_grad_()
    cos, sin = _cos_sin(_positions(B, S, True, 11), d, torch.float32)
    g = randn(*x.shape, seed=12)
    assert_triton_runs(x)
    ours = apply_rope_qkv_(x * 1, cos, sin, hq, hkv)
    (d_ours,) = torch.autograd.grad(ours, x, g)
    monkeypatch.setattr(rope_mod, "use_triton", lambda x: False)
    ref = apply_rope_qkv_(x * 1, cos, sin, hq, hkv)
    (d_ref,) = torch.autograd.grad(ref, x, g)
    assert_rel(ours, ref, torch.float32, "values", bound=1e-6)
    assert_rel(d_ours, d_ref, torch.float32, "gradient", bound=1e-6)
    with torch.no_grad():
        buf = x.detach().clone()
        assert apply_rope_qkv_(buf, cos, sin, hq, hkv) is buf
        assert_rel(buf, ref, torch.float32, "no-grad in place", bound=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("layout", ["whole-shared", "partial-per-token", "interleaved-batch1", "partial-interleaved"])
def test_the_host_path_of_the_packed_rotation_gives_the_references_numbers_bit_for_bit(monkeypatch, dtype, layout):
    """The packed op's reference path (a CPU without the interpreter) runs one function with its own backward,
    not rope_reference's graph: the same values, gradient and in-place result, bit for bit."""
    B, S, hq, hkv, d = 3, 17, 4, 2, 32
    rd, interleaved, cs_shape = {"whole-shared": (32, False, (S, 32)), "partial-per-token": (24, False, (B, S, 24)),
                                 "interleaved-batch1": (32, True, (1, S, 32)),
                                 "partial-interleaved": (16, True, (S, 16))}[layout]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, S, (hq + 2 * hkv) * d, generator=g, dtype=dtype)
    cos, sin = torch.randn(cs_shape, generator=g), torch.randn(cs_shape, generator=g)
    dy = torch.randn(x.shape, generator=g)
    monkeypatch.setattr(rope_mod, "use_triton", lambda x: False)

    def graph(t):  # rope_reference through autograd, written back out of place as the reference path was
        q, k, v = rope_mod._split_heads(t, hq, hkv)
        q, k = rope_reference(q, k, cos, sin, interleaved)
        return torch.cat([q, k, v], dim=2).flatten(2)

    outs = []
    for fn in (graph, lambda t: apply_rope_qkv_(t, cos, sin, hq, hkv, interleaved)):
        leaf = x.clone().requires_grad_()
        out = fn(leaf * 1)
        out.backward(dy)
        outs.append((out.detach(), leaf.grad))
    (ref, d_ref), (ours, d_ours) = outs
    assert torch.equal(ours, ref) and torch.equal(d_ours, d_ref)
    buf = x.clone()
    with torch.no_grad():
        assert apply_rope_qkv_(buf, cos, sin, hq, hkv, interleaved) is buf
    assert torch.equal(buf, ref)


def test_rope_qkv_inplace_rejects_bad_layouts():
    cs = torch.zeros(2, 5, 64, device=DEVICE)
    with pytest.raises(ValueError, match="Hq"):
        apply_rope_qkv_(torch.zeros(2, 5, 7 * 64 + 1, device=DEVICE), cs, cs, 5, 1)
    with pytest.raises(ValueError, match="batch, seq"):
        apply_rope_qkv_(torch.zeros(2, 5, 7, 64, device=DEVICE), cs, cs, 5, 1)
    with pytest.raises(ValueError, match="cos/sin head_dim"):
        apply_rope_qkv_(torch.zeros(2, 5, 7 * 32, device=DEVICE), cs, cs, 5, 1)


def test_rope_general_cos_sin_halves():
    """Arbitrary cos/sin whose halves differ: catches any mix-up of halves that duplicated (HF) cos/sin would hide."""
    B, S, hq, hkv, d = 2, 5, 6, 2, 96
    _, q, k = _qk(B, S, hq, hkv, d, torch.float32, fused=True, seed=21)
    cos, sin = randn(B, S, d, seed=22), randn(B, S, d, seed=23)
    dq_rot, dk_rot = randn(B, S, hq, d, seed=24), randn(B, S, hkv, d, seed=25)
    assert_triton_runs(q)
    q_rot, k_rot = apply_rope(q, k, cos, sin)
    dq, dk = torch.autograd.grad((q_rot, k_rot), (q, k), (dq_rot, dk_rot))
    for ours, ref, what in zip((q_rot, k_rot, dq, dk), _float64(q, k, cos, sin, dq_rot, dk_rot),
                               ("q_rot", "k_rot", "dq", "dk"), strict=True):
        assert_rel(ours, ref, torch.float32, what)


def test_rope_matches_transformers_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    B, S, hq, hkv, d = 2, 9, 6, 2, 96
    _, q, k = _qk(B, S, hq, hkv, d, torch.float32, fused=True, seed=11)
    cos, sin = _cos_sin(_positions(B, S, True, 11), d, torch.float32)
    assert_triton_runs(q)
    q_rot, k_rot = apply_rope(q, k, cos, sin)
    hf_q, hf_k = apply_rotary_pos_emb(q.detach().transpose(1, 2), k.detach().transpose(1, 2), cos, sin)
    assert_rel(q_rot, hf_q.transpose(1, 2), torch.float32, "q_rot vs transformers", bound=1e-6)
    assert_rel(k_rot, hf_k.transpose(1, 2), torch.float32, "k_rot vs transformers", bound=1e-6)


def test_rope_batch_one_cos_and_non_unit_last_stride():
    """cos/sin (1, S, D) shared by a batch of 3; q and k whose last dim is strided (copied, not rejected)."""
    B, S, hq, hkv, d = 3, 4, 4, 2, 64
    q = randn(B, S, d, hq, seed=1).transpose(-1, -2).requires_grad_()
    k = randn(B, S, d, hkv, seed=2).transpose(-1, -2).requires_grad_()
    cos, sin = _cos_sin(torch.arange(S)[None], d, torch.float32)
    dq_rot, dk_rot = randn(B, S, hq, d, seed=3), randn(B, S, hkv, d, seed=4)
    assert q.stride(-1) != 1
    assert_triton_runs(q)
    q_rot, k_rot = apply_rope(q, k, cos, sin)
    dq, dk = torch.autograd.grad((q_rot, k_rot), (q, k), (dq_rot, dk_rot))
    for ours, ref, what in zip((q_rot, k_rot, dq, dk), _float64(q, k, cos, sin, dq_rot, dk_rot),
                               ("q_rot", "k_rot", "dq", "dk"), strict=True):
        assert_rel(ours, ref, torch.float32, what)


def test_rope_reference_path_matches_kernel(monkeypatch):
    """The pure-PyTorch fallback (taken when use_triton is False) agrees with the kernel and gives no cos grad."""
    B, S, hq, hkv, d = 2, 5, 4, 2, 96
    _, q, k = _qk(B, S, hq, hkv, d, torch.float32, fused=True, seed=5)
    cos, sin = _cos_sin(_positions(B, S, True, 5), d, torch.float32)
    assert_triton_runs(q)
    ours = apply_rope(q, k, cos, sin)
    monkeypatch.setattr(rope_mod, "use_triton", lambda x: False)
    ref = apply_rope(q, k, cos, sin)
    for a, b in zip(ours, ref, strict=True):
        assert_rel(a, b, torch.float32, "kernel vs reference", bound=1e-6)
    direct = rope_reference(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(ref, direct, strict=True))


def test_rope_custom_ops_pass_opcheck():
    """The registered ops pass torch.library's checks: schema (no hidden mutation / aliasing) everywhere, and
    fake-tensor tracing on CUDA. Under TRITON_INTERPRET, torch's wrap_triton hands the interpreted kernel
    itself back (no tracing HOP), so fake tensors would reach the interpreter: that check needs a GPU."""
    _, q, k = _qk(1, 3, 4, 2, 64, torch.float32, fused=True, seed=7)
    cos, sin = _cos_sin(torch.arange(3), 64, torch.float32)
    args = (q.detach(), k.detach(), cos, sin)
    checks = ("test_schema", "test_faketensor") if DEVICE.type == "cuda" else ("test_schema",)
    for op in (torch.ops.ligermodels.rope_fwd.default, torch.ops.ligermodels.rope_bwd.default):
        torch.library.opcheck(op, args, test_utils=checks)
    qkv = randn(1, 3, 8 * 64, seed=8)
    for op in (torch.ops.ligermodels.rope_qkv_.default, torch.ops.ligermodels.rope_qkv_bwd.default):
        torch.library.opcheck(op, (qkv.clone(), cos, sin, 4, 2), test_utils=checks)
    torch.library.opcheck(torch.ops.ligermodels.rope_qkv_.default, (qkv.clone(), cos, sin, 4, 2, False, True),
                          test_utils=checks)


def test_rope_empty_sequence():
    q, k = torch.zeros(2, 0, 4, 64, device=DEVICE), torch.zeros(2, 0, 2, 64, device=DEVICE)
    cos = torch.zeros(0, 64, device=DEVICE)
    q_rot, k_rot = apply_rope(q, k, cos, cos)
    assert q_rot.shape == q.shape and k_rot.shape == k.shape


def test_rope_rejects_bad_shapes():
    z = lambda *s, dtype=torch.float32: torch.zeros(*s, dtype=dtype, device=DEVICE)
    q, k, cs = z(2, 5, 4, 64), z(2, 5, 2, 64), z(2, 5, 64)
    with pytest.raises(ValueError, match="4-D"):
        apply_rope(z(10, 4, 64), k, cs, cs)
    with pytest.raises(ValueError, match="batch"):
        apply_rope(q, z(3, 5, 2, 64), cs, cs)
    with pytest.raises(ValueError, match="seq"):
        apply_rope(q, z(2, 6, 2, 64), cs, cs)
    with pytest.raises(ValueError, match="head_dim"):
        apply_rope(q, z(2, 5, 2, 32), cs, cs)
    with pytest.raises(ValueError, match="even"):
        apply_rope(z(2, 5, 4, 63), z(2, 5, 2, 63), z(5, 63), z(5, 63))
    with pytest.raises(ValueError, match="cos/sin head_dim"):
        apply_rope(q, k, z(2, 5, 128), z(2, 5, 128))
    with pytest.raises(ValueError, match="even"):
        apply_rope(q, k, z(2, 5, 31), z(2, 5, 31))
    with pytest.raises(ValueError, match="cos/sin seq"):
        apply_rope(q, k, z(2, 4, 64), z(2, 4, 64))
    with pytest.raises(ValueError, match="cos/sin batch"):
        apply_rope(q, k, z(3, 5, 64), z(3, 5, 64))
    with pytest.raises(ValueError, match="one shape"):
        apply_rope(q, k, z(2, 5, 64), z(5, 64))
    with pytest.raises(ValueError, match="dtype"):
        apply_rope(q, z(2, 5, 2, 64, dtype=torch.bfloat16), cs, cs)


# ------------------------------------------------------- partial and interleaved rotary; q/k head norm + rope
def _hf_rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """transformers' Phi-3 / GLM-4 apply_rotary_pos_emb on the (B, S, H, D) layout, in float64: the first
    R = cos.shape[-1] channels rotate (GLM: GPT-J pairs with cos[..., :R/2] repeated), the rest pass."""
    x, c, s = x.double(), cos.double().unsqueeze(-2), sin.double().unsqueeze(-2)
    rd = c.shape[-1]
    if interleaved:
        c = c[..., : rd // 2].repeat_interleave(2, dim=-1)
        s = s[..., : rd // 2].repeat_interleave(2, dim=-1)
    xr, xp = x[..., :rd], x[..., rd:]
    rot = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2) if interleaved else _rotate_half(xr)
    return torch.cat((xr * c + rot * s, xp), dim=-1)


def _rms64(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.double())


PARTIAL_CASES = [  # (batch, seq, q_heads, kv_heads, head_dim, rotary_dim)
    (2, 5, 6, 2, 40, 30),   # Phi-4-mini's 3/4 of the head, halves not powers of two
    (1, 7, 3, 3, 24, 12),   # GLM-4's half
    (3, 3, 10, 2, 18, 18),  # whole head, odd pair count
]


def _check_partial_rope(case, dtype, interleaved: bool, cos: torch.Tensor, sin: torch.Tensor, seed: int) -> None:
    """apply_rope and apply_rope_qkv_ (in place on the packed buffer) with rotary tables ``cos`` / ``sin`` of
    R <= D channels: forward and gradients against transformers' formula in float64; the channels past R and
    the v heads pass unchanged, in place too; the in-place pass gives the out-of-place results bit for bit."""
    B, S, hq, hkv, d, rd = case
    leaf, q, k = _qk(B, S, hq, hkv, d, dtype, True, seed)
    dq_rot = randn(B, S, hq, d, dtype=dtype, seed=seed + 2)
    dk_rot = randn(B, S, hkv, d, dtype=dtype, seed=seed + 3)
    assert_triton_runs(q)
    q_rot, k_rot = apply_rope(q, k, cos, sin, interleaved=interleaved)
    dq, dk = torch.autograd.grad((q_rot, k_rot), (q, k), (dq_rot, dk_rot))
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    rq, rk = _hf_rope64(q64, cos, sin, interleaved), _hf_rope64(k64, cos, sin, interleaved)
    rdq, rdk = torch.autograd.grad((rq, rk), (q64, k64), (dq_rot.double(), dk_rot.double()))
    for ours, ref, what in zip((q_rot, k_rot, dq, dk), (rq, rk, rdq, rdk), ("q_rot", "k_rot", "dq", "dk"), strict=True):
        assert_rel(ours, ref, dtype, what)
    assert torch.equal(q_rot[..., rd:], q.detach()[..., rd:]), "pass-through channels changed"
    assert torch.equal(dk[..., rd:], dk_rot[..., rd:]), "pass-through gradient changed"

    heads = hq + 2 * hkv
    x = leaf.detach().reshape(B, S, heads * d).clone().requires_grad_()
    buf = x * 1
    out = apply_rope_qkv_(buf, cos, sin, hq, hkv, interleaved=interleaved)
    assert out is buf
    g = torch.cat([dq_rot, dk_rot, randn(B, S, hkv, d, dtype=dtype, seed=seed + 4)], dim=2)
    (dx,) = torch.autograd.grad(out, x, g.flatten(2))
    o4, dx4 = out.detach().view(B, S, heads, d), dx.view(B, S, heads, d)
    assert torch.equal(o4[:, :, :hq], q_rot) and torch.equal(o4[:, :, hq:hq + hkv], k_rot)
    assert torch.equal(o4[..., rd:], leaf.detach()[..., rd:]), "in place: pass-through channels changed"
    assert torch.equal(o4[:, :, hq + hkv:], leaf.detach()[:, :, hq + hkv:]), "v heads changed"
    assert torch.equal(dx4[:, :, :hq], dq) and torch.equal(dx4[:, :, hq:hq + hkv], dk)
    assert torch.equal(dx4[:, :, hq + hkv:], g[:, :, hq + hkv:]), "v gradient changed"


@pytest.mark.parametrize("case", PARTIAL_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_partial_and_interleaved_rope_match_float64(case, interleaved, dtype):
    """Partial rotary (cos/sin narrower than the head) and GPT-J pairs, with transformers' cos/sin tables."""
    B, S = case[:2]
    seed = zlib.crc32(repr(("partial", case, interleaved, dtype)).encode()) % 10_000
    cos, sin = _cos_sin(_positions(B, S, True, seed), case[5], torch.float32)
    _check_partial_rope(case, dtype, interleaved, cos, sin, seed)


NORM_CASES = [  # (batch, seq, q_heads, kv_heads, head_dim, rotary_dim)
    (2, 5, 6, 2, 24, 24),
    (1, 6, 5, 1, 40, 30),
    (3, 3, 20, 4, 64, 64),  # more q heads than one tile holds
    (2, 7, 4, 2, 32, 32),  # power-of-two heads: the persistent backward's unmasked form, 1-2 tokens a program
]


#: (gemma3 norm, interleaved, bf16, reuse_grad) settings each shape runs: every pair of the four switches' values
#: appears (a pairwise design: 6 rows, not all 16), and the last row is the persistent backward's (whole-head
#: rotate-half with reuse_grad) in fp32.
NORM_SWITCHES = [(0, 0, 0, 0), (0, 1, 1, 1), (1, 0, 1, 1), (1, 1, 0, 1), (1, 1, 1, 0), (0, 0, 0, 1)]


@pytest.mark.parametrize("case,casting,offset,interleaved,dtype,reuse", [
    pytest.param(case, *(("gemma", 1.0) if gemma else ("llama", 0.0)), bool(inter),
                 torch.bfloat16 if bf16 else torch.float32, bool(reuse),
                 id="-".join(("x".join(map(str, case)), ("qwen3", "gemma3")[gemma],
                              ("rotate_half", "interleaved")[inter], ("fp32", "bf16")[bf16],
                              ("new_grad", "reuse_grad")[reuse])))
    for case in NORM_CASES for gemma, inter, bf16, reuse in NORM_SWITCHES])
def test_qk_norm_rope_qkv_inplace_matches_float64(case, casting, offset, interleaved, dtype, reuse):
    """The fused in-place q/k head RMSNorm + RoPE on a packed qkv: values, the qkv gradient and both weight
    gradients against float64 (norm then transformers' rotation); v and its gradient pass unchanged. With
    ``reuse_grad`` the backward writes over the incoming gradient (whole-head rotate-half rotary at a
    power-of-two head dim: the persistent kernel)."""
    B, S, hq, hkv, d, rd = case
    heads = hq + 2 * hkv
    seed = zlib.crc32(repr(("qknorm", case, casting, interleaved, dtype)).encode()) % 10_000
    x = randn(B, S, heads * d, dtype=dtype, seed=seed, scale=3.0).requires_grad_()
    wq = (randn(d, seed=seed + 1) * 0.5 + (1 - offset)).to(dtype).requires_grad_()
    wk = (randn(d, seed=seed + 2) * 0.5 + (1 - offset)).to(dtype).requires_grad_()
    cos, sin = _cos_sin(_positions(B, S, True, seed), rd, torch.float32)
    g = randn(B, S, heads * d, dtype=dtype, seed=seed + 3)
    eps = 1e-6
    assert_triton_runs(x)
    before = snapshot(g, wq, wk)
    buf = x * 1
    ptr = buf.data_ptr()
    out = apply_qk_norm_rope_qkv_(buf, cos, sin, hq, hkv, wq, wk, eps, offset, casting, interleaved, reuse_grad=reuse)
    assert out is buf and out.data_ptr() == ptr, "not in place"
    dx, dwq, dwk = torch.autograd.grad(out, (x, wq, wk), g.clone() if reuse else g)
    assert_unchanged(before, g, wq, wk)
    assert dwq.dtype == dtype and dwk.dtype == dtype

    x64 = x.detach().double().requires_grad_()
    wq64, wk64 = wq.detach().double().requires_grad_(), wk.detach().double().requires_grad_()
    q, k, v = x64.view(B, S, heads, d).split([hq, hkv, hkv], dim=2)
    rq = _hf_rope64(_rms64(q, wq64, eps, offset), cos, sin, interleaved)
    rk = _hf_rope64(_rms64(k, wk64, eps, offset), cos, sin, interleaved)
    ref = torch.cat([rq, rk, v], dim=2).flatten(2)
    rdx, rdwq, rdwk = torch.autograd.grad(ref, (x64, wq64, wk64), g.double())
    bound = 1e-5 if dtype == torch.float32 else 1.5e-2
    pairs = ((out, ref, "qkv"), (dx, rdx, "dqkv"), (dwq, rdwq, "dq_weight"), (dwk, rdwk, "dk_weight"))
    for ours, theirs, what in pairs:
        assert_rel(ours, theirs, dtype, what, bound=bound)
    o4, dx4 = out.detach().view(B, S, heads, d), dx.view(B, S, heads, d)
    assert torch.equal(o4[:, :, hq + hkv:], x.detach().view(B, S, heads, d)[:, :, hq + hkv:]), "v heads changed"
    assert torch.equal(dx4[:, :, hq + hkv:], g.view(B, S, heads, d)[:, :, hq + hkv:]), "v gradient changed"


def test_qk_norm_rope_reference_path_agrees(monkeypatch):
    """Without Triton the fused op runs qk_norm_rope_reference: same values and gradients as the kernels."""
    B, S, hq, hkv, d = 2, 5, 4, 2, 40
    x = randn(B, S, (hq + 2 * hkv) * d, seed=31).requires_grad_()
    wq, wk = randn(d, seed=32).requires_grad_(), randn(d, seed=33).requires_grad_()
    cos, sin = _cos_sin(_positions(B, S, True, 31), 30, torch.float32)
    g = randn(*x.shape, seed=34)
    assert_triton_runs(x)
    ours = apply_qk_norm_rope_qkv_(x * 1, cos, sin, hq, hkv, wq, wk, 1e-6, 1.0, "gemma", True)
    d_ours = torch.autograd.grad(ours, (x, wq, wk), g)
    monkeypatch.setattr(rope_mod, "use_triton", lambda x: False)
    ref = apply_qk_norm_rope_qkv_(x * 1, cos, sin, hq, hkv, wq, wk, 1e-6, 1.0, "gemma", True)
    d_ref = torch.autograd.grad(ref, (x, wq, wk), g)
    assert_rel(ours, ref, torch.float32, "values", bound=1e-6)
    for a, b, what in zip(d_ours, d_ref, ("dqkv", "dq_weight", "dk_weight"), strict=True):
        assert_rel(a, b, torch.float32, what, bound=1e-5)
    with pytest.raises(ValueError, match="head_dim"):
        apply_qk_norm_rope_qkv_(x.detach() * 1, cos, sin, hq, hkv, wq[:-1], wk, 1e-6)


def test_qk_norm_rope_custom_ops_pass_opcheck():
    qkv = randn(1, 3, 8 * 32, seed=9)
    cos, sin = _cos_sin(torch.arange(3), 24, torch.float32)
    w = randn(32, seed=10)
    checks = ("test_schema", "test_faketensor") if DEVICE.type == "cuda" else ("test_schema",)
    torch.library.opcheck(torch.ops.ligermodels.qk_norm_rope_qkv_.default,
                          (qkv.clone(), cos, sin, w, w, 4, 2, 1e-6, 0.0, 0, True), test_utils=checks)
    xs, rs = torch.ops.ligermodels.qk_norm_rope_qkv_(qkv.clone(), cos, sin, w, w, 4, 2, 1e-6, 0.0, 0, True)
    for op in (torch.ops.ligermodels.qk_norm_rope_qkv_bwd.default, torch.ops.ligermodels.qk_norm_rope_qkv_bwd_.default):
        torch.library.opcheck(op, (qkv.clone(), xs, rs, cos, sin, w, w, 4, 2, 0.0, True), test_utils=checks)


REUSE_CASES = [  # (op, (batch, seq, q_heads, kv_heads, head_dim, rotary_dim), interleaved)
    ("rope", (2, 5, 6, 2, 40, 30), False),  # partial rotate-half: the row path
    ("rope", (1, 7, 3, 3, 24, 12), True),
    ("rope", (2, 3, 5, 1, 32, 32), False),
    ("qk_norm", (2, 5, 6, 2, 24, 24), False),
    ("qk_norm", (1, 6, 5, 1, 40, 30), True),
    ("qk_norm", (3, 3, 20, 4, 64, 64), False),  # more q heads than one tile holds
]


@pytest.mark.parametrize("op,case,interleaved", REUSE_CASES,
                         ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else str(c))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reuse_grad_writes_the_same_gradient_over_the_incoming_one(op, case, interleaved, dtype):
    """``reuse_grad=True`` (what the attention block passes): the packed ops' backward gives the same qkv and
    weight gradients as with a new buffer, and writes the qkv gradient over the incoming one (its v heads and
    pass-through channels already are that); without it the incoming gradient is untouched."""
    B, S, hq, hkv, d, rd = case
    heads = hq + 2 * hkv
    seed = zlib.crc32(repr(("reuse", op, case, interleaved, dtype)).encode()) % 10_000
    x = randn(B, S, heads * d, dtype=dtype, seed=seed, scale=3.0).requires_grad_()
    w = [(randn(d, seed=seed + i) * 0.5 + 1).to(dtype).requires_grad_() for i in (1, 2)]
    cos, sin = _cos_sin(_positions(B, S, True, seed), rd, torch.float32)
    g = randn(B, S, heads * d, dtype=dtype, seed=seed + 3)
    assert_triton_runs(x)

    def grads(reuse: bool, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if op == "rope":
            out = apply_rope_qkv_(x * 1, cos, sin, hq, hkv, interleaved, reuse_grad=reuse)
            return torch.autograd.grad(out, x, grad)
        out = apply_qk_norm_rope_qkv_(x * 1, cos, sin, hq, hkv, *w, 1e-6, 1.0, "gemma", interleaved, reuse_grad=reuse)
        return torch.autograd.grad(out, (x, *w), grad)

    kept = g.clone()
    ref = grads(False, kept)
    assert torch.equal(kept, g), "reuse_grad=False changed the incoming gradient"
    ours = grads(True, kept)
    # The same arithmetic per element (bit for bit here; on a GPU another kernel may contract a multiply-add
    # differently); the weight gradients are summed in another order (the persistent kernel's programs).
    assert torch.equal(ours[0], ref[0]) if DEVICE.type == "cpu" else rel_err(ours[0], ref[0]) <= 1e-2
    for a, b in zip(ours[1:], ref[1:], strict=True):
        assert rel_err(a, b) <= (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(kept, ours[0]), "reuse_grad=True did not write qkv's gradient over the incoming one"
    assert not torch.equal(kept, g)


ROW_CASES = [  # (batch, seq, q_heads, kv_heads, head_dim, rotary_dim): partial rotate-half, the row path
    (1, 3, 20, 3, 80, 48),  # Phi-2-like widths; 20 q heads: the head loop runs more than once (8 rows of 128)
    (2, 3, 5, 2, 70, 22),   # neither D nor R/2 a power of two, R not a multiple of 16
]


@pytest.mark.parametrize("case", ROW_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_partial_rope_general_cos_sin_halves(case, dtype):
    """Partial rotate-half rotary with cos/sin whose halves differ (the backward's swapped, negated sine halves
    would hide behind HF's duplicated ones)."""
    B, S, rd = case[0], case[1], case[5]
    seed = zlib.crc32(repr(("row", case, dtype)).encode()) % 10_000
    cos, sin = randn(B, S, rd, seed=seed + 10), randn(B, S, rd, seed=seed + 11)
    _check_partial_rope(case, dtype, False, cos, sin, seed)
