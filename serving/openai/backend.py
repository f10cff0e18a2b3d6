"""Calls the router models over Triton's gRPC API (asyncio): one request, or a stream of partial outputs.

A stream goes to the release's streaming router (``<model>_stream``) when it is loaded, which it is
while the llm is decoupled: tokens then come as the engine makes them, routed by the release's
weights. Otherwise the router answers once, and its single answer is streamed as one chunk. Triton's
full queue (RESOURCE_EXHAUSTED / UNAVAILABLE) becomes `Overloaded`, which the HTTP layer turns into 429
with Retry-After.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from serving.llm_client import is_overload
from serving.triton.repository import stream_model_name

STREAM_TARGET_TTL_S = 5.0  # how long whether a model has a streaming router is remembered


class BackendError(Exception):
    def __init__(self, message: str, *, status: str = "") -> None:
        super().__init__(message)
        self.status = status


class Overloaded(BackendError):
    """Triton refused the request because its queue is full: try again later."""


class UnknownModel(BackendError):
    pass


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None


@dataclass
class Piece:
    text: str
    token_ids: list[int]
    finish_reason: str | None


def _inputs(grpc: Any, prompt: str, sampling: Sampling, *, stream: bool = False) -> list[Any]:
    values = [
        ("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
        ("max_tokens", np.array([[sampling.max_tokens]], dtype=np.int32), "INT32"),
    ]
    if stream:
        values.append(("stream", np.array([[True]], dtype=bool), "BOOL"))
    # OpenAI's defaults (temperature 1, top_p 1) mean "sample"; temperature 0 means greedy.
    if sampling.temperature is not None and sampling.temperature > 0:
        values.append(("temperature", np.array([[sampling.temperature]], dtype=np.float32), "FP32"))
        if sampling.top_p is not None:
            values.append(("top_p", np.array([[sampling.top_p]], dtype=np.float32), "FP32"))
        if sampling.seed is not None:
            values.append(("seed", np.array([[sampling.seed]], dtype=np.int64), "INT64"))
    tensors = []
    for name, array, dtype in values:
        tensor = grpc.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _piece(result: Any) -> Piece:
    def flat(name: str) -> Any:
        array = result.as_numpy(name)
        return None if array is None else array.reshape(-1)

    text, ids, reason = flat("text_output"), flat("output_ids"), flat("finish_reason")
    return Piece(
        text=text[0].decode("utf-8", "replace") if text is not None and len(text) else "",
        token_ids=[int(i) for i in ids] if ids is not None else [],
        finish_reason=reason[0].decode() if reason is not None and len(reason) and reason[0] else None,
    )


def _error(exc: Any, model: str) -> BackendError:
    status = str(exc.status()) if hasattr(exc, "status") else ""
    message = exc.message() if hasattr(exc, "message") else str(exc)
    if is_overload(status, message):
        return Overloaded(f"model {model!r} is overloaded: {message}", status=status)
    if "unknown model" in message.lower() or "not found" in message.lower():
        return UnknownModel(f"model {model!r} is not served: {message}", status=status)
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

            self._client = grpc.InferenceServerClient(self.grpc_url)
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

    async def complete(self, model: str, prompt: str, sampling: Sampling) -> Piece:
        import tritonclient.grpc.aio as grpc

        outputs = [grpc.InferRequestedOutput(n) for n in ("text_output", "output_ids", "finish_reason")]
        try:
            result = await self.client().infer(
                model, _inputs(grpc, prompt, sampling), outputs=outputs, request_id=uuid.uuid4().hex,
                client_timeout=self.timeout_s,
            )
        except Exception as exc:
            raise _error(exc, model) from exc
        return _piece(result)

    async def has_streaming_router(self, model: str) -> bool:
        """Whether ``<model>_stream`` is loaded (remembered for STREAM_TARGET_TTL_S)."""
        known = self._streaming.get(model)
        if known is None or time.monotonic() - known[1] > STREAM_TARGET_TTL_S:
            known = (await self.model_ready(stream_model_name(model)), time.monotonic())
            self._streaming[model] = known
        return known[0]

    async def stream(self, model: str, prompt: str, sampling: Sampling) -> AsyncIterator[Piece]:
        import tritonclient.grpc.aio as grpc

        outputs = [grpc.InferRequestedOutput(n) for n in ("text_output", "output_ids", "finish_reason")]
        streaming = await self.has_streaming_router(model)
        target = stream_model_name(model) if streaming else model

        async def requests():
            yield {"model_name": target, "inputs": _inputs(grpc, prompt, sampling, stream=streaming),
                   "outputs": outputs, "request_id": uuid.uuid4().hex, "enable_empty_final_response": True}

        async for result, error in self.client().stream_infer(requests(), stream_timeout=self.timeout_s):
            if error is not None:
                raise _error(error, model)
            response = result.get_response()
            final = response.parameters.get("triton_final_response")
            piece = _piece(result) if response.outputs else Piece("", [], None)
            if piece.text or piece.token_ids or piece.finish_reason:
                yield piece
            if final is None or final.bool_param:
                return
