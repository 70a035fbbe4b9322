"""The benchmark definitions that can be checked without a GPU: the README's tables read the newest results file
by its recorded date."""

from __future__ import annotations

import json

from benchmarks import report


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
