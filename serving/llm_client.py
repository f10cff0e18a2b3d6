"""A client for the promoted models over `tritonclient` (HTTP or gRPC), with request ids, deadlines and
retries of retryable errors only. Streaming uses gRPC's bidirectional stream when the model is decoupled.

`tritonclient` is imported lazily: this module stays importable inside Triton's python backend.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Errors worth another try: the server (or its queue) is momentarily unable to take the request.
RETRYABLE_GRPC = {"StatusCode.UNAVAILABLE", "StatusCode.RESOURCE_EXHAUSTED"}
RETRYABLE_HTTP = {429, 502, 503, 504}
# Through the BLS router a full engine queue arrives as INTERNAL with Triton's own words.
OVERLOAD_WORDS = ("exceeds maximum queue size", "resource exhausted")
# Triton's words for a model that is not loaded, not yet (a restarted server loading it) or not any more; through
# the router these too arrive as INTERNAL. "is not at ready state": a version Triton is still loading.
NOT_LOADED_WORDS = ("unknown model", "is not found", "not ready", "is not at ready state", "has no available versions")


def is_overload(status: str, message: str) -> bool:
    """Whether Triton refused the request for lack of room (try again later), whatever the status says."""
    return status in RETRYABLE_GRPC or status in {"429", "503"} or any(w in message.lower() for w in OVERLOAD_WORDS)


class LLMClientError(Exception):
    """A request failed; `retryable` says whether trying again later can help."""

    def __init__(self, message: str, *, status: str, retryable: bool, request_id: str) -> None:
        super().__init__(f"{message} (status {status}, request {request_id})")
        self.status = status
        self.retryable = retryable
        self.request_id = request_id


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 16
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None


@dataclass
class Completion:
    text: str
    output_ids: list[int]
    finish_reason: str
    routed_version: int | None
    request_id: str
    attempts: int = 1
    chunks: list[str] = field(default_factory=list)


def _inputs(module: Any, prompt: str | list[int], params: GenerationParams) -> list[Any]:
    arrays: list[tuple[str, np.ndarray, str]] = []
    if isinstance(prompt, str):
        arrays.append(("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"))
    else:
        arrays.append(("input_ids", np.array([prompt], dtype=np.int32), "INT32"))
    arrays.append(("max_tokens", np.array([[params.max_tokens]], dtype=np.int32), "INT32"))
    for name, value, dtype, np_dtype in (
        ("temperature", params.temperature, "FP32", np.float32),
        ("top_k", params.top_k, "INT32", np.int32),
        ("top_p", params.top_p, "FP32", np.float32),
        ("seed", params.seed, "INT64", np.int64),
    ):
        if value is not None:
            arrays.append((name, np.array([[value]], dtype=np_dtype), dtype))
    tensors = []
    for name, array, dtype in arrays:
        tensor = module.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _completion(result: Any, request_id: str, attempts: int, missing_reason: str = "length") -> Completion:
    def first(name: str) -> Any:
        array = result.as_numpy(name)
        return None if array is None else array.reshape(-1)

    text = first("text_output")
    ids = first("output_ids")
    reason = first("finish_reason")
    routed = first("routed_version")
    return Completion(
        text=text[0].decode() if text is not None and len(text) else "",
        output_ids=[int(x) for x in ids] if ids is not None else [],
        finish_reason=reason[0].decode() if reason is not None and len(reason) else missing_reason,
        routed_version=int(routed[0]) if routed is not None and len(routed) else None,
        request_id=request_id,
        attempts=attempts,
    )


class LLMClient:
    """Calls one Triton endpoint. `protocol` is "grpc" (host:port) or "http" (host:port, no scheme)."""

    def __init__(self, url: str, *, protocol: str = "grpc", deadline_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 0.2) -> None:
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol={protocol!r} must be grpc or http")
        self.url = url.removeprefix("http://").removeprefix("grpc://")
        self.protocol = protocol
        self.deadline_s = deadline_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._client: Any = None

    def _module(self) -> Any:
        if self.protocol == "grpc":
            import tritonclient.grpc as module
        else:
            import tritonclient.http as module
        return module

    def client(self) -> Any:
        if self._client is None:
            module = self._module()
            self._client = module.InferenceServerClient(self.url)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def generate(self, model: str, prompt: str | list[int], params: GenerationParams = GenerationParams(), *,
                 request_id: str | None = None) -> Completion:
        """One complete generation, retried on retryable errors until the deadline."""
        request_id = request_id or uuid.uuid4().hex
        deadline = time.monotonic() + self.deadline_s
        module = self._module()
        for attempt in itertools.count(1):
            remaining = deadline - time.monotonic()
            try:
                result = self._infer(module, model, prompt, params, request_id, remaining)
                return _completion(result, request_id, attempt)
            except Exception as exc:
                error = self._classify(exc, request_id)
                if not error.retryable or attempt > self.retries or time.monotonic() + self.backoff_s >= deadline:
                    raise error from exc
                time.sleep(self.backoff_s * attempt)
        raise AssertionError("unreachable")

    def _infer(self, module: Any, model: str, prompt, params, request_id: str, timeout_s: float) -> Any:
        outputs = [module.InferRequestedOutput(n) for n in ("text_output", "output_ids", "finish_reason")]
        kwargs: dict[str, Any] = {"request_id": request_id, "outputs": outputs}
        if self.protocol == "grpc":
            kwargs["client_timeout"] = max(timeout_s, 0.001)
        else:
            kwargs["timeout"] = int(max(timeout_s, 0.001) * 1e6)  # microseconds, a server-side deadline
        return self.client().infer(model, _inputs(module, prompt, params), **kwargs)

    def _classify(self, exc: Exception, request_id: str) -> LLMClientError:
        status = str(getattr(exc, "status", lambda: None)() or "unknown")
        message = getattr(exc, "message", lambda: str(exc))() or str(exc)
        if self.protocol == "grpc":
            retryable = status in RETRYABLE_GRPC
        else:
            retryable = status.isdigit() and int(status) in RETRYABLE_HTTP
        retryable = retryable or is_overload(status, message)
        return LLMClientError(message, status=status, retryable=retryable, request_id=request_id)

    def stream(self, model: str, prompt: str | list[int], params: GenerationParams = GenerationParams(), *,
               request_id: str | None = None) -> Iterator[Completion]:
        """Yield partial completions as a decoupled model sends them (gRPC only); the last has the finish reason."""
        if self.protocol != "grpc":
            raise ValueError("streaming needs protocol='grpc'")
        import queue

        import tritonclient.grpc as module

        request_id = request_id or uuid.uuid4().hex
        answers: queue.Queue = queue.Queue()
        client = module.InferenceServerClient(self.url)
        try:
            client.start_stream(callback=lambda result, error: answers.put((result, error)),
                                stream_timeout=self.deadline_s)
            outputs = [module.InferRequestedOutput(n) for n in ("text_output", "output_ids", "finish_reason")]
            client.async_stream_infer(model, _inputs(module, prompt, params), request_id=request_id,
                                      outputs=outputs, enable_empty_final_response=True)
            deadline = time.monotonic() + self.deadline_s
            while True:
                try:
                    result, error = answers.get(timeout=max(deadline - time.monotonic(), 0.001))
                except queue.Empty:
                    raise LLMClientError("stream timed out", status="DEADLINE_EXCEEDED", retryable=True,
                                         request_id=request_id) from None
                if error is not None:
                    raise self._classify(error, request_id)
                response = result.get_response()
                final = response.parameters.get("triton_final_response")
                is_final = bool(final and final.bool_param)
                if response.outputs:  # streamed chunks carry finish_reason only on the final one
                    yield _completion(result, request_id, 1, missing_reason="")
                if is_final:
                    return
        finally:
            client.stop_stream()
            client.close()
