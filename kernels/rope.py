"""Rotary position embedding (rotate-half / Hugging Face convention) applied to q and k in one launch.

``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)`` over the two halves
of ``head_dim``. Written per half (``c1, c2, s1, s2`` the halves of cos and sin)::

    out1 = x1 * c1 - x2 * s1          out2 = x2 * c2 + x1 * s2

The backward pass is the transpose, ``dx = dy * cos + rotate_half^T(dy * sin)`` with
``rotate_half^T(v) = cat(v2, -v1)``::

    dx1 = dy1 * c1 + dy2 * s2         dx2 = dy2 * c2 - dy1 * s1

which is the forward formula with the sine halves swapped and negated (``s1 -> -s2``, ``s2 -> -s1``),
so one kernel serves both passes (a compile-time switch). cos and sin are buffers: no gradient.

Layout: q (B, S, Hq, D) and k (B, S, Hkv, D), as a projection produces them. They may be strided
views (e.g. slices of one fused qkv projection viewed as (B, S, Hq + 2*Hkv, D)); the kernel takes
their batch / seq / head strides and only the last dim must be unit-stride. cos / sin are
(B, S, D) (per-token positions, e.g. packed sequences), (1, S, D) or (S, D) (shared by the batch),
fp32 or the model dtype. D must be even; it need not be a power of two (Phi-3: 96), the halves are
masked. Outputs are fresh contiguous tensors in q's dtype; the math runs in fp32.

``apply_rope_qkv_`` is the in-place form for blocks that own a packed (B, S, (Hq + 2*Hkv) * D)
projection output: the kernel writes the rotated q and k heads back where they were read (each
tile is loaded whole before it is stored), so no rotated copies exist; its backward writes a new
gradient buffer with the q / k heads rotated back and the v heads copied.

One program handles one token: it loads that token's cos / sin once, then rotates all q heads and
then all kv heads, in tiles of up to ``_TILE`` elements per half.

Bytes moved (the fewest each pass must move), for T = B*S tokens, P distinct cos rows (B*S, or S
when shared), element size s of q/k and c of cos/sin:
forward  2*T*(Hq + Hkv)*D*s + 2*P*D*c   (read q, k; write q_rot, k_rot; read cos, sin once per row),
backward 2*T*(Hq + Hkv)*D*s + 2*P*D*c   (read dq_rot, dk_rot; write dq, dk; read cos, sin).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kernels._common import LIB, check_same_device, compute_dtype, use_triton

#: Elements per half-tile of one program (16 heads x 64 at head_dim 128), and warps. Measured on an
#: H100 (kernel time, 32/8 heads of 128, bf16): 2048 x 4 warps ran at 83-92% of copy bandwidth,
#: 1024 x 4 at 85-95%; 8 warps or larger tiles were slower.
_TILE = 1024
_WARPS = 4


# --------------------------------------------------------------------------------------- kernels
@triton.jit
def _rotate_heads(x_ptr, o_ptr, n_heads, stride_h, stride_oh, half, c1, c2, s1, s2,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate the ``n_heads`` rows of one token: x at ``x_ptr`` (head stride ``stride_h``) -> o at
    ``o_ptr`` (head stride ``stride_oh``). Each tile is loaded whole before it is stored, so o may be x."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    for h0 in range(0, n_heads, BLOCK_H):
        hh = h0 + h
        mask = (hh < n_heads)[:, None] & dmask[None, :]
        x_off = hh[:, None] * stride_h + d[None, :]
        o_off = hh[:, None] * stride_oh + d[None, :]
        x1 = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + x_off + half, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_ptr + o_off, (x1 * c1 - x2 * s1).to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(o_ptr + o_off + half, (x2 * c2 + x1 * s2).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, seq_len, n_qh, n_kh,
                 sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sqo_b, sqo_s, sqo_h, sko_b, sko_s, sko_h,
                 sc_b, sc_s, ss_b, ss_s, half,
                 BACKWARD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    b = tok // seq_len
    s = tok - b * seq_len
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    c_row = cos_ptr + b * sc_b + s * sc_s
    s_row = sin_ptr + b * ss_b + s * ss_s
    c1 = tl.load(c_row + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c_row + half + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s_row + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s_row + half + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if BACKWARD:  # transpose of rotate_half: swap the sine halves and negate them
        s1_fwd = s1
        s1 = -s2
        s2 = -s1_fwd
    _rotate_heads(q_ptr + b * sq_b + s * sq_s, qo_ptr + b * sqo_b + s * sqo_s, n_qh, sq_h, sqo_h, half,
                  c1, c2, s1, s2, BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr + b * sk_b + s * sk_s, ko_ptr + b * sko_b + s * sko_s, n_kh, sk_h, sko_h, half,
                  c1, c2, s1, s2, BLOCK_HK, BLOCK_D)


# ------------------------------------------------------------------------------------ custom ops
def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _cs_strides(t: torch.Tensor) -> tuple[int, int]:
    """(batch, seq) strides of cos / sin; 0 on the batch when it is shared ((S, D) or (1, S, D))."""
    if t.dim() == 2:
        return 0, t.stride(0)
    return (0 if t.shape[0] == 1 else t.stride(0)), t.stride(1)


def _head_block(n_heads: int, block_d: int) -> int:
    return min(triton.next_power_of_2(max(n_heads, 1)), max(_TILE // block_d, 1))


def _launch(x_q: torch.Tensor, x_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qo: torch.Tensor,
            ko: torch.Tensor, backward: bool) -> None:
    """Rotate x_q -> qo and x_k -> ko, all (B, S, H, D) with unit last stride (qo / ko may alias x_q / x_k)."""
    B, S, Hq, D = x_q.shape
    Hkv = x_k.shape[2]
    if B * S == 0 or D == 0:
        return
    block_d = triton.next_power_of_2(int(D) // 2)  # compile-time sizes: int() specialises symbolic shapes
    sc_b, sc_s = _cs_strides(cos)
    ss_b, ss_s = _cs_strides(sin)
    wrap_triton(_rope_kernel)[(B * S,)](
        x_q, x_k, cos, sin, qo, ko, S, Hq, Hkv,
        x_q.stride(0), x_q.stride(1), x_q.stride(2), x_k.stride(0), x_k.stride(1), x_k.stride(2),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
        sc_b, sc_s, ss_b, ss_s, D // 2,
        BACKWARD=backward, BLOCK_HQ=_head_block(int(Hq), block_d), BLOCK_HK=_head_block(int(Hkv), block_d),
        BLOCK_D=block_d, num_warps=_WARPS)


def _rotate_new(x_q: torch.Tensor, x_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of x_q and x_k as fresh contiguous tensors in x_q's dtype."""
    x_q, x_k, cos, sin = _unit_last(x_q), _unit_last(x_k), _unit_last(cos), _unit_last(sin)
    qo = torch.empty(x_q.shape, dtype=x_q.dtype, device=x_q.device)
    ko = torch.empty(x_k.shape, dtype=x_q.dtype, device=x_q.device)
    _launch(x_q, x_k, cos, sin, qo, ko, backward)
    return qo, ko


def _split_heads(qkv: torch.Tensor, n_q: int, n_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, S, (Hq + 2*Hkv) * D) -> q, k, v views (B, S, H, D) of the packed projection output."""
    b, s, n = qkv.shape
    heads = qkv.view(b, s, n_q + 2 * n_kv, n // (n_q + 2 * n_kv))
    return heads[:, :, :n_q], heads[:, :, n_q:n_q + n_kv], heads[:, :, n_q + n_kv:]


@triton_op(f"{LIB}::rope_fwd", mutates_args={})
def _rope_fwd(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_rot, k_rot), fresh contiguous (B, S, H, D) tensors in q's dtype."""
    return _rotate_new(q, k, cos, sin, backward=False)


@triton_op(f"{LIB}::rope_bwd", mutates_args={})
def _rope_bwd(dq_rot: torch.Tensor, dk_rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dk) from the gradients of q_rot and k_rot, fresh contiguous (B, S, H, D) tensors."""
    return _rotate_new(dq_rot, dk_rot, cos, sin, backward=True)


@triton_op(f"{LIB}::rope_qkv_", mutates_args={"qkv"})
def _rope_qkv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int) -> None:
    """Rotate the q and k heads of a packed (B, S, (Hq + 2*Hkv) * D) projection output in place."""
    q, k, _ = _split_heads(qkv, n_q, n_kv)
    _launch(q, k, _unit_last(cos), _unit_last(sin), q, k, backward=False)


@triton_op(f"{LIB}::rope_qkv_bwd", mutates_args={})
def _rope_qkv_bwd(dqkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int) -> torch.Tensor:
    """Gradient of the packed qkv before :func:`_rope_qkv_`: q / k heads rotated back, v heads copied."""
    dqkv = _unit_last(dqkv)
    out = torch.empty(dqkv.shape, dtype=dqkv.dtype, device=dqkv.device)
    dq, dk, dv = _split_heads(dqkv, n_q, n_kv)
    oq, ok, ov = _split_heads(out, n_q, n_kv)
    _launch(dq, dk, _unit_last(cos), _unit_last(sin), oq, ok, backward=True)
    ov.copy_(dv)
    return out


class RoPEFunction(torch.autograd.Function):
    """Autograd wrapper: ``forward(q, k, cos, sin) -> (q_rot, k_rot)``; no gradient for cos / sin."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        ctx.save_for_backward(cos, sin)
        return _rope_fwd(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq_rot: torch.Tensor, dk_rot: torch.Tensor):
        cos, sin = ctx.saved_tensors
        dq, dk = _rope_bwd(dq_rot, dk_rot, cos, sin)
        return dq, dk, None, None


class RoPEQKVInplaceFunction(torch.autograd.Function):
    """Autograd wrapper of the in-place rotation of a packed qkv: ``forward(qkv, cos, sin, n_q, n_kv) -> qkv``.

    The forward overwrites q and k in the caller's buffer (``mark_dirty``); the backward writes a new
    gradient buffer (the incoming one is left as it is).
    """

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int) -> torch.Tensor:
        _rope_qkv_(qkv, cos, sin, n_q, n_kv)
        ctx.mark_dirty(qkv)
        ctx.save_for_backward(cos, sin)
        ctx.heads = (n_q, n_kv)
        return qkv

    @staticmethod
    def backward(ctx, dqkv: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rope_qkv_bwd(dqkv, cos, sin, *ctx.heads), None, None, None, None


# ------------------------------------------------------------------------------------- reference
def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch rotate-half RoPE in fp32 (fp64 for fp64 inputs), rounded once to q's dtype.

    Shapes as in :func:`apply_rope`; differentiable through autograd (cos / sin included).
    """
    cd = compute_dtype(q.dtype)
    c, s = cos.to(cd).unsqueeze(-2), sin.to(cd).unsqueeze(-2)  # broadcast over heads

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.to(cd)
        x1, x2 = x.chunk(2, dim=-1)
        return (x * c + torch.cat((-x2, x1), dim=-1) * s).to(q.dtype)

    return rotate(q), rotate(k)


# ---------------------------------------------------------------------------------------- public
def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"apply_rope: q and k must be 4-D (batch, seq, heads, head_dim), "
                         f"got q {tuple(q.shape)} and k {tuple(k.shape)}")
    (B, S, _, D), (Bk, Sk, _, Dk) = q.shape, k.shape
    if Bk != B:
        raise ValueError(f"apply_rope: q and k differ in batch: {B} vs {Bk}")
    if Sk != S:
        raise ValueError(f"apply_rope: q and k differ in seq: {S} vs {Sk}")
    if Dk != D:
        raise ValueError(f"apply_rope: q and k differ in head_dim: {D} vs {Dk}")
    if D % 2:
        raise ValueError(f"apply_rope: head_dim must be even for rotate_half, got {D}")
    if q.dtype != k.dtype or not q.dtype.is_floating_point:
        raise ValueError(f"apply_rope: q and k must share one floating dtype, got {q.dtype} and {k.dtype}")
    if cos.shape != sin.shape:
        raise ValueError(f"apply_rope: cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dim() not in (2, 3):
        raise ValueError(f"apply_rope: cos/sin must be (batch, seq, head_dim) or (seq, head_dim), "
                         f"got {tuple(cos.shape)}")
    if cos.shape[-1] != D:
        raise ValueError(f"apply_rope: cos/sin head_dim {cos.shape[-1]} != q/k head_dim {D}")
    if cos.shape[-2] != S:
        raise ValueError(f"apply_rope: cos/sin seq {cos.shape[-2]} != q/k seq {S}")
    if cos.dim() == 3 and cos.shape[0] not in (1, B):
        raise ValueError(f"apply_rope: cos/sin batch {cos.shape[0]} != q/k batch {B} (or 1)")
    if not (cos.dtype.is_floating_point and sin.dtype.is_floating_point):
        raise ValueError(f"apply_rope: cos/sin must be floating point, got {cos.dtype} and {sin.dtype}")
    check_same_device(q, k, cos, sin)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k (rotate-half convention), one kernel launch per pass.

    Args:
        q: (B, S, Hq, D), possibly a strided view (only the last dim need be unit-stride).
        k: (B, S, Hkv, D), same batch, seq, head_dim and dtype as q.
        cos, sin: (B, S, D), (1, S, D) or (S, D); fp32 or the model dtype. No gradient flows to them.
    Returns:
        (q_rot, k_rot): fresh contiguous (B, S, Hq, D) and (B, S, Hkv, D) tensors in q's dtype.
    """
    _check(q, k, cos, sin)
    if not use_triton(q):
        return rope_reference(q, k, cos, sin)
    return RoPEFunction.apply(q, k, cos, sin)


def apply_rope_qkv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                    num_kv_heads: int) -> torch.Tensor:
    """Rotate the q and k heads of a packed q/k/v projection output **in place**; returns ``qkv``.

    For blocks that own the projection's output buffer: the rotated q and k take no new memory, so
    attention saves views of this one buffer for backward instead of separate rotated copies
    (at Llama-3.2-1B, batch 8 x 2048, 1.3 GB less). Unlike the other public ops this one
    modifies its input, by design; autograd tracks it (``mark_dirty``), so a stale use raises.

    Args:
        qkv: (B, S, (Hq + 2*Hkv) * D) with unit last stride, heads ordered q, k, v (the layout of a
            fused projection); not a view (the projection's own output).
        cos, sin: as in :func:`apply_rope`.
        num_q_heads, num_kv_heads: Hq and Hkv.
    Returns:
        ``qkv``, with its q and k heads rotated; view it as (B, S, Hq + 2*Hkv, D) to split heads.
    """
    if qkv.dim() != 3:
        raise ValueError(f"apply_rope_qkv_: qkv must be (batch, seq, (Hq + 2*Hkv) * head_dim), got {tuple(qkv.shape)}")
    heads = num_q_heads + 2 * num_kv_heads
    if num_q_heads < 1 or num_kv_heads < 1 or qkv.shape[-1] % heads:
        raise ValueError(f"apply_rope_qkv_: last dim {qkv.shape[-1]} is not (Hq + 2*Hkv) * head_dim for "
                         f"Hq={num_q_heads}, Hkv={num_kv_heads}")
    if qkv.stride(-1) != 1:
        raise ValueError("apply_rope_qkv_: qkv must have a unit last stride")
    q, k, _ = _split_heads(qkv, num_q_heads, num_kv_heads)
    _check(q, k, cos, sin)
    if not use_triton(qkv):
        q_rot, k_rot = rope_reference(q, k, cos, sin)
        if qkv.requires_grad and torch.is_grad_enabled():  # autograd needs an out-of-place form
            return torch.cat([q_rot, k_rot, qkv.view(q.shape[:2] + (heads, -1))[:, :, q.shape[2] + k.shape[2]:]],
                             dim=2).flatten(2)
        with torch.no_grad():
            q.copy_(q_rot)
            k.copy_(k_rot)
        return qkv
    return RoPEQKVInplaceFunction.apply(qkv, cos, sin, int(num_q_heads), int(num_kv_heads))
