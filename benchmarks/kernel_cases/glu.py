"""Benchmark cases for swiglu / geglu: ours vs eager PyTorch vs torch.compile of the same math."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common import compare_impls
from kernels import geglu, swiglu


def _eager_swiglu(g, u):
    return F.silu(g) * u


def _eager_geglu(g, u):
    return F.gelu(g, approximate="tanh") * u


def run(copy_gbs: float, dtype=torch.bfloat16) -> list[dict]:
    rows = []
    for tokens, inter in [(4096, 8192), (16384, 8192), (16384, 14336), (32768, 5632), (8192, 8960)]:
        def make(tokens=tokens, inter=inter):
            return [torch.randn(tokens, inter, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2)]

        s = dtype.itemsize
        for name, ours, eager in [("swiglu", swiglu, _eager_swiglu), ("geglu", geglu, _eager_geglu)]:
            rows += compare_impls(name, f"{tokens}x{inter}", dtype,
                                  {"ligermodels": ours, "eager": eager, "compile": torch.compile(eager)},
                                  make, 3 * tokens * inter * s, 5 * tokens * inter * s, copy_gbs)
    return rows
