"""Ctrl-C and SIGTERM while a command waits for a person: one exception, so the command ends at once,
says so in one line, and has changed nothing (the wait runs before anything is started or written).

The signal is turned into an exception only where that is safe: while the wait sleeps between polls.
A signal that arrives during a poll (inside MLflow's client or its database driver) is held until the
poll returns, so no library is torn mid-call; a second signal during the same poll stops at once.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class WaitInterrupted(BaseException):  # like KeyboardInterrupt: no `except Exception` swallows it
    """SIGINT or SIGTERM arrived while the command waited for a person; nothing had been changed."""

    def __init__(self, signum: int, what: str) -> None:
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} while waiting for {what}: stopped; nothing was changed "
                         "(no server was started, no tag or alias was written)")


class _Stopper:
    """The signal handler and the sleep it may interrupt."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.pending: int | None = None
        self.sleeping = False

    def on_signal(self, signum: int, _frame: object) -> None:
        if self.sleeping or self.pending is not None:
            raise WaitInterrupted(signum, self.what)
        self.pending = signum

    def sleep(self, seconds: float) -> None:
        self.raise_pending()
        self.sleeping = True
        try:
            time.sleep(seconds)
        finally:
            self.sleeping = False

    def raise_pending(self) -> None:
        if self.pending is not None:
            raise WaitInterrupted(self.pending, self.what)


@contextmanager
def interruptible(what: str) -> Iterator[Callable[[float], None]]:
    """Within the block, SIGINT and SIGTERM raise WaitInterrupted from the yielded sleep (or at once if
    the block ends first). Off the main thread signals cannot be handled: the plain sleep is yielded."""
    if threading.current_thread() is not threading.main_thread():
        yield time.sleep
        return
    stopper = _Stopper(what)
    previous = {sig: signal.signal(sig, stopper.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stopper.sleep
        stopper.raise_pending()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
