# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Python writes each module's bytecode at its first import (the .venv is installed without it, below). An
# environment that sets PYTHONDONTWRITEBYTECODE (some sandboxes do) makes every process compile every module it
# imports, every time: each test's servers, CLIs and Triton stubs import torch, transformers, MLflow or Prefect.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test test-kernels test-kernels-all lint clean browser

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q uv
	# torch first, by exact version: pip takes the CPU wheel lying on disk; any other spec downloads CUDA builds.
	# No bytecode compiled ahead: compiling the whole 2.7 GB venv cost 132 s of CPU (compileall -j 2, 2 cores),
	# while the first import of torch, transformers, MLflow, Prefect and the flows, writing its .pyc files as it
	# goes, took 29 s of CPU against 26 s for the next one; what is never imported is never compiled.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q --no-compile torch==2.13.0
	VIRTUAL_ENV=$(VENV) $(BIN)/uv pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/enginewright demo

# One pytest over three pytest-xdist workers (most tests wait on servers they start, so three share two cores
# well). tests/conftest.py makes each file one unit of work (its module fixtures on one worker), puts the
# gray-release files on one worker in turn (they judge latency side by side and count failed requests; no
# two of their load tests compete), and hands out the longest units first; --no-loadscope-reorder keeps
# that order (xdist would otherwise start the files with the most tests first and the long ones last).
# The 30 slowest tests are listed at the end, to see where the time goes.
# Then the files in ALONE, in a second pytest with the machine to themselves: the gray release's load test
# holds p99 through a rollout within 1.5x of steady state (issue 27), and three workers beside it on two
# cores would make that a measure of the other tests. All three runs go ahead; the target fails when any does.
# The kernel tests on CPU tensors (mark `interpreter`) run in `test-kernels` instead, beside the parallel run at
# nice 10: pure CPU, they take the cycles the parallel run leaves while its tests wait on servers, and yield the
# cores to it otherwise (run after it, they added their whole time to the target's); their output follows it.
# The venv and the browser are set up side by side (pip's downloads and unpacking beside apt's, on a fresh clone).
ALONE := tests/test_rollout_triton.py
test:
	@$(MAKE) --no-print-directory -j 2 $(STAMP) browser
	kernels_log=$$(mktemp); \
	  nice -n 10 $(MAKE) --no-print-directory test-kernels >$$kernels_log 2>&1 & kernels_pid=$$!; \
	  $(BIN)/pytest -q -n 3 --dist loadfile --no-loadscope-reorder --durations=30 -m "not interpreter" \
	  $(ALONE:%=--ignore=%); parallel=$$?; \
	  wait $$kernels_pid; kernels=$$?; echo "== make test-kernels (beside the parallel run):"; cat $$kernels_log; \
	  rm -f $$kernels_log; \
	  $(BIN)/pytest -q --durations=5 $(ALONE) && [ $$parallel = 0 ] && [ $$kernels = 0 ]

# Triton's kernels on CPU tensors under its interpreter: Triton chooses the interpreter when a kernel is defined,
# so TRITON_INTERPRET=1 is set for this pytest alone, which runs only the `interpreter` tests (tests/conftest.py),
# spread test by test over the workers; `large` cases (minutes of CPU each) only in test-kernels-all.
# KERNEL_TESTS: the files that use the mark.
KERNEL_TESTS = $(shell grep -l "mark.interpreter" tests/test_*.py)
test-kernels: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/pytest -q -n 3 --dist load --durations=10 -o cache_dir=.pytest_cache/kernels \
	  -m "interpreter and not large" $(KERNEL_TESTS)
test-kernels-all: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/pytest -q -n 3 --dist load --durations=10 -m interpreter $(KERNEL_TESTS)

# The browser test (tests/test_browser_approval.py) drives Debian's headless Chromium: installed when missing
# and apt-get may (root, as in CI); where it cannot, that test skips saying why.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver; } || \
	  echo "make: no chromium/chromedriver and apt-get could not install them: the browser test will skip"

lint: $(STAMP)
	$(BIN)/ruff check flows tasks serving registry bench tests

clean:
	rm -rf .state build
