"""Ctrl-C and SIGTERM while a command waits for a person: one exception, so the command ends at once,
says so in one line, and has changed nothing (the wait runs before anything is started or written)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class WaitInterrupted(BaseException):  # like KeyboardInterrupt: no `except Exception` swallows it
    """SIGINT or SIGTERM arrived while the command waited for a person; nothing had been changed."""

    def __init__(self, signum: int, what: str) -> None:
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} while waiting for {what}: stopped; nothing was changed "
                         "(no server was started, no tag or alias was written)")


@contextmanager
def interruptible(what: str) -> Iterator[None]:
    """Turn SIGINT and SIGTERM into WaitInterrupted for the block (the main thread only; restored after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: object) -> None:
        raise WaitInterrupted(signum, what)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
