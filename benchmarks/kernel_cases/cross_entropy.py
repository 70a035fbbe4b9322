"""Benchmark cases for ``cross_entropy`` over (N, V) bf16 logits: ours vs eager vs torch.compile.

The baseline is the Hugging Face recipe, ``F.cross_entropy(logits.float(), target)``, eager and
compiled. Bytes counted (the fewest the op must move): forward reads the logits once (N*V*s);
backward reads the logits and writes d logits (2*N*V*s). Targets have 10% ``ignore_index``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common import compare_impls
from kernels.cross_entropy import cross_entropy


def _eager(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), target)


def _ours(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return cross_entropy(logits, target)


def run(copy_gbs: float, dtype=torch.bfloat16) -> list[dict]:
    rows = []
    compiled = torch.compile(_eager)
    for tokens in (4096, 16384):
        for vocab in (128256, 152064):
            def make(tokens=tokens, vocab=vocab):
                logits = torch.randn(tokens, vocab, device="cuda", dtype=dtype).mul_(2.0).requires_grad_()
                target = torch.randint(0, vocab, (tokens,), device="cuda")
                target[::10] = -100
                return [logits, target]

            nbytes = tokens * vocab * dtype.itemsize
            rows += compare_impls("cross_entropy", f"{tokens}x{vocab}", dtype,
                                  {"ligermodels": _ours, "eager": _eager, "compile": compiled},
                                  make, nbytes, 2 * nbytes, copy_gbs)
    return rows
