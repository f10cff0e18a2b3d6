"""Opt-in: the CPU seconds each test costs, its setup, call and teardown together, with every process it starts.

``ENGINEWRIGHT_CPU_PROFILE=<file> pytest ...`` appends one JSON line per test to ``<file>`` (one per xdist worker,
suffixed with the worker's name): the worker's own CPU, plus the CPU its live descendants (servers, Triton stubs,
CLIs) spent meanwhile, plus what its reaped children spent. Sum the lines by file to see where a run's CPU goes;
wall time follows total CPU on CI's two saturated cores."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

ENV_PROFILE = "ENGINEWRIGHT_CPU_PROFILE"
_TICK = os.sysconf("SC_CLK_TCK")


def _children_of() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def _tree_cpu(root: int) -> dict[int, float]:
    """CPU seconds of each live descendant of ``root`` (with what it reaped), by pid."""
    children, cpu = _children_of(), {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu[pid] = sum(int(f) for f in fields[11:15]) / _TICK
    return cpu


def _own() -> tuple[float, float]:
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    target = os.environ.get(ENV_PROFILE)
    if not target:
        yield
        return
    me = os.getpid()
    own_0, reaped_0 = _own()
    tree_0 = _tree_cpu(me)
    start, started_at = time.monotonic(), time.time()
    yield
    own_1, reaped_1 = _own()
    tree_1 = _tree_cpu(me)
    # a descendant gone by the end is counted whole where it was reaped (here or in a live descendant)
    descendants = sum(cpu - tree_0.get(pid, 0.0) for pid, cpu in tree_1.items()) - sum(
        cpu for pid, cpu in tree_0.items() if pid not in tree_1)
    line = {"test": item.nodeid, "file": item.path.name, "started_at": round(started_at, 2),
            "wall_s": round(time.monotonic() - start, 2),
            "own_s": round(own_1 - own_0, 2), "children_s": round(reaped_1 - reaped_0 + descendants, 2)}
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(f"{target}.{worker}", "a") as out:
        out.write(json.dumps(line) + "\n")
