"""`enginewright serve` in front of a real Triton, driven by the official `openai` client."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest
from triton_support import openai_front, tiny_models_served

from serving.triton.client import infer_text

pytestmark = pytest.mark.slow

MODEL = "tiny-openai"
TIGHT = "tiny-openai-tight"  # the same engine behind a queue of one request
LIVE = "tiny-openai-inflight"  # the same engine with in-flight batching: its streams go through <name>_stream
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    # MODEL's queue holds the hundred concurrent streams below beside the engine's batch of 8: with 64 the 100
    # requests overflowed it (429) whenever the front forwarded them faster than the engine took batches
    with tiny_models_served(tmp_path_factory.mktemp("openai"), {MODEL: 128, TIGHT: 1, LIVE: 64},
                            decoupled=frozenset({LIVE})) as server:
        yield server


@pytest.fixture(scope="module")
def front(triton, tmp_path_factory):
    with openai_front(triton.grpc_url, [MODEL, TIGHT, LIVE], tmp_path_factory.mktemp("front") / "serve.log") as base:
        yield base


@pytest.fixture
def client(front):
    return openai.OpenAI(base_url=f"{front}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_are_listed(client):
    assert [m.id for m in client.models.list().data] == sorted([MODEL, TIGHT, LIVE])


def test_completion_equals_tritons_own_answer(client, triton):
    expected = infer_text(triton.http_url, MODEL, PROMPT, max_tokens=12).text
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert done.choices[0].text == expected
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 12


def test_streamed_completion_adds_up_to_the_whole(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_stream_of_an_in_flight_batching_model_comes_token_by_token_through_its_streaming_router(client):
    whole = client.completions.create(model=LIVE, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    chunks = list(client.completions.create(model=LIVE, prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert len([c for c in chunks if c.choices[0].text]) > 1  # not one chunk: the engine's tokens as they came
    assert chunks[-1].choices[0].finish_reason == "length"
    # and it is the same text as the plain model's: one engine behind both
    assert whole == client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text


def test_chat_with_an_engine_without_a_chat_template_is_a_400_naming_it(client):
    """The tiny model's tokenizer has no chat template (chat with one: test_openai_real_model.py)."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="has no chat template") as caught:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=stream)
        error = caught.value.body
        assert error["param"] == "messages" and "text_input" not in error["message"]
        assert "/" not in error["message"].replace("/v1/completions", ""), error  # no server path
        assert f"{MODEL}_v" not in error["message"]


def test_stop_string_cuts_the_text(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = whole[3:5]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == whole[: whole.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_hundred_concurrent_streams_all_finish(client):
    def one(i: int) -> tuple[str, str | None]:
        chunks = list(client.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=6,
                                                temperature=0, stream=True))
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(max_workers=100) as pool:
        results = list(pool.map(one, range(100)))
    assert len(results) == 100
    # "stop": the tiny model's EOS came up within 6 tokens (it ends a generation by default)
    assert all(reason in ("length", "stop") for _, reason in results), [r for _, r in results]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": 5}, "temperature"),
        ({"model": MODEL, "prompt": []}, "prompt"),
        ({"prompt": "hi"}, "model"),
    ],
)
def test_malformed_requests_get_400_naming_the_field(front, body, field):
    reply = httpx.post(f"{front}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and field in error["message"]


def test_unknown_model_is_404(front):
    reply = httpx.post(f"{front}/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=30)
    assert reply.status_code == 404 and "nope" in reply.json()["error"]["message"]


def test_metrics_count_requests(front, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    text = httpx.get(f"{front}/metrics", timeout=10).text
    assert 'enginewright_openai_requests_total{model="tiny-openai",route="/v1/completions",status="200"}' in text


def test_full_triton_queue_becomes_429_with_retry_after(front):
    """An engine queue of one request: a burst overflows it, and the overflow is told when to come back."""
    def one(i: int) -> httpx.Response:
        body = {"model": TIGHT, "prompt": f"{PROMPT} {i}", "max_tokens": 48}
        return httpx.post(f"{front}/v1/completions", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(max_workers=24) as pool:
        replies = list(pool.map(one, range(24)))
    statuses = sorted({r.status_code for r in replies})
    assert set(statuses) <= {200, 429}, [r.text for r in replies if r.status_code not in (200, 429)]
    refused = [r for r in replies if r.status_code == 429]
    assert refused, f"no request was refused with a queue of one: {statuses}"
    assert all(r.headers["Retry-After"] == "1" and r.json()["error"]["type"] == "rate_limit_error" for r in refused)
