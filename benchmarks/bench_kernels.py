"""Kernel benchmark: every op forward and backward against eager PyTorch and torch.compile.

Run on a GPU:  python -m benchmarks.bench_kernels [--out DIR] [--only rms_norm rope] [--merge-from OLD.json|latest]
Writes ``kernels-<gpu>-<date>.json`` with the measured copy bandwidth and one row per
(op, shape, impl, pass): ``ms`` = kernel time (the summed device time of the op's kernels, memcpys and
memsets, host overhead excluded; ``timing: "cuda-kernels"``), ``wall_ms`` = wall time per call with the
CPU launching it, ``launches`` = device events per call, bytes counted, and GB/s and the fraction of
copy bandwidth from the kernel time. benchmarks/common.py's docstring says exactly what is measured and why.
Rows merged from older files (no ``timing`` key) carry wall time in ``ms``.
"""

from __future__ import annotations

import argparse
import importlib
import json

import torch

from benchmarks.common import copy_bandwidth_gbs, environment, newest_results, write_results

#: Case modules, ``benchmarks/kernel_cases/<family>.py``; ``rope_variants``: the q/k-norm + RoPE, partial and
#: interleaved rotary of the newer families.
FAMILIES = ["glu", "rms_norm", "rope", "rope_variants", "cross_entropy", "adamw"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--only", nargs="*", default=FAMILIES, help="families to run")
    ap.add_argument("--merge-from", help="an earlier results file: its rows for ops not rerun are kept "
                                         "(marked with their own date and copy bandwidth); 'latest': the newest "
                                         "kernels-*.json of this GPU in benchmarks/results, by its recorded date; "
                                         "its notes are carried over")
    args = ap.parse_args()
    gpu = environment()["gpu"]
    if args.merge_from == "latest":
        args.merge_from = newest_results("kernels", gpu=gpu)
        print(f"merging from {args.merge_from or 'nothing (no earlier kernels-*.json of ' + gpu + ')'}")
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s (kernel time)")
    rows = []
    for fam in args.only:
        try:
            mod = importlib.import_module(f"benchmarks.kernel_cases.{fam}")
        except ImportError as e:
            print(f"skip {fam}: {e}")
            continue
        fam_rows = mod.run(copy_gbs)
        rows += fam_rows
        for r in fam_rows:
            if "error" in r:
                print(f"{r['op']:>22} {r['shape']:>16} {r['impl']:>12} ERROR {r['error']}")
            else:
                print(f"{r['op']:>22} {r['shape']:>16} {r['impl']:>12} {r['pass']} {r['ms']:8.3f} ms "
                      f"{r['gbs']:7.0f} GB/s {100 * r['frac_copy_bw']:5.1f}%  wall {r['wall_ms']:8.3f} ms  "
                      f"{r['launches']:g} launches")
    extra = {}
    if args.merge_from:
        with open(args.merge_from) as f:
            old = json.load(f)
        extra["notes"] = old.get("notes", [])  # what earlier runs said of the rows kept; new notes are appended
        rerun = {r["op"] for r in rows}
        # a row the old file itself carried over keeps the date and copy bandwidth of the run that measured it
        rows += [{**r, "from_run": r.get("from_run", old["date"]),
                  "run_copy_gbs": r.get("run_copy_gbs", old["copy_gbs"])} for r in old["rows"] if r["op"] not in rerun]
    path = write_results(f"kernels-{gpu.replace(' ', '_')}-{environment()['date']}",
                         {"copy_gbs": copy_gbs, "timing": "cuda-kernels", **extra, "rows": rows}, args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
