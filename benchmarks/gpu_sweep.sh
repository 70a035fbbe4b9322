#!/usr/bin/env bash
# One command on a GPU machine: the test suite, then kernel, attention, loss, decode and end-to-end benchmarks.
# Usage on the GPU machine (repo root):
#   bash benchmarks/gpu_sweep.sh [tests|kernels|attention|linear|flce|decode|e2e|all]...
# Everything (logs, results JSON, profiles) is written to /tmp/sweep and packed into one archive, $OUT/sweep.tgz,
# at the end. Each step has its own time limit (seconds), so the pack
# still happens when one step hangs:
#   T_TEST_FILE T_KERNELS T_LINEAR T_FLCE T_DECODE T_E2E T_ATTENTION   (TEST_FILES limits the test files)
# KERNELS="rms_norm rope" limits the kernel families (rows of the others are kept from the newest committed JSON
# of the same GPU; KERNELS="rope_variants": the q/k-norm + RoPE, partial and interleaved rotary cases).
# E2E="llama-1b:8 qwen2-1.5b:4" and E2E_IMPLS="ligermodels hf hf+liger ..." choose the end-to-end runs;
# LINEAR="qwen2-7b:4 gemma-2b:4" chooses the projection-GEMM shapes (bench_linear);
# ATTENTION_ARGS adds bench_attention flags (e.g. "--shapes qwen2-1.5b:4 gemma-2b:4");
# DECODE_ARGS adds bench_decode flags (e.g. "--only ligermodels-compiled transformers-static").
# E2E_ARGS adds flags (e.g. "--profile", "--max-batch", "--ac").
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
RES=/tmp/sweep
mkdir -p "$RES"
OUT=${OUT:-benchmarks/results}
if ls .whl/*.whl >/dev/null 2>&1; then  # benchmark-only baselines (liger-kernel), never a dependency
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
for what in "${@:-all}"; do
  echo "=== $what ($(date +%T))"
  case $what in
    tests|all)  # one file at a time, each with its own limit, so a slow file never hides the others' results
      for f in ${TEST_FILES:-tests/test_*.py}; do
        echo "--- $f"
        timeout "${T_TEST_FILE:-120}" python3 -m pytest -q -p no:cacheprovider -rfs --tb=short --durations=3 "$f" 2>&1 \
          | tee -a "$RES/gpu_tests.log" | grep -E "passed|failed|FAILED|Error|error|SKIPPED|^E |^[0-9.]+s " | head -n 30
      done ;;&
    kernels|all)  # with KERNELS, the other families' rows come from the newest kernels JSON of this GPU (by date)
      timeout "${T_KERNELS:-300}" python3 -m benchmarks.bench_kernels --out "$RES" \
        ${KERNELS:+--only $KERNELS --merge-from latest} 2>&1 | tee "$RES/bench_kernels.log" | tail -n 80 ;;&
    attention|all) timeout "${T_ATTENTION:-300}" python3 -m benchmarks.bench_attention --out "$RES" ${ATTENTION_ARGS:-} \
                     2>&1 | tee "$RES/bench_attention.log" | cut -c1-400 ;;&
    linear|all) timeout "${T_LINEAR:-200}" python3 -m benchmarks.bench_linear --out "$RES" ${LINEAR:+--models $LINEAR} 2>&1 \
                  | tee "$RES/bench_linear.log" | tail -n 80 ;;&
    flce|all) timeout "${T_FLCE:-150}" python3 -m benchmarks.bench_flce --out "$RES" 2>&1 \
                | tee "$RES/bench_flce.log" | tail -n 20 ;;&
    decode|all) timeout "${T_DECODE:-200}" python3 -m benchmarks.bench_decode --out "$RES" ${DECODE_ARGS:-} 2>&1 \
                  | tee "$RES/bench_decode.log" | tail -n 20 ;;&
    e2e|all) timeout "${T_E2E:-500}" python3 -m benchmarks.bench_e2e --out "$RES" --runs ${E2E:-llama-1b:8} \
               ${E2E_IMPLS:+--impls $E2E_IMPLS} ${E2E_ARGS:-} 2>&1 | tee "$RES/bench_e2e.log" | grep -v "^{" ;;&
    *) ;;
  esac
done
tar czf "$OUT/sweep.tgz" -C "$RES" . && ls -la "$RES"
