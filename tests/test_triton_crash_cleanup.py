"""A tritonserver that crashed leaves its python backend's shared memory in /dev/shm (nothing unlinks it);
``TritonProcess.stop`` removes the regions no process maps any more, and none of a live server's."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
from triton_crash_rerun import ends_in_crash_report
from triton_support import TritonServers

from serving.triton.process import stub_resources
from serving.triton.repository import init_repository

pytestmark = pytest.mark.slow

ECHO_MODEL = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy())])
                for r in requests]
"""
ECHO_CONFIG = ('backend: "python"\nmax_batch_size: 0\ninput [{ name: "x" data_type: TYPE_INT32 dims: [1] }]\n'
               'output [{ name: "y" data_type: TYPE_INT32 dims: [1] }]\n')


def echo_repository(root: Path) -> Path:
    root = init_repository(root)
    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    (root / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    return root


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_a_crashed_server_leaves_no_shared_memory_and_a_live_one_keeps_its_own(tmp_path: Path) -> None:
    servers = TritonServers(tmp_path)
    try:
        crashing, live = (servers.start(echo_repository(tmp_path / name)) for name in ("crashing", "live"))
        for proc in (crashing, live):
            proc.control().load_model("echo", timeout_s=60)
        regions = {proc.pid: stub_resources(proc.pid)[1] for proc in (crashing, live)}
        assert all(regions.values()) and all(Path("/dev/shm", r).exists() for r in regions[crashing.pid])
        os.kill(crashing.pid, signal.SIGSEGV)
        deadline = time.monotonic() + 20
        while crashing.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ends_in_crash_report(crashing.log_path)
        crashing.stop(timeout_s=10)
        assert not any(Path("/dev/shm", r).exists() for r in regions[crashing.pid])
        assert all(Path("/dev/shm", r).exists() for r in regions[live.pid])
        assert live.control().server_live()
    finally:
        servers.stop_all()


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_triton_stop_of_an_embedded_server_that_crashed_says_so_and_cleans_up(tmp_path: Path) -> None:
    from flows.embedded import ensure_embedded, read_record, recorded_server, stop_embedded
    from serving.triton.control import TritonControl

    repository = echo_repository(tmp_path / "repo")
    server = ensure_embedded(repository)
    try:
        TritonControl(server.http_url).load_model("echo", timeout_s=60)
        regions = stub_resources(server.pid)[1]
        assert regions
        os.kill(server.pid, signal.SIGSEGV)
        deadline = time.monotonic() + 20
        while Path(f"/proc/{server.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.1)  # a zombie (our child here) has an empty command line
        message = stop_embedded(repository)
        assert f"Triton pid {server.pid}" in message and "had already exited" in message, message
        assert f"removed the {len(regions)} shared-memory regions" in message and server.log_path in message
        assert not any(Path("/dev/shm", r).exists() for r in regions)
        assert recorded_server(repository) is None  # the record stays, for its ports: the next start comes back there
        assert read_record(repository).grpc_url == server.grpc_url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)


def test_triton_stop_returns_once_the_server_and_its_python_stubs_are_gone(tmp_path: Path) -> None:
    """`enginewright triton stop` (stop_embedded) said "stopped" while the server's python stubs lived on for
    about 3 s: now it returns when every process of that server, by PID and start time, has exited."""
    from flows.embedded import ensure_embedded, stop_embedded
    from serving.triton.control import TritonControl
    from serving.triton.process import _still_running, server_processes

    repository = echo_repository(tmp_path / "repo")
    server = ensure_embedded(repository)
    try:
        TritonControl(server.http_url).load_model("echo", timeout_s=60)
        processes = server_processes(server.pid)
        assert server.pid in processes and len(processes) >= 2, processes  # the server and the echo model's stub
        message = stop_embedded(repository)
        assert _still_running(processes) == {}, (message, _still_running(processes))
        assert f"stopped Triton pid {server.pid}" in message and "have exited" in message, message
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)


def test_stop_server_kills_what_ignores_sigterm_and_waits_for_it(tmp_path: Path) -> None:
    """A server (here a stand-in in its own session, with a child) that ignores SIGTERM is SIGKILLed after the
    timeout, its child with it, and stop_server returns only once both are gone."""
    import subprocess
    import sys

    from serving.triton.process import _still_running, server_processes, stop_server

    script = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, "
              "signal.SIG_IGN); time.sleep(60)']); print('up', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        deadline = time.monotonic() + 10
        while len(server_processes(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        processes = server_processes(proc.pid)
        assert len(processes) == 2, processes
        t0 = time.monotonic()
        stop_server(proc.pid, timeout_s=0.5, kill_timeout_s=5)
        assert _still_running(processes) == {} and 0.5 <= time.monotonic() - t0 < 5
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
