"""The in-flight llm's request intake (`serving.triton.models.intake`) and the launch lock it takes turns on
(`serving.engine.launch_lock`): order, launches first, the limit, and nothing dropped at unload. The same
path through a real Triton server: tests/test_triton_streaming.py and tests/test_triton_server.py."""

from __future__ import annotations

import threading
import time

import pytest

from serving.engine.launch_lock import LaunchLock
from serving.triton.models.intake import Full, Intake


def make_intake(admit, *, lock: LaunchLock | None = None, limit: int | None = None):
    lock = lock or LaunchLock()
    refused: list[tuple[object, str]] = []
    errors: list[str] = []
    intake = Intake(admit, lambda item, msg: refused.append((item, msg)), between_launches=lock.between,
                    launch_waits=lock.launch_waits, on_error=errors.append, name="t", limit=limit,
                    limit_setting="max_queue_size")
    return intake, refused, errors


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_requests_are_admitted_in_the_order_execute_queued_them() -> None:
    admitted: list[int] = []
    intake, refused, errors = make_intake(admitted.append)
    intake.start()
    for i in range(200):
        intake.put(i)
    wait_for(lambda: len(admitted) == 200)
    intake.stop()
    assert admitted == list(range(200)) and not refused and not errors


def test_nothing_is_admitted_while_a_step_launches() -> None:
    lock = LaunchLock()
    admitted: list[int] = []
    intake, _, _ = make_intake(admitted.append, lock=lock)
    intake.start()
    with lock.launching():
        intake.put(1)
        time.sleep(0.1)
        assert admitted == []
    wait_for(lambda: admitted == [1])
    intake.stop()


def test_a_waiting_launch_goes_before_the_rest_of_a_burst() -> None:
    """A launch that waits while the intake admits a burst gets the lock after the item in hand, not after the
    burst; the intake then takes the rest in a later turn."""
    lock = LaunchLock()
    admitted: list[int] = []
    launched_after: list[int] = []
    first = threading.Event()
    release = threading.Event()

    def admit(i: int) -> None:
        admitted.append(i)
        if i == 0:
            first.set()
            release.wait(5)  # hold the first item until a launch waits

    intake, _, _ = make_intake(admit, lock=lock)
    for i in range(50):
        intake.put(i)
    intake.start()
    assert first.wait(5)

    def launch() -> None:
        with lock.launching():
            launched_after.append(len(admitted))

    launcher = threading.Thread(target=launch)
    launcher.start()
    wait_for(lock.launch_waits)
    release.set()
    launcher.join(5)
    wait_for(lambda: len(admitted) == 50)
    intake.stop()
    assert launched_after == [1], launched_after
    assert admitted == list(range(50)) and intake.turns >= 2


def test_between_waits_for_a_launch_that_waits() -> None:
    """`between` does not take the lock while a launch waits for it: launches first."""
    lock = LaunchLock()
    order: list[str] = []
    with lock.between():
        def launch() -> None:
            with lock.launching():
                order.append("launch")
                time.sleep(0.05)

        launcher = threading.Thread(target=launch)
        launcher.start()
        wait_for(lock.launch_waits)
        def between() -> None:
            with lock.between():
                order.append("between")

        other = threading.Thread(target=between)
        other.start()
        time.sleep(0.05)
    launcher.join(5)
    other.join(5)
    assert order == ["launch", "between"]


def test_past_the_limit_a_request_is_refused_naming_the_setting() -> None:
    intake, _, _ = make_intake(lambda i: None, limit=2)  # not started: nothing is taken
    intake.put(1)
    intake.put(2)
    with pytest.raises(Full, match=r"resource exhausted: 2 requests .*max_queue_size=2"):
        intake.put(3)


def test_at_unload_every_queued_request_is_answered_and_no_new_one_taken() -> None:
    intake, refused, _ = make_intake(lambda i: None)  # not started: all stay queued
    for i in range(3):
        intake.put(i)
    intake.stop()
    assert [item for item, _ in refused] == [0, 1, 2]
    assert all("unloading" in msg for _, msg in refused)
    with pytest.raises(RuntimeError, match="unloading"):
        intake.put(4)


def test_an_admission_that_raises_answers_its_request_and_the_intake_goes_on() -> None:
    admitted: list[int] = []

    def admit(i: int) -> None:
        if i == 1:
            raise ValueError("broken")
        admitted.append(i)

    intake, refused, errors = make_intake(admit)
    intake.start()
    for i in range(3):
        intake.put(i)
    wait_for(lambda: len(admitted) == 2)
    intake.stop()
    assert admitted == [0, 2]
    assert refused == [(1, "internal error: ValueError: broken")] and "broken" in errors[0]


def test_waiting_out_a_launch_takes_no_lock_and_returns_when_it_ends() -> None:
    """`wait_out_launch` (the llm's `execute_waits_launches`): Triton's thread waits while a launch holds or
    waits for the lock, and not while the intake holds it between launches."""
    lock = LaunchLock()
    returned = threading.Event()
    with lock.launching():
        waiter = threading.Thread(target=lambda: (lock.wait_out_launch(), returned.set()))
        waiter.start()
        assert not returned.wait(0.1), "returned while a step launched"
    assert returned.wait(5)
    waiter.join(5)
    with lock.between():  # the intake's turn: no launch, nothing to wait out
        lock.wait_out_launch()
