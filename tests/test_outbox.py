"""The decoupled llm model's outbox, pumped by the engine thread: one response per token while the
pump keeps up, coalesced responses (never a lost or reordered token) while it is behind, first and
final responses before middle ones, errors last, middle responses paced by `stream_interval_s`."""

from __future__ import annotations

import threading
import time

import pytest

from serving.triton.models.outbox import Outbox


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, object, object]] = []

    def tokens(self, name: str):
        def send(ids: list[int], reason: str | None, text: str = "") -> None:
            self.sent.append((name, list(ids), reason))
        return send

    def error(self, name: str):
        def send(message: str, cancelled: bool) -> None:
            self.sent.append((name, "cancelled" if cancelled else "error", message))
        return send


def pump(box: Outbox) -> int:
    n = 0
    while box.send_next():
        n += 1
    return n


def open_streams(box: Outbox, rec: Recorder, *names: str, streaming: bool = True):
    return [box.open(rec.tokens(n), rec.error(n), streaming=streaming) for n in names]


def test_one_response_per_token_while_the_pump_keeps_up() -> None:
    rec, box = Recorder(), Outbox("t", print)
    (stream,) = open_streams(box, rec, "a")
    for i in range(5):
        box.emit(stream, [i], "length" if i == 4 else None)
        assert pump(box) == 1
    assert rec.sent == [("a", [0], None), ("a", [1], None), ("a", [2], None), ("a", [3], None), ("a", [4], "length")]
    assert box.stats.responses == 5 and box.stats.largest_chunk == 1 and box.pending() == 0
    assert not box.send_next()


def test_a_late_pump_sends_every_waiting_token_in_one_response_in_order() -> None:
    rec, box = Recorder(), Outbox("t", print)
    a, b = open_streams(box, rec, "a", "b")
    box.emit(a, [1], None)
    pump(box)
    for t in range(2, 40):
        box.emit(a, [t], None)
        box.emit(b, [100 + t], None)
    box.emit(a, [40], "stop")
    box.emit(b, [140], "length")
    assert pump(box) == 2
    # b waited for its first response before a's last token made a's urgent: urgent ones go in that order
    assert rec.sent == [("a", [1], None), ("b", list(range(102, 141)), "length"), ("a", list(range(2, 41)), "stop")]
    assert box.stats.tokens == 40 + 39 and box.stats.largest_chunk == 39


def test_first_and_final_responses_go_before_middle_ones() -> None:
    rec, box = Recorder(), Outbox("t", print)
    mid, new, ending = open_streams(box, rec, "mid", "new", "ending")
    box.emit(mid, [1], None)
    box.emit(ending, [10], None)
    pump(box)  # both have had their first response
    box.emit(mid, [2], None)  # middle, waiting longest
    box.emit(new, [20], None)  # a first response
    box.emit(ending, [11], "stop")  # a final response
    pump(box)
    assert [name for name, _, _ in rec.sent[2:]] == ["new", "ending", "mid"]


def test_not_streaming_sends_once_and_an_error_comes_after_the_tokens() -> None:
    rec, box = Recorder(), Outbox("t", print)
    (whole,) = open_streams(box, rec, "whole", streaming=False)
    (broken,) = open_streams(box, rec, "broken")
    box.emit(whole, [1, 2], None)
    box.emit(broken, [7], None)
    pump(box)
    box.emit(broken, [8], None)
    box.fail(broken, "generate failed: boom")
    box.emit(broken, [9], None)  # after the failure: never sent
    box.emit(whole, [3], "length")
    pump(box)
    assert [x for x in rec.sent if x[0] == "whole"] == [("whole", [1, 2, 3], "length")]
    assert [x for x in rec.sent if x[0] == "broken"] == [
        ("broken", [7], None), ("broken", [8], None), ("broken", "error", "generate failed: boom")]


def test_a_failing_send_is_logged_and_the_others_still_go_out() -> None:
    errors: list[str] = []
    rec, box = Recorder(), Outbox("t", errors.append)

    def explode(ids: list[int], reason: str | None, text: str = "") -> None:
        raise RuntimeError("client went away")

    bad = box.open(explode, rec.error("bad"), streaming=True)
    (good,) = open_streams(box, rec, "good")
    box.emit(bad, [1], "length")
    box.emit(good, [2], "length")
    pump(box)
    assert rec.sent == [("good", [2], "length")]
    assert box.stats.failed_sends == 1 and "client went away" in errors[0]


def test_stream_interval_paces_middle_responses_but_never_the_first_or_the_final() -> None:
    rec, box = Recorder(), Outbox("t", print, stream_interval_s=0.2)
    (stream,) = open_streams(box, rec, "a")
    box.emit(stream, [0], None)
    first = time.monotonic()  # before the send, which stamps the interval's start at or after it
    assert box.send_next()  # the first response is never held back
    box.emit(stream, [1], None)
    box.emit(stream, [2], None)
    assert not box.send_next() and box.pending() == 1  # a middle one waits out the interval
    while not box.send_next():
        time.sleep(0.005)
    assert time.monotonic() - first >= 0.2
    box.emit(stream, [3], None)
    box.emit(stream, [4], "length")
    assert box.send_next()  # the final one is not held back, and carries the token that waited
    assert rec.sent == [("a", [0], None), ("a", [1, 2], None), ("a", [3, 4], "length")]


def test_flush_sends_paced_responses_at_once() -> None:
    rec, box = Recorder(), Outbox("t", print, stream_interval_s=30.0)
    a, b = open_streams(box, rec, "a", "b")
    box.emit(a, [1], None)
    box.emit(b, [10], None)
    pump(box)
    box.emit(a, [2], None)
    box.emit(b, [11], None)
    box.fail(a, "boom")
    assert pump(box) == 1  # a's failure is final; b's middle token waits 30 s
    box.flush()
    assert [x for x in rec.sent if x[0] == "a"] == [("a", [1], None), ("a", [2], None), ("a", "error", "boom")]
    assert [x for x in rec.sent if x[0] == "b"] == [("b", [10], None), ("b", [11], None)]


def test_a_negative_stream_interval_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="stream_interval_s=-1"):
        Outbox("t", print, stream_interval_s=-1)


def test_a_cancelled_stream_is_noticed_when_nothing_is_due_and_asked_at_most_every_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from serving.triton.models import outbox as outbox_mod

    monkeypatch.setattr(outbox_mod, "CANCEL_CHECK_S", 0.1)
    CANCEL_CHECK_S = 0.1
    rec, box = Recorder(), Outbox("t", print)
    asked: list[str] = []
    gone: set[str] = set()
    cancelled: list[str] = []

    def watch(name: str):
        def is_cancelled() -> bool:
            asked.append(name)
            return name in gone
        return box.open(rec.tokens(name), rec.error(name), streaming=True, is_cancelled=is_cancelled,
                        on_cancel=lambda: cancelled.append(name))

    a = watch("a")
    watch("b")
    box.emit(a, [1], None)
    assert box.send_next() and asked == []  # a response was due: no question asked
    assert not box.send_next() and asked == []  # just opened: first asked an interval later
    time.sleep(CANCEL_CHECK_S + 0.01)
    box.drain()
    assert asked == []  # an idle drain only sends
    assert box.send_next() and box.send_next() and asked == ["a", "b"]  # then one question per call
    assert not box.send_next()  # both asked within the interval: nothing to do
    gone.add("b")
    time.sleep(CANCEL_CHECK_S + 0.01)
    assert pump(box) == 2 and cancelled == ["b"]
    time.sleep(CANCEL_CHECK_S + 0.01)
    box.emit(a, [2], "length")  # a closes: no longer asked
    pump(box)
    time.sleep(CANCEL_CHECK_S + 0.01)
    assert not box.send_next() and asked == ["a", "b", "a", "b"]
    assert rec.sent == [("a", [1], None), ("a", [2], "length")]


def test_a_cancellation_failure_is_sent_as_one() -> None:
    rec, box = Recorder(), Outbox("t", print)
    (stream,) = open_streams(box, rec, "a")
    box.emit(stream, [1], None)
    box.fail(stream, "gone", cancelled=True)
    pump(box)
    assert rec.sent == [("a", [1], None), ("a", "cancelled", "gone")]


def test_an_idle_drain_sends_on_every_idle_sender_at_once() -> None:
    senders = 4
    together = threading.Barrier(senders, timeout=10)  # broken (and the send fails) unless 4 sends overlap
    threads: set[str] = set()
    rec, box = Recorder(), Outbox("t", print, idle_senders=senders)
    streams = open_streams(box, rec, *"abcdefgh")
    for stream in streams:
        send = stream.send_tokens

        def overlapping(ids: list[int], reason: str | None, text: str = "", send=send) -> None:
            threads.add(threading.current_thread().name)
            together.wait()
            send(ids, reason)

        stream.send_tokens = overlapping
        box.emit(stream, [1, 2], "length")
    box.drain()
    box.close()
    assert sorted(name for name, _, _ in rec.sent) == list("abcdefgh")
    assert all(ids == [1, 2] and reason == "length" for _, ids, reason in rec.sent)
    assert len(threads) == senders and box.stats.responses == 8 and box.stats.failed_sends == 0
    assert box.pending() == 0


def test_a_stream_is_never_in_two_sends_at_once_so_its_responses_stay_in_order() -> None:
    rec, box = Recorder(), Outbox("t", print, idle_senders=3)
    (a,) = open_streams(box, rec, "a")
    in_flight: list[int] = []
    most: list[int] = [0]
    send = a.send_tokens

    def slow(ids: list[int], reason: str | None, text: str = "") -> None:
        in_flight.append(1)
        most[0] = max(most[0], len(in_flight))
        if ids == [1]:
            box.emit(a, [2], None)  # new tokens while its first response is still being sent
            box.emit(a, [3], "length")
            time.sleep(0.05)  # the other senders look for work meanwhile
        send(ids, reason)
        in_flight.pop()

    a.send_tokens = slow
    box.emit(a, [1], None)
    box.drain()
    box.drain()  # the senders that found `a` busy gave up; its newer tokens went out now or here
    box.close()
    assert most[0] == 1
    assert rec.sent == [("a", [1], None), ("a", [2, 3], "length")]


def test_idle_senders_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="idle_senders=0"):
        Outbox("t", print, idle_senders=0)


def test_busy_senders_send_at_once_while_busy_and_stop_when_the_step_is_done() -> None:
    """`send_while(busy)` on 3 threads: sends overlap (a barrier of 3 would break otherwise); once `busy()`
    turns false the helpers stop and what is still due waits for the next call; with nothing busy this
    thread still sends one."""
    senders = 3
    together = threading.Barrier(senders, timeout=10)
    threads: set[str] = set()
    rec, box = Recorder(), Outbox("t", print, busy_senders=senders)
    streams = open_streams(box, rec, *"abcdefghij")
    calls = {"sent": 0}
    lock = threading.Lock()
    for stream in streams:
        send = stream.send_tokens

        def overlapping(ids: list[int], reason: str | None, text: str = "", send=send) -> None:
            threads.add(threading.current_thread().name)
            with lock:
                calls["sent"] += 1
                first_round = calls["sent"] <= senders
            if first_round:
                together.wait()
            send(ids, reason)

        stream.send_tokens = overlapping
        box.emit(stream, [1], None)
    box.send_while(lambda: calls["sent"] < 6)  # busy for about 6 sends
    assert len(threads) == senders and box.stats.failed_sends == 0
    assert 6 <= len(rec.sent) <= 6 + senders - 1 and box.pending() == 10 - len(rec.sent)
    before = len(rec.sent)
    box.send_while(lambda: False)  # not busy: one send on this thread, none on the helpers
    box.close()
    assert len(rec.sent) == before + 1 and threads >= {threading.current_thread().name}


def test_busy_senders_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="busy_senders=0"):
        Outbox("t", print, busy_senders=0)
