"""The benchmark definitions that can be checked without a GPU: the eager baselines of the rope-variant kernel
cases compute what our ops compute, and the README's tables read the newest results file by its recorded date."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from benchmarks import kernels_rope_variants as rv
from benchmarks import report


# --------------------------------------------------------------------------- rope-variant kernel cases
@pytest.mark.parametrize("case", rv.CASES, ids=lambda c: c.op + c.tag)
def test_rope_variant_baselines_compute_what_our_op_computes(case):
    """On each case's head_dim, rotary width, pairing and norm (fewer heads, a few tokens, fp32, kernels in
    Triton's interpreter on CPU): the eager baseline's q and k and their gradients equal ours, our in-place op
    leaves the v heads and passes their gradient through, through the same alias the benchmark times."""
    case = dataclasses.replace(case, heads=(4, 2, case.heads[2]))
    hq, hkv, d = case.heads
    batch, seq = 2, 5
    packed = case.inplace
    ours_in = rv.make_inputs(case, batch, seq, torch.float32, "cpu", packed, seed=3)
    base_in = rv.make_inputs(case, batch, seq, torch.float32, "cpu", False, seed=3)
    eager_q, eager_k = rv.eager_fn(case)(*base_in)
    g = torch.Generator().manual_seed(4)
    dq, dk = torch.randn(eager_q.shape, generator=g), torch.randn(eager_k.shape, generator=g)
    weights = base_in[4:]
    eager_grads = torch.autograd.grad((eager_q, eager_k), [base_in[0], base_in[1], *weights], (dq, dk))

    if packed:
        v_before = ours_in[0].detach().view(batch, seq, hq + 2 * hkv, d)[:, :, hq + hkv:].clone()
        out = rv.ours_fn(case)(*ours_in)
        assert out.data_ptr() == ours_in[0].data_ptr()  # in place, on the leaf's storage
        heads = out.view(batch, seq, hq + 2 * hkv, d)
        q, k, v = heads[:, :, :hq], heads[:, :, hq:hq + hkv], heads[:, :, hq + hkv:]
        dv = torch.randn(v.shape, generator=g)
        grads = torch.autograd.grad(out, [ours_in[0], *ours_in[3:]], torch.cat((dq, dk, dv), dim=2).flatten(2))
        dheads = grads[0].view(batch, seq, hq + 2 * hkv, d)
        torch.testing.assert_close(v, v_before, rtol=0, atol=0)
        torch.testing.assert_close(dheads[:, :, hq + hkv:], dv, rtol=0, atol=0)
        ours_grads = (dheads[:, :, :hq], dheads[:, :, hq:hq + hkv], *grads[1:])
    else:
        q, k = rv.ours_fn(case)(*ours_in)
        ours_grads = torch.autograd.grad((q, k), ours_in[:2], (dq, dk))
    torch.testing.assert_close(q, eager_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, eager_k, rtol=1e-5, atol=1e-5)
    for ours_g, eager_g in zip(ours_grads, eager_grads, strict=True):
        torch.testing.assert_close(ours_g, eager_g, rtol=1e-4, atol=1e-4)


def test_rope_variant_bytes_follow_the_stated_count():
    """The bytes the harness divides by: Qwen3-1.7B q/k norm + RoPE at 4 x 2048 tokens in bf16 (24 q/k heads of
    128: read + write forward, 3x backward, plus cos and sin), and the partial in-place rotation (96 channels)."""
    t, qk = 4 * 2048, 4 * 2048 * 24 * 128 * 2
    tables = 2 * t * 128 * 2
    assert rv.CASES[0].nbytes(t, 2) == (2 * qk + tables, 3 * qk + tables)
    partial = next(c for c in rv.CASES if c.op == "rope_partial_inplace")
    qk = t * (24 + 8) * 2
    assert partial.nbytes(t, 2) == (2 * qk * 96 + 2 * t * 96 * 2, 2 * qk * 128 + 2 * t * 96 * 2)
    assert partial.shape(4, 2048) == "4x2048x24/8x128-r96"


# --------------------------------------------------------------------------------------- report
def test_report_reads_the_newest_results_by_date_and_shows_new_ops(tmp_path):
    """Files of equal modification time (a checkout) are ordered by their recorded date, then name; the kernel
    table has a line per (op, pass) for the new ops, the baselines measured in a separate call included."""
    def write(name, date, gpu, rows):
        (tmp_path / name).write_text(json.dumps({"gpu": gpu, "date": date, "rows": rows}))

    write("kernels-H100-2026-11-30.json", "2026-11-30", "H100", [])
    write("kernels-H100-2026-12-01.json", "2026-12-01", "H100", [])
    write("kernels-H100-2026-12-01b.json", "2026-12-01", "H100", [])
    write("kernels-H200-2026-12-02.json", "2026-12-02", "H200", [])
    assert report.newest_results("kernels", results=str(tmp_path)).endswith("H200-2026-12-02.json")
    assert report.newest_results("kernels", gpu="H100", results=str(tmp_path)).endswith("H100-2026-12-01b.json")
    assert report.newest_results("kernels", gpu="A100", results=str(tmp_path)) is None

    def row(op, impl, pas, ms):
        return {"op": op, "shape": "4x2048x16/8x128", "impl": impl, "pass": pas, "ms": ms, "wall_ms": ms,
                "timing": "cuda-kernels", "gbs": 100.0 / ms, "frac_copy_bw": 0.03 / ms, "frac_same_size_copy": 0.9}

    rows = [row(op, impl, pas, ms) for op in ("qk_norm_rope", "rope_partial_inplace") for pas in ("fwd", "bwd")
            for impl, ms in (("ligermodels", 0.04), ("eager", 0.4), ("compile", 0.05))]
    table = report.kernels_table({"gpu": "H100", "torch": "2.13", "triton": "3.6", "date": "2026-12-01",
                                  "_file": "x.json", "copy_gbs": 3000.0, "rows": rows})
    for op in ("qk_norm_rope", "rope_partial_inplace"):
        for pas in ("fwd", "bwd"):
            assert f"| {op} | {pas} | 2500 | 75% | 90% | 60% | 10.00x | 1.25x | 0.040 |" in table
