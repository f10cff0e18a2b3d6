"""How the OpenAI front names a failed Triton call (serving/openai/backend.py `_error`): the HTTP status a client
sees for each kind of gRPC failure, with tritonclient's own exception type. The real-server paths (Triton killed
under load, queues full) are tests/test_openai_doors.py's; this pins the words they depend on."""

from __future__ import annotations

import pytest
from tritonclient.utils import InferenceServerException

from serving.openai.backend import _error


@pytest.mark.parametrize(("status", "message", "http"), [
    ("StatusCode.INTERNAL", "Received RST_STREAM with error code 2", 503),  # Triton killed mid-stream
    ("StatusCode.UNAVAILABLE", "Socket closed", 503),
    ("StatusCode.INTERNAL", "Connection reset by peer", 503),
    ("StatusCode.UNAVAILABLE", "failed to connect to all addresses", 503),
    ("StatusCode.NOT_FOUND", "Request for unknown model: 'm' is not found", 503),
    ("StatusCode.UNAVAILABLE", "'m_v1' version 1 is not at ready state", 503),  # loading after a restart
    ("StatusCode.INTERNAL", "'m_v1' version 1 is not at ready state", 503),  # ... through the BLS router
    ("StatusCode.RESOURCE_EXHAUSTED", "resource exhausted: the queue is full", 429),
    ("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded", 504),
    ("StatusCode.INTERNAL", "m_v1: v1 broke: ValueError", 500),  # the model's own failure stays ours to look into
])
def test_a_failed_call_gets_the_status_of_what_happened(status, message, http):
    err = _error(InferenceServerException(message, status=status), "m")
    assert err.http_status == http, f"{status} {message!r} -> {type(err).__name__}: {err}"


def test_the_router_passes_a_target_that_is_loading_or_full_on_as_unavailable():
    """Triton's BLS reports every target error as INTERNAL; the routers name the code a client can act on:
    UNAVAILABLE (try again) for a full queue or a version a restarted Triton is still loading."""
    from types import SimpleNamespace

    from serving.triton.models.requests import INVALID_REQUEST
    from serving.triton.models.routing import target_error_code

    codes = SimpleNamespace(INVALID_ARG="invalid", UNAVAILABLE="unavailable")
    internal = SimpleNamespace(code=lambda: "internal")
    for message in ("'m_v1' version 1 is not at ready state", "Request for unknown model: 'm_v2' is not found",
                    "exceeds maximum queue size"):
        assert target_error_code(message, internal, codes) == "unavailable", message
    assert target_error_code(f"{INVALID_REQUEST}: max_tokens", internal, codes) == "invalid"
    assert target_error_code("m_v1: v1 broke: ValueError", internal, codes) == "internal"


@pytest.mark.parametrize(("message", "chat", "param", "words"), [
    ("tiny_v3: invalid request: tiny_v3 v3: input 'top_logprobs'=21 must be from 0 to 20", True, "top_logprobs",
     "'top_logprobs'=21"),
    ("tiny_v3: invalid request: tiny_v3 v3: input 'top_logprobs'=9 must be from 0 to 20", False, "logprobs", "9"),
    (("tiny_v3: invalid request: tiny_v3 v3: input 'logit_bias_ids' names token id 99999, outside the vocabulary "
     "[0, 512)"), False, "logit_bias", "99999"),
    ("tiny_v3: invalid request: tiny_v3 v3: input 'prompt_logprobs' is served by engines with a paged KV cache",
     False, "echo", "'echo'"),
    ("tiny_v3: invalid request: tiny_v3 v3: prompt of 300 tokens exceeds the engine limit max_input_len=128", True,
     "messages", "max_input_len=128"),
    ("tiny_v3: invalid request: tiny_v3 v3: input 'text_input' of 9000 bytes exceeds the engine limit", False,
     "prompt", "9000 bytes"),
    (("tiny_v3: invalid request: tiny_v3 v3: input 'messages' needs a chat template, and the engine folder "
     "/srv/repo/tiny_v3/1/engine has none: send 'text_input' instead"), True, "messages", "no chat template"),
])
def test_an_engine_refusal_reads_in_openai_terms(message, chat, param, words):
    from serving.openai.errors import client_error

    text, got = client_error(message, chat=chat, model="tiny")
    assert got == param and words in text, (text, got)
    for internal in ("invalid request", "tiny_v3", "text_input", "input_ids", "logit_bias_ids", "/srv"):
        assert internal not in text, text


def test_completion_logprobs_have_openais_shape():
    from serving.openai.responses import completion_logprobs

    def entry(text: str, logprob: float | None, top: list[tuple[str, float]]) -> dict:
        return {"id": 0, "bytes": list(text.encode()), "logprob": logprob,
                "top": [{"id": 1, "bytes": list(t.encode()), "logprob": lp} for t, lp in top]}

    shaped = completion_logprobs([entry("The", None, []), entry(" cat", -1.5, [(" dog", -0.5), (" cat", -1.5)]),
                                  entry(" sat", -0.25, [(" sat", -0.25)])], top_n=1, offset=0)
    assert shaped["tokens"] == ["The", " cat", " sat"]
    assert shaped["token_logprobs"] == [None, -1.5, -0.25]
    assert shaped["top_logprobs"] == [None, {" dog": -0.5, " cat": -1.5}, {" sat": -0.25}]  # the chosen one too
    assert shaped["text_offset"] == [0, 3, 7]


def test_an_internal_error_once_the_deadline_has_passed_is_the_deadline():
    """Triton cancels a timed-out stream's request and may answer "Internal error from Core" rather than
    DEADLINE_EXCEEDED: past the front's deadline that is a 504, before it a 500, and a client's mistake stays a 400."""
    import time

    from serving.openai.backend import TritonBackend

    backend = TritonBackend("127.0.0.1:1", timeout_s=0.5)
    internal = InferenceServerException("Internal error from Core", status="StatusCode.INTERNAL")
    invalid = InferenceServerException("bad", status="StatusCode.INVALID_ARGUMENT")
    assert backend._failure(internal, "m", time.monotonic()).http_status == 500
    assert backend._failure(internal, "m", time.monotonic() - 1).http_status == 504
    assert backend._failure(invalid, "m", time.monotonic() - 1).http_status == 400
