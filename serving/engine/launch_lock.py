"""The lock between an engine thread's step launches and other Python work in its process, launches first.

On CUDA a step's eager launches give the interpreter lock up at every torch op; while another thread runs
Python, each launch waits up to the switch interval to win it back (hundreds of ops a prompt step), and the
GPU waits for the host. So other Python work (Triton's request intake) runs `between()` launches, and the
engine thread holds `launching()` while it launches.

The engine goes first: `between()` waits while a launch waits, and work holding it checks `launch_waits()`
between items and steps aside when it is true, so a launch waits for at most one item of other work, and
never for a whole burst of it (a plain lock, released and taken again at once by the thread that holds the
interpreter lock, can keep a waiting launch out for as long as that thread has work).

Imports: stdlib only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class LaunchLock:
    """One engine thread's `launching()`; any other thread's `between()` (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._waiting = 0  # launches waiting for the lock
        self._launching = False  # a launch holds the lock

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
        acquired = False
        try:
            acquired = self._lock.acquire()
        finally:
            with self._cond:
                self._waiting -= 1
                self._launching = acquired
                self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._launching = False
                self._cond.notify_all()
            self._lock.release()

    def wait_out_launch(self) -> None:
        """Return once no launch holds or waits for the lock, without taking it (work too small to need the
        lock that should still keep off the interpreter lock while a step launches)."""
        with self._cond:
            while self._launching or self._waiting:
                self._cond.wait()

    @contextlib.contextmanager
    def between(self) -> Iterator[None]:
        with self._cond:
            while self._waiting:
                self._cond.wait()
        with self._lock:
            yield

    def launch_waits(self) -> bool:
        """Whether a launch waits for the lock (work holding `between()` should step aside)."""
        return self._waiting > 0

    def locked(self) -> bool:
        return self._lock.locked()
