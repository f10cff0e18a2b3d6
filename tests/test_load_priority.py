"""The llm's engine load at the CPU's idle priority: a thread of its own under SCHED_IDLE, while the threads
that serve keep the model's policy (Linux keeps it per thread)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from serving.triton.models.load_priority import load_at_priority
from serving.triton.models.params import check_parameters

ROOT = Path(__file__).resolve().parents[1]
linux_only = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="the SCHED_IDLE policy is Linux's")


@linux_only
def test_the_load_runs_idle_on_a_thread_of_its_own_and_the_caller_keeps_its_policy() -> None:
    before = os.sched_getscheduler(0)
    assert before != os.SCHED_IDLE
    seen = load_at_priority(lambda: (threading.get_ident(), os.sched_getscheduler(0)), priority="idle", name="load")
    assert seen == (seen[0], os.SCHED_IDLE) and seen[0] != threading.get_ident()
    assert os.sched_getscheduler(0) == before
    # a thread the caller starts afterwards (the engine's, the intake's) gets the caller's policy
    after: list[int] = []
    worker = threading.Thread(target=lambda: after.append(os.sched_getscheduler(0)))
    worker.start()
    worker.join()
    assert after == [before]


def test_the_loads_error_is_raised_to_the_caller() -> None:
    def fail() -> None:
        raise FileNotFoundError("no engine here")

    with pytest.raises(FileNotFoundError, match="no engine here"):
        load_at_priority(fail, priority="idle", name="load")


def test_where_the_idle_policy_is_refused_the_load_goes_on_and_says_so(monkeypatch) -> None:
    def refuse(*_: object) -> None:
        raise PermissionError("not here")

    monkeypatch.setattr(os, "sched_setscheduler", refuse, raising=False)
    said: list[str] = []
    assert load_at_priority(lambda: 7, priority="idle", name="load", log=said.append) == 7
    assert len(said) == 1 and "caller's CPU priority" in said[0] and "not here" in said[0]


def test_normal_loads_on_the_callers_thread() -> None:
    assert load_at_priority(threading.get_ident, priority="normal", name="load") == threading.get_ident()


def test_an_unknown_priority_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="priority='low'"):
        load_at_priority(lambda: None, priority="low", name="load")
    with pytest.raises(ValueError, match="load_priority='low' must be one of idle, normal"):
        check_parameters({"load_priority": "low"})


def test_the_llm_model_imports_torch_only_when_it_loads_an_engine() -> None:
    """Importing the model file (which the stub does at the model's priority) must not import torch: torch's
    import is most of a CPU engine's load, and it belongs on the load's idle thread. Nor the package's
    client-side modules (repository, operations, the HTTP client): they were ~40% of the stub's start."""
    client_side = ("torch", "serving.triton.client", "serving.triton.operations", "serving.triton.repository",
                   "serving.triton.process")
    probe = f"import sys, serving.triton.models.llm; print([m for m in {client_side!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]", out.stderr
