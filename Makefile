# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean browser

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q uv
	# torch first, by exact version: pip takes the CPU wheel lying on disk; any other spec downloads CUDA builds.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	VIRTUAL_ENV=$(VENV) UV_COMPILE_BYTECODE=1 $(BIN)/uv pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/enginewright demo

# Most tests wait on servers they start (Triton, MLflow, Prefect, moto), so three workers share the two
# cores well (measured: 20.6 against 36.4 min on a loaded machine); a test file stays on one worker, with
# its module fixtures. The gray-release tests (a promotion killed at every step, a fleet, a load test)
# judge latency: they run alone in a pytest process of their own, after the rest.
test: $(STAMP) browser
	$(BIN)/pytest -q -n 3 --dist loadfile --ignore-glob='tests/test_rollout_*.py'
	$(BIN)/pytest -q tests/test_rollout_*.py

# The browser test (tests/test_browser_approval.py) drives Debian's headless Chromium: installed when missing
# and apt-get may (root, as in CI); where it cannot, that test skips saying why.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver; } || \
	  echo "make: no chromium/chromedriver and apt-get could not install them: the browser test will skip"

lint: $(STAMP)
	$(BIN)/ruff check flows tasks serving registry tests

clean:
	rm -rf .state build
