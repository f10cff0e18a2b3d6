"""Shared fixtures: Prefect's test harness (a temporary API and database for the whole session), and a
fix of Triton's interpreter for bf16 `tl.dot` (the kernel tests under TRITON_INTERPRET=1). A failed test's
report also shows the log tail of any Triton server that died during it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


pytest_plugins = ["services"]


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


REPORTED_CRASHES: set[int] = set()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails because a Triton server crashed says so, with the end of that server's log."""
    report = (yield).get_result()
    if not report.failed:
        return
    from triton_support import TritonServers

    for proc in [*TritonServers.died_early(), *TritonServers.segfaulted]:
        if proc.pid in REPORTED_CRASHES:
            continue
        REPORTED_CRASHES.add(proc.pid)
        lines = proc.log_path.read_text(errors="replace").splitlines() if proc.log_path.is_file() else []
        report.sections.append((f"Triton pid {proc.pid} exited with {proc.popen.returncode} ({proc.log_path})",
                                "\n".join(line[:400] for line in lines[-40:])))
