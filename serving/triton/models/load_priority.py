"""An engine's load at the CPU's idle priority, below the model's serving threads.

A candidate version loads beside the live one, on the same host: its stub imports torch and reads the
weights (on the 2-core CI machine, about 1.2 s of a core), and the live version's requests that wake up
while it holds a core wait for it. The load runs on a thread of its own under Linux's SCHED_IDLE policy:
the scheduler gives it only what the other threads leave and preempts it at once for any of them. Linux keeps
the policy per thread, so the threads that serve afterwards (started by the caller) keep the caller's.
Entering SCHED_IDLE needs no privilege; leaving it would, which is why the load gets a thread of its own.

Imports: stdlib only.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
LOAD_PRIORITIES = ("idle", "normal")


def load_at_priority(load: Callable[[], T], *, priority: str, name: str,
                     log: Callable[[str], None] = print) -> T:
    """`load()`'s result; with `priority` "idle", computed on a thread of the SCHED_IDLE policy (where the
    platform has none or refuses it, `log` says so and the thread keeps the caller's priority), with
    "normal" on this thread. `load`'s exception is raised here."""
    if priority not in LOAD_PRIORITIES:
        raise ValueError(f"priority={priority!r} must be one of {', '.join(LOAD_PRIORITIES)}")
    if priority == "normal":
        return load()
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
        except (AttributeError, OSError) as exc:
            log(f"loading at the caller's CPU priority: the idle policy is not available here "
                f"({type(exc).__name__}: {exc})")
        try:
            outcome.append(load())
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread below
            failure.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]
