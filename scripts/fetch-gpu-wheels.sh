#!/usr/bin/env bash
# Fetch, on this machine, the wheels that scripts/gpu-check.sh installs on the GPU machine (listed, with why, in
# scripts/gpu-wheels.txt): CPython 3.12, manylinux x86-64, no dependencies, into .whl/ (git-ignored; the device
# call carries it). One version of each: the folder is emptied first, as two versions of a wheel stop the install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .whl
mkdir -p .whl
grep -v '^#' scripts/gpu-wheels.txt | grep . | xargs "$PY" -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl
ls .whl | wc -l | xargs echo "wheels:"
du -sh .whl
