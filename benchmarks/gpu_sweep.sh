#!/usr/bin/env bash
# One device call: GPU test-suite, then kernel and loss benchmarks; logs and JSON go to $OUT.
# Usage on the GPU machine (repo root):  bash benchmarks/gpu_sweep.sh [tests|kernels|flce|all]...
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-benchmarks/results}
if ls .whl/*.whl >/dev/null 2>&1; then  # benchmark-only baselines (liger-kernel), never a dependency
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
for what in "${@:-all}"; do
  case $what in
    tests|all) python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 40 ;;&
    kernels|all) python3 -m benchmarks.bench_kernels --out "$OUT" 2>&1 | tee "$OUT/bench_kernels.log" ;;&
    flce|all) python3 -m benchmarks.bench_flce --out "$OUT" 2>&1 | tee "$OUT/bench_flce.log" ;;&
    *) ;;
  esac
done
