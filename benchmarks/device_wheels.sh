#!/usr/bin/env bash
# The wheels the GPU scripts carry to the device machine (it reaches no registry): what they import that the
# device image lacks, at the versions installed here (what CI tests), for CPython 3.12 on x86-64 Linux, into
# .whl/ (git-ignored; benchmarks/gpu_suite.sh installs it there). Usage: bash benchmarks/device_wheels.sh [dir]
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
packages="megatron-core pydantic pydantic-core annotated-types typing-inspection typing-extensions fastapi starlette
uvicorn zstandard opentelemetry-api annotated-doc"
# shellcheck disable=SC2086
pins=$(python3 -c 'import sys, importlib.metadata as m; print(" ".join(f"{p}=={m.version(p)}" for p in sys.argv[1:]))' \
  $packages)
mkdir -p "$dest"
# shellcheck disable=SC2086
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" $pins
ls "$dest"
