"""The served benchmark's harness end to end on the CPU: a tiny random engine in the real bundled Triton,
streaming gRPC client processes, two variants of the llm model's parameters measured in turn, the
scheduler's and the outbox's counters read back from Triton's log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.served import parse_variant, run_served

pytestmark = pytest.mark.slow
pytest.importorskip("tritonclient.grpc")


def test_two_variants_measured_in_turn_with_their_counters(tmp_path: Path) -> None:
    clients, per_client, gen_len = 3, 2, 24
    report = run_served(shape="tiny", clients=clients, requests_per_client=per_client, prompt_len=8, gen_len=gen_len,
                        max_batch_size=4, work=tmp_path, out_json=tmp_path / "served.json",
                        variants=(parse_variant("plain"), parse_variant("paced:stream_interval_ms=40,idle_senders=3,busy_senders=2")),
                        via_stream_router=True)
    assert json.loads((tmp_path / "served.json").read_text())["variants"].keys() == {"plain", "paced"}
    expected = clients * per_client * gen_len
    for label in ("plain", "paced"):
        figures = report["variants"][label]
        routed = figures["via_stream_router"]  # the same clients again, through the release's streaming router
        assert figures["n_errors"] == 0 and routed["n_errors"] == 0, (figures["errors"], routed["errors"])
        assert figures["output_tokens"] == routed["output_tokens"] == expected and routed["over_direct"] > 0
        # one untimed warm-up request per client before each run, kept apart from the timed figures
        for run in (figures, routed):
            assert run["warmup"]["requests"] == clients and run["warmup"]["output_tokens"] == clients * gen_len
            assert run["requests"] == clients * per_client
        # Triton's own counters of the direct run: every request succeeded, in at most as many execute calls
        triton = figures["triton"]
        assert triton["nv_inference_request_success"] == clients * (per_client + 1)
        assert 1 <= triton["nv_inference_exec_count"] <= clients * (per_client + 1)
        assert triton["nv_inference_queue_duration_us"] > 0
        warmed = 2 * clients * gen_len
        # the llm's counters, read at its unload, cover both runs; every response it sent reached a client
        assert figures["counters"]["scheduler"]["tokens"] == 2 * expected + warmed
        assert figures["counters"]["outbox"]["tokens"] == 2 * expected + warmed
        assert figures["counters"]["outbox"]["responses"] == (figures["responses"] + routed["responses"]
                                                              + figures["warmup"]["responses"]
                                                              + routed["warmup"]["responses"])
        assert figures["ttft_ms_p50"] > 0 and figures["tpot_ms_p50"] > 0
    assert report["variants"]["paced"]["parameters"]["stream_interval_ms"] == "40"
    assert report["variants"]["paced"]["parameters"]["idle_senders"] == "3"
    assert report["variants"]["paced"]["parameters"]["busy_senders"] == "2"
    # pacing: fewer, fuller responses, every stream's first and final one still sent
    assert report["variants"]["paced"]["responses"] < report["variants"]["plain"]["responses"]
    assert report["variants"]["paced"]["responses"] >= 2 * clients * per_client
    assert report["output_tok_s"] == report["variants"]["plain"]["output_tok_s"]


def test_an_engine_with_its_own_kv_cache_served_with_several_requests_in_flight_per_stream(tmp_path: Path) -> None:
    """`--num-blocks` serves an engine built with those KV cache settings; `--lanes-per-client` keeps that many requests in flight on
    each client's one stream, every response routed to its own request (a response given to the wrong one
    would leave a request short or over its tokens), and the report sets it against a throughput report."""
    from bench.served import most_in_flight, offline_figures
    from serving.engine.kv_cache import KVCacheConfig

    clients, lanes, per_lane, gen_len = 2, 3, 2, 12
    offline = {"config": {}, "sides": [{"side": "engine-torch-ops", "output_tok_s": 1.0},
                                       {"side": "engine", "output_tok_s": 100.0}]}
    (tmp_path / "throughput.json").write_text(json.dumps(offline))
    report = run_served(shape="tiny", clients=clients, lanes=lanes, requests_per_client=per_lane, prompt_len=8,
                        gen_len=gen_len, max_batch_size=8, work=tmp_path,
                        kv_cache=KVCacheConfig(block_size=16, num_blocks=64, max_num_tokens=64),
                        offline_json=tmp_path / "throughput.json", warmup_lanes=lanes)
    assert json.loads((tmp_path / "engine-kv-cache" / "engine.json").read_text())["kv_cache"]["num_blocks"] == 64
    assert report["n_errors"] == 0, report["errors"]
    assert report["warmup"]["requests"] == clients * lanes and report["warmup"]["most_in_flight"] > clients
    assert report["requests"] == clients * lanes * per_lane
    assert report["samples"]["tokens"] == [gen_len] * clients * lanes * per_lane
    assert report["most_in_flight"] > clients
    # the scheduler's and the request intake's counters, read back from Triton's log at the unload
    served = clients * lanes * (per_lane + 1)  # the warm-up round sends every lane too
    assert report["counters"]["scheduler"]["tokens"] == served * gen_len
    assert report["counters"]["intake"]["requests"] == served and report["counters"]["intake"]["seconds"] > 0
    first = report["counters"]["first_tokens"]  # every request's first response, its stages in order
    assert first["requests"] == served
    assert 0 <= first["wait_ms_p50"] <= first["wait_ms_p99"] and 0 < first["engine_ms_p50"] <= first["engine_ms_p99"]
    assert 0 <= first["send_ms_p50"] <= first["send_ms_p99"]
    assert report["served_over_offline_e2e"] == pytest.approx(report["output_tok_s"] / 100.0)
    assert most_in_flight([(0, 2), (1, 3), (2.5, 4)]) == 2 and most_in_flight([]) == 0
    with pytest.raises(ValueError, match="no engine side"):
        offline_figures({"config": {}, "sides": [{"side": "engine-torch-ops", "output_tok_s": 1.0}]})


def test_a_shared_prefix_is_served_from_the_cache_by_the_variant_that_turns_it_on(tmp_path: Path) -> None:
    """`--shared-prefix 16` with two variants of one engine built without prefix caching: the one loaded
    with `prefix_caching=true` takes the shared blocks from its cache, the default computes them."""
    from serving.engine.kv_cache import KVCacheConfig

    report = run_served(shape="tiny", clients=2, lanes=2, requests_per_client=2, prompt_len=20, gen_len=4,
                        max_batch_size=8, work=tmp_path, shared_prefix=16,
                        kv_cache=KVCacheConfig(block_size=8, num_blocks=64, max_num_tokens=64),
                        variants=(("plain", {}), ("cached", {"prefix_caching": "true"})))
    plain, cached = report["variants"]["plain"], report["variants"]["cached"]
    assert plain["n_errors"] == cached["n_errors"] == 0 and report["shared_prefix"] == 16
    assert plain["counters"]["scheduler"]["prefix_hit_tokens"] == 0
    assert cached["counters"]["scheduler"]["prefix_hit_tokens"] >= 16 * 8  # most of 12 requests, 2 blocks each


@pytest.mark.parametrize("text", ["bad label:x=1", "ok:novalue", "ok:=3"])
def test_a_malformed_variant_is_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match="--variant"):
        parse_variant(text)


def test_offline_engine_report_has_the_scheduler_figure_of_the_same_workload(tmp_path: Path) -> None:
    from bench.served import bench_offline_engine, build_random_engine

    engine_dir = build_random_engine("tiny", tmp_path, max_batch_size=4, max_seq_len=256)
    report = bench_offline_engine(engine_dir, batch=4, prompt_len=8, gen_len=10, repeats=1,
                                  scheduler_requests_per_client=3, out_json=tmp_path / "offline.json")
    scheduler = report["scheduler"]
    assert scheduler["output_tokens"] == 4 * 3 * 10
    assert scheduler["stats"]["admitted"] == 12 and scheduler["stats"]["largest_batch"] == 4
    assert scheduler["output_tok_s"] > 0 and report["scheduler_over_e2e"] > 0
    assert json.loads((tmp_path / "offline.json").read_text())["scheduler"]["clients"] == 4


def test_a_quantized_engine_is_built_beside_the_bf16_one_from_the_same_weights(tmp_path: Path) -> None:
    """`--quantization` serves an engine converted that way from the same random checkpoint, in a folder of
    its own (never the bf16 engine reused), and the CLI offers exactly the engine's methods."""
    from bench.__main__ import QUANTIZATION_CHOICES
    from bench.served import build_random_engine
    from serving.engine import load_engine
    from serving.engine.quantize import QUANTIZATIONS

    assert tuple(QUANTIZATION_CHOICES) == tuple(QUANTIZATIONS)
    plain = build_random_engine("tiny", tmp_path, max_batch_size=2, max_seq_len=256)
    hf_config = (tmp_path / "hf" / "config.json").stat().st_mtime_ns
    int8 = build_random_engine("tiny", tmp_path, max_batch_size=2, max_seq_len=256, quantization="int8-weight-only")
    assert int8 != plain and (tmp_path / "hf" / "config.json").stat().st_mtime_ns == hf_config
    assert json.loads((int8 / "engine.json").read_text())["quantization"]["method"] == "int8-weight-only"
    assert json.loads((plain / "engine.json").read_text()).get("quantization", {}).get("method", "none") == "none"
    prompt = [[5, 6, 7, 8]]
    ids = {d: load_engine(d, device="cpu").generate(prompt, max_new_tokens=4)[0].token_ids for d in (plain, int8)}
    assert all(len(v) == 4 for v in ids.values())
    assert build_random_engine("tiny", tmp_path, max_batch_size=2, max_seq_len=256,
                               quantization="int8-weight-only") == int8  # built once


def test_a_run_stopped_by_its_time_limit_keeps_the_requests_done_so_far(tmp_path: Path, monkeypatch) -> None:
    """`timeout` sends SIGTERM: the report still holds the figures of the requests that finished. The
    signal goes once Triton has answered timed requests (its success count past the two warm-ups), not
    after a fixed sleep: on a loaded machine the spawned clients may need longer than any sleep."""
    import os
    import signal
    import threading
    import time

    from bench import served
    from serving.triton.metrics import model_counter, scrape

    handler_before = signal.getsignal(signal.SIGTERM)
    metrics: list[str] = []
    counters = served.triton_counters

    def seen_counters(metrics_url: str, model: str) -> dict[str, float]:
        metrics.append(metrics_url)
        return counters(metrics_url, model)

    monkeypatch.setattr(served, "triton_counters", seen_counters)

    def stop_mid_run() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if metrics and model_counter(scrape(metrics[0]), "nv_inference_request_success", "bench_default_v1") >= 12:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.2)

    threading.Thread(target=stop_mid_run, daemon=True).start()
    with pytest.raises(SystemExit):
        run_served(shape="tiny", clients=2, requests_per_client=100_000, prompt_len=8, gen_len=8, max_batch_size=2,
                   work=tmp_path, out_json=tmp_path / "served.json")
    figures = json.loads((tmp_path / "served.json").read_text())["variants"]["default"]
    assert figures["partial"] is True and "SystemExit" in figures["interrupted"]
    assert figures["requests"] > 0 and figures["output_tokens"] == 8 * (figures["requests"] - figures["n_errors"])
    assert signal.getsignal(signal.SIGTERM) == handler_before  # run_served put the previous handler back


def test_the_counters_a_cuda_model_logs_at_unload_are_read_back_for_its_own_name(tmp_path: Path) -> None:
    """What an H200 run logs and a CPU run cannot: the allocator line beside the scheduler's, per model."""
    from bench.served import model_counters

    log = tmp_path / "triton.log"
    log.write_text(
        "I1204 [llm_v1 v1] engine thread joined (alive=False); scheduler SchedulerStats(steps=291, mixed_forward_s=2.5, "
        "mixed_forward_cpu_s=1.25, launch_wait_s=0.01)\n"
        "I1204 [llm_v1 v1] allocator: num_alloc_retries=3, num_device_alloc=40, num_device_free=12, "
        "num_sync_all_streams=3, num_ooms=0\n"
        "I1204 [other_v1 v1] allocator: num_alloc_retries=9, num_device_alloc=1, num_device_free=0, "
        "num_sync_all_streams=0, num_ooms=0\n")
    counters = model_counters(log, "llm_v1")
    assert counters["allocator"] == {"num_alloc_retries": 3.0, "num_device_alloc": 40.0, "num_device_free": 12.0,
                                     "num_sync_all_streams": 3.0, "num_ooms": 0.0}
    assert counters["scheduler"]["mixed_forward_cpu_s"] == 1.25
