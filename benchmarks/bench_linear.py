"""Projection GEMMs of a decoder layer: one fused q/k/v or gate+up GEMM against one GEMM per part.

GEMMs are 70-82% of a training step (benchmarks/results/profiles/), and cuBLAS picks its kernel by
shape: a fused gate+up projection (N = 2*I) can get a different, slower kernel than two GEMMs of
N = I. This benchmark times, at the token counts of the end-to-end shapes, the three GEMMs of each
projection exactly as ligermodels issues them (``kernels.norm_linear`` / ``kernels.glu``):

* ``fwd``:   out = x @ W.T                                   (M, K) x (N, K)^T
* ``dgrad``: dx  = dout @ W                                  (M, N) x (N, K)
* ``wgrad``: dW  = dout.T @ x                                (N, M) x (M, K)

``fused`` is one GEMM over the whole (N, K) weight; ``split`` is one GEMM per part (q, k, v or
gate, up) on row slices of the same weight, the parts' outputs in separate buffers, dgrad summed
by ``addmm`` (beta = 1) and wgrad written into row slices of one (N, K) gradient -- what a split
implementation would run without copies. Kernel time (L2 flushed), TFLOP/s against the square
bf16 matmul rate measured in the same run. Writes ``linear-<gpu>-<date>.json``.

    python -m benchmarks.bench_linear [--models qwen2-7b:4 gemma-2b:4 ...]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import environment, kernel_time, matmul_tflops, projections, write_results


def gemm_calls(m: int, k: int, parts: list[int], split: bool):
    """{pass: zero-argument callable} of the three GEMMs, fused (one N) or split (one GEMM per part)."""
    dev, dt = "cuda", torch.bfloat16
    n = sum(parts)
    x = torch.randn(m, k, device=dev, dtype=dt)
    w = torch.randn(n, k, device=dev, dtype=dt) / k**0.5
    dw = torch.empty(n, k, device=dev, dtype=dt)
    if not split:
        dout = torch.randn(m, n, device=dev, dtype=dt)
        return {"fwd": lambda: F.linear(x, w), "dgrad": lambda: dout.matmul(w),
                "wgrad": lambda: torch.mm(dout.t(), x, out=dw)}
    bounds = [sum(parts[:i]) for i in range(len(parts) + 1)]
    ws = [w[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    dws = [dw[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    douts = [torch.randn(m, p, device=dev, dtype=dt) for p in parts]

    def dgrad():
        dx = douts[0].matmul(ws[0])
        for d, wi in zip(douts[1:], ws[1:], strict=True):
            dx.addmm_(d, wi)
        return dx

    def wgrad():
        for d, dwi in zip(douts, dws, strict=True):
            torch.mm(d.t(), x, out=dwi)

    return {"fwd": lambda: [F.linear(x, wi) for wi in ws], "dgrad": dgrad, "wgrad": wgrad}


def run(models: list[tuple[str, int]], seq: int = 2048) -> list[dict]:
    rows = []
    for model, batch in models:
        m = batch * seq
        for proj, (k, parts) in projections(model).items():
            for layout in (("fused", "split") if len(parts) > 1 else ("fused",)):
                calls = gemm_calls(m, k, parts, layout == "split")
                for pas, fn in calls.items():
                    t = kernel_time(fn, reps=20)
                    flops = 2 * m * k * sum(parts)
                    rows.append({"model": model, "batch": batch, "tokens": m, "proj": proj, "layout": layout,
                                 "pass": pas, "m": m, "n": sum(parts), "k": k, "parts": parts,
                                 "ms": round(t.ms, 4), "launches": t.launches,
                                 "tflops": round(flops / t.ms / 1e9, 1)})
                    r = rows[-1]
                    print(f"{model:>11} b{batch} {proj:>8} {layout:>6} {pas:>6} M={m} N={r['n']} K={k}: "
                          f"{r['ms']:8.3f} ms {r['tflops']:6.1f} TFLOP/s", flush=True)
                del calls
                torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen2-7b:4", "qwen2-1.5b:8", "llama-1b:8", "gemma-2b:4"],
                    help="model:batch pairs (seq 2048), models from benchmarks.common.MODELS")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    args = ap.parse_args()
    rate = matmul_tflops()
    print(f"square bf16 matmul: {rate:.0f} TFLOP/s")
    rows = run([(s.split(":")[0], int(s.split(":")[1])) for s in args.models])
    env = environment()
    path = write_results(f"linear-{env['gpu'].replace(' ', '_')}-{env['date']}",
                         {"matmul_tflops": round(rate, 1), "timing": "cuda-kernels", "rows": rows}, args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
