"""The FastAPI app: /v1/models, /v1/completions, /v1/chat/completions (with server-sent events), /health, /metrics."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from serving.openai.backend import BackendError, Overloaded, Piece, Sampling, TritonBackend, UnknownModel
from serving.openai.schemas import ChatCompletionRequest, CompletionRequest, chat_prompt

RETRY_AFTER_S = 1


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("enginewright_openai_requests", "Requests by route, model and HTTP status",
                                ["route", "model", "status"], registry=self.registry)
        self.tokens = Counter("enginewright_openai_completion_tokens", "Generated tokens", ["model"],
                              registry=self.registry)
        self.latency = Histogram("enginewright_openai_request_seconds", "Time to the last byte", ["route"],
                                 registry=self.registry)
        self.ttft = Histogram("enginewright_openai_time_to_first_token_seconds", "Streaming: first chunk",
                              ["model"], registry=self.registry)
        self.in_flight = Gauge("enginewright_openai_in_flight", "Requests being served", registry=self.registry)


def openai_error(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


def _error_response(exc: BackendError) -> JSONResponse:
    if isinstance(exc, Overloaded):
        return openai_error(429, str(exc), kind="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, UnknownModel):
        return openai_error(404, str(exc), kind="invalid_request_error", param="model")
    if "DEADLINE_EXCEEDED" in exc.status:
        return openai_error(504, str(exc), kind="timeout_error")
    return openai_error(502, str(exc), kind="server_error")


def apply_stop(text: str, stops: list[str] | None) -> tuple[str, bool]:
    """Cut `text` before the first stop string; say whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops or []) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def create_app(backend: TritonBackend, models: list[str]) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await backend.close()

    app = FastAPI(title="enginewright OpenAI-compatible API", lifespan=lifespan)
    metrics = Metrics()
    served = set(models)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        metrics.requests.labels(request.url.path, "-", "400").inc()
        return openai_error(400, f"{param or 'body'}: {first.get('msg')}", param=param)

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = await backend.ready()
        return JSONResponse({"status": "ok" if ready else "triton not ready"}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "enginewright"} for m in sorted(served)
        ]}

    async def serve(route: str, req: CompletionRequest | ChatCompletionRequest, prompt: str, chat: bool):
        if req.model not in served:
            metrics.requests.labels(route, req.model, "404").inc()
            return openai_error(404, f"model {req.model!r} is not served here; served: {sorted(served)}",
                                param="model")
        max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
        sampling = Sampling(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:
            return await _stream(route, req, prompt, sampling, rid, chat)
        started = time.monotonic()
        metrics.in_flight.inc()
        try:
            piece = await backend.complete(req.model, prompt, sampling)
        except BackendError as exc:
            response = _error_response(exc)
            metrics.requests.labels(route, req.model, str(response.status_code)).inc()
            return response
        finally:
            metrics.in_flight.dec()
        text, stopped = apply_stop(piece.text, req.stop)
        reason = "stop" if stopped else (piece.finish_reason or "length")
        metrics.requests.labels(route, req.model, "200").inc()
        metrics.tokens.labels(req.model).inc(len(piece.token_ids))
        metrics.latency.labels(route).observe(time.monotonic() - started)
        return JSONResponse(_body(rid, req.model, text, reason, len(piece.token_ids), chat))

    async def _stream(route, req, prompt, sampling, rid, chat) -> StreamingResponse | JSONResponse:
        pieces = backend.stream(req.model, prompt, sampling)
        started = time.monotonic()
        try:
            first = await anext(pieces, None)  # errors before the first byte still get a status code
        except BackendError as exc:
            response = _error_response(exc)
            metrics.requests.labels(route, req.model, str(response.status_code)).inc()
            return response
        metrics.ttft.labels(req.model).observe(time.monotonic() - started)

        async def events() -> AsyncIterator[bytes]:
            metrics.in_flight.inc()
            text, tokens, reason = "", 0, None
            try:
                if chat:
                    yield _sse(_chunk(rid, req.model, None, None, chat, role=True))
                piece: Piece | None = first
                while piece is not None:
                    tokens += len(piece.token_ids)
                    new_text, stopped = apply_stop(text + piece.text, req.stop)
                    delta, text = new_text[len(text):], new_text
                    if delta:
                        yield _sse(_chunk(rid, req.model, delta, None, chat))
                    if stopped:
                        reason = "stop"
                        break
                    reason = piece.finish_reason or reason
                    piece = await anext(pieces, None)
                yield _sse(_chunk(rid, req.model, "", reason or "length", chat))
                yield b"data: [DONE]\n\n"
                metrics.requests.labels(route, req.model, "200").inc()
            except BackendError as exc:
                yield _sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
                metrics.requests.labels(route, req.model, "stream-error").inc()
            finally:
                metrics.in_flight.dec()
                metrics.tokens.labels(req.model).inc(tokens)
                metrics.latency.labels(route).observe(time.monotonic() - started)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return await serve("/v1/completions", req, req.prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        return await serve("/v1/chat/completions", req, chat_prompt(req.messages), chat=True)

    return app


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def _body(rid: str, model: str, text: str, reason: str, completion_tokens: int, chat: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        # Triton tokenizes the prompt inside the engine model, so the front does not know its length.
        "usage": {"prompt_tokens": 0, "completion_tokens": completion_tokens, "total_tokens": completion_tokens},
    }


def _chunk(rid: str, model: str, text: str | None, reason: str | None, chat: bool, *, role: bool = False) -> dict:
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
        if reason is not None:
            delta = {}
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
