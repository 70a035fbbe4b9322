"""The optimiser step of full fine-tuning on one GPU as ``ligermodels.train`` runs it: ``kernels.AdamW`` with fp32
masters kept beside bf16 weights (``init_master_weights_``), bf16 gradients, clipping at 1.0, decay on matrices
only, a model's whole parameter list (Qwen2-1.5B's by default: 198 tensors, 113 above a million elements).

Per implementation, medians of ``--reps`` steps:

* ``host_ms``: the host's time to enqueue ``clip_grad_norm_`` and ``step`` while the GPU is still busy with an
  earlier sleep kernel, so none of it waits for the device: what the step costs an eager training loop's host;
* ``kernel_ms``: the device time of clip + step (``benchmarks.common.kernel_time``: every kernel, L2 flushed
  first); ``launches``: its device events; ``gbs`` and ``frac_copy_bw``: 28 bytes a parameter (the norm reads the
  bf16 gradient; the step reads it again with the bf16 weight, its 16 low master bits and both fp32 moments, and
  writes all but the gradient) over that time.

``--baseline FILE`` adds the same step from another copy of ``kernels/adamw.py`` (for example an earlier
commit's, ``git show COMMIT:kernels/adamw.py > FILE``), on the same parameters, runs alternating.

    python -m benchmarks.bench_adamw_step [--model qwen2-1.5b] [--baseline FILE] [--out DIR] [--tag T]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time

import torch

import kernels.adamw
from benchmarks.common import MODELS, copy_bandwidth_gbs, environment, kernel_time, write_results
from ligermodels import CausalLM
from ligermodels.families import config_from_hf
from ligermodels.train.parallelize import decay_groups

#: Bytes a parameter the clipping norm and one master-weight step move (see the module docstring).
BYTES_PER_PARAM = 28


def load_module(path: str, name: str):
    """A copy of kernels/adamw.py loaded from ``path`` as module ``name`` (it imports ``kernels._common``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_optimizer(module, params: list[torch.nn.Parameter]):
    """``module.AdamW`` as ``ligermodels.train.parallelize.build_optimizer`` makes it for one bf16 GPU."""
    opt = module.AdamW(decay_groups(params, 0.1), lr=torch.tensor(1e-5, device="cuda"), betas=(0.9, 0.95), eps=1e-8)
    opt.init_master_weights_(torch.bfloat16)
    return opt


def clip_and_step(opt) -> None:
    opt.clip_grad_norm_(1.0)
    opt.step()


def host_ms(opt, reps: int) -> float:
    """Median host time of clip + step enqueued behind a sleeping GPU."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(300_000_000)  # a few hundred ms of GPU work queued first
        t0 = time.perf_counter()
        clip_and_step(opt)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2-1.5b", choices=sorted(MODELS))
    ap.add_argument("--baseline", help="another copy of kernels/adamw.py to time beside this tree's")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = CausalLM(config_from_hf(MODELS[args.model]))
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    impls = {"kernels.AdamW": kernels.adamw}
    if args.baseline:
        impls[f"baseline {os.path.basename(args.baseline)}"] = load_module(args.baseline, "baseline_adamw")
    opts = {name: make_optimizer(module, params) for name, module in impls.items()}  # each its own state
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    copy_gbs = copy_bandwidth_gbs()
    rows = {name: {"impl": name, "host_ms": [], "kernel_ms": [], "launches": []} for name in opts}
    for _ in range(2):  # alternating, so that neither runs only first
        for name, opt in opts.items():
            for _ in range(3):
                clip_and_step(opt)
            rows[name]["host_ms"].append(host_ms(opt, args.reps))
            kt = kernel_time(lambda opt=opt: clip_and_step(opt), reps=args.reps)
            rows[name]["kernel_ms"].append(kt.ms)
            rows[name]["launches"].append(kt.launches)
    out = []
    for row in rows.values():
        ms = statistics.median(row["kernel_ms"])
        gbs = BYTES_PER_PARAM * n / ms / 1e6
        out.append({**row, "host_ms_median": round(statistics.median(row["host_ms"]), 3), "kernel_ms_median":
                    round(ms, 3), "gbs": round(gbs), "frac_copy_bw": round(gbs / copy_gbs, 3)})
        print(f"{row['impl']:>40}: host {out[-1]['host_ms_median']:.2f} ms, kernel {ms:.3f} ms "
              f"({100 * gbs / copy_gbs:.0f}% of copy bandwidth), {row['launches'][-1]:g} launches")
    env = environment()
    name = f"adamw-step-{env['gpu'].replace(' ', '_')}-{env['date']}{args.tag}"
    path = write_results(name, {"model": args.model, "params": n, "tensors": len(params),
                                "tensors_above_multi_tensor_size": sum(
                                    p.numel() > kernels.adamw.MULTI_TENSOR_MAX_NUMEL for p in params),
                                "copy_gbs": round(copy_gbs), "bytes_per_param": BYTES_PER_PARAM, "rows": out},
                         args.out)
    print(path)


if __name__ == "__main__":
    main()
