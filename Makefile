# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q uv
	# torch first, by exact version: pip takes the CPU wheel lying on disk; any other spec downloads CUDA builds.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	VIRTUAL_ENV=$(VENV) UV_COMPILE_BYTECODE=1 $(BIN)/uv pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/enginewright demo

# The gray-release tests (a promotion killed at every step, a fleet, a load test) keep both cores busy
# for minutes: they run in a pytest process of their own, after the rest.
test: $(STAMP)
	$(BIN)/pytest -q --ignore-glob='tests/test_rollout_*.py'
	$(BIN)/pytest -q tests/test_rollout_*.py

lint: $(STAMP)
	$(BIN)/ruff check flows tasks serving registry tests

clean:
	rm -rf .state build
