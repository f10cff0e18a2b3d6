"""The one retry the rollout tests allow themselves: a scenario runs again only when a Triton it started died
of Triton's own segfault (docs/triton.md, Pitfalls); a failure of ours is never retried."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from test_rollout_support import once_more_if_triton_segfaults
from triton_support import TritonServers, crashed_in_triton

from serving.triton.repository import init_repository


def crash_one(tmp: Path) -> None:
    """A real tritonserver killed with SIGSEGV: its own handler writes the crash report into its log."""
    servers = TritonServers(tmp)
    try:
        proc = servers.start(init_repository(tmp / "repo"))
        os.kill(proc.pid, signal.SIGSEGV)
        deadline = time.monotonic() + 20
        while proc.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not proc.running() and crashed_in_triton(proc), proc.log_path.read_text()[-2000:]
        raise ConnectionRefusedError("the server is gone")
    finally:
        servers.stop_all()


def test_a_scenario_whose_triton_segfaulted_runs_once_more(tmp_path: Path) -> None:
    attempts = []

    def scenario(attempt: str) -> None:
        attempts.append(attempt)
        if attempt == "first":
            crash_one(tmp_path / attempt)

    with pytest.warns(UserWarning, match="Triton segfaulted .* ran once more on fresh servers"):
        once_more_if_triton_segfaults(scenario)
    assert attempts == ["first", "again"]


def test_a_failure_without_a_segfault_is_not_retried() -> None:
    attempts = []

    def scenario(attempt: str) -> None:
        attempts.append(attempt)
        assert attempt == "never", "our own bug"

    with pytest.raises(AssertionError, match="our own bug"):
        once_more_if_triton_segfaults(scenario)
    assert attempts == ["first"]


def test_a_second_segfault_fails_the_test(tmp_path: Path) -> None:
    attempts = []

    def scenario(attempt: str) -> None:
        attempts.append(attempt)
        crash_one(tmp_path / attempt)

    with pytest.warns(UserWarning), pytest.raises(ConnectionRefusedError):
        once_more_if_triton_segfaults(scenario)
    assert attempts == ["first", "again"]


def test_a_server_stopped_by_us_is_no_crash(tmp_path: Path) -> None:
    servers = TritonServers(tmp_path)
    proc = servers.start(init_repository(tmp_path / "repo"))
    before = len(TritonServers.segfaulted)
    servers.stop_all()
    assert not proc.running() and not crashed_in_triton(proc)
    assert TritonServers.segfaulted[before:] == []
