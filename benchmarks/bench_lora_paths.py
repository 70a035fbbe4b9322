"""LoRA adapters on one decoder layer's projections: the committed path against three alternatives.

What LoRA adds to a frozen projection ``out = x @ W.T`` (M tokens, K -> N, T targets of rank r, Tr = T*r) is
rank-r products that move (M, K) and (M, N) tensors: memory-bound work beside a compute-bound base GEMM.
This benchmark times, at a model's shapes, each projection's forward and backward GEMM work (the norm, GLU and
attention kernels around them left out):

* ``base``: the frozen projection alone (forward GEMM and input-gradient GEMM): the floor LoRA adds to.
* ``committed``: :mod:`kernels.low_rank` as the model runs it (fp32 A/B masters; the base GEMM's output read
  back as the low-rank GEMM's C operand; backward dz, dB, the (M, K) part dz @ A as C, dA).
* ``packed-cols`` / ``packed-rows``: the base weight stored in an (N + Tr, K + Tr) buffer whose pad columns
  hold ``scale * B`` and pad rows ``A`` (bf16), so forward is one GEMM over ``[x | x @ A.T]`` (K + Tr), and
  backward either takes dz from the input-gradient GEMM's extra columns (``cols``: ``[dx | dz] = d2 @ buf[:N]``,
  then ``dx += dz @ A``) or folds ``dz @ A`` into it (``rows``: ``[d2 | dz] @ buf[:, :K]``).
* ``onepass``: dz and dB from one pass over the output gradient (a Triton prototype below: fp32 partials
  per row block and column group, summed after) instead of cuBLAS's two skinny GEMMs.
* ``side``: the committed backward with the weight gradients (dB, dA: off the critical path) on a side
  stream beside the input-gradient GEMM; ``side-carveout8``: the same with cuBLAS limited to all SMs but 8.

Wall time (median, ``triton.testing.do_bench``), two rounds over all variants: at these sizes the GPU's
clock under load moves timings by a few percent, which the second round shows. Writes
``lora-paths-<gpu>-<date>.json``.

    python -m benchmarks.bench_lora_paths [--model qwen2-7b:4] [--rank 16] [--out DIR]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from benchmarks.common import bench_ms, environment, projections, write_results
from kernels.low_rank import LowRank, low_rank_backward, low_rank_grad_a, low_rank_input_grad, low_rank_linear


@triton.jit
def _onepass_kernel(D, Z, BB, DZP, DBBP, M, N, sd_m, sz_m, TR: tl.constexpr, TRP: tl.constexpr,
                    ROW_TILES: tl.constexpr, COL_TILES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Program (row block, column group): for each column tile, dbb.T (BN, TRP) over the block's rows in
    registers; dz's partial over the group's columns read-modify-written in the group's fp32 slab."""
    pid_r = tl.program_id(0)
    pid_g = tl.program_id(1)
    offs_t = tl.arange(0, TRP)
    t_ok = offs_t < TR
    for jj in range(COL_TILES):
        cols = (pid_g * COL_TILES + jj) * BN + tl.arange(0, BN)
        c_ok = cols < N
        bbt = tl.load(BB + offs_t[None, :] * N + cols[:, None], mask=c_ok[:, None] & t_ok[None, :], other=0.0)
        dbbt = tl.zeros((BN, TRP), dtype=tl.float32)
        for ii in range(ROW_TILES):
            rows = (pid_r * ROW_TILES + ii) * BM + tl.arange(0, BM)
            r_ok = rows < M
            d = tl.load(D + rows[:, None] * sd_m + cols[None, :], mask=r_ok[:, None] & c_ok[None, :], other=0.0)
            z = tl.load(Z + rows[:, None] * sz_m + offs_t[None, :], mask=r_ok[:, None] & t_ok[None, :], other=0.0)
            dbbt = tl.dot(tl.trans(d), z, dbbt)
            part = tl.dot(d, bbt)
            p_ptr = DZP + pid_g * M * TRP + rows[:, None] * TRP + offs_t[None, :]
            if jj > 0:
                part += tl.load(p_ptr, mask=r_ok[:, None], other=0.0)
            tl.store(p_ptr, part, mask=r_ok[:, None])
        tl.store(DBBP + pid_r * N * TRP + cols[:, None] * TRP + offs_t[None, :], dbbt, mask=c_ok[:, None])


def onepass_dz_dbb(d2: torch.Tensor, z: torch.Tensor, bb: torch.Tensor, scale: float, bm: int = 128,
                   bn: int = 128, row_tiles: int = 4, col_tiles: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(dz = scale * d2 @ bb.T (M, Tr), dbb = z.T @ d2 (Tr, N) fp32) from one pass over d2 (M, N)."""
    m, n = d2.shape
    tr = z.shape[1]
    trp = max(16, triton.next_power_of_2(tr))
    p, g = triton.cdiv(m, bm * row_tiles), triton.cdiv(triton.cdiv(n, bn), col_tiles)
    dzp = torch.empty(g, m, trp, device=d2.device, dtype=torch.float32)
    dbbp = torch.empty(p, n, trp, device=d2.device, dtype=torch.float32)
    _onepass_kernel[(p, g)](d2, z, bb, dzp, dbbp, m, n, d2.stride(0), z.stride(0), tr, trp, row_tiles, col_tiles,
                            bm, bn, num_warps=8, num_stages=3)
    return (dzp.sum(0)[:, :tr] * scale).to(d2.dtype), dbbp.sum(0)[:, :tr].t()


def projection_case(m: int, k: int, parts: list[int], r: int, side: torch.cuda.Stream) -> dict:
    """{variant: (forward callable, backward callable)} of one projection with one adapter per part."""
    dev, bf = "cuda", torch.bfloat16
    n, t = sum(parts), len(parts)
    tr, scale = t * r, 2.0
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, k, device=dev, dtype=bf, generator=g)
    w = torch.randn(n, k, device=dev, dtype=bf, generator=g) / k**0.5
    d2 = torch.randn(m, n, device=dev, dtype=bf, generator=g)
    bounds = [sum(parts[:i]) for i in range(t + 1)]
    lr = LowRank(torch.randn(tr, k, device=dev, generator=g) / k**0.5,
                 torch.randn(n, r, device=dev, generator=g) * 0.02,
                 tuple(zip(bounds, bounds[1:], strict=False)), scale)
    _, z, bb = low_rank_linear(x, w, None, lr, None)

    def committed_bwd(carveout: int | None = None):
        if carveout is None:
            dz, db = low_rank_backward(d2, lr, z, bb, True)
            return low_rank_input_grad(d2, w, dz, lr, None), db, low_rank_grad_a(dz, x, lr, None)
        dz, _ = low_rank_backward(d2, lr, z, bb, False)
        dbb = torch.empty(bb.shape, device=dev, dtype=bf)  # allocated on the main stream, written on the side
        da = torch.empty(lr.a.shape, device=dev, dtype=bf)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.mm(z.t(), d2, out=dbb)
            torch.mm(dz.t(), x, out=da)
        if carveout:
            torch._C._set_sm_carveout_experimental(carveout)
        dx = low_rank_input_grad(d2, w, dz, lr, None)
        if carveout:
            torch._C._set_sm_carveout_experimental(None)
        torch.cuda.current_stream().wait_stream(side)
        return dx, dbb, da

    # packed: W, scale * block B (pad columns) and A (pad rows) in one bf16 buffer
    buf = torch.zeros(n + tr, k + tr, device=dev, dtype=bf)
    buf[:n, :k] = w
    buf[:n, k:] = (bb * scale).t()
    buf[n:, :k] = lr.a.to(bf)
    xa = torch.empty(m, k + tr, device=dev, dtype=bf)
    xa[:, :k] = x
    d2a = torch.empty(m, n + tr, device=dev, dtype=bf)

    def packed_fwd():
        xa[:, k:].copy_(x @ buf[n:, :k].t())  # z' = x @ A.T into the pad columns (an out= view measured slower)
        return xa @ buf[:n].t()

    def packed_bwd_cols():
        o = d2 @ buf[:n]  # [dx | dz]
        dx, dz = o[:, :k], o[:, k:]
        dx.addmm_(dz, buf[n:, :k])
        return dx, z.t() @ d2, dz.t() @ x

    def packed_bwd_rows():
        d2a[:, :n].copy_(d2)
        d2a[:, n:].copy_(d2 @ buf[:n, k:])  # dz into the pad columns
        return d2a @ buf[:, :k], z.t() @ d2, d2a[:, n:].t() @ x

    def onepass_bwd():
        dz, dbb = onepass_dz_dbb(d2, z, bb, scale)
        return low_rank_input_grad(d2, w, dz, lr, None), dbb, low_rank_grad_a(dz, x, lr, None)

    def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
        return ((got.float() - ref.float()).norm() / ref.float().norm()).item()

    # the variants agree with the committed path: forward output, input gradient, dz
    dx_ref = committed_bwd()[0]
    errs = {"packed_fwd": rel(packed_fwd(), low_rank_linear(x, w, None, lr, None)[0]),
            "packed_cols_dx": rel(packed_bwd_cols()[0], dx_ref), "packed_rows_dx": rel(packed_bwd_rows()[0], dx_ref),
            "side_dx": rel(committed_bwd(8)[0], dx_ref),
            "onepass_dz": rel(onepass_dz_dbb(d2, z, bb, scale)[0], low_rank_backward(d2, lr, z, bb, False)[0])}
    return {"errors": errs, "variants": {
        "base": (lambda: F.linear(x, w), lambda: d2 @ w),
        "committed": (lambda: low_rank_linear(x, w, None, lr, None), committed_bwd),
        "packed-cols": (packed_fwd, packed_bwd_cols),
        "packed-rows": (packed_fwd, packed_bwd_rows),
        "onepass": (lambda: low_rank_linear(x, w, None, lr, None), onepass_bwd),
        "side": (lambda: low_rank_linear(x, w, None, lr, None), lambda: committed_bwd(0)),
        "side-carveout8": (lambda: low_rank_linear(x, w, None, lr, None), lambda: committed_bwd(8)),
    }}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2-7b:4", help="model:batch (seq 2048), a model of benchmarks.common.MODELS")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    args = ap.parse_args()
    model, batch = args.model.split(":")
    m = int(batch) * 2048
    side = torch.cuda.Stream()
    rows, errors = [], {}
    for proj, (k, parts) in projections(model).items():
        case = projection_case(m, k, parts, args.rank, side)
        errors[proj] = {key: float(f"{v:.2e}") for key, v in case["errors"].items()}
        for rnd in range(args.rounds):
            for variant, (fwd, bwd) in case["variants"].items():
                row = {"proj": proj, "m": m, "k": k, "n": sum(parts), "targets": len(parts), "round": rnd,
                       "variant": variant, "fwd_ms": round(bench_ms(fwd), 4), "bwd_ms": round(bench_ms(bwd), 4)}
                rows.append(row)
                print(f"{proj:>8} round {rnd} {variant:>15}: fwd {row['fwd_ms']:.4f} bwd {row['bwd_ms']:.4f} ms",
                      flush=True)
        del case
        torch.cuda.empty_cache()
    layer = {}
    for rnd in range(args.rounds):
        got = {r["variant"]: [0.0, 0.0] for r in rows}
        for r in rows:
            if r["round"] == rnd:
                got[r["variant"]][0] += r["fwd_ms"]
                got[r["variant"]][1] += r["bwd_ms"]
        base = sum(got["base"])
        layer[f"round {rnd}"] = {v: {"fwd_ms": round(f, 4), "bwd_ms": round(b, 4),
                                     "adapter_ms": round(f + b - base, 4)} for v, (f, b) in got.items()}
    for rnd, v in layer.items():
        print(rnd, {name: x["adapter_ms"] for name, x in v.items()})
    env = environment()
    path = write_results(f"lora-paths-{env['gpu'].replace(' ', '_')}-{env['date']}",
                         {"benchmark": __doc__.splitlines()[0], "model": model, "batch": int(batch), "seq": 2048,
                          "rank": args.rank, "timing": "wall (triton.testing.do_bench median)",
                          "errors_vs_committed": errors, "layer_sums": layer, "rows": rows}, args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
