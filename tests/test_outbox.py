"""The decoupled llm model's outbox: one response per token while the sender keeps up, coalesced
responses (never a lost or reordered token) while it is behind, errors last."""

from __future__ import annotations

import threading
import time

import pytest

from serving.triton.models.outbox import Outbox


class Recorder:
    """A response sender that can be held, to make the outbox fall behind on purpose."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object, object]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.done = threading.Event()

    def tokens(self, name: str):
        def send(ids: list[int], reason: str | None) -> None:
            self.entered.set()
            self.gate.wait(10)
            self.sent.append((name, list(ids), reason))
            if reason is not None:
                self.done.set()
        return send

    def error(self, name: str):
        def send(message: str) -> None:
            self.sent.append((name, "error", message))
            self.done.set()
        return send


def test_one_response_per_token_while_the_sender_keeps_up() -> None:
    rec = Recorder()
    box = Outbox("t", print)
    stream = box.open(rec.tokens("a"), rec.error("a"), streaming=True)
    for i in range(5):
        sent_before = len(rec.sent)
        box.emit(stream, [i], "length" if i == 4 else None)
        for _ in range(1000):  # wait until the sender has taken it
            if len(rec.sent) > sent_before:
                break
            threading.Event().wait(0.001)
    assert rec.done.wait(5)
    box.stop()
    assert rec.sent == [("a", [0], None), ("a", [1], None), ("a", [2], None), ("a", [3], None), ("a", [4], "length")]
    assert box.stats.responses == 5 and box.stats.largest_chunk == 1


def test_a_late_sender_gets_every_waiting_token_in_one_response_in_order() -> None:
    rec = Recorder()
    box = Outbox("t", print)
    a = box.open(rec.tokens("a"), rec.error("a"), streaming=True)
    b = box.open(rec.tokens("b"), rec.error("b"), streaming=True)
    rec.gate.clear()
    box.emit(a, [1], None)
    assert rec.entered.wait(5)  # the sender is now stuck inside a's first send
    for t in range(2, 40):
        box.emit(a, [t], None)
        box.emit(b, [100 + t], None)
    box.emit(a, [40], "stop")
    box.emit(b, [140], "length")
    rec.gate.set()
    box.stop()
    a_sent = [x for x in rec.sent if x[0] == "a"]
    b_sent = [x for x in rec.sent if x[0] == "b"]
    assert a_sent == [("a", [1], None), ("a", list(range(2, 41)), "stop")]
    assert b_sent == [("b", list(range(102, 141)), "length")]
    assert box.stats.tokens == 40 + 39 and box.stats.largest_chunk == 39


def test_not_streaming_sends_once_and_an_error_comes_after_the_tokens() -> None:
    rec = Recorder()
    box = Outbox("t", print)
    whole = box.open(rec.tokens("whole"), rec.error("whole"), streaming=False)
    broken = box.open(rec.tokens("broken"), rec.error("broken"), streaming=True)
    rec.gate.clear()
    box.emit(whole, [1, 2], None)
    box.emit(broken, [7], None)
    assert rec.entered.wait(5)
    box.emit(broken, [8], None)
    box.fail(broken, "generate failed: boom")
    box.emit(broken, [9], None)  # after the failure: never sent
    box.emit(whole, [3], "length")
    rec.gate.set()
    box.stop()
    assert [x for x in rec.sent if x[0] == "whole"] == [("whole", [1, 2, 3], "length")]
    assert [x for x in rec.sent if x[0] == "broken"] == [
        ("broken", [7], None), ("broken", [8], None), ("broken", "error", "generate failed: boom")]


def test_a_failing_send_is_logged_and_the_others_still_go_out() -> None:
    errors: list[str] = []
    rec = Recorder()
    box = Outbox("t", errors.append)

    def explode(ids: list[int], reason: str | None) -> None:
        raise RuntimeError("client went away")

    bad = box.open(explode, rec.error("bad"), streaming=True)
    good = box.open(rec.tokens("good"), rec.error("good"), streaming=True)
    box.emit(bad, [1], "length")
    box.emit(good, [2], "length")
    box.stop()
    assert rec.sent == [("good", [2], "length")]
    assert box.stats.failed_sends == 1 and "client went away" in errors[0]


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.001)
    return False


def test_stream_interval_paces_middle_responses_but_never_the_first_or_the_final() -> None:
    rec = Recorder()
    box = Outbox("t", print, stream_interval_s=0.3)
    stream = box.open(rec.tokens("a"), rec.error("a"), streaming=True)
    stamps: list[float] = []
    started = time.monotonic()
    box.emit(stream, [0], None)
    assert _wait_for(lambda: len(rec.sent) == 1)
    stamps.append(time.monotonic())
    for t in range(1, 6):
        box.emit(stream, [t], None)
    assert _wait_for(lambda: len(rec.sent) == 2)
    stamps.append(time.monotonic())
    box.emit(stream, [6], None)
    box.emit(stream, [7], "length")  # final: goes out at once, with the token that was waiting
    assert _wait_for(lambda: len(rec.sent) == 3)
    stamps.append(time.monotonic())
    box.stop()
    assert rec.sent == [("a", [0], None), ("a", [1, 2, 3, 4, 5], None), ("a", [6, 7], "length")]
    assert stamps[0] - started < 0.25  # the first token was not held back
    assert stamps[1] - stamps[0] >= 0.25  # the middle ones waited out the interval
    assert stamps[2] - stamps[1] < 0.25  # the final one did not


def test_a_paced_stream_failing_is_sent_at_once_and_stop_flushes_without_waiting() -> None:
    rec = Recorder()
    box = Outbox("t", print, stream_interval_s=30.0)
    failing = box.open(rec.tokens("f"), rec.error("f"), streaming=True)
    waiting = box.open(rec.tokens("w"), rec.error("w"), streaming=True)
    box.emit(failing, [1], None)
    box.emit(waiting, [10], None)
    assert _wait_for(lambda: len(rec.sent) == 2)
    box.emit(failing, [2], None)
    box.emit(waiting, [11], None)
    box.fail(failing, "boom")
    assert _wait_for(lambda: len(rec.sent) == 4)
    started = time.monotonic()
    box.stop()
    assert time.monotonic() - started < 5.0
    assert [x for x in rec.sent if x[0] == "f"] == [("f", [1], None), ("f", [2], None), ("f", "error", "boom")]
    assert [x for x in rec.sent if x[0] == "w"] == [("w", [10], None), ("w", [11], None)]


def test_a_negative_stream_interval_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="stream_interval_s=-1"):
        Outbox("t", print, stream_interval_s=-1)
