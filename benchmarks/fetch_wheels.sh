#!/usr/bin/env bash
# Download wheels for the GPU image (Python 3.12, manylinux x86_64), without their dependencies, into DIR:
#
#   bash benchmarks/fetch_wheels.sh DIR PACKAGE==VERSION ...
#
# The lists of what each benchmark's baseline needs there: fetch_titan_wheels.sh, fetch_trl_wheels.sh.
set -euo pipefail
DIR=$1
shift
mkdir -p "$DIR"
for package in "$@"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 \
    -d "$DIR" "$package"
done
ls -l "$DIR"
