"""Benchmark cases for rms_norm / fused_add_rms_norm: ours vs eager PyTorch vs torch.compile of the same math.

The baselines are the HF Llama module's math (fp32 statistics, ``weight * n.to(bf16)``); the fused
baseline is HF's ``h = residual + x`` followed by that norm.
"""

from __future__ import annotations

import functools

import torch

from benchmarks.common import compare_impls
from kernels.rms_norm import fused_add_rms_norm, rms_norm

EPS = 1e-6


def _eager_rms_norm(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _eager_fused_add_rms_norm(x, r, w):
    h = x + r
    return _eager_rms_norm(h, w), h


def _ours_rms_norm(x, w):
    return rms_norm(x, w, EPS)


def _ours_fused_add_rms_norm(x, r, w):
    return fused_add_rms_norm(x, r, w, EPS)


def run(copy_gbs: float, dtype=torch.bfloat16) -> list[dict]:
    rows = []
    s = dtype.itemsize
    for tokens in (4096, 16384, 32768):
        for hidden in (2048, 4096, 8192):
            def make(n_act, tokens=tokens, hidden=hidden):
                def t(*dims):
                    return torch.randn(*dims, device="cuda", dtype=dtype, requires_grad=True)

                return [t(tokens, hidden) for _ in range(n_act)] + [t(hidden)]

            act = tokens * hidden * s
            weight = hidden * s  # read by both passes; dw written by backward. The 4 bytes/row of rstd
            # that ours saves (the baselines recompute it) are not counted.
            shape = f"{tokens}x{hidden}"
            rows += compare_impls(
                "rms_norm", shape, dtype,
                {"ligermodels": _ours_rms_norm, "eager": _eager_rms_norm, "compile": torch.compile(_eager_rms_norm)},
                functools.partial(make, 1), 2 * act + weight, 3 * act + 2 * weight, copy_gbs)
            rows += compare_impls(
                "fused_add_rms_norm", shape, dtype,
                {"ligermodels": _ours_fused_add_rms_norm, "eager": _eager_fused_add_rms_norm,
                 "compile": torch.compile(_eager_fused_add_rms_norm)},
                functools.partial(make, 2), 4 * act + weight, 4 * act + 2 * weight, copy_gbs)
    return rows
