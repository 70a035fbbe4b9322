"""Benchmark cases for apply_rope: ours vs eager PyTorch (the Hugging Face formula) vs torch.compile of it.

Llama-3-8B attention shapes: 32 q / 8 kv heads of 128, cos/sin per token (B, S, D) in the model dtype.
q and k are either separate contiguous tensors or strided slices of one fused qkv projection
(B, S, Hq + 2*Hkv, D), the layout the models feed the op; the "fused" cases time the same op on those
views (the gradients are taken w.r.t. the views, so the slice backward is not counted).
Bytes counted per pass: q, k read + written once, cos and sin read once per token (see kernels/rope.py).
"""

from __future__ import annotations

import torch

from benchmarks.common import compare_impls
from kernels.rope import apply_rope

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _eager_rope(q, k, cos, sin):
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def _cos_sin(batch: int, seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda", dtype=torch.float32) / HEAD_DIM)
    pos = torch.arange(seq, device="cuda", dtype=torch.float32).expand(batch, seq)
    emb = pos[..., None] * inv
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos().to(dtype).contiguous(), emb.sin().to(dtype).contiguous()


def run(copy_gbs: float, dtype=torch.bfloat16) -> list[dict]:
    rows = []
    compiled = torch.compile(_eager_rope)
    impls = {"ligermodels": apply_rope, "eager": _eager_rope, "compile": compiled}
    for batch, seq, fused in [(1, 4096, False), (4, 4096, False), (4, 8192, False), (4, 4096, True),
                              (4, 8192, True)]:
        def make(batch=batch, seq=seq, fused=fused):
            cos, sin = _cos_sin(batch, seq, dtype)
            if fused:
                qkv = torch.randn(batch, seq, Q_HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype,
                                  requires_grad=True)
                q, k = qkv[:, :, :Q_HEADS], qkv[:, :, Q_HEADS:Q_HEADS + KV_HEADS]
            else:
                q = torch.randn(batch, seq, Q_HEADS, HEAD_DIM, device="cuda", dtype=dtype, requires_grad=True)
                k = torch.randn(batch, seq, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype, requires_grad=True)
            return [q, k, cos, sin]

        tokens = batch * seq
        s = dtype.itemsize
        nbytes = 2 * tokens * (Q_HEADS + KV_HEADS) * HEAD_DIM * s + 2 * tokens * HEAD_DIM * s
        shape = f"{batch}x{seq}x{Q_HEADS}/{KV_HEADS}x{HEAD_DIM}" + ("-fused" if fused else "")
        rows += compare_impls("rope", shape, dtype, impls, make, nbytes, nbytes, copy_gbs)
    return rows
