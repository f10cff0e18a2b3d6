"""Integration: the decoupled llm model (in-flight batching on an engine thread) in a real tritonserver,
streamed over gRPC with tritonclient: token responses with a final flag, the accumulated
(non-streaming) answer, concurrent requests batched in flight, errors as responses, clean unload."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import numpy as np
import pytest
from triton_support import TritonServers, make_tiny_engine

from serving.engine import load_engine
from serving.triton import init_repository, router_stats, stage_engine_version

pytestmark = pytest.mark.slow
grpcclient = pytest.importorskip("tritonclient.grpc")

ENGINE = "tiny_v1"
PROMPTS = [[5, 6, 7, 8], [40, 41], [100, 7, 300, 12, 9, 3], [9, 9, 9]]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("stream")
    engine_dir = make_tiny_engine(work, seed=0, max_batch_size=4)
    root = init_repository(work / "repo")
    # decode_gemm: the llm passes it to load_engine (on the CPU "torch" is what "auto" picks anyway)
    stage_engine_version(root, "tiny", engine_dir, device_kind="cpu",
                         parameters={"decoupled": "true", "decode_gemm": "torch"})
    servers = TritonServers(work)
    proc = servers.start(root)
    control = proc.control()
    control.load_model(ENGINE, timeout_s=90)
    yield {"proc": proc, "control": control, "engine": engine_dir, "work": work, "root": root}
    servers.stop_all()


def inputs(prompt: list[int], max_tokens: int, *, stream: bool, stop: list[int] | None = None):
    items = [("input_ids", np.asarray([prompt], dtype=np.int32), "INT32"),
             ("max_tokens", np.asarray([[max_tokens]], dtype=np.int32), "INT32"),
             ("stream", np.asarray([[stream]], dtype=bool), "BOOL")]
    if stop:
        items.append(("stop_token_ids", np.asarray([stop], dtype=np.int32), "INT32"))
    out = []
    for name, arr, dt in items:
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


BURST = 48  # 12, then 24, were all served in CI runs: they reached the engine slower than it finished them
BURST_TOKENS = 64  # 9 blocks a request: 4 live fit the 40 blocks


def run_stream(url: str, requests: list[tuple[list[int], int, bool]], timeout_s: float = 60.0,
               model: str = ENGINE) -> dict[str, list]:
    """Send all requests on one stream; collect (ids, finish_reason, final flag) or errors per request id."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for i, (prompt, n, stream) in enumerate(requests):
            client.async_stream_infer(model, inputs(prompt, n, stream=stream), request_id=str(i),
                                      enable_empty_final_response=True)
        out: dict[str, list] = {str(i): [] for i in range(len(requests))}
        finished: set[str] = set()
        deadline = time.monotonic() + timeout_s
        while len(finished) < len(requests) and time.monotonic() < deadline:
            result, error = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            if error is not None:
                out.setdefault("errors", []).append(str(error))
                finished.add(f"error-{len(out['errors'])}")  # an error response is its request's last
                continue
            resp = result.get_response()
            final = resp.parameters["triton_final_response"].bool_param
            ids = result.as_numpy("output_ids")
            reason = result.as_numpy("finish_reason")
            out[resp.id].append((None if ids is None else ids.reshape(-1).tolist(),
                                 None if reason is None else reason.reshape(-1)[0].decode(), final))
            if final:
                finished.add(resp.id)
        return out
    finally:
        client.stop_stream()
        client.close()


def reference(engine_dir: Path, prompt: list[int], n: int) -> list[int]:
    return load_engine(engine_dir, device="cpu").generate([prompt], max_new_tokens=n)[0].token_ids


def test_stream_sends_tokens_as_they_come_then_final(world) -> None:
    """Tokens arrive in order over several responses (one per token while the sender keeps up, several
    per response when it falls behind: tests/test_outbox.py), the last one flagged final."""
    out = run_stream(world["proc"].grpc_url, [(PROMPTS[0], 6, True)])["0"]
    assert 1 < len(out) <= 6 and all(ids for ids, _, _ in out)
    assert [final for _, _, final in out] == [False] * (len(out) - 1) + [True]
    assert out[-1][1] == "length"
    assert [t for ids, _, _ in out for t in ids] == reference(world["engine"], PROMPTS[0], 6)


def test_concurrent_streams_and_accumulated_match_engine(world) -> None:
    """More requests than slots (4), mixed streaming and accumulated, unequal max_tokens."""
    reqs = [(PROMPTS[i % 4], 3 + i, i % 2 == 0) for i in range(7)]
    out = run_stream(world["proc"].grpc_url, reqs)
    assert "errors" not in out
    for i, (prompt, n, stream) in enumerate(reqs):
        ids = [t for chunk, _, _ in out[str(i)] for t in chunk]
        assert ids == reference(world["engine"], prompt, n), f"request {i}"
        assert 1 < len(out[str(i)]) <= n if stream else len(out[str(i)]) == 1


def test_bad_request_is_an_error_response_and_serving_goes_on(world) -> None:
    out = run_stream(world["proc"].grpc_url, [([5] * 200, 4, True), (PROMPTS[1], 2, True)])
    assert any("max_input_len=128" in e for e in out.get("errors", [])), out
    assert [t for ids, _, _ in out["1"] for t in ids] == reference(world["engine"], PROMPTS[1], 2)


def test_a_cancelled_stream_frees_its_slot_and_serving_goes_on(world) -> None:
    """The client cancels mid-generation (its gRPC stream cancelled): the model notices, stops the request
    in the scheduler and logs it; the next request is served. A second model of the same engine, slowed
    to 10 ms per step (tasks.fault_injection), so that 240 tokens take longer than noticing does."""
    from tasks.fault_injection import write_fault

    root, control, url = world["root"], world["control"], world["proc"].grpc_url
    stage_engine_version(root, "slow", world["engine"], device_kind="cpu",
                         parameters={"decoupled": "true", "engine_loader": "tasks.fault_injection:load_engine"})
    write_fault(root, "slow", 1, {"delay_per_token_s": 0.01})
    control.load_model("slow_v1", timeout_s=90)
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("slow_v1", inputs(PROMPTS[0], 240, stream=True), request_id="gone")
    _, error = got.get(timeout=30)  # the first tokens arrived: generation is under way
    assert error is None
    client.stop_stream(cancel_requests=True)
    client.close()

    def logs() -> str:
        return "".join(p.read_text(errors="replace") for p in Path(world["work"]).glob("triton-*.log"))

    deadline = time.monotonic() + 20
    while "cancelled by its client" not in logs() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "[slow_v1 v1] request" in logs() and "cancelled by its client" in logs()
    out = run_stream(url, [(PROMPTS[1], 3, True)])  # the tiny_engine model, on the same server
    assert [t for ids, _, _ in out["0"] for t in ids] == reference(world["engine"], PROMPTS[1], 3)
    control.unload_model("slow_v1", wait=True)
    stats = next(line for line in logs().splitlines() if "[slow_v1 v1] engine thread joined" in line)
    assert "cancelled=1," in stats and "finished=0," in stats, stats


def test_an_engine_with_a_small_pool_streams_the_default_engines_tokens(world) -> None:
    """The same checkpoint built with a small KV cache (40 blocks of 8 positions, 16 tokens a step, at most 6
    requests waiting), staged with no loader named: the llm model's default loader serves it with that pool
    (engine.json says so), more requests than live slots, streamed and accumulated, each with the tokens of the
    engine of the default pool. Then a burst of 48 long requests at once: 4 live, 6 wait, and the ones past the queue
    limit are refused with UNAVAILABLE in words that clients and the OpenAI front read as overload (429);
    the others are served."""
    from serving.engine import EngineLimits, build_engine
    from serving.engine.kv_cache import KVCacheConfig
    from serving.llm_client import is_overload
    from serving.openai.backend import Overloaded, _error

    root, control, work = world["root"], world["control"], Path(world["work"])
    paged = build_engine(work / "ckpt-0", work / "engine-paged", kv_cache=KVCacheConfig(8, 40, max_num_tokens=16,
                                                                                     max_waiting=6),
                         limits=EngineLimits(dtype="float32", max_batch_size=4, max_input_len=128, max_seq_len=256))
    stage_engine_version(root, "paged", paged.path, device_kind="cpu",
                         parameters={"decoupled": "true"})
    control.load_model("paged_v1", timeout_s=90)
    try:
        reqs = [(PROMPTS[i % 4] * (5 if i == 2 else 1), 3 + i, i % 2 == 0) for i in range(6)]
        out = run_stream(world["proc"].grpc_url, reqs, model="paged_v1")
        assert "errors" not in out
        for i, (prompt, n, _) in enumerate(reqs):
            assert [t for ids, _, _ in out[str(i)] for t in ids] == reference(world["engine"], prompt, n), f"request {i}"
        burst = run_stream(world["proc"].grpc_url, [(PROMPTS[i % 4], BURST_TOKENS, False) for i in range(BURST)],
                           model="paged_v1")
    finally:
        control.unload_model("paged_v1", wait=True)
    refused, served = burst.get("errors", []), [k for k in map(str, range(BURST)) if burst[k]]
    assert len(refused) >= 2 and len(refused) + len(served) == BURST, burst  # 4 live + 6 waiting at most
    assert all("resource exhausted" in e and "kv_cache.max_waiting=6" in e for e in refused), refused
    assert all(is_overload("", e) and isinstance(_error(RuntimeError(e), "m"), Overloaded) for e in refused)
    want = load_engine(world["engine"], device="cpu").generate(PROMPTS, max_new_tokens=BURST_TOKENS)
    for k in served:
        assert [t for ids, _, _ in burst[k] for t in ids] == want[int(k) % 4].token_ids, f"burst request {k}"
    logs = "".join(p.read_text(errors="replace") for p in work.glob("triton-*.log"))
    joined = next(line for line in logs.splitlines() if "[paged_v1 v1] engine thread joined" in line)
    assert "scheduler SchedulerStats(" in joined and f"finished={6 + len(served)}," in joined, joined


def test_a_paged_engine_with_prefix_caching_serves_a_shared_prompt_from_its_cache(world) -> None:
    """Built with `prefix_caching`: requests whose prompts share 24 tokens (three blocks of 8), sent after one
    another, stream the default engine's tokens, and the scheduler counted the shared blocks as taken from the
    cache (its counters in the log at unload)."""
    from serving.engine import EngineLimits, build_engine
    from serving.engine.kv_cache import KVCacheConfig

    root, control, work = world["root"], world["control"], Path(world["work"])
    built = build_engine(work / "ckpt-0", work / "engine-prefix",
                         kv_cache=KVCacheConfig(8, 40, max_num_tokens=16, prefix_caching=True),
                         limits=EngineLimits(dtype="float32", max_batch_size=4, max_input_len=128, max_seq_len=256))
    stage_engine_version(root, "prefix", built.path, device_kind="cpu", parameters={"decoupled": "true"})
    control.load_model("prefix_v1", timeout_s=90)
    system = [(7 * i) % 500 + 3 for i in range(24)]
    prompts = [system + tail for tail in ([11, 12], [40, 41, 42], [99])]
    try:
        for i, prompt in enumerate(prompts):
            out = run_stream(world["proc"].grpc_url, [(prompt, 5, True)], model="prefix_v1")
            assert [t for ids, _, _ in out["0"] for t in ids] == reference(world["engine"], prompt, 5), f"prompt {i}"
    finally:
        control.unload_model("prefix_v1", wait=True)
    logs = "".join(p.read_text(errors="replace") for p in work.glob("triton-*.log"))
    joined = next(line for line in logs.splitlines() if "[prefix_v1 v1] engine thread joined" in line)
    assert "prefix_hit_tokens=48" in joined, joined  # the second and third prompts: 24 each


def test_the_router_answers_through_a_decoupled_engine_over_http(world) -> None:
    """The stable name of a gray release in front of the in-flight batching llm: the router calls it with
    decoupled BLS and answers once (HTTP, no streaming), tokens equal to the engine's; its counters count
    them; a bad request comes back as this request's error."""

    import tritonclient.http as httpclient

    from serving.triton import apply_router_weights

    apply_router_weights(world["control"], world["root"], "tiny", {1: 100}, timeout_s=90)
    client = httpclient.InferenceServerClient(world["proc"].http_url.removeprefix("http://"))

    def call(prompt: list[int], n: int):
        tensors = []
        for name, arr in (("input_ids", np.asarray([prompt], dtype=np.int32)),
                          ("max_tokens", np.asarray([[n]], dtype=np.int32))):
            t = httpclient.InferInput(name, list(arr.shape), "INT32")
            t.set_data_from_numpy(arr)
            tensors.append(t)
        return client.infer("tiny", tensors)

    result = call(PROMPTS[2], 5)
    assert result.as_numpy("output_ids").reshape(-1).tolist() == reference(world["engine"], PROMPTS[2], 5)
    assert result.as_numpy("finish_reason").reshape(-1)[0] == b"length"
    assert result.as_numpy("routed_version").reshape(-1).tolist() == [1]
    with pytest.raises(Exception, match="max_input_len=128"):
        call([5] * 200, 2)
    # streaming clients: the release's streaming router, written beside the router for a decoupled llm
    streamed = run_stream(world["proc"].grpc_url, [(PROMPTS[3], 6, True)], model="tiny_stream")["0"]
    tokens = [t for ids, _, _ in streamed if ids for t in ids]
    assert tokens == reference(world["engine"], PROMPTS[3], 6)
    assert len([ids for ids, _, _ in streamed if ids]) > 1 and streamed[-1][2]  # several responses, then final
    got: queue.Queue = queue.Queue()
    stream_client = grpcclient.InferenceServerClient(world["proc"].grpc_url)
    stream_client.start_stream(callback=lambda result, error: got.put((result, error)))
    stream_client.async_stream_infer("tiny_stream", inputs(PROMPTS[0], 3, stream=True),
                                     enable_empty_final_response=True)
    routed = []
    while True:
        result, error = got.get(timeout=30)
        assert error is None, error
        if result.as_numpy("output_ids") is not None:
            routed += result.as_numpy("routed_version").reshape(-1).tolist()
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    stream_client.stop_stream()
    stream_client.close()
    client.close()  # an open HTTP connection would hold the server's shutdown for its exit timeout (5 s)
    assert routed and set(routed) == {1}  # on every response that carries tokens
    stats = router_stats(world["proc"].model_repository, "tiny")
    counted = stats["detail"]["1"]  # the router's and the streaming router's counters, one load
    assert counted["requests"] == 4 and counted["errors"] == 1 and counted["output_tokens"] == 5 + 6 + 3
    world["control"].unload_model("tiny", timeout_s=60)
    world["control"].unload_model("tiny_stream", timeout_s=60)


def test_an_unload_under_load_ends_every_request(world) -> None:
    """Unloaded while a burst is queued in the intake and the scheduler and generating (a model slowed to 10 ms
    a token, 4 slots, 16 requests of 40 tokens: about 1.6 s): every request ends, with all its tokens (Triton
    2.51 waits for a decoupled model's open responses before it finalizes it) or with an error saying why;
    none is left without its final response."""
    import threading

    from tasks.fault_injection import write_fault

    root, control = world["root"], world["control"]
    stage_engine_version(root, "doomed", world["engine"], device_kind="cpu",
                         parameters={"decoupled": "true", "engine_loader": "tasks.fault_injection:load_engine"})
    write_fault(root, "doomed", 1, {"delay_per_token_s": 0.01})
    control.load_model("doomed_v1", timeout_s=90)
    burst = [(PROMPTS[i % 4], 40, i % 2 == 0) for i in range(16)]
    unloaded: list[float] = []
    unloader = threading.Timer(0.6, lambda: control.unload_model("doomed_v1", wait=False)
                               or unloaded.append(time.monotonic()))
    unloader.start()
    try:
        out = run_stream(world["proc"].grpc_url, burst, timeout_s=60, model="doomed_v1")
        done = time.monotonic()
    finally:
        unloader.join()
    assert unloaded and unloaded[0] < done - 0.3, "the burst ended before the unload began"
    ended = [i for i in range(len(burst)) if out[str(i)] and out[str(i)][-1][2]]
    errors = out.get("errors", [])
    assert len(ended) + len(errors) == len(burst), out
    assert all("stopped" in e or "unloading" in e for e in errors), errors
    for i in ended:
        assert sum(len(ids) for ids, _, _ in out[str(i)]) == 40 and out[str(i)][-1][1] == "length"


def test_unload_joins_engine_thread(world) -> None:
    control = world["control"]
    control.unload_model(ENGINE, wait=True)
    logs = "".join(p.read_text() for p in Path(world["work"]).glob("triton-*.log"))
    assert "engine thread joined (alive=False)" in logs

