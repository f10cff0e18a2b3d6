"""A release that turns in-flight batching on, on a real Triton (bundled 2.51, loopback, real tiny engines).

The release (`engine_parameters: {decoupled: "true"}`) runs under a live router with HTTP requests
flowing the whole time: the candidate is warmed up through `/generate` (HTTP `/infer` refuses a
decoupled model), the router learns that its target is decoupled and reaches it with decoupled BLS, no
request fails, and the streaming router `<name>_stream` appears beside the router: gRPC streams through
it then come from the new version, token by token, and count in the router's stats.

One client each: on the 2-core CI machine, more concurrent load during the reloads made the python
backend's stubs miss their one-second health checks (docs/triton.md, pitfalls).
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest
from test_rollout_support import Load, assert_consistent, first_release, make_spec, publish, start_server
from triton_support import TritonServers, make_tiny_engine

from flows.promote import StageFailed, promote
from serving.triton.repository import llm_model_config, router_stats, stream_model_name
from tasks.fault_injection import write_fault

pytestmark = pytest.mark.slow
grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
NAME = "inflight"
STEPS = [{"set_weight": 50}, {"analysis": {"requests": 8, "compare": None}}, {"set_weight": 100}]


class Streams:
    """gRPC streaming clients of the streaming router, one stream after another, until stopped."""

    def __init__(self, url: str, model: str, clients: int = 2) -> None:
        self.url, self.model = url, model
        self.results: list[tuple[str | None, set[int], int]] = []  # (error, routed versions, tokens) per stream
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Streams:  # noqa: PYI034
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(60)

    def _run(self, client_index: int) -> None:
        got: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        try:
            n = 0
            while not self.stopping.is_set():
                n += 1
                tensors = []
                for name, arr, dt in (("input_ids", np.asarray([[5 + n % 40, 6, 7]], dtype=np.int32), "INT32"),
                                      ("max_tokens", np.asarray([[6]], dtype=np.int32), "INT32"),
                                      ("stream", np.asarray([[True]], dtype=bool), "BOOL")):
                    t = grpcclient.InferInput(name, list(arr.shape), dt)
                    t.set_data_from_numpy(arr)
                    tensors.append(t)
                client.async_stream_infer(self.model, tensors, enable_empty_final_response=True)
                error, versions, tokens = None, set(), 0
                while True:
                    try:
                        result, err = got.get(timeout=60)
                    except queue.Empty:
                        error = "no response within 60 s"
                        break
                    if err is not None:
                        error = str(err)
                        break
                    ids = result.as_numpy("output_ids")
                    if ids is not None:
                        tokens += ids.size
                        versions.update(result.as_numpy("routed_version").reshape(-1).tolist())
                    if result.get_response().parameters["triton_final_response"].bool_param:
                        break
                self.results.append((error, versions, tokens))
        finally:
            client.stop_stream()
            client.close()


def test_a_release_turns_in_flight_batching_on_under_load_and_streams_follow(tmp_path) -> None:
    for seed in (0, 1):
        publish(tmp_path, NAME, make_tiny_engine(tmp_path / "engines", seed=seed))
    servers = TritonServers(tmp_path)
    try:
        proc = start_server(servers, tmp_path / "repo")
        plain = make_spec(tmp_path, NAME, [proc], steps=STEPS, engine_parameters={"warmup": "true", "decoupled": "false"},
                          concurrency=1)
        first_release(plain)
        assert_consistent(plain, 1)
        assert not (proc.model_repository / stream_model_name(NAME)).exists()
        inflight = make_spec(tmp_path, NAME, [proc], steps=STEPS, engine_parameters={"decoupled": "true"},
                             concurrency=1)
        with Load([proc.http_url], NAME, concurrency=1) as load:
            load.mark("plain v1")
            load.wait_for(10, timeout_s=60)
            load.mark("promoting v2, decoupled on")
            assert promote(inflight, "2").rollout.outcome == "Successful"
            load.mark("decoupled v2")
            load.wait_for(10, timeout_s=60)
        print("\n" + load.table())
        assert_consistent(inflight, 2)
        assert llm_model_config(proc.model_repository, NAME, 2)["model_transaction_policy"] == {"decoupled": True}
        failures = [r.error for r in load.records() if not r.ok]
        assert not failures, sorted(set(failures))[:3]
        assert {r.version for r in load.records() if r.ok} == {1, 2}
        with Streams(proc.grpc_url, stream_model_name(NAME), clients=1) as streams:
            deadline = time.monotonic() + 60
            while len(streams.results) < 20 and time.monotonic() < deadline:
                time.sleep(0.1)
        print(f"{len(streams.results)} streams through {stream_model_name(NAME)}")
        assert len(streams.results) >= 20
        assert all(error is None and versions == {2} and tokens == 6 for error, versions, tokens in streams.results)
        stats = router_stats(proc.model_repository, NAME)
        assert stats["cumulative"]["2"]["requests"] >= len(streams.results)
    finally:
        servers.stop_all()


def test_a_failed_release_that_turned_decoupled_on_leaves_the_live_version_plain(tmp_path) -> None:
    """The candidate brings `decoupled: "true"` and fails its warm-up: v1, a model of its own, kept the
    parameters it was staged with, so it is plain (HTTP /infer works), and the streaming router the
    release's parameters called for is gone."""
    loader = {"engine_loader": "tasks.fault_injection:load_engine", "decoupled": "false"}
    for seed in (0, 1):
        publish(tmp_path, NAME, make_tiny_engine(tmp_path / "engines", seed=seed))
    servers = TritonServers(tmp_path)
    try:
        proc = start_server(servers, tmp_path / "repo")
        plain = make_spec(tmp_path, NAME, [proc], steps=STEPS, engine_parameters=loader, concurrency=1)
        first_release(plain)
        write_fault(proc.model_repository, NAME, 2, {"error_rate": 1.0})
        inflight = make_spec(tmp_path, NAME, [proc], steps=STEPS, engine_parameters={**loader, "decoupled": "true"},
                             concurrency=1)
        with pytest.raises(StageFailed):
            promote(inflight, "2")
        assert_consistent(plain, 1)
        assert "model_transaction_policy" not in llm_model_config(proc.model_repository, NAME, 1)
        assert not (proc.model_repository / stream_model_name(NAME)).exists()
        loaded = httpclient.InferenceServerClient(proc.http_url.removeprefix("http://")).get_model_config(
            f"{NAME}_v1")
        assert not loaded.get("model_transaction_policy", {}).get("decoupled", False)
        with Load([proc.http_url], NAME, concurrency=1) as load:  # plain /infer through the router
            load.wait_for(5, timeout_s=60)
        records = load.records()
        assert records and all(r.ok and r.version == 1 for r in records), [r.error for r in records if not r.ok][:3]
    finally:
        servers.stop_all()
