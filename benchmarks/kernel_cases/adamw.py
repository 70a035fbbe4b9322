"""Benchmark case for the optimiser step: kernels.AdamW against torch.optim.AdamW (fused and foreach).

The parameters are a whole model's (the shapes of Qwen2-1.5B and Llama-3.2-1B, bf16 as in the
end-to-end benchmark), with random gradients; one row per (model, impl), pass "step". Bytes per
element: read p, g, exp_avg, exp_avg_sq and write p, exp_avg, exp_avg_sq (7 x the dtype's size).
"""

from __future__ import annotations

import torch

from benchmarks.common import timed_pass, timing_row
from kernels import AdamW

#: (hidden, intermediate, layers, q heads, kv heads, head_dim, vocab, qkv bias) of the models whose parameters are used.
MODELS = {"qwen2-1.5b": (1536, 8960, 28, 12, 2, 128, 151936, True),
          "llama-1b": (2048, 8192, 16, 32, 8, 64, 128256, False)}


def _shapes(hidden, inter, layers, heads, kv, head_dim, vocab, qkv_bias) -> list[tuple[int, ...]]:
    """Parameter shapes of one decoder (tied embeddings): embedding, per layer norms/qkv/o/gate_up/down, final norm."""
    qkv = (heads + 2 * kv) * head_dim
    layer = [(hidden,), (qkv, hidden), (hidden, heads * head_dim), (hidden,), (2 * inter, hidden), (hidden, inter)]
    layer += [(qkv,)] if qkv_bias else []
    return [(vocab, hidden)] + layer * layers + [(hidden,)]


def run(copy_gbs: float, dtype=torch.bfloat16) -> list[dict]:
    rows = []
    for name, spec in MODELS.items():
        shapes = _shapes(*spec)
        n = sum(torch.Size(s).numel() for s in shapes)
        impls = {"ligermodels": lambda ps: AdamW(ps, lr=1e-4),
                 "torch-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
                 "torch-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True)}
        for impl, make in impls.items():
            params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype)) for s in shapes]
            for p in params:
                p.grad = torch.randn_like(p)
            opt = make(params)
            base = {"op": "adamw", "shape": f"{name} ({n / 1e9:.2f}B params)",
                    "dtype": str(dtype).removeprefix("torch."), "impl": impl}
            rows.append(timing_row(base, "step", timed_pass(opt.step), 7 * n * dtype.itemsize, copy_gbs))
            del params, opt
            torch.cuda.empty_cache()
    return rows
