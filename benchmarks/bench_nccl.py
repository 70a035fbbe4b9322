"""NCCL's collectives at one decoder layer's size, alone and beside a GEMM, per NCCL setting.

What FSDP2 costs a step besides its exposed communication: every layer's all-gather and reduce-scatter run on
their own streams beside the layer's GEMMs, and take SMs and memory bandwidth from them. This measures both
sides of that trade at Llama-3.1-8B's layer (218.1M parameters) on ``--ranks`` GPUs, for each ``--settings``
entry (``default``, or space-separated ``NAME=VALUE`` NCCL variables, each one torchrun of its own):

* ``<op>_ms`` and ``<op>_busbw_gbs``: the collective alone (mean of 10 after 3 warm-ups): ``all_gather_bf16``
  (each rank's bf16 shard into the whole layer), ``reduce_scatter_fp32`` / ``reduce_scatter_bf16`` (the layer's
  gradient into each rank's shard); bus bandwidth = bytes x (ranks - 1) / ranks / time, NCCL's convention;
* ``gemm_ms`` / ``gemm_tflops``: an (8192 x 4096) @ (4096 x 14336) bf16 GEMM alone (the gate/up projection's
  shape at 8192 tokens), mean of 20;
* ``gemm_beside_<op>``: the same GEMM's mean time while 30 of that collective run back to back on another
  stream, and ``slowdown_beside_<op>``, its ratio to ``gemm_ms``.

Rank 0's numbers; every rank runs the same work.

    python -m benchmarks.bench_nccl --ranks 2 4 --settings default NCCL_PROTO=Simple "NCCL_MAX_CTAS=8"
    python -m benchmarks.bench_nccl --tiny --out /tmp/nccl     # CPU smoke test: gloo, small tensors, seconds

``--tiny`` runs 2 ranks on the CPU over gloo with 2**16-element tensors and a 64 x 64 x 64 GEMM: it checks the
plumbing, not NCCL; its results go to ``--out``, never to benchmarks/results.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

#: One Llama-3.1-8B decoder layer's parameters (q, k, v, o, gate, up, down, two norms).
LAYER_PARAMS = 218_112_000
GEMM = (8192, 4096, 14336)
OPS = ("all_gather_bf16", "reduce_scatter_fp32", "reduce_scatter_bf16")


def child(params: int, gemm: tuple[int, int, int], out: str, cpu: bool = False) -> None:
    """One rank of one setting: time the collectives and the GEMM, alone and side by side; rank 0 writes ``out``.
    ``cpu`` (``--tiny``): gloo on the CPU even where GPUs are (two ranks on one GPU cannot share it under NCCL)."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not cpu
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    bf16, fp32 = torch.bfloat16, torch.float32
    params -= params % world
    shard, full = torch.randn(params // world, dtype=bf16, device=device), torch.empty(params, dtype=bf16,
                                                                                      device=device)
    g32 = torch.randn(params, dtype=fp32, device=device)
    g16, o32, o16 = g32.to(bf16), torch.empty(params // world, device=device), torch.empty(
        params // world, dtype=bf16, device=device)
    m, k, n = gemm
    a, b = torch.randn(m, k, dtype=bf16, device=device), torch.randn(k, n, dtype=bf16, device=device)
    ops = {"all_gather_bf16": (lambda: dist.all_gather_into_tensor(full, shard), params * 2),
           "reduce_scatter_fp32": (lambda: dist.reduce_scatter_tensor(o32, g32), params * 4),
           "reduce_scatter_bf16": (lambda: dist.reduce_scatter_tensor(o16, g16), params * 2)}

    def gemm_op() -> None:
        torch.mm(a, b)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def mean_ms(fn, n_runs: int, settle: bool = True) -> float:
        """Mean time of ``n_runs`` calls after three warm-ups; ``settle``: wait for the device first (False: leave
        what other streams run going, so that the timed calls run beside it)."""
        for _ in range(3):
            fn()
        if settle:
            sync()
        if not cuda:
            t0 = time.perf_counter()
            for _ in range(n_runs):
                fn()
            return (time.perf_counter() - t0) * 1e3 / n_runs
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n_runs):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n_runs

    row: dict = {"ranks": world}
    for name, (fn, nbytes) in ops.items():
        ms = mean_ms(fn, 10)
        row[f"{name}_ms"] = round(ms, 4)
        row[f"{name}_busbw_gbs"] = round(nbytes * (world - 1) / world / ms / 1e6, 1)
    alone = mean_ms(gemm_op, 20)
    row.update(gemm_ms=round(alone, 4), gemm_tflops=round(2 * m * k * n / alone / 1e9, 1))
    if cuda:
        side = torch.cuda.Stream()
        for name, (fn, _) in ops.items():
            sync()
            with torch.cuda.stream(side):  # 30 back to back: longer than the GEMMs timed beside them
                for _ in range(30):
                    fn()
            beside = mean_ms(gemm_op, 10, settle=False)  # three warm-ups, then ten timed, beside the side stream
            sync()
            row[f"gemm_beside_{name}_ms"] = round(beside, 4)
            row[f"slowdown_beside_{name}"] = round(beside / alone, 3)
        row["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(row, f)
    dist.destroy_process_group()


def parse_setting(setting: str) -> dict[str, str]:
    """``default`` -> {}; ``"NCCL_PROTO=Simple NCCL_MAX_CTAS=8"`` -> the variables (NCCL_* / TORCH_NCCL_* only)."""
    if setting == "default":
        return {}
    env = {}
    for item in setting.split():
        name, sep, value = item.partition("=")
        if not sep or not value or not name.startswith(("NCCL_", "TORCH_NCCL_")):
            raise ValueError(f"--settings {setting!r}: give 'default' or NCCL_NAME=VALUE pairs, not {item!r}")
        env[name] = value
    return env


def last_error(output: str) -> str:
    """The line of a failed torchrun's output that says what went wrong: the last naming an error, else the last
    that is not one of torchrun's rules of ``=`` signs."""
    lines = [line.strip() for line in output.splitlines() if line.strip().strip("=")]
    named = [line for line in lines if "Error" in line or "error" in line]
    return (named or lines or [""])[-1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2], help="GPUs per run (one torchrun each)")
    ap.add_argument("--settings", nargs="+", default=["default"],
                    help="'default' or space-separated NCCL_NAME=VALUE pairs, one run of each per --ranks")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: 2 gloo ranks, small tensors")
    ap.add_argument("--out", default="/tmp/bench_nccl", help="work directory (and --tiny's results)")
    ap.add_argument("--results", help="directory of the results JSON (default benchmarks/results)")
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    ap.add_argument("--child", nargs=2, metavar=("PARAMS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    gemm = (64, 64, 64) if args.tiny else GEMM
    if args.child:
        child(int(args.child[0]), gemm, args.child[1], cpu=args.tiny)
        return
    try:
        settings = {s: parse_setting(s) for s in args.settings}
    except ValueError as e:
        ap.error(str(e))
    from benchmarks.common import child_env, environment, torchrun, write_results

    os.makedirs(args.out, exist_ok=True)
    params = 1 << 16 if args.tiny else LAYER_PARAMS
    rows = []
    for ranks in [2] if args.tiny else args.ranks:
        for setting, extra in settings.items():
            out = os.path.join(args.out, f"row-{ranks}.json")
            if os.path.exists(out):
                os.remove(out)
            cmd = [*torchrun(ranks), "-m", "benchmarks.bench_nccl", *(["--tiny"] if args.tiny else []),
                   "--child", str(params), out]
            env = child_env("cpu" if args.tiny else "cuda", **extra)
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            row = {"setting": setting, "env": extra}
            if res.returncode != 0 or not os.path.exists(out):
                row["error"] = last_error(res.stderr or res.stdout) or f"exit {res.returncode}"
            else:
                with open(out) as f:
                    row.update(json.load(f))
            print(json.dumps(row), flush=True)
            rows.append(row)
    gpu = environment()["gpu"].replace(" ", "_")
    name = f"nccl-{gpu}-{environment()['date']}{args.tag}"
    payload = {"benchmark": "NCCL collectives at one Llama-3.1-8B layer's size, alone and beside a bf16 GEMM",
               "layer_params": params, "gemm_mnk": list(gemm), "rows": rows}
    print(f"wrote {write_results(name, payload, out_dir=args.out if args.tiny else args.results)}")
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
