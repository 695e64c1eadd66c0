#!/usr/bin/env bash
# The pure-Python dependencies `make gpu-check` needs beyond a GPU image's torch, Triton, transformers,
# numpy, safetensors, pyyaml and pytest (pydantic and its parts), as CPython 3.12 x86-64 wheels in .whl/,
# for a GPU machine without network: carry .whl/ there; `make gpu-check` installs them if present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection==0.4.5
ls .whl
