"""The in-flight ``llm`` model's request intake: Triton's ``execute`` queues, one thread hands over.

Without a dynamic batcher Triton calls ``execute`` once a request, one call after another. When each call
also handed its request to the scheduler, it waited for the engine thread to finish launching a step
(`SchedulerLoop.between_launches`), and a burst of arrivals queued in Triton behind those waits: at 1,024
streams of the 8B engine on the H200 each request spent 1.2-1.3 s in Triton's queue on average (its queue
counter), most of a client's time to its first token. Now ``execute`` reads each request's inputs (they
live in shared memory only until it returns), answers a malformed one, and queues the rest here; this
thread takes them in order and hands each to `admit` between the engine's launches, all that arrived
meanwhile in one turn (stepping aside after any item while a launch waits: `launch_waits`).

`put` refuses past `limit` queued requests (`Full`: an overload the client retries); `stop` ends the thread
and answers every request still queued through `refuse`, so none is dropped.

Imports: stdlib only.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")


class Full(Exception):
    """The intake already holds its `limit` of requests."""


class Intake(Generic[Item]):
    """Items queued by ``execute`` (`put`), handed to `admit` on the intake's own thread (see the module doc)."""

    def __init__(self, admit: Callable[[Item], None], refuse: Callable[[Item, str], None], *,
                 between_launches: Callable[[], contextlib.AbstractContextManager[Any]],
                 launch_waits: Callable[[], bool], on_error: Callable[[str], None], name: str,
                 limit: int | None = None, limit_setting: str = "limit") -> None:
        self.admit = admit
        self.refuse = refuse
        self.between_launches = between_launches
        self.launch_waits = launch_waits
        self.on_error = on_error
        self.limit = limit
        self.limit_setting = limit_setting
        self.pending: collections.deque[Item] = collections.deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.turns = 0  # times the thread took the launch lock
        self.thread = threading.Thread(target=self._run, name=f"intake-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def put(self, item: Item) -> None:
        """Queue `item` (any thread); raises `Full` past the limit and RuntimeError once stopping."""
        with self.cond:
            if self.stopping:
                raise RuntimeError("the model is unloading; request not accepted")
            if self.limit is not None and len(self.pending) >= self.limit:
                raise Full(f"resource exhausted: {len(self.pending)} requests already wait for the engine's intake "
                           f"({self.limit_setting}={self.limit}): try again later")
            self.pending.append(item)
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.pending and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return
            with self.between_launches():
                self.turns += 1
                self._admit_pending()

    def _admit_pending(self) -> None:
        """Admit what is queued, in order, until it runs out or a launch waits."""
        while True:
            with self.cond:
                if not self.pending or self.stopping:
                    return
                item = self.pending.popleft()
            try:
                self.admit(item)
            except Exception as exc:  # noqa: BLE001 - `admit` answers its own errors; this is a bug
                self.on_error(f"intake: {type(exc).__name__}: {exc}")
                self._refuse(item, f"internal error: {type(exc).__name__}: {exc}")
            if self.launch_waits():
                return

    def _refuse(self, item: Item, message: str) -> None:
        try:
            self.refuse(item, message)
        except Exception as exc:  # noqa: BLE001
            self.on_error(f"intake: answering a refused request failed: {type(exc).__name__}: {exc}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the thread (after the item it admits), then refuse what is still queued."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout_s)
        with self.cond:
            left, self.pending = list(self.pending), collections.deque()
        for item in left:
            self._refuse(item, "the model is unloading; the request was not started")
