"""Benchmark cases for the rope variants of the newer families: the q/k head RMSNorm fused with RoPE (Qwen3,
Gemma 3), partial rotary (Phi-4-mini) and interleaved partial rotary (GLM-4). Ours against eager PyTorch doing
what transformers does and against torch.compile of that eager code.

Ops (the ``op`` of a row; docs/performance.md's kernel table has one line per op and pass, min-max over its
shapes):

* ``qk_norm_rope``: ``apply_qk_norm_rope_qkv_`` in place on the packed (B, S, (Hq + 2*Hkv) * D) projection
  output, as the attention block runs it (``reuse_grad=True``: the backward writes over the incoming gradient).
  Baselines: transformers' order on separate q (B, S, Hq, D) and k (B, S, Hkv, D) tensors, ``q_norm`` /
  ``k_norm`` (an RMSNorm over each head) then rotate-half RoPE. Shapes: Qwen3-1.7B (16 q / 8 kv heads of 128,
  Llama rounding ``w * n.to(dtype)``) and Gemma 3 ("-gemma": 8 / 4 heads of 256 as Gemma3TextConfig's defaults
  and Gemma-3-4B, ``(1 + w)`` in fp32, offset 1).
* ``rope_partial``: ``apply_rope`` (out of place, separate q and k) rotating the first 96 of 128 channels
  (Phi-4-mini: 24 / 8 heads, ``partial_rotary_factor`` 0.75), against transformers' Phi-3 code (rotate the first
  R channels, concatenate the others).
* ``rope_partial_inplace``: the same rotation by ``apply_rope_qkv_`` in place on the packed projection, what
  the model runs (``reuse_grad=True``, as the block: the backward too rotates in place); same baselines.
* ``rope_interleaved`` / ``rope_interleaved_inplace``: GLM-4's interleaved pairs (2i, 2i + 1) on the first 64
  of 128 channels (GLM-4-9B, Glm4Config's defaults: 32 / 2 heads, ``partial_rotary_factor`` 0.5), against
  transformers' GLM-4 code (``cos[..., :R/2].repeat_interleave(2)``, rotate the even/odd pairs).

cos / sin are per token (B, S, R) in the model dtype, as transformers passes them and as
benchmarks/kernel_cases/rope.py does. B x S: 4 x 2048 (the end-to-end benchmarks' batch 4 at seq 2048) and
4 x 8192.

Timing an in-place op. The timing (:func:`benchmarks.common.compare_impls`) calls each implementation many times
on the same inputs, and an in-place op cannot take a leaf that requires grad. Ours therefore receives the leaf
through :class:`_Alias`, an autograd Function whose forward returns ``qkv.detach()`` (the same storage, no kernel)
and whose backward passes the gradient through (no kernel): every call then modifies the one buffer in place and
gets a fresh, short graph, so the kernel time is the op's alone (the wall time includes one extra Python-level
Function call). Repeated calls rotate (and normalise) the buffer again, and with ``reuse_grad`` the backward
rewrites the timing's output gradient each call; the kernels' time does not depend on the values. The baselines
take separate contiguous q and k, as transformers' projections produce them, so their backward is timed with
respect to those tensors (no slicing or concatenation counted).

Bytes counted, the fewest each pass must move for the math (T = B*S tokens, s bytes per element, cos and sin
read once per token: 2*T*R*s; the (D,) norm weights and their gradients are negligible and not counted):

* ``qk_norm_rope``: forward 3*T*(Hq + Hkv)*D*s: read the q and k heads, write them normalised and rotated,
  and write them once more as read, for the backward. That last write is what working in place costs: the
  output overwrites the input, which the norm's backward needs (an out-of-place baseline keeps its input alive
  instead, at the price of one more (T, Hq + Hkv, D) buffer).
  The v heads are not touched. Backward 3*T*(Hq + Hkv)*D*s (read the output gradient and the saved input of
  the q and k heads, write their input gradient over the output gradient; the v heads' gradient is already
  in place). Not counted: the fp32 partial weight gradients (one (2, D) row per program) and their sum.
* ``rope_partial``, ``rope_interleaved`` (out of place): forward and backward 2*T*(Hq + Hkv)*D*s (whole heads
  read and written: the channels past R are copied).
* ``*_inplace``: forward and backward 2*T*(Hq + Hkv)*R*s (in place only the R rotary channels of the q and k
  heads change; with ``reuse_grad`` the backward rotates the incoming gradient's back where they are).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from benchmarks.common import compare_impls
from kernels.rope import apply_qk_norm_rope_qkv_, apply_rope, apply_rope_qkv_

EPS = 1e-6
SHAPES = [(4, 2048), (4, 8192)]


@dataclass(frozen=True)
class Case:
    """One benchmarked configuration: row name, head layout and which rotation / norm."""

    op: str  # the rows' op name
    heads: tuple[int, int, int]  # (Hq, Hkv, D)
    rotary: int  # R, the rotary channels per head (R <= D)
    theta: float  # rope base of the cos / sin tables (the values do not change the timing)
    inplace: bool  # ours runs in place on the packed projection (apply_rope_qkv_ / apply_qk_norm_rope_qkv_)
    interleaved: bool = False  # GLM pairs (2i, 2i + 1) instead of rotate-half
    norm: str | None = None  # q/k head norm before the rotation: "llama" (Qwen3) or "gemma" (Gemma 3)
    tag: str = ""  # suffix of the shape label

    def shape(self, batch: int, seq: int) -> str:
        hq, hkv, d = self.heads
        rot = f"-r{self.rotary}" if self.rotary != d else ""
        return f"{batch}x{seq}x{hq}/{hkv}x{d}{rot}{self.tag}"

    def nbytes(self, tokens: int, itemsize: int) -> tuple[int, int]:
        """(forward, backward) bytes counted, as the module docstring states."""
        hq, hkv, d = self.heads
        qk = tokens * (hq + hkv) * itemsize  # one byte count per channel of the q and k heads
        tables = 2 * tokens * self.rotary * itemsize
        if self.norm:
            return 3 * qk * d + tables, 3 * qk * d + tables
        if self.inplace:
            return 2 * qk * self.rotary + tables, 2 * qk * self.rotary + tables
        return 2 * qk * d + tables, 2 * qk * d + tables


CASES = [
    Case("qk_norm_rope", (16, 8, 128), 128, 1_000_000.0, inplace=True, norm="llama"),  # Qwen3-1.7B
    Case("qk_norm_rope", (8, 4, 256), 256, 1_000_000.0, inplace=True, norm="gemma", tag="-gemma"),  # Gemma 3
    Case("rope_partial", (24, 8, 128), 96, 10_000.0, inplace=False),  # Phi-4-mini
    Case("rope_partial_inplace", (24, 8, 128), 96, 10_000.0, inplace=True),
    Case("rope_interleaved", (32, 2, 128), 64, 10_000.0, inplace=False, interleaved=True),  # GLM-4-9B
    Case("rope_interleaved_inplace", (32, 2, 128), 64, 10_000.0, inplace=True, interleaved=True),
]


# ------------------------------------------------------------------------------------ baselines
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: (x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """GLM's rotation of interleaved pairs: (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """transformers' RoPE of x (B, S, H, D) with per-token tables (B, S, R), R <= D: the first R channels
    rotate in the tables' dtype, the others are concatenated back unchanged (Phi-3 / GLM-4 partial rotary)."""
    r = cos.shape[-1]
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    if interleaved:
        c = c[..., : r // 2].repeat_interleave(2, dim=-1)
        s = s[..., : r // 2].repeat_interleave(2, dim=-1)
        rot = x[..., :r] * c + _rotate_pairs(x[..., :r]) * s
    else:
        rot = x[..., :r] * c + _rotate_half(x[..., :r]) * s
    return rot if r == x.shape[-1] else torch.cat((rot, x[..., r:]), dim=-1)


def _hf_norm_llama(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Qwen3RMSNorm: statistics in fp32, the normalised head rounded to x's dtype, then times the weight."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _hf_norm_gemma(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Gemma3RMSNorm: everything in fp32 with the weight as (1 + w), rounded to x's dtype once."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + w.float())).to(x.dtype)


def eager_qk_norm_rope_llama(q, k, cos, sin, wq, wk):
    """Qwen3's attention up to the rotation: q_norm / k_norm per head, then RoPE; new (q, k)."""
    return _hf_rope(_hf_norm_llama(q, wq), cos, sin), _hf_rope(_hf_norm_llama(k, wk), cos, sin)


def eager_qk_norm_rope_gemma(q, k, cos, sin, wq, wk):
    """Gemma 3's attention up to the rotation: (1 + w) q_norm / k_norm per head, then RoPE; new (q, k)."""
    return _hf_rope(_hf_norm_gemma(q, wq), cos, sin), _hf_rope(_hf_norm_gemma(k, wk), cos, sin)


def eager_rope(q, k, cos, sin):
    """Phi-3's apply_rotary_pos_emb: rotate-half on the first cos.shape[-1] channels; new (q, k)."""
    return _hf_rope(q, cos, sin), _hf_rope(k, cos, sin)


def eager_rope_interleaved(q, k, cos, sin):
    """GLM-4's apply_rotary_pos_emb: interleaved pairs on the first cos.shape[-1] channels; new (q, k)."""
    return _hf_rope(q, cos, sin, True), _hf_rope(k, cos, sin, True)


def eager_fn(case: Case):
    """The eager baseline of a case (one function per math, so torch.compile's cache is shared by cases)."""
    if case.norm:
        return eager_qk_norm_rope_llama if case.norm == "llama" else eager_qk_norm_rope_gemma
    return eager_rope_interleaved if case.interleaved else eager_rope


# ------------------------------------------------------------------------------------------ ours
class _Alias(torch.autograd.Function):
    """``qkv.detach()`` with the gradient passed through: the same storage as a fresh non-leaf, so an in-place
    op can run on a leaf that requires grad, call after call, without a copy kernel (see the module docstring)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor) -> torch.Tensor:
        return qkv.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def ours_fn(case: Case):
    """Our op for a case, taking the inputs :func:`make_inputs` gives it (packed qkv for the in-place ops)."""
    hq, hkv, _ = case.heads
    if case.norm:
        offset, casting = (1.0, "gemma") if case.norm == "gemma" else (0.0, "llama")

        def qk_norm_rope(qkv, cos, sin, wq, wk):
            return apply_qk_norm_rope_qkv_(_Alias.apply(qkv), cos, sin, hq, hkv, wq, wk, EPS, offset, casting,
                                           reuse_grad=True)

        return qk_norm_rope
    if case.inplace:
        def rope_inplace(qkv, cos, sin):
            return apply_rope_qkv_(_Alias.apply(qkv), cos, sin, hq, hkv, case.interleaved, reuse_grad=True)

        return rope_inplace
    return functools.partial(apply_rope, interleaved=case.interleaved)


# ---------------------------------------------------------------------------------------- inputs
def cos_sin(batch: int, seq: int, rotary: int, theta: float, dtype: torch.dtype, device: str
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (B, S, R) tables as transformers builds them (``cat(freqs, freqs)``) in ``dtype``."""
    inv = 1.0 / theta ** (torch.arange(0, rotary, 2, device=device, dtype=torch.float32) / rotary)
    emb = torch.arange(seq, device=device, dtype=torch.float32).expand(batch, seq)[..., None] * inv
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos().to(dtype).contiguous(), emb.sin().to(dtype).contiguous()


def make_inputs(case: Case, batch: int, seq: int, dtype: torch.dtype, device: str, packed: bool,
                seed: int = 0) -> list[torch.Tensor]:
    """Inputs of one call: ``[qkv, cos, sin]`` (packed, for our in-place ops) or ``[q, k, cos, sin]`` (separate
    contiguous heads, for the baselines and ``apply_rope``), plus ``[wq, wk]`` (D,) with a head norm. The same
    ``seed`` gives the same values either way: q and k are copies of the packed buffer's heads."""
    hq, hkv, d = case.heads
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(batch, seq, (hq + 2 * hkv) * d, device=device, dtype=dtype, generator=g)
    if packed:
        tensors = [qkv.requires_grad_()]
    else:
        heads = qkv.view(batch, seq, hq + 2 * hkv, d)
        tensors = [heads[:, :, :hq].contiguous().requires_grad_(),
                   heads[:, :, hq:hq + hkv].contiguous().requires_grad_()]
    tensors += list(cos_sin(batch, seq, case.rotary, case.theta, dtype, device))
    if case.norm:
        w = 0.1 * torch.randn(2, d, device=device, dtype=torch.float32, generator=g)
        w = (w if case.norm == "gemma" else w + 1.0).to(dtype)  # Gemma's weight scales as (1 + w): near 0
        tensors += [w[0].clone().requires_grad_(), w[1].clone().requires_grad_()]
    return tensors


# ------------------------------------------------------------------------------------------- run
def run(copy_gbs: float, dtype=torch.bfloat16) -> list[dict]:
    rows = []
    compiled = {}  # one torch.compile per eager function, shared by the cases (and shapes) that use it
    for case in CASES:
        base = eager_fn(case)
        comp = compiled.setdefault(base, torch.compile(base))
        for batch, seq in SHAPES:
            fwd, bwd = case.nbytes(batch * seq, dtype.itemsize)
            shape = case.shape(batch, seq)
            separate = functools.partial(make_inputs, case, batch, seq, dtype, "cuda", False)
            if case.inplace:  # ours on the packed buffer, the baselines on separate q and k
                rows += compare_impls(case.op, shape, dtype, {"ligermodels": ours_fn(case)},
                                      functools.partial(make_inputs, case, batch, seq, dtype, "cuda", True),
                                      fwd, bwd, copy_gbs)
                rows += compare_impls(case.op, shape, dtype, {"eager": base, "compile": comp}, separate, fwd, bwd,
                                      copy_gbs)
            else:
                rows += compare_impls(case.op, shape, dtype, {"ligermodels": ours_fn(case), "eager": base,
                                                              "compile": comp}, separate, fwd, bwd, copy_gbs)
    return rows
