"""Integration: a real tritonserver (bundled 2.51) on loopback serving a real tiny CPU engine through the
router; versions staged, served, weighted, unloaded; errors, batching, load timeout, stop by PID.

The tests in this module share one server and run in file order (each step builds on the previous).
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import time
from pathlib import Path

import pytest
from triton_support import TritonServers, make_tiny_engine, pid_alive

from serving.engine import load_engine
from serving.triton import (
    InferenceError,
    ModelLoadError,
    ModelLoadTimeout,
    TritonControl,
    apply_router_weights,
    infer_ids,
    infer_text,
    init_repository,
    remove_version,
    router_stats,
    serve_versions,
    stage_engine_version,
    write_router,
)
from serving.triton.client import infer
from serving.triton.process import stub_resources

pytestmark = pytest.mark.slow

NAME = "tiny"
ENGINE = "tiny_v1"  # one Triton model per engine version
ENGINE2 = "tiny_v2"
PROMPTS = [[5, 6, 7, 8], [40, 41], [100, 7, 300, 12, 9, 3]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("triton")
    engines = {1: make_tiny_engine(work, seed=0), 2: make_tiny_engine(work, seed=1)}
    root = init_repository(work / "repo")
    assert stage_engine_version(root, NAME, engines[1], device_kind="cpu", max_queue_delay_us=20000) == 1
    write_router(root, NAME, {1: 100})
    servers = TritonServers(work)
    t0 = time.monotonic()
    proc = servers.start(root)
    started_s = time.monotonic() - t0
    control = proc.control()
    t0 = time.monotonic()
    control.load_model(ENGINE, timeout_s=60)
    control.load_model(NAME, timeout_s=60)
    print(f"\ntriton ready in {started_s:.2f} s; engine + router loaded in {time.monotonic() - t0:.2f} s")
    yield {"root": root, "proc": proc, "control": control, "engines": engines, "servers": servers, "work": work}
    servers.stop_all()


def reference(engine_dir: Path, prompt: list[int]) -> list[int]:
    runner = load_engine(engine_dir, device="cpu")
    return runner.generate([prompt], max_new_tokens=MAX_TOKENS)[0].token_ids


def test_router_and_direct_match_engine(world) -> None:
    url, engine = world["proc"].http_url, world["engines"][1]
    for prompt in PROMPTS:
        expected = reference(engine, prompt)
        via_router = infer_ids(url, NAME, prompt, max_tokens=MAX_TOKENS, timeout_s=30)
        direct = infer_ids(url, ENGINE, prompt, max_tokens=MAX_TOKENS, timeout_s=30)
        assert via_router.output_ids == direct.output_ids == expected, (prompt, via_router, direct, expected)
        assert via_router.routed_version == 1 and direct.routed_version is None
        assert via_router.finish_reason == "length"


def test_text_input(world) -> None:
    from tokenizers import Tokenizer

    engine = world["engines"][1]
    tok = Tokenizer.from_file(str(engine / "tokenizer.json"))
    text = "The quick brown fox"
    res = infer_text(world["proc"].http_url, NAME, text, max_tokens=MAX_TOKENS, timeout_s=30)
    expected = reference(engine, tok.encode(text).ids)
    assert res.output_ids == expected and res.routed_version == 1
    assert res.text == tok.decode(expected, skip_special_tokens=True)


def test_bad_requests_get_errors_and_server_keeps_serving(world) -> None:
    url = world["proc"].http_url
    with pytest.raises(InferenceError, match="max_input_len=128") as err:
        infer_ids(url, NAME, [5] * 129, max_tokens=2, timeout_s=30)
    with pytest.raises(InferenceError, match="max_input_len=128") as direct:
        infer_ids(url, ENGINE, [5] * 129, max_tokens=2, timeout_s=30)
    assert direct.value.status == 400  # a rejected request is INVALID_ARG
    # BLS drops the error code: the router's answer is an INTERNAL error (500) carrying the target's message
    assert err.value.status in (400, 500)
    with pytest.raises(InferenceError, match="max_seq_len=256"):
        infer_ids(url, ENGINE, [5] * 100, max_tokens=200, timeout_s=30)
    with pytest.raises(InferenceError, match="outside the vocabulary"):
        infer_ids(url, ENGINE, [10**6], max_tokens=2, timeout_s=30)
    assert infer_ids(url, NAME, PROMPTS[0], max_tokens=2, timeout_s=30).output_ids
    stats = router_stats(world["proc"].model_repository, NAME)
    assert stats["versions"]["1"]["errors"] == 1  # the router's own count (Triton's counts it as a success)
    with pytest.raises(InferenceError, match="stats") as internal:  # the counters are not a client's to read
        infer(url, NAME, [{"name": "stats", "datatype": "BYTES", "shape": [1, 1], "data": ["1"]},
                          {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [1]}], [], timeout_s=30)
    assert internal.value.status == 400


def test_concurrent_requests_are_batched(world) -> None:
    """In flight: Triton hands the model one request an execution (no dynamic batcher), and the engine runs
    them in shared steps; the scheduler's counters, logged when the model unloads, show the batch."""
    url, control = world["proc"].http_url, world["control"]
    prompts = [[i + 3, i + 4, i + 5] for i in range(16)]
    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: infer_ids(url, NAME, p, max_tokens=MAX_TOKENS, timeout_s=60), prompts))
    assert all(len(r.output_ids) == MAX_TOKENS for r in results)
    control.unload_model(ENGINE, timeout_s=60)
    try:
        joined = [line for line in world["proc"].log_path.read_text().splitlines()
                  if f"[{ENGINE} v1] engine thread joined" in line]
        largest = int(re.search(r"largest_batch=(\d+)", joined[-1]).group(1))
        print(f"\nlargest batch in flight: {largest}")
        assert largest > 1
    finally:
        control.load_model(ENGINE, timeout_s=60)


def test_a_short_request_overtakes_a_long_one(world) -> None:
    """The plain llm batches in flight (`in_flight`): a request that arrives while a long one generates joins
    the engine's next steps and is answered first; the static path would answer it after the long one."""
    url = world["proc"].http_url
    finished: list[str] = []

    def run(name: str, max_tokens: int) -> None:
        infer_ids(url, ENGINE, [5, 6, 7, 8], max_tokens=max_tokens, timeout_s=60)
        finished.append(name)

    with cf.ThreadPoolExecutor(2) as pool:
        long = pool.submit(run, "long", 200)  # 200 engine steps; the short one needs 2
        time.sleep(0.05)
        short = pool.submit(run, "short", 2)
        long.result(), short.result()
    assert finished == ["short", "long"]


def test_second_version_split_then_switch(world) -> None:
    root, control, url = world["root"], world["control"], world["proc"].http_url
    assert stage_engine_version(root, NAME, world["engines"][2]) == 2
    serve_versions(control, root, NAME, [1, 2], timeout_s=60)
    assert control.ready_versions(ENGINE) == [1] and control.ready_versions(ENGINE2) == [1]
    stubs = stub_resources(world["proc"].pid)[1]
    apply_router_weights(control, root, NAME, {1: 50, 2: 50}, timeout_s=30)
    expected = {v: reference(world["engines"][v], PROMPTS[0]) for v in (1, 2)}
    assert expected[1] != expected[2]
    # 30 draws at 50/50: P(all on one side) = 2 * 0.5**30 ~ 2e-9
    seen = []
    for _ in range(30):
        res = infer_ids(url, NAME, PROMPTS[0], max_tokens=MAX_TOKENS, timeout_s=30)
        assert res.output_ids == expected[res.routed_version]
        seen.append(res.routed_version)
    assert set(seen) == {1, 2}
    stats = router_stats(world["proc"].model_repository, NAME)
    assert stats["weights"] == {"1": 50, "2": 50}
    assert {v: c["requests"] for v, c in stats["versions"].items()} == {"1": seen.count(1), "2": seen.count(2)}

    apply_router_weights(control, root, NAME, {2: 100}, timeout_s=30)
    assert {infer_ids(url, NAME, PROMPTS[0], max_tokens=2, timeout_s=30).routed_version for _ in range(10)} == {2}
    assert stub_resources(world["proc"].pid)[1] == stubs  # two weight changes started no stub: nothing reloaded

    serve_versions(control, root, NAME, [2], timeout_s=60)
    assert control.ready_versions(ENGINE2) == [1]
    assert not control.model_ready(ENGINE)
    remove_version(root, NAME, 1)
    assert infer_ids(url, NAME, PROMPTS[1], max_tokens=2, timeout_s=30).routed_version == 2
    with pytest.raises(InferenceError):
        infer_ids(url, ENGINE, PROMPTS[1], max_tokens=2, timeout_s=30)


def test_router_counts_errors_of_a_missing_version(world) -> None:
    root, control, url = world["root"], world["control"], world["proc"].http_url
    apply_router_weights(control, root, NAME, {1: 100}, timeout_s=30)  # version 1 is gone
    with pytest.raises(InferenceError, match="tiny_v1"):
        infer_ids(url, NAME, PROMPTS[0], max_tokens=2, timeout_s=30)
    assert router_stats(world["proc"].model_repository, NAME)["versions"]["1"] == pytest.approx(
        {"requests": 1, "errors": 1, "latency_sum_s": 0.0, "latency_max_s": 0.0}, abs=1.0)
    apply_router_weights(control, root, NAME, {2: 100}, timeout_s=30)
    control.unload_model(NAME, timeout_s=30)  # waits until the index no longer shows it READY/UNLOADING
    assert not control.model_ready(NAME) and control.ready_versions(ENGINE2) == [1]


SLOW_MODEL = '''
import time
class TritonPythonModel:
    def initialize(self, args):
        time.sleep(120)
    def execute(self, requests):
        return []
'''


def test_loads_over_grpc(world) -> None:
    """With ``grpc_url`` loads go over gRPC (an HTTP load holds one of Triton's HTTP threads until it is done,
    stalling the HTTP clients that thread serves): a router Triton does not run loads there with its complete
    config and answers; a model the repository lacks is refused, naming it, the address and the setting."""
    from serving.triton.repository import router_weights

    proc, root = world["proc"], world["root"]
    control = TritonControl(proc.http_url, grpc_url=proc.grpc_url, setting="triton.endpoints[0]")
    weights = router_weights(root, NAME)
    control.unload_model(NAME, timeout_s=30)
    config = apply_router_weights(control, root, NAME, weights, timeout_s=60)
    assert control.model_config(NAME)["parameters"] == config["parameters"]
    assert infer_ids(proc.http_url, NAME, PROMPTS[0], max_tokens=2).routed_version in weights
    with pytest.raises(ModelLoadError, match=rf"Triton at {re.escape(proc.grpc_url)} \(gRPC of .*triton.endpoints"
                                             r"\[0\]\) refused to load 'absent': .*absent"):
        control.load_model("absent", timeout_s=30)


def test_load_timeout_raises_and_stop_kills(world) -> None:
    root = world["root"]
    (root / "slow" / "1").mkdir(parents=True)
    (root / "slow" / "1" / "model.py").write_text(SLOW_MODEL)
    (root / "slow" / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 0\n'
                                                'input [{ name: "x" data_type: TYPE_INT32 dims: [1] }]\n'
                                                'output [{ name: "y" data_type: TYPE_INT32 dims: [1] }]\n')
    proc = world["proc"]
    control = TritonControl(proc.http_url, setting="triton.endpoints[0]")
    t0 = time.monotonic()
    with pytest.raises(ModelLoadTimeout, match=r"'slow' did not load .*triton.endpoints\[0\].* within 2 s"):
        control.load_model("slow", timeout_s=2)
    assert time.monotonic() - t0 < 5
    _, regions = stub_resources(proc.pid)  # the hung stub's shared memory, which a killed server leaves
    assert regions and all(Path("/dev/shm", r).exists() for r in regions)
    t0 = time.monotonic()
    proc.stop(timeout_s=3)
    print(f"\nstop with a hung load took {time.monotonic() - t0:.2f} s")
    assert not pid_alive(proc.pid)
    assert not control.server_live()
    assert not any(Path("/dev/shm", r).exists() for r in regions)
