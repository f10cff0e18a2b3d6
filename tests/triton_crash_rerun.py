"""A pytest plugin: a test that failed while a Triton server of it segfaulted runs once more, and a failed
test's report ends with the log tail of each Triton server that died during it.

Triton 2.51 (the one nvidia-pytriton 0.7.0 bundles) now and then crashes while it destroys a model's
instances, which every reload and every shutdown does (docs/triton.md, Pitfalls). Such a crash says nothing
about our code, so the test runs once more, from its own fixtures up, with a warning that names the crash
log and the first failure. The module's fixtures are set up afresh for it (a module-scoped server may be
the one that crashed). A failure without a crash, or a crash in the second run too, fails as usual.

A crash is Triton's own report (``Signal (11) received.``) at the end of a ``*.log`` under pytest's
temporary folder written during the failed run: every server a test starts logs there.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from _pytest.runner import runtestprotocol

CRASH_REPORT = re.compile(rb"Signal \((6|7|8|11)\) received")
TAIL_BYTES = 20_000


def ends_in_crash_report(log: Path) -> bool:
    """The log ends in Triton's own crash report: ``Signal (11) received.`` and a stack."""
    try:
        with log.open("rb") as file:
            file.seek(max(0, log.stat().st_size - TAIL_BYTES))
            return CRASH_REPORT.search(file.read()) is not None
    except OSError:
        return False


def crash_logs_since(root: Path, since: float) -> list[Path]:
    """Logs under ``root`` written at or after ``since`` (epoch seconds) that end in Triton's crash report."""
    return sorted(path for path in root.rglob("*.log") if _mtime(path) >= since and ends_in_crash_report(path))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _first_failure(reports: list[pytest.TestReport]) -> str:
    failed = next(report for report in reports if report.failed)
    crash = getattr(failed.longrepr, "reprcrash", None)
    return f"{failed.when}: {crash.message if crash else str(failed.longrepr).splitlines()[-1]}"


def _log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(line[:400] for line in path.read_text(errors="replace").splitlines()[-lines:])


_SHOWN_DEAD: set[int] = set()  # pids of servers whose log a report already showed


def _dead_servers_logs() -> list[Path]:
    """Logs of the servers started through ``TritonServers`` that exited by themselves, each shown once."""
    from triton_support import TritonServers

    fresh = [proc for proc in TritonServers.died_early() if proc.pid not in _SHOWN_DEAD]
    _SHOWN_DEAD.update(proc.pid for proc in fresh)
    return [proc.log_path for proc in fresh if proc.log_path.is_file()]


def _run(item: pytest.Item, nextitem: pytest.Item | None, temp_root: Path) -> tuple[list[pytest.TestReport], list[Path]]:
    """One run of the test: its reports, and the crash logs written while it failed (none when it passed)."""
    started = time.time() - 1  # a log's mtime may lag the clock by up to a second's granularity
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    failed = any(report.failed for report in reports)
    return reports, crash_logs_since(temp_root, started) if failed else []


def _tear_down_module(item: pytest.Item) -> str:
    """Finalize the module's (and class's) fixtures, so that a server one of them started, which may be the
    one that crashed, is started afresh for the second run; what went wrong doing so, for the warning."""
    module = item.getparent(pytest.Module)
    try:
        item.session._setupstate.teardown_exact(module.parent if module else None)  # pytest has no public API
    except Exception as error:  # noqa: BLE001 (a crashed server's fixture may fail to stop it cleanly)
        return f" (tearing the module's fixtures down: {error!r})"
    return ""


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool:
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    temp_root = item.config._tmp_path_factory.getbasetemp()  # pytest has no public getter
    reports, crashes = _run(item, nextitem, temp_root)
    if crashes:
        item.warn(pytest.PytestWarning(
            f"Triton segfaulted ({', '.join(map(str, crashes))}) while the test failed "
            f"({_first_failure(reports)}): it ran once more{_tear_down_module(item)}"))
        reports, crashes = _run(item, nextitem, temp_root)
    if failed := next((report for report in reports if report.failed), None):
        for log in sorted({*crashes, *_dead_servers_logs()}):
            failed.sections.append((f"Triton log {log}", _log_tail(log)))
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True
