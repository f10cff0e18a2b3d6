"""The tritonclient-based helper: HTTP and gRPC agree, streams assemble, deadlines hold, and only
retryable errors are retried."""

from __future__ import annotations

import concurrent.futures

import pytest
from triton_support import tiny_models_served

from serving.llm_client import GenerationParams, LLMClient, LLMClientError
from serving.triton.client import infer_ids

pytestmark = pytest.mark.slow

MODEL = "tiny-client"
TIGHT = "tiny-client-tight"  # the same engine behind a queue of one request
PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    with tiny_models_served(tmp_path_factory.mktemp("client"), {MODEL: 64, TIGHT: 1}) as server:
        yield server


def test_grpc_and_http_agree_with_the_plain_client(triton):
    expected = infer_ids(triton.http_url, MODEL, PROMPT, max_tokens=8).output_ids
    for client in (LLMClient(triton.grpc_url), LLMClient(triton.http_url, protocol="http")):
        try:
            done = client.generate(MODEL, PROMPT, GenerationParams(max_tokens=8), request_id="req-42")
        finally:
            client.close()
        assert done.output_ids == expected and done.request_id == "req-42" and done.attempts == 1


def test_stream_over_grpc_assembles_the_answer(triton):
    client = LLMClient(triton.grpc_url)
    whole = client.generate(MODEL, "Once upon a time", GenerationParams(max_tokens=8))
    pieces = list(client.stream(MODEL, "Once upon a time", GenerationParams(max_tokens=8)))
    client.close()
    assert [i for p in pieces for i in p.output_ids] == whole.output_ids
    assert pieces[-1].finish_reason == "length" and all(p.finish_reason == "" for p in pieces[:-1])


def test_invalid_request_is_not_retried(triton):
    client = LLMClient(triton.grpc_url, retries=5)
    with pytest.raises(LLMClientError) as failed:
        client.generate(MODEL, list(range(3)) * 400, GenerationParams(max_tokens=8))  # longer than max_input_len
    client.close()
    assert not failed.value.retryable


def test_deadline_is_enforced(triton):
    client = LLMClient(triton.grpc_url, deadline_s=0.001, retries=0)
    with pytest.raises(LLMClientError) as failed:
        client.generate(MODEL, PROMPT, GenerationParams(max_tokens=64))
    client.close()
    assert "DEADLINE_EXCEEDED" in failed.value.status


def test_overload_is_retried_until_it_succeeds(triton):
    def one(i: int):
        client = LLMClient(triton.grpc_url, retries=40, backoff_s=0.05, deadline_s=120)
        try:
            return client.generate(TIGHT, [*PROMPT, i], GenerationParams(max_tokens=32))
        finally:
            client.close()

    with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(one, range(12)))
    assert all(len(r.output_ids) == 32 for r in results)
    assert max(r.attempts for r in results) > 1, "the burst should have overflowed a queue of one"
