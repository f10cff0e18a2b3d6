"""Ctrl-C during a wait becomes WaitInterrupted only at a safe point: in the wait's sleep, never inside a
poll (a library torn mid-call logs tracebacks of its own, seen from SQLAlchemy in CI). A second signal
during the same poll, or the block ending with a signal held, stops too."""

from __future__ import annotations

import os
import signal

import pytest

from flows.interrupt import WaitInterrupted, interruptible


def test_a_signal_during_a_poll_is_raised_at_the_next_sleep() -> None:
    polled_on = False
    with pytest.raises(WaitInterrupted, match="SIGINT while waiting for the approval"), \
            interruptible("the approval") as sleep:
        os.kill(os.getpid(), signal.SIGINT)  # handled now, while "polling": held, not raised
        polled_on = True
        sleep(5)
    assert polled_on


def test_a_signal_during_the_sleep_stops_it() -> None:
    with pytest.raises(WaitInterrupted) as stopped, interruptible("the approval") as sleep:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        previous = signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
        try:
            sleep(10)
        finally:
            signal.signal(signal.SIGALRM, previous)
    assert stopped.value.signum == signal.SIGTERM


def test_a_second_signal_stops_at_once_and_a_held_one_stops_at_the_end() -> None:
    with pytest.raises(WaitInterrupted), interruptible("the approval"):
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(WaitInterrupted):
            os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(WaitInterrupted), interruptible("the approval"):
        os.kill(os.getpid(), signal.SIGTERM)


def test_the_handlers_are_restored() -> None:
    before = signal.getsignal(signal.SIGINT)
    with interruptible("the approval"):
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before
