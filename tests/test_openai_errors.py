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
