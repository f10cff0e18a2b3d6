"""The decoupled `llm` model's request timing (`serving.triton.models.request_timing`), without Triton; the
served benchmark's test reads the same figures back from a real Triton's log (tests/test_bench_served.py)."""

from __future__ import annotations

import math

import pytest

from serving.triton.models.request_timing import FirstTokenTimes, IntakeStats, nearest_rank


def test_nearest_rank_percentiles() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [nearest_rank(values, q) for q in (0, 20, 50, 99, 100)] == [1.0, 1.0, 3.0, 5.0, 5.0]
    assert math.isnan(nearest_rank([], 50))


def test_first_token_times_split_each_request_into_wait_engine_and_send() -> None:
    times = FirstTokenTimes()
    for i in range(100):  # received, submitted 1 ms later, first token after 10 + i ms, sent 2 ms after it
        times.add(0.0, 0.001, 0.011 + i / 1e3, 0.013 + i / 1e3)
    stats = times.stats()
    assert stats.requests == 100
    assert stats.wait_ms_p50 == pytest.approx(1.0) and stats.send_ms_p99 == pytest.approx(2.0)
    assert stats.engine_ms_p50 == pytest.approx(59.0) and stats.engine_ms_p99 == pytest.approx(108.0)
    assert FirstTokenTimes().stats().requests == 0


def test_intake_stats_add_up() -> None:
    intake = IntakeStats()
    for seconds in (0.002, 0.005, 0.001):
        intake.add(seconds)
    assert (intake.requests, intake.longest_s) == (3, 0.005) and intake.seconds == pytest.approx(0.008)


def test_first_token_times_keep_only_the_last_requests(monkeypatch) -> None:
    from serving.triton.models import request_timing

    monkeypatch.setattr(request_timing, "FIRST_TOKENS_KEPT", 3)
    times = FirstTokenTimes()
    for i in range(5):
        times.add(0.0, 0.0, i / 1e3, i / 1e3)
    assert times.stats().requests == 3 and times.stats().engine_ms_p50 == pytest.approx(3.0)
