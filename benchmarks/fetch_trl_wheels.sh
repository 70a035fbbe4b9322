#!/usr/bin/env bash
# Wheels of TRL, Liger-Kernel and bitsandbytes (the baselines of benchmarks/bench_preference.py, bench_train.py's LoRA
# and QLoRA runs and bench_nf4.py: benchmark- and test-only, never a dependency) and of what TRL imports that the GPU image lacks, for a GPU machine without network. Run from the
# repository root on a machine where pip reaches PyPI:
#
#   bash benchmarks/fetch_trl_wheels.sh [DIR]          # default DIR: .whl (git-ignored)
#
# then carry .whl to the GPU machine and, there, before the benchmark:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site
#
# The GPU image (torch 2.11, transformers 5.17, accelerate, Python 3.12) lacks trl 1.16.0 and datasets (5.2.0, with
# dill 0.4.1 and multiprocess 0.70.19; pyarrow, pandas and xxhash are in the image: see fetch_titan_wheels.sh).
set -euo pipefail
DIR=${1:-.whl}
bash "$(dirname "$0")/fetch_wheels.sh" "$DIR" trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  liger-kernel==0.8.5 bitsandbytes==0.50.2
