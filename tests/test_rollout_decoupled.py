"""Releases with in-flight batching on a real Triton (bundled 2.51, loopback, real tiny engines).

1. A release turns it on (`engine_parameters: {decoupled: "true"}`) under a live router: the candidate is
   warmed up through `/generate` (HTTP `/infer` refuses a decoupled model), the router reaches the
   decoupled llm with decoupled BLS and answers HTTP clients as before, and the streaming router
   `<name>_stream` appears beside it.
2. The next release, with HTTP requests and gRPC streams flowing through both routers the whole time: the
   streams move from the live version to the candidate with the weights, and nothing fails.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
from test_rollout_support import Load, assert_consistent, first_release, make_spec, publish, start_server
from triton_support import TritonServers, make_tiny_engine

from flows.promote import promote
from serving.triton.repository import llm_model_config, stream_model_name

pytestmark = pytest.mark.slow
grpcclient = pytest.importorskip("tritonclient.grpc")
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
                    result, err = got.get(timeout=60)
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


def test_releases_turn_in_flight_batching_on_then_shift_streams_with_nothing_failing(tmp_path) -> None:
    for seed in (0, 1, 2):
        publish(tmp_path, NAME, make_tiny_engine(tmp_path / "engines", seed=seed))
    servers = TritonServers(tmp_path)
    try:
        proc = start_server(servers, tmp_path / "repo")
        plain = make_spec(tmp_path, NAME, [proc], steps=STEPS, engine_parameters={"warmup": "true"})
        first_release(plain)
        assert_consistent(plain, 1)
        assert not (proc.model_repository / stream_model_name(NAME)).exists()
        inflight = make_spec(tmp_path, NAME, [proc], steps=STEPS, engine_parameters={"decoupled": "true"})
        with Load([proc.http_url], NAME) as load:
            load.mark("plain v1")
            load.gen.wait_for(10, timeout_s=60)
            load.mark("promoting v2, decoupled on")
            assert promote(inflight, "2").rollout.outcome == "Successful"
            load.mark("decoupled v2, streams start")
            with Streams(proc.grpc_url, stream_model_name(NAME)) as streams:
                load.gen.wait_for(10, timeout_s=60)
                load.mark("promoting v3 with streams flowing")
                assert promote(inflight, "3").rollout.outcome == "Successful"
                load.mark("v3")
                load.gen.wait_for(10, timeout_s=60)
        print("\n" + load.table())
        assert_consistent(inflight, 3)
        assert llm_model_config(proc.model_repository, NAME)["model_transaction_policy"] == {"decoupled": True}
        failures = [r.error for r in load.gen.log.since(0) if not r.ok]
        assert not failures, sorted(set(failures))[:3]
        assert {r.version for r in load.gen.log.since(0) if r.ok} == {1, 2, 3}
        stream_errors = [e for e, _, _ in streams.results if e]
        print(f"{len(streams.results)} streams, {len(stream_errors)} failed, versions "
              f"{sorted({v for _, vs, _ in streams.results for v in vs})}")
        assert not stream_errors, stream_errors[:3]
        assert all(tokens == 6 and len(vs) == 1 for _, vs, tokens in streams.results)
        assert {v for _, vs, _ in streams.results for v in vs} == {2, 3}
    finally:
        servers.stop_all()
