"""The served report's latency plot: a PNG with the three distributions, from a report's samples."""

from __future__ import annotations

import json
from pathlib import Path

from bench.plots import plot_served


def test_plot_served_writes_a_png(tmp_path: Path) -> None:
    report = {"shape": "tiny", "clients": 4, "prompt_len": 16, "gen_len": 24, "output_tok_s": 969.2,
              "tokens_per_response": 1.25,
              "samples": {"ttft_ms": [30.0, 34.5, 99.9], "tpot_ms": [2.4, 2.5, 3.4], "itl_ms": [2.6, 10.1]}}
    src = tmp_path / "served.json"
    src.write_text(json.dumps(report))
    out = plot_served(src, tmp_path / "plots" / "served.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
