"""The doors hold (issue 23): every client mistake a 4xx naming the field and the limit, a dead or restarting
Triton a 503, a deadline a 504 streamed or not, the addresses of a restarted embedded Triton unchanged, and
what one client may cost everyone bounded. Real parts only: the embedded Triton (`flows.embedded`) on the
tiny engine, `enginewright serve` under uvicorn, the official `openai` client, tritonclient on the router.

The fault test (Triton killed under load and started again by `enginewright triton start`) runs last: it
restarts the module's Triton.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from triton_support import make_tiny_engine, pid_alive

from flows.embedded import EmbeddedServer, ensure_embedded, read_record, stop_embedded
from serving.triton.control import TritonControl
from serving.triton.operations import apply_router_weights, serve_versions
from serving.triton.process import clean_up_after_crash, free_port
from serving.triton.repository import stage_engine_version

pytestmark = pytest.mark.slow

MODEL = "tiny-doors"
LIVE = "tiny-doors-inflight"  # in-flight batching: its streams go through <name>_stream
PROMPT = "The capital of France is"
LONG_PROMPT = "the cat sat on the mat " * 60  # more than the tiny engine's max_input_len=128 tokens
MAX_PROMPT_CHARS = 20_000  # the front's limit in this file (--max-prompt-chars)


@dataclass
class World:
    repository: Path
    server: EmbeddedServer
    front: str
    front_pid: int
    hasty: str  # a front whose deadline (--timeout-s) no generation of 200 tokens meets


def start_front(grpc_url: str, log: Path, *extra: str) -> tuple[str, subprocess.Popen]:
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "serve", "--triton-grpc", grpc_url, "--model", MODEL, "--model", LIVE,
             "--port", str(port), "--max-prompt-chars", str(MAX_PROMPT_CHARS), *extra],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    return f"http://127.0.0.1:{port}", proc


def wait_healthy(base: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        assert proc.poll() is None, log.read_text()
        time.sleep(0.2)
    raise AssertionError(f"front never became healthy: {log.read_text()}")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    work = tmp_path_factory.mktemp("doors")
    repository = work / "repository"
    engine = make_tiny_engine(work, max_batch_size=8)
    # the tiny tokenizer has no chat template of its own; chat requests need one
    (engine / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    server = ensure_embedded(repository)
    fronts: list[subprocess.Popen] = []
    try:
        control = TritonControl(server.http_url)
        for name, decoupled in ((MODEL, False), (LIVE, True)):
            version = stage_engine_version(repository, name, engine, device_kind="cpu",
                                           parameters={"decoupled": "true"} if decoupled else None)
            serve_versions(control, repository, name, [version])
            apply_router_weights(control, repository, name, {version: 100})
        front, front_proc = start_front(server.grpc_url, work / "front.log")
        hasty, hasty_proc = start_front(server.grpc_url, work / "hasty.log", "--timeout-s", "0.05")
        fronts = [front_proc, hasty_proc]
        wait_healthy(front, front_proc, work / "front.log")
        wait_healthy(hasty, hasty_proc, work / "hasty.log")
        yield World(repository, server, front, front_proc.pid, hasty)
    finally:
        for proc in fronts:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        last = read_record(repository)
        stop_embedded(repository)
        if last is not None:
            clean_up_after_crash(last.pid, 0)  # the stubs of a server the fault test killed, if any are left


@pytest.fixture
def client(world):
    """The official client with its default retries (2): a client error must not be retried."""
    return openai.OpenAI(base_url=f"{world.front}/v1", api_key="unused", timeout=60)


def requests_counted(front: str, status: str) -> float:
    text = httpx.get(f"{front}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("enginewright_openai_requests_total{") and f'status="{status}"' in line)


# ---------------------------------------------------------------- finding 4: client errors are 4xx, not retried


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"prompt": LONG_PROMPT, "max_tokens": 2}, "max_input_len=128"),
    ({"prompt": "the cat sat on the mat " * 10, "max_tokens": 200}, "max_seq_len=256"),
    ({"prompt": PROMPT, "max_tokens": 2, "seed": 2**70}, "seed"),
])
def test_a_client_mistake_is_a_400_naming_the_limit_and_is_not_retried(client, world, kwargs, words):
    before = requests_counted(world.front, "400")
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, **kwargs)
    assert words in caught.value.message, caught.value.message
    assert requests_counted(world.front, "400") == before + 1  # one call, no retry (502 was retried twice)
    with pytest.raises(openai.BadRequestError):  # streamed: refused before the first byte, the same way
        client.completions.create(model=LIVE, stream=True, **kwargs)


def _triton_input(module, name: str, array: np.ndarray, dtype: str):
    tensor = module.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


ROUTER_MISTAKES = {
    "batch of 2": ({"input_ids": np.array([[1, 2], [3, 4]], np.int32), "max_tokens": np.array([[2], [2]], np.int32)},
                   "batch-size must be <= 1"),
    "token outside the vocabulary": ({"input_ids": np.array([[999_999]], np.int32),
                                      "max_tokens": np.array([[2]], np.int32)}, "outside the vocabulary"),
    "top_p 5": ({"input_ids": np.array([[1, 2]], np.int32), "max_tokens": np.array([[2]], np.int32),
                 "temperature": np.array([[1.0]], np.float32), "top_p": np.array([[5.0]], np.float32)}, "top_p"),
    "no max_tokens": ({"input_ids": np.array([[1, 2]], np.int32)}, "max_tokens"),
}
DTYPES = {np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32"}


@pytest.mark.parametrize("case", sorted(ROUTER_MISTAKES))
def test_the_router_passes_the_engines_refusal_on_as_400_and_invalid_argument(world, case):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    arrays, words = ROUTER_MISTAKES[case]
    http = httpclient.InferenceServerClient(world.server.http_url.removeprefix("http://"))
    grpc = grpcclient.InferenceServerClient(world.server.grpc_url)
    for module, triton, expected in ((httpclient, http, "400"), (grpcclient, grpc, "StatusCode.INVALID_ARGUMENT")):
        inputs = [_triton_input(module, n, a, DTYPES[a.dtype]) for n, a in arrays.items()]
        with pytest.raises(Exception) as caught:
            triton.infer(MODEL, inputs)
        assert str(caught.value.status()) == expected and words in caught.value.message(), caught.value


def test_the_routers_config_declares_what_the_engine_takes(world):
    """Finding 6: one value per request (max_batch_size 1, so Triton refuses a batch of 2 itself), and
    ``max_tokens`` required, as the engine requires it."""
    config = TritonControl(world.server.http_url).model_config(MODEL)
    assert config["max_batch_size"] == 1
    inputs = {i["name"]: i for i in config["input"]}
    assert not inputs["max_tokens"].get("optional", False)
    assert inputs["text_input"].get("optional") and inputs["input_ids"].get("optional")


# ---------------------------------------------------------------- finding 3: a deadline is a 504, streamed or not


def _sse_events(reply: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in reply.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_a_deadline_is_a_504_streamed_or_not(world):
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0}
    plain = httpx.post(f"{world.hasty}/v1/completions", json={"model": MODEL, **body}, timeout=30)
    assert plain.status_code == 504 and plain.json()["error"]["type"] == "timeout_error", plain.text
    for model in (MODEL, LIVE):  # one answer streamed as one chunk; the engine's tokens as they come
        streamed = httpx.post(f"{world.hasty}/v1/completions", json={"model": model, "stream": True, **body},
                              timeout=30)
        if streamed.status_code == 200:  # the deadline passed after the first token: the stream says so
            error = _sse_events(streamed)[-1]["error"]
            assert error["code"] == 504 and error["type"] == "timeout_error", streamed.text
        else:
            assert streamed.status_code == 504 and streamed.json()["error"]["type"] == "timeout_error", streamed.text


# ---------------------------------------------------------------- finding 9: OpenAI compatibility


def test_models_retrieve_and_content_parts(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    messages = [{"role": "user", "content": "Name a colour."}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    joined = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, temperature=0)
    assert joined.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(("method", "path", "body", "status", "param"), [
    ("POST", "/v1/nowhere", {}, 404, None),
    ("GET", "/v1/completions", None, 405, None),
    ("POST", "/v1/completions", b'{"model": "x", "prompt": "hi",}', 400, None),
    ("POST", "/v1/completions", b"[1, 2]", 400, None),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "seed": 2**70}, 400, "seed"),
    # past OpenAI's limits; a token id outside the vocabulary is the engine's refusal, named as logit_bias
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 17}, 400, "n"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"999999": 5}}, 400, "logit_bias"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "frequency_penalty": 7}, 400, "frequency_penalty"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "wat": 1}, 400, "wat"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "tools": [{"type": "function", "function": {"name": "f"}}],
                                      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "x", "schema": ["not", "one"]}}},
     400, "response_format"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "response_format": {"type": "json_schema", "json_schema": {
                                          "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     400, "response_format"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "top_logprobs": 2}, 400, "top_logprobs"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content"),
])
def test_every_error_is_openais_error_object_naming_the_parameter(world, method, path, body, status, param):
    content = body if isinstance(body, bytes) else None
    reply = httpx.request(method, f"{world.front}{path}", json=None if content else body, content=content,
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    if param:
        assert param.split(".")[0] in error["message"], error


def test_no_op_values_of_unsupported_parameters_are_accepted(client):
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=None,
                                     echo=False, best_of=1, frequency_penalty=0, presence_penalty=0.0)
    assert done.choices[0].text


def test_stream_options_include_usage_ends_the_stream_with_the_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


# ---------------------------------------------------------------- finding 5: one client's cost to everyone


def test_a_huge_body_and_a_long_prompt_are_refused_before_any_tokenizing(world):
    huge = httpx.post(f"{world.front}/v1/completions", json={"model": MODEL, "prompt": "x" * (4 << 20)}, timeout=30)
    assert huge.status_code == 413 and "--max-body-bytes" in huge.json()["error"]["message"], huge.text
    long = httpx.post(f"{world.front}/v1/completions", json={"model": MODEL, "prompt": "x" * (MAX_PROMPT_CHARS + 1)},
                      timeout=30)
    assert long.status_code == 400 and "--max-prompt-chars" in long.json()["error"]["message"], long.text
    assert long.json()["error"]["param"] == "prompt"
    for bad in ("abc", "-1", str(1 << 40)):  # httpx refuses to send these: a raw socket does
        assert raw_post(world.front, bad).startswith((b"HTTP/1.1 400", b"HTTP/1.1 413")), bad


def raw_post(base: str, content_length: str) -> bytes:
    """POST an empty JSON object with this Content-Length header; the status line and headers that come back."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {content_length}\r\nConnection: close\r\n\r\n{{}}".encode())
        return conn.recv(4096)


def test_an_idle_kept_alive_connection_outlives_the_clients_expiry(world):
    """httpx and the OpenAI SDK drop an idle pooled connection after 5 s; a server that closes its side at the same
    moment (uvicorn's default) fails the request that reuses it, mid-load, with a read error."""
    import http.client

    host, port = world.front.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        for pause_s in (0, 6):
            time.sleep(pause_s)
            conn.request("GET", "/v1/models")
            reply = conn.getresponse()
            assert reply.status == 200 and MODEL in reply.read().decode(), pause_s
    finally:
        conn.close()


def test_the_engine_refuses_a_huge_text_without_tokenizing_it(world):
    """Straight to the router (past the front's limits): 4 MB of text is refused by its size alone."""
    import tritonclient.http as httpclient

    http = httpclient.InferenceServerClient(world.server.http_url.removeprefix("http://"), network_timeout=60)
    inputs = [_triton_input(httpclient, "text_input", np.array([[b"word " * (800 << 10)]], dtype=object), "BYTES"),
              _triton_input(httpclient, "max_tokens", np.array([[2]], np.int32), "INT32")]
    started = time.monotonic()
    with pytest.raises(Exception) as caught:
        http.infer(MODEL, inputs)
    took = time.monotonic() - started
    assert str(caught.value.status()) == "400" and "bytes exceeds the engine limit max_input_len" in str(caught.value)
    print(f"4 MB text refused by the engine in {took:.2f} s")


def test_small_requests_stay_fast_while_huge_ones_are_refused(world):
    """Measured, not a speed target: the median latency of small requests alone and while 4 MB bodies keep
    arriving (the issue saw 3.9-6.0 s instead of 0.04 s). The bound is loose, for a loaded 2-core machine."""
    small = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}

    def one_small() -> float:
        started = time.monotonic()
        assert httpx.post(f"{world.front}/v1/completions", json=small, timeout=60).status_code == 200
        return time.monotonic() - started

    alone = statistics.median(one_small() for _ in range(8))
    huge_body = json.dumps({"model": MODEL, "prompt": "x" * (4 << 20)}).encode()
    stop = threading.Event()
    refused: list[int] = []

    def huge_ones() -> None:
        while not stop.is_set():
            refused.append(httpx.post(f"{world.front}/v1/completions", content=huge_body, timeout=60,
                                      headers={"Content-Type": "application/json"}).status_code)

    thread = threading.Thread(target=huge_ones)
    thread.start()
    try:
        time.sleep(0.2)
        during = statistics.median(one_small() for _ in range(8))
    finally:
        stop.set()
        thread.join(60)
    print(f"small requests: median {alone * 1e3:.0f} ms alone, {during * 1e3:.0f} ms beside "
          f"{len(refused)} refused 4 MB bodies")
    assert refused and set(refused) == {413}
    assert during < max(1.0, 10 * alone)


# ---------------------------------------------------------------- findings 1, 2, 9: Triton killed and restarted


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], check=False, capture_output=True,
                          text=True, timeout=timeout)


def test_triton_killed_under_load_is_503_then_back_on_the_same_ports_without_restarting_the_front(world):
    """Acceptance: steady load through the front (plain and streamed); Triton killed with SIGKILL, then
    `enginewright triton start`: requests meanwhile get 503 (not 429, not 500), and from 10 s after it is
    ready again every request succeeds, on the same ports, through the same front process."""
    before = read_record(world.repository)
    outcomes: list[tuple[float, int, str]] = []  # (when, status, model/stream)
    odd: list[str] = []  # what a request that got neither 200 nor 503 was told
    stop = threading.Event()
    client = openai.OpenAI(base_url=f"{world.front}/v1", api_key="unused", max_retries=0, timeout=30)

    def load(stream: bool) -> None:
        while not stop.is_set():
            try:
                if stream:
                    chunks = list(client.completions.create(model=LIVE, prompt=PROMPT, max_tokens=3, stream=True))
                    assert chunks[-1].choices[0].finish_reason
                else:
                    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
                status = 200
            except openai.APIStatusError as exc:
                status = exc.status_code
                odd.extend([] if status == 503 else [f"{status}: {exc.message}"])
            except openai.APIError as exc:  # an error event in a stream that had begun
                status = int((exc.body or {}).get("code") or 0) if isinstance(exc.body, dict) else 0
                odd.extend([] if status == 503 else [f"{status} (stream event): {exc.message}"])
            outcomes.append((time.monotonic(), status, "stream" if stream else "plain"))
            time.sleep(0.05)

    workers = [threading.Thread(target=load, args=(s,)) for s in (False, True)]
    for w in workers:
        w.start()
    try:
        time.sleep(1.5)
        os.kill(before.pid, signal.SIGKILL)
        killed = time.monotonic()
        time.sleep(2)
        status = cli("triton", "status", "--repository", str(world.repository))
        assert status.returncode != 0 and "no embedded Triton running" in status.stdout, status
        restarted = cli("triton", "start", "--repository", str(world.repository))
        assert restarted.returncode == 0, restarted.stderr
        ready = time.monotonic()
        time.sleep(12)
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    after = read_record(world.repository)
    assert after.pid != before.pid and pid_alive(after.pid)
    assert (after.http_url, after.grpc_url, after.metrics_url) == (before.http_url, before.grpc_url, before.metrics_url)
    assert pid_alive(world.front_pid)  # the same front, never restarted
    outage = [(s, kind) for t, s, kind in outcomes if killed < t < ready]
    late = [(s, kind) for t, s, kind in outcomes if t > ready + 10]
    print(f"outage {ready - killed:.1f} s: {len(outage)} requests, statuses {sorted({s for s, _ in outage})}; "
          f"from 10 s after ready: {len(late)} requests, statuses {sorted({s for s, _ in late})}")
    assert outage and {s for s, _ in outage} <= {200, 503}, (outage, odd)  # 200: answered before the kill landed
    assert any(s == 503 for s, kind in outage if kind == "plain") and any(s == 503 for s, kind in outage
                                                                          if kind == "stream")
    assert late and all(s == 200 for s, _ in late), late
    assert cli("triton", "status", "--repository", str(world.repository)).returncode == 0
