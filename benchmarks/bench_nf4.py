"""NF4 (QLoRA's 4-bit base) pieces on one GPU: the format against bitsandbytes' CUDA kernels, the dequantisation
kernel's bandwidth, and what loading a checkpoint with ``quantize="nf4"`` holds.

``exact``: for each Llama-3.1-8B projection part (q 4096 x 4096, k/v 1024 x 4096, o, gate/up 14336 x 4096, down
4096 x 14336), random bf16 weights (std 0.02) quantised by :func:`kernels.nf4.quantize_nf4` and by
``bitsandbytes.functional.quantize_4bit(blocksize=64, quant_type="nf4", compress_statistics=True)``: the number of
differing packed bytes, 8-bit block-maximum codes, group maxima and offsets, and of differing values after each
side's dequantisation to bf16.

``kernels``: kernel time (after an L2 flush) of dequantising each projection of one Llama-3.1-8B layer to bf16 (ours:
one Triton pass; bitsandbytes' ``dequantize_4bit``: its double-quantised maxima first, then the values), bytes moved
(0.5 read + 2 written an element, plus the maxima) and the fraction of copy bandwidth measured in the same run; and
the GEMM that follows (bf16, 2048 and 8192 tokens) for scale.

``load``: ``LigerLlama.from_hf(BASE, dtype="bf16", device="cuda", quantize="nf4")`` of ``--base``, a bf16
checkpoint (bench_train's ``WORK/llama-3.1-8b/base``: Llama-3.1-8B's shape at random init), each in a process of its
own: seconds, the host's peak resident memory growth (``ru_maxrss``: the checkpoint's memory-mapped pages count
while mapped) and its anonymous memory's peak growth (``RssAnon`` sampled every 5 ms: what the loader allocated), the
GPU's peak and the weights' bytes, against the bf16 load of the same checkpoint.

Written to ``results/nf4-<gpu>-<date><tag>.json``; docs/qlora.md shows it (``python -m benchmarks.report``).

    python -m benchmarks.bench_nf4 --base /tmp/bt/llama-3.1-8b/base
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

from benchmarks.common import copy_bandwidth_gbs, environment, kernel_time, write_results

#: (name, rows, columns) of one Llama-3.1-8B layer's projection parts, as the checkpoint stores them.
PARTS = (("q", 4096, 4096), ("k", 1024, 4096), ("v", 1024, 4096), ("o", 4096, 4096), ("gate", 14336, 4096),
         ("up", 14336, 4096), ("down", 4096, 14336))


def exact() -> list[dict]:
    import bitsandbytes.functional as bf

    from kernels.nf4 import quantize_nf4

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in PARTS:
        w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        ours = quantize_nf4(w)
        q, st = bf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        theirs = bf.dequantize_4bit(q, st)
        rows.append({"part": name, "shape": [n, k],
                     "packed_bytes_differing": int((q.view(-1) != ours.packed).sum()),
                     "block_codes_differing": int((st.absmax != ours.qabs).sum()),
                     "blocks": ours.qabs.numel(),
                     "group_maxima_differing": int((st.state2.absmax != ours.absmax2).sum()),
                     "offset_equal": bool(st.offset.item() == ours.offset.item()),
                     "dequantised_values_differing": int((theirs != ours.dequantize()).sum()),
                     "values": n * k})
        print(rows[-1], flush=True)
    return rows


def kernels() -> dict:
    import bitsandbytes.functional as bf

    from kernels.nf4 import quantize_nf4

    copy = copy_bandwidth_gbs()
    rows = []
    for name, n, k in (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)):
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        t = quantize_nf4(w)
        nbytes = t.packed.numel() + t.qabs.numel() + 4 * t.absmax2.numel() + 2 * n * k
        ours = kernel_time(lambda t=t: t.dequantize()).ms
        q, st = bf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        theirs = kernel_time(lambda q=q, st=st: bf.dequantize_4bit(q, st)).ms
        row = {"projection": name, "shape": [n, k], "bytes": nbytes, "ours_ms": round(ours, 4),
               "ours_frac_copy_bw": round(nbytes / ours / 1e6 / copy, 3), "bnb_ms": round(theirs, 4)}
        dense = t.dequantize()
        for tokens in (2048, 8192):
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            row[f"gemm_{tokens}_ms"] = round(kernel_time(lambda x=x, d=dense: x @ d.t()).ms, 4)
        rows.append(row)
        print(row, flush=True)
    return {"copy_bandwidth_gbs": round(copy, 1), "rows": rows}


def load(base: str) -> dict:
    """Each load in a child process of its own (its peak host memory is its own)."""
    rows = {}
    for quantize in ("none", "nf4"):
        res = subprocess.run([sys.executable, "-m", "benchmarks.bench_nf4", "--load-worker", base,
                              "--quantize", quantize], capture_output=True, text=True, timeout=900)
        if res.returncode != 0:
            rows[quantize] = {"error": res.stderr[-2000:]}
            continue
        rows[quantize] = json.loads(res.stdout.strip().splitlines()[-1])
        print(quantize, rows[quantize], flush=True)
    size = sum(os.path.getsize(os.path.join(base, f)) for f in os.listdir(base) if f.endswith(".safetensors"))
    return {"checkpoint": os.path.basename(os.path.dirname(base.rstrip("/"))), "checkpoint_gb": round(size / 1e9, 2),
            "rows": rows}


def _anon_bytes() -> int:
    """This process's anonymous resident memory (``RssAnon``): what it allocated, without the pages of files it
    maps (a memory-mapped checkpoint's pages count in ``ru_maxrss`` while mapped, reclaimable page cache)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def load_worker(model_dir: str, quantize: str) -> None:
    import threading

    from ligermodels import LigerLlama

    before, anon0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, _anon_bytes()
    peak, done = [anon0], threading.Event()

    def sample():  # the anonymous memory's peak, every 5 ms
        while not done.wait(0.005):
            peak[0] = max(peak[0], _anon_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    model = LigerLlama.from_hf(model_dir, dtype="bf16", device="cuda",
                               quantize=None if quantize == "none" else quantize)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    host = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 / 1e9
    weights = sum(p.nbytes_stored() if hasattr(p, "nbytes_stored") else p.numel() * p.element_size()
                  for p in model.parameters())
    print(json.dumps({"seconds": round(seconds, 1), "host_peak_growth_gb": round(host, 2),
                      "host_anonymous_peak_growth_gb": round((max(peak[0], _anon_bytes()) - anon0) / 1e9, 2),
                      "gpu_peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
                      "weights_gb": round(weights / 1e9, 2)}))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="``load``: a bf16 Llama checkpoint directory")
    ap.add_argument("--only", choices=("exact", "kernels", "load"), nargs="+", default=["exact", "kernels", "load"])
    ap.add_argument("--tag", default="")
    ap.add_argument("--load-worker", help=argparse.SUPPRESS)
    ap.add_argument("--quantize", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.load_worker:
        return load_worker(args.load_worker, args.quantize)
    env = environment()
    payload = {**env, "command": " ".join(["python -m benchmarks.bench_nf4", *(argv or sys.argv[1:])])}
    if "exact" in args.only:
        payload["exact"] = exact()
    if "kernels" in args.only:
        payload["kernels"] = kernels()
    if "load" in args.only:
        payload["load"] = load(args.base)
    gpu = (env.get("gpu") or "cpu").replace(" ", "_")
    name = f"nf4-{gpu}-{env['date']}{args.tag}"
    print(f"wrote {write_results(name, payload)}")


if __name__ == "__main__":
    main()
