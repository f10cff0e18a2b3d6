"""Calls the router models over Triton's gRPC API (asyncio): one request, or a stream of partial outputs.

A stream goes to the release's streaming router (``<model>_stream``) when it is loaded, which it is
while the llm is decoupled: tokens then come as the engine makes them, routed by the release's
weights. Otherwise the router answers once, and its single answer is streamed as one chunk.

Every failure becomes one `BackendError` subclass, which the HTTP layer turns into its status: the
client's mistake (INVALID_ARGUMENT, from Triton or the engine through the router) `ClientError` 400;
a full queue `Overloaded` 429; Triton down, restarting or not serving the model yet `Unavailable` 503
(its message never carries Triton's address; the gRPC channel reconnects by itself within
MAX_RECONNECT_BACKOFF_MS of Triton coming back); the deadline `DeadlineExceeded` 504; anything else
(our bug) `BackendError` 500.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from serving.llm_client import NOT_LOADED_WORDS, is_overload
from serving.triton.models.requests import INVALID_REQUEST
from serving.triton.repository import stream_model_name

STREAM_TARGET_TTL_S = 5.0  # how long whether a model has a streaming router is remembered


class BackendError(Exception):
    """A request failed for a reason of ours (HTTP 500)."""

    http_status = 500
    kind = "server_error"

    def __init__(self, message: str, *, status: str = "") -> None:
        super().__init__(message)
        self.status = status


class ClientError(BackendError):
    """The request itself is wrong (a limit of the engine, a bad value): HTTP 400."""

    http_status = 400
    kind = "invalid_request_error"


class Overloaded(BackendError):
    """Triton refused the request because its queue is full: try again later (HTTP 429)."""

    http_status = 429
    kind = "rate_limit_error"


class Unavailable(BackendError):
    """Triton is down or restarting, or has not loaded the model (again) yet (HTTP 503)."""

    http_status = 503
    kind = "service_unavailable"


class DeadlineExceeded(BackendError):
    """No answer within the front's deadline (HTTP 504)."""

    http_status = 504
    kind = "timeout_error"


class UnknownModel(BackendError):
    http_status = 404
    kind = "invalid_request_error"


# The gRPC channel's reconnect backoff (gRPC's default grows to 120 s: a restarted Triton would wait that long)
MAX_RECONNECT_BACKOFF_MS = 1000
CHANNEL_ARGS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]
UNAVAILABLE_STATUSES = ("UNAVAILABLE", "UNKNOWN", "CANCELLED")  # with a message that is not an overload
# gRPC's words for a connection that went away under a call (INTERNAL "Received RST_STREAM with error code 2"
# when the server dies mid-stream): the server is down, not failing
TRANSPORT_WORDS = ("rst_stream", "socket closed", "connection reset", "goaway", "broken pipe", "stream removed")


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings, matched by the engine model (special tokens included)
    ignore_eos: bool = False
    top_k: int = 0
    logprobs: bool = False  # each output token's log-prob
    top_logprobs: int = 0  # and this many alternatives (of prompt tokens too)
    prompt_logprobs: bool = False  # each prompt token's log-prob (echo)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    guided_decoding: str | None = None  # the grammar the output must match (serving/openai/structured.py)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0 or self.prompt_logprobs


@dataclass
class Piece:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int | None = None  # on the final piece
    logprobs: dict[str, Any] | None = None  # the llm's `output_logprobs` (`logprob_output`), when asked for


# A chat goes as `messages` (JSON): the engine model applies its tokenizer's chat template (a dict when it
# carries tools: serving/openai/tools.chat_messages); token ids as `input_ids`.
Prompt = str | list[int] | list[dict[str, Any]] | dict[str, Any]
OUTPUTS = ("text_output", "output_ids", "finish_reason", "prompt_tokens")


def _outputs(grpc: Any, sampling: Sampling) -> list[Any]:
    return [grpc.InferRequestedOutput(n) for n in OUTPUTS + (("output_logprobs",) if sampling.wants_logprobs else ())]


def _prompt_input(prompt: Prompt) -> tuple[str, np.ndarray, str]:
    if isinstance(prompt, str):
        return "text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return "input_ids", np.array([prompt], dtype=np.int32), "INT32"
    return "messages", np.array([[json.dumps(prompt).encode()]], dtype=object), "BYTES"


def _inputs(grpc: Any, prompt: Prompt, sampling: Sampling, *, stream: bool = False) -> list[Any]:
    values = [_prompt_input(prompt), ("max_tokens", np.array([[sampling.max_tokens]], dtype=np.int32), "INT32")]
    if sampling.stop:
        values.append(("stop", np.array([[s.encode() for s in sampling.stop]], dtype=object), "BYTES"))
    if sampling.ignore_eos:
        values.append(("ignore_eos", np.array([[True]], dtype=bool), "BOOL"))
    if stream:
        values.append(("stream", np.array([[True]], dtype=bool), "BOOL"))
    # OpenAI's defaults (temperature 1, top_p 1) mean "sample"; temperature 0 means greedy.
    if sampling.temperature is not None and sampling.temperature > 0:
        values.append(("temperature", np.array([[sampling.temperature]], dtype=np.float32), "FP32"))
        if sampling.top_p is not None:
            values.append(("top_p", np.array([[sampling.top_p]], dtype=np.float32), "FP32"))
        if sampling.top_k > 0:
            values.append(("top_k", np.array([[sampling.top_k]], dtype=np.int32), "INT32"))
        if sampling.seed is not None:
            values.append(("seed", np.array([[sampling.seed]], dtype=np.int64), "INT64"))
    values += _extra_inputs(sampling)
    tensors = []
    for name, array, dtype in values:
        tensor = grpc.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _extra_inputs(sampling: Sampling) -> list[tuple[str, np.ndarray, str]]:
    """The inputs of what only the in-flight paged engine serves, each only when asked for."""
    values: list[tuple[str, np.ndarray, str]] = []
    flags = (("logprobs", sampling.logprobs), ("prompt_logprobs", sampling.prompt_logprobs))
    values += [(name, np.array([[True]], dtype=bool), "BOOL") for name, on in flags if on]
    if sampling.top_logprobs:
        values.append(("top_logprobs", np.array([[sampling.top_logprobs]], dtype=np.int32), "INT32"))
    for name, value, off in (("presence_penalty", sampling.presence_penalty, 0.0),
                             ("frequency_penalty", sampling.frequency_penalty, 0.0),
                             ("repetition_penalty", sampling.repetition_penalty, 1.0)):
        if value != off:
            values.append((name, np.array([[value]], dtype=np.float32), "FP32"))
    if sampling.logit_bias:
        values.append(("logit_bias_ids", np.array([[t for t, _ in sampling.logit_bias]], dtype=np.int32), "INT32"))
        values.append(("logit_bias_values", np.array([[b for _, b in sampling.logit_bias]], dtype=np.float32), "FP32"))
    if sampling.min_tokens:
        values.append(("min_tokens", np.array([[sampling.min_tokens]], dtype=np.int32), "INT32"))
    if sampling.stop_token_ids:
        values.append(("stop_token_ids", np.array([list(sampling.stop_token_ids)], dtype=np.int32), "INT32"))
    if sampling.guided_decoding is not None:
        values.append(("guided_decoding", np.array([[sampling.guided_decoding.encode()]], dtype=object), "BYTES"))
    return values


def _piece(result: Any) -> Piece:
    def flat(name: str) -> Any:
        array = result.as_numpy(name)
        return None if array is None else array.reshape(-1)

    text, ids, reason, prompt = flat("text_output"), flat("output_ids"), flat("finish_reason"), flat("prompt_tokens")
    logprobs = flat("output_logprobs")
    return Piece(
        text=text[0].decode("utf-8", "replace") if text is not None and len(text) else "",
        token_ids=[int(i) for i in ids] if ids is not None else [],
        finish_reason=reason[0].decode() if reason is not None and len(reason) and reason[0] else None,
        prompt_tokens=int(prompt[0]) if prompt is not None and len(prompt) else None,
        logprobs=json.loads(bytes(logprobs[0])) if logprobs is not None and len(logprobs) else None,
    )


def _error(exc: Any, model: str) -> BackendError:
    """The BackendError of a failed call (AioRpcError, InferenceServerException or another exception)."""
    if callable(getattr(exc, "status", None)):  # tritonclient's InferenceServerException
        status, message = str(exc.status()), exc.message() or str(exc)
    elif callable(getattr(exc, "code", None)) and callable(getattr(exc, "details", None)):  # grpc's AioRpcError
        status, message = str(exc.code()), exc.details() or str(exc)
    else:
        status, message = "", str(exc)
    code = status.rsplit(".", 1)[-1]
    if is_overload(code if code == "RESOURCE_EXHAUSTED" else "", message):
        return Overloaded(f"model {model!r} is overloaded (its queue is full): try again later", status=status)
    if code == "INVALID_ARGUMENT" or INVALID_REQUEST in message:  # a stream's errors carry no code, only words
        return ClientError(message, status=status)
    if code == "DEADLINE_EXCEEDED":
        return DeadlineExceeded(f"model {model!r} did not answer within the deadline", status=status)
    if any(w in message.lower() for w in NOT_LOADED_WORDS) or code == "NOT_FOUND":
        return Unavailable(f"model {model!r} is not loaded in the model server (it may be restarting): "
                           "try again later", status=status)
    if code in UNAVAILABLE_STATUSES or isinstance(exc, OSError) or any(w in message.lower() for w in TRANSPORT_WORDS):
        return Unavailable("the model server is unavailable (down or restarting): try again later", status=status)
    return BackendError(f"model {model!r} failed: {message}", status=status)


class TritonBackend:
    """One gRPC channel to a Triton endpoint, shared by every request."""

    def __init__(self, grpc_url: str, *, timeout_s: float = 60.0) -> None:
        self.grpc_url = grpc_url
        self.timeout_s = timeout_s
        self._client: Any = None
        self._streaming: dict[str, tuple[bool, float]] = {}  # model -> (has a streaming router, when asked)

    def client(self) -> Any:
        if self._client is None:
            import tritonclient.grpc.aio as grpc

            self._client = grpc.InferenceServerClient(self.grpc_url, channel_args=CHANNEL_ARGS)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def ready(self) -> bool:
        try:
            return bool(await self.client().is_server_ready())
        except Exception:  # noqa: BLE001 - not ready is the answer
            return False

    async def model_ready(self, model: str) -> bool:
        try:
            return bool(await self.client().is_model_ready(model))
        except Exception:  # noqa: BLE001
            return False

    async def complete(self, model: str, prompt: Prompt, sampling: Sampling) -> Piece:
        import tritonclient.grpc.aio as grpc

        outputs = _outputs(grpc, sampling)
        started = time.monotonic()
        try:
            result = await self.client().infer(
                model, _inputs(grpc, prompt, sampling), outputs=outputs, request_id=uuid.uuid4().hex,
                client_timeout=self.timeout_s,
            )
        except Exception as exc:
            raise self._failure(exc, model, started) from exc
        return _piece(result)

    def _failure(self, exc: Any, model: str, started: float) -> BackendError:
        """The call's BackendError; any failure once the deadline has passed is the deadline's (Triton cancels a
        timed-out stream's request and may report that as an internal error rather than DEADLINE_EXCEEDED)."""
        error = _error(exc, model)
        if type(error) is BackendError and time.monotonic() - started >= self.timeout_s:
            return DeadlineExceeded(f"model {model!r} did not answer within the deadline", status=error.status)
        return error

    async def has_streaming_router(self, model: str) -> bool:
        """Whether ``<model>_stream`` is loaded (remembered for STREAM_TARGET_TTL_S)."""
        known = self._streaming.get(model)
        if known is None or time.monotonic() - known[1] > STREAM_TARGET_TTL_S:
            try:  # Triton down is this request's 503, not a "no" to remember
                ready = bool(await self.client().is_model_ready(stream_model_name(model)))
            except Exception as exc:
                raise _error(exc, model) from exc
            known = (ready, time.monotonic())
            self._streaming[model] = known
        return known[0]

    async def stream(self, model: str, prompt: Prompt, sampling: Sampling) -> AsyncIterator[Piece]:
        import tritonclient.grpc.aio as grpc

        outputs = _outputs(grpc, sampling)
        streaming = await self.has_streaming_router(model)
        target = stream_model_name(model) if streaming else model

        async def requests():
            yield {"model_name": target, "inputs": _inputs(grpc, prompt, sampling, stream=streaming),
                   "outputs": outputs, "request_id": uuid.uuid4().hex, "enable_empty_final_response": True}

        started = time.monotonic()
        try:
            async for result, error in self.client().stream_infer(requests(), stream_timeout=self.timeout_s):
                if error is not None:
                    raise self._failure(error, model, started)
                response = result.get_response()
                final = response.parameters.get("triton_final_response")
                piece = _piece(result) if response.outputs else Piece("", [], None)
                if piece.text or piece.token_ids or piece.finish_reason or piece.logprobs:
                    yield piece
                if final is None or final.bool_param:
                    return
        except BackendError:
            raise
        except Exception as exc:  # the channel itself failed (Triton gone mid-stream, the deadline)
            raise self._failure(exc, model, started) from exc
