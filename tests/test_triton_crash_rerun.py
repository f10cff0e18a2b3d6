"""The one rerun the tests allow themselves (``triton_crash_rerun``): a test runs once more only when it
failed while a Triton server of it died of Triton's own segfault (docs/triton.md, Pitfalls); a failure of ours,
or a second crash, fails it. Each case runs an inner pytest whose test crashes a real tritonserver."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from triton_crash_rerun import crash_logs_since
from triton_support import TritonServers

from serving.triton.repository import init_repository

ROOT = Path(__file__).resolve().parents[1]

INNER = '''
import os, signal, time
from pathlib import Path
from triton_crash_rerun import ends_in_crash_report
from triton_support import TritonServers
from serving.triton.repository import init_repository

RUNS = Path(__file__).parent / "runs.txt"


def crash_one(tmp):
    """A real tritonserver killed with SIGSEGV: its own handler writes the crash report into its log."""
    servers = TritonServers(tmp)
    try:
        proc = servers.start(init_repository(tmp / "repo"))
        os.kill(proc.pid, signal.SIGSEGV)
        deadline = time.monotonic() + 20
        while proc.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ends_in_crash_report(proc.log_path), proc.log_path.read_text()[-2000:]
    finally:
        servers.stop_all()


def test_scenario(tmp_path):
    with RUNS.open("a") as runs:
        runs.write("run\\n")
    run = len(RUNS.read_text().splitlines())
'''


def inner_pytest(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, body: str) -> tuple[pytest.RunResult, int]:
    """Run a test whose last lines are ``body`` under the plugin; its outcome and how many times it ran."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    pytester.makepyfile(test_inner=INNER + "".join(f"    {line}\n" for line in body.splitlines()))
    result = pytester.runpytest_subprocess("-p", "triton_crash_rerun", "-q", "-p", "no:cacheprovider")
    return result, len((pytester.path / "runs.txt").read_text().splitlines())


@pytest.mark.slow
def test_a_test_that_failed_while_triton_segfaulted_runs_once_more(pytester, monkeypatch) -> None:
    result, runs = inner_pytest(pytester, monkeypatch, """
if run == 1:
    crash_one(tmp_path)
    raise ConnectionRefusedError("the server is gone")""")
    assert runs == 2
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines([("*Triton segfaulted (*triton-0.log) while the test failed "
                                  "(call: ConnectionRefusedError: the server is gone): it ran once more*")])


@pytest.mark.slow
def test_a_second_segfault_fails_the_test_with_the_log(pytester, monkeypatch) -> None:
    result, runs = inner_pytest(pytester, monkeypatch, """
crash_one(tmp_path)
raise ConnectionRefusedError("the server is gone")""")
    assert runs == 2
    result.assert_outcomes(failed=1, warnings=1)
    result.stdout.fnmatch_lines(["*Triton log *triton-0.log*", "*Signal (11) received*"])


def test_a_failure_without_a_segfault_is_not_run_again(pytester, monkeypatch) -> None:
    result, runs = inner_pytest(pytester, monkeypatch, 'assert run == 0, "our own bug"')
    assert runs == 1
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*our own bug*"])


@pytest.mark.slow
def test_a_test_that_passes_despite_a_crash_runs_once(pytester, monkeypatch) -> None:
    result, runs = inner_pytest(pytester, monkeypatch, "crash_one(tmp_path)")
    assert runs == 1
    result.assert_outcomes(passed=1)


@pytest.mark.slow
def test_a_server_stopped_by_us_is_no_crash(tmp_path: Path) -> None:
    servers = TritonServers(tmp_path)
    proc = servers.start(init_repository(tmp_path / "repo"))
    servers.stop_all()
    assert not proc.running() and proc.log_path.is_file()
    assert crash_logs_since(tmp_path, 0) == []


MODULE_SERVER = '''
import os, signal, time
from pathlib import Path
import pytest
from triton_support import TritonServers
from serving.triton.repository import init_repository

RUNS = Path(__file__).parent / "runs.txt"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("module")
    servers = TritonServers(work)
    yield servers.start(init_repository(work / "repo"))
    servers.stop_all()


def test_crashes_the_module_server_once(server):
    with RUNS.open("a") as runs:
        runs.write(f"{server.pid}\\n")
    if len(RUNS.read_text().splitlines()) == 1:
        os.kill(server.pid, signal.SIGSEGV)
        server.popen.wait(timeout=20)
    assert server.running()


def test_the_next_test_of_the_module_has_a_live_server(server):
    assert server.running()
'''


@pytest.mark.slow
def test_the_second_run_gets_the_module_fixtures_afresh(pytester, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    pytester.makepyfile(test_inner=MODULE_SERVER)
    result = pytester.runpytest_subprocess("-p", "triton_crash_rerun", "-q", "-p", "no:cacheprovider")
    pids = (pytester.path / "runs.txt").read_text().split()
    assert len(pids) == 2 and pids[0] != pids[1]  # a new server for the second run
    result.assert_outcomes(passed=2, warnings=1)
