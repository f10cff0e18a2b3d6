"""The send benchmark on the CPU: the real bundled Triton's python backend sends every response of
each burst, on one thread and on several."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.send_bench import run_send_bench

pytestmark = pytest.mark.slow
pytest.importorskip("tritonclient.grpc")


def test_bursts_are_sent_whole_on_one_thread_and_on_several(tmp_path: Path) -> None:
    report = run_send_bench(tmp_path, burst=6, threads=(1, 3), rounds=2, out_json=tmp_path / "sends.json")
    assert json.loads((tmp_path / "sends.json").read_text()) == report
    assert report["threads"].keys() == {"1", "3"}
    for figures in report["threads"].values():
        assert len(figures["samples_ms"]) == 2 and all(ms > 0 for ms in figures["samples_ms"])
        assert figures["per_response_ms"] == pytest.approx(figures["median_ms"] / 6)
