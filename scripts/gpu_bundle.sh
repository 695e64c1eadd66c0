#!/usr/bin/env bash
# What `make gpu-check` needs on a GPU machine without network, beyond its image's torch, Triton,
# transformers, numpy, safetensors, pyyaml and pytest, gathered into .gpu/ (git ignores it; carry it):
#   .gpu/wheels     pydantic and its parts, CPython 3.12 x86-64 wheels
#   .gpu/tokenizer  the embedded model's tokenizer files (benchmarks.full_size writes them beside its weights)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rm -rf .gpu && mkdir -p .gpu/wheels .gpu/tokenizer
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/wheels pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection==0.4.5
model=$($PY -c "from specdec.model.loading import ensure_embedded_model; print(ensure_embedded_model())")
cp "$model"/tokenizer.json "$model"/tokenizer_config.json "$model"/chat_template.jinja .gpu/tokenizer/
du -sh .gpu
