"""The served benchmark's harness end to end on the CPU: a tiny random engine in the real bundled Triton,
streaming gRPC client processes, two variants of the llm model's parameters measured in turn, the
scheduler's and the outbox's counters read back from Triton's log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serving.bench.served import parse_variant, run_served

pytestmark = pytest.mark.slow
pytest.importorskip("tritonclient.grpc")


def test_two_variants_measured_in_turn_with_their_counters(tmp_path: Path) -> None:
    clients, per_client, gen_len = 3, 2, 24
    report = run_served(shape="tiny", clients=clients, requests_per_client=per_client, prompt_len=8, gen_len=gen_len,
                        max_batch_size=4, work=tmp_path, out_json=tmp_path / "served.json", compile_decode=False,
                        variants=(parse_variant("plain"), parse_variant("paced:stream_interval_ms=40")))
    assert json.loads((tmp_path / "served.json").read_text())["variants"].keys() == {"plain", "paced"}
    expected = clients * per_client * gen_len
    for label in ("plain", "paced"):
        figures = report["variants"][label]
        assert figures["n_errors"] == 0, figures["errors"]
        assert figures["output_tokens"] == expected
        assert figures["counters"]["scheduler"]["tokens"] == expected
        assert figures["counters"]["outbox"]["tokens"] == expected
        assert figures["counters"]["outbox"]["responses"] == figures["responses"]
        assert figures["ttft_ms_p50"] > 0 and figures["tpot_ms_p50"] > 0
    assert report["variants"]["paced"]["parameters"]["stream_interval_ms"] == "40"
    # pacing: fewer, fuller responses, every stream's first and final one still sent
    assert report["variants"]["paced"]["responses"] < report["variants"]["plain"]["responses"]
    assert report["variants"]["paced"]["responses"] >= 2 * clients * per_client
    assert report["output_tok_s"] == report["variants"]["plain"]["output_tok_s"]


@pytest.mark.parametrize("text", ["bad label:x=1", "ok:novalue", "ok:=3"])
def test_a_malformed_variant_is_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match="--variant"):
        parse_variant(text)


def test_offline_engine_report_has_the_scheduler_figure_of_the_same_workload(tmp_path: Path) -> None:
    from serving.bench.served import bench_offline_engine, build_random_engine

    engine_dir = build_random_engine("tiny", tmp_path, max_batch_size=4, max_seq_len=256)
    report = bench_offline_engine(engine_dir, batch=4, prompt_len=8, gen_len=10, repeats=1, compile_decode=False,
                                  scheduler_requests_per_client=3, out_json=tmp_path / "offline.json")
    scheduler = report["scheduler"]
    assert scheduler["output_tokens"] == 4 * 3 * 10
    assert scheduler["stats"]["admitted"] == 12 and scheduler["stats"]["largest_batch"] == 4
    assert scheduler["output_tok_s"] > 0 and report["scheduler_over_e2e"] > 0
    assert json.loads((tmp_path / "offline.json").read_text())["scheduler"]["clients"] == 4
