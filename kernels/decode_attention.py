"""Attention of one new query token per row over a static key/value cache (the decode step of generation),
split over the cache length (flash-decoding) so that a batch of one still fills the GPU.

``out[b, h] = softmax(scale * q[b, h] . k[b, l, h // G] over the allowed l) @ v[b, :, h // G]`` with
G = Hq / Hkv query heads per kv head (grouped-query attention): the G query heads of a kv head are one tile, so
each key and value is read once, never repeated per query head.

Why a kernel: a decode step reads every layer's cache once, a few hundred KB at a short context, and the rest of
the layer is GEMV-sized too. SDPA's memory-efficient kernel (what a boolean mask selects) gives one program to
each kv head's 64-query tile, 8 programs at Llama-3.2-1B's batch 1 on 132 multiprocessors, and the mask is first
turned into an additive float mask by separate kernels.

Two launches:

* ``_decode_split_kernel``: program (b * Hkv + h, split) runs the online softmax of its G query rows over its
  chunk of the cache (BLOCK_N keys a tile, fp32 scores and accumulator, the probabilities rounded to the value
  dtype for the second product, as FlashAttention does), and writes its unnormalised fp32 output row, its row max
  and its row sum. With one split it writes the normalised output itself and there is no second launch.
* ``_decode_combine_kernel``: program (b, query head) rescales the splits' rows to their common max and divides
  by the summed weights: one rounding to the output dtype.

``allowed`` (B, L) bool says which cache slots a row may read (not padding, not past the query, inside a
window); a slot it may not read adds nothing as long as it holds finite values (the cache is zero-filled).
Every row needs one allowed slot.

Bytes: the cache reads 2*B*L*Hkv*D*s (s = element size) plus B*L mask bytes; q, the output and the split
workspace (B*Hq*splits*(D + 2) fp32) are small next to it at any context worth splitting.

On a CPU without the interpreter, and for float64, :func:`decode_attention_reference` runs: the SDPA call that
generation made before this kernel, so CPU generation keeps its numbers. What the kernel changed end to end:
docs/performance.md, "Decoding".
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import LIB, eager_op, sm_count, use_triton
from kernels.attention import _precision

#: Programs the split count aims at, per multiprocessor.
_PROGRAMS_PER_SM = 2
#: Most (splits x padded head dim) the combine kernel holds at once (fp32): 64 splits at head dim 128, 32 at 256.
#: Without it a batch of one on a long cache of one kv head (Gemma's multi-query attention) would ask for hundreds.
_COMBINE_ELEMENTS = 8192


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, ok_ptr, o_ptr, acc_ptr, m_ptr, l_ptr,
                         s_qb, s_qh, s_kb, s_kl, s_kh, s_vb, s_vl, s_vh, s_okb, s_ob, s_oh,
                         n_kv, group, head_dim, length, chunk, n_split, qk_scale,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         DIRECT: tl.constexpr, PRECISION: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // n_kv
    h = bh % n_kv
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < group
    d_ok = d < head_dim
    heads = h * group + g  # the query heads of kv head h
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                other=0.0)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        ok = tl.load(ok_ptr + b * s_okb + n, mask=n_ok, other=0) != 0
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + b * s_kb + n[:, None] * s_kl + h * s_kh + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))  # log2 units: scale * log2(e) folded in
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no allowed slot yet: keep every weight 0
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + b * s_vb + n[:, None] * s_vl + h * s_vh + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    rows = g_ok[:, None] & d_ok[None, :]
    if DIRECT:
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * s_ob + heads[:, None] * s_oh + d[None, :], out.to(o_ptr.dtype.element_ty), mask=rows)
    else:
        row = (b * n_kv * group + heads) * n_split + split  # workspace row of (b, query head, split)
        tl.store(acc_ptr + row[:, None] * head_dim + d[None, :], acc, mask=rows)
        tl.store(m_ptr + row, m_i, mask=g_ok)
        tl.store(l_ptr + row, l_i, mask=g_ok)


@triton.jit
def _decode_combine_kernel(acc_ptr, m_ptr, l_ptr, o_ptr, s_ob, s_oh, n_heads, head_dim, n_split,
                           BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    bq = tl.program_id(0)  # b * Hq + query head
    b = bq // n_heads
    h = bq % n_heads
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sp_ok = sp < n_split
    row = bq * n_split + sp
    m = tl.load(m_ptr + row, mask=sp_ok, other=float("-inf"))
    l = tl.load(l_ptr + row, mask=sp_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # a split with no allowed slot weighs nothing
    acc = tl.load(acc_ptr + row[:, None] * head_dim + d[None, :], mask=sp_ok[:, None] & (d < head_dim)[None, :],
                  other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(o_ptr + b * s_ob + h * s_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < head_dim)


def _tiles(head_dim: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_N): the head dim padded to a power of two (16 at least, for tl.dot), and the keys a tile: 64
    up to head dim 128, 32 beyond (the k and v tiles stay within registers at head dim 256)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return block_d, 64 if block_d <= 128 else 32


def _splits(batch: int, n_kv: int, length: int, block_n: int, block_d: int, sms: int) -> tuple[int, int]:
    """(splits, keys a split): enough programs to fill ``sms`` multiprocessors, at least one tile a split, at most
    ``_COMBINE_ELEMENTS // block_d`` splits."""
    tiles = triton.cdiv(length, block_n)
    n = max(1, min(tiles, triton.cdiv(_PROGRAMS_PER_SM * sms, batch * n_kv), _COMBINE_ELEMENTS // block_d))
    chunk = triton.cdiv(tiles, n) * block_n
    return triton.cdiv(length, chunk), chunk


@eager_op
@torch.library.custom_op(f"{LIB}::decode_attention", mutates_args=())
def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """q (B, Hq, D), k/v (B, L, Hkv, D) unit last stride, allowed (B, L) bool -> (B, Hq, D) in q's dtype.

    An opaque ``custom_op``, not a ``triton_op``: Inductor's own build of these kernels failed on an H200
    (torch 2.11, triton 3.6: an InductorError from its compile subprocess, in ``generate(compile=True)``), so
    under torch.compile they launch exactly as in eager."""
    B, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    block_d, block_n = _tiles(D)
    n_split, chunk = _splits(B, Hkv, L, block_n, block_d, sm_count(q.device))
    direct = n_split == 1
    rows = 1 if direct else B * Hq * n_split
    acc = torch.empty((rows, D), dtype=torch.float32, device=q.device)
    m = torch.empty((rows,), dtype=torch.float32, device=q.device)
    l_sum = torch.empty((rows,), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(B * Hkv, n_split)](
        q, k, v, allowed, out, acc, m, l_sum, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), allowed.stride(0), out.stride(0), out.stride(1),
        Hkv, group, D, L, chunk, n_split, scale * math.log2(math.e),
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d, DIRECT=direct,
        PRECISION=_precision(q), num_warps=4)
    if not direct:
        _decode_combine_kernel[(B * Hq,)](
            acc, m, l_sum, out, out.stride(0), out.stride(1), Hq, D, n_split,
            BLOCK_S=triton.next_power_of_2(n_split), BLOCK_D=block_d, num_warps=4)
    return out


@_decode_attention.register_fake
def _(q, k, v, allowed, scale):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


# ------------------------------------------------------------------------------------- reference
def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                               scale: float | None = None) -> torch.Tensor:
    """PyTorch's SDPA in the inputs' dtype, the G query heads of a kv head laid out as its query axis (a view: k/v
    never repeated); shapes as in :func:`decode_attention`. The CPU path of generation, which ran exactly this
    before the kernel existed (its numbers unchanged), and with float64 inputs the tests' reference."""
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    out = F.scaled_dot_product_attention(q.reshape(B, Hkv, Hq // Hkv, D), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=allowed[:, None, None, :], scale=scale)
    return out.reshape(B, Hq, D)


# ---------------------------------------------------------------------------------------- public
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Attention of one query token per row over a key/value cache; no gradient (generation runs without one).

    Args:
        q: (B, Hq, D), the new token's query heads (last dim unit-stride).
        k, v: (B, L, Hkv, D) cache buffers (last dim unit-stride), Hkv dividing Hq; fp16, bf16 or fp32 on the
            kernel path (fp64 runs the reference).
        allowed: (B, L) bool, True where the row may read the slot; every row needs one True.
        scale: softmax scale (default D ** -0.5).
    Returns:
        (B, Hq, D) in q's dtype.
    """
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"decode_attention: q must be (B, Hq, D) and k, v one (B, L, Hkv, D) shape, got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    (B, Hq, D), (Bk, L, Hkv, Dk) = q.shape, k.shape
    if Bk != B or Dk != D or Hq % Hkv:
        raise ValueError(f"decode_attention: k/v {tuple(k.shape)} do not fit q {tuple(q.shape)} (same batch and "
                         "head dim, kv heads dividing query heads)")
    if allowed.shape != (B, L) or allowed.dtype != torch.bool:
        raise ValueError(f"decode_attention: allowed must be ({B}, {L}) bool, got {tuple(allowed.shape)} "
                         f"{allowed.dtype}")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError("decode_attention has no backward: call it under torch.no_grad()")
    if not use_triton(q) or q.dtype == torch.float64 or any(t.stride(-1) != 1 for t in (q, k, v)):
        return decode_attention_reference(q, k, v, allowed, scale)
    return _decode_attention(q, k, v, allowed, D ** -0.5 if scale is None else float(scale))
