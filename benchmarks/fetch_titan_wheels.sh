#!/usr/bin/env bash
# Wheels of torchtitan (benchmarks/bench_scale.py's baseline: benchmark-only, never a dependency) and of what its
# trainer imports that the GPU image lacks, for a GPU machine without network. Run from the repository root on a
# machine where pip reaches PyPI:
#
#   bash benchmarks/fetch_titan_wheels.sh [DIR]        # default DIR: .whl (git-ignored)
#
# then carry .whl to the GPU machine and, there, before the benchmark:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site
#
# The GPU image (torch 2.11, triton 3.6, Python 3.12) and torchtitan 0.2.2's Requires-Dist:
#   torchdata>=0.8.0           absent there: torchdata 0.11.0 (needs urllib3, requests, torch: in the image)
#   datasets>=2.21.0           absent there: datasets 5.2.0, with dill 0.4.1 and multiprocess 0.70.19 (its other
#                              needs, pyarrow>=24, pandas, xxhash, requests, tqdm, filelock, pyyaml, packaging and
#                              huggingface-hub>=1.31, are in the image; if `python3 -m pip show pyarrow` there
#                              says < 24, fetch datasets 5.0.1 instead, which takes pyarrow>=21)
#   fsspec                     in the image; fsspec 2026.9.0 here, the newest datasets 5.2.0 accepts
#   tyro                       absent there: tyro 1.0.17, with docstring-parser 0.18.0 and typeguard 4.6.1
#                              (typing-extensions is in the image)
#   tomli>=1.1.0               not needed: on Python >= 3.11 torchtitan reads TOML with tomllib
#   tokenizers, tensorboard, einops, pillow: in the image
# torchtitan 0.2.2 is the release made against torch 2.11 (0.3.0 wants a later torch and more packages).
# bench_scale's titan runs were checked here (torch 2.13 CPU, the same wheels) for the config, the model flavors,
# the tokenizer and the data loader; the trainer itself needs CUDA.
set -euo pipefail
DIR=${1:-.whl}
PACKAGES=(torchtitan==0.2.2 torchdata==0.11.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0
          tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1)
bash "$(dirname "$0")/fetch_wheels.sh" "$DIR" "${PACKAGES[@]}"
