"""The FastAPI app: /v1/models, /v1/completions, /v1/chat/completions (with server-sent events), /health, /metrics.

Every error, ours or FastAPI's (unknown route, wrong method, invalid JSON, a body over the limit), is
OpenAI's error object; a backend failure gets the status of its `BackendError` class (400, 404, 429,
503, 504; 500 only for a bug of ours), with Retry-After where trying again later helps. A stream that
fails after its first byte ends with an SSE ``error`` event carrying that status as ``code``.
"""

from __future__ import annotations

import contextlib
import json
import logging
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
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.openai.backend import BackendError, ClientError, Piece, Sampling, TritonBackend
from serving.openai.limits import BodyLimit, FrontLimits, prompt_too_long
from serving.openai.schemas import UNSUPPORTED, ChatCompletionRequest, CompletionRequest
from serving.openai.structured import guided_decoding
from serving.openai.tools import (
    ParamRefused,
    ToolCallStream,
    ToolRequest,
    assistant_message,
    chat_messages,
    prompt_chars,
    tool_request,
)

RETRY_AFTER_S = 1
RETRY_LATER = (429, 503)  # the statuses that carry Retry-After
HTTP_KINDS = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}
LOG = logging.getLogger("enginewright.openai")


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


def _error_response(exc: BackendError, *, prompt_param: str = "prompt") -> JSONResponse:
    if exc.http_status >= 500 and exc.http_status != 503:  # ours to look into: say what it was
        LOG.warning("answering %d: %s (%s)", exc.http_status, exc, exc.status)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.http_status in RETRY_LATER else None
    param = prompt_param if isinstance(exc, ClientError) and "prompt" in str(exc) else None
    return openai_error(exc.http_status, str(exc), kind=exc.kind, param=param, headers=headers)


def validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """The message and ``param`` of the first problem of a request body that failed validation."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    ctx = first.get("ctx") or {}
    if first.get("type") == UNSUPPORTED:
        return str(ctx.get("message")), str(ctx.get("param"))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":  # loc holds the character offset, not a field
        return f"the body is not valid JSON: {ctx.get('error', first.get('msg'))} (at character {'.'.join(loc)})", None
    if first.get("type") == "model_attributes_type":
        return "the body must be a JSON object", None
    # strip pydantic's union branch names (messages.0.content.str) down to the field path
    branches = {"str", "list[str]", "list[TextPart]", "int", "bool", "float", "function-after[_stop()]"}
    param = ".".join(p for p in loc if p not in branches and not p.startswith("function-")) or None
    if first.get("type") == "extra_forbidden":
        return f"unrecognized parameter {param!r}: this server does not support it", param
    value = "" if first.get("type") == "missing" else f" (got {first.get('input')!r:.80})"
    return f"{param or 'body'}: {first.get('msg')}{value}", param

def create_app(backend: TritonBackend, models: list[str], limits: FrontLimits | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await backend.close()

    limits = limits or FrontLimits()
    app = FastAPI(title="enginewright OpenAI-compatible API", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes, error=openai_error)
    metrics = Metrics()
    served = set(models)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_error(list(exc.errors()))
        metrics.requests.labels(request.url.path, "-", "400").inc()
        return openai_error(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}: see /v1/models, /v1/completions, "
                        "/v1/chat/completions",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                               str(exc.detail))
        return openai_error(exc.status_code, message, kind=HTTP_KINDS.get(exc.status_code, "invalid_request_error"),
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:  # a bug of ours: no traceback to the client
        metrics.requests.labels(request.url.path, "-", "500").inc()
        return openai_error(500, f"internal error of the front ({type(exc).__name__}); see its log",
                            kind="server_error")

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = await backend.ready()
        return JSONResponse({"status": "ok" if ready else "triton not ready"}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "enginewright"}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(m) for m in sorted(served)]}

    @app.get("/v1/models/{name:path}")
    async def retrieve_model(name: str):
        if name not in served:
            return openai_error(404, f"model {name!r} is not served here; served: {sorted(served)}",
                                kind="not_found_error", param="model")
        return model_card(name)

    async def serve(route: str, req: CompletionRequest | ChatCompletionRequest, prompt: str | list | dict,
                    chat: bool, tools: ToolRequest | None = None):
        if req.model not in served:
            metrics.requests.labels(route, req.model, "404").inc()
            return openai_error(404, f"model {req.model!r} is not served here; served: {sorted(served)}",
                                param="model")
        try:
            guide = guided_decoding(response_format=req.response_format, guided_json=req.guided_json,
                                    guided_regex=req.guided_regex, guided_choice=req.guided_choice, tools=tools)
        except ParamRefused as exc:
            metrics.requests.labels(route, req.model, "400").inc()
            return openai_error(400, str(exc), param=exc.param)
        too_long = prompt_too_long(prompt_chars(prompt), limits)
        if too_long is not None:
            metrics.requests.labels(route, req.model, "400").inc()
            return openai_error(400, too_long, param="messages" if chat else "prompt")
        max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
        sampling = Sampling(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                            stop=tuple(req.stop or ()), ignore_eos=req.ignore_eos, guided_decoding=guide)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:
            return await _stream(route, req, prompt, sampling, rid, chat, tools)
        started = time.monotonic()
        metrics.in_flight.inc()
        try:
            piece = await backend.complete(req.model, prompt, sampling)
        except BackendError as exc:
            response = _error_response(exc, prompt_param="messages" if chat else "prompt")
            metrics.requests.labels(route, req.model, str(response.status_code)).inc()
            return response
        finally:
            metrics.in_flight.dec()
        reason = piece.finish_reason or "length"
        metrics.requests.labels(route, req.model, "200").inc()
        metrics.tokens.labels(req.model).inc(len(piece.token_ids))
        metrics.latency.labels(route).observe(time.monotonic() - started)
        body = _body(rid, req.model, piece.text, reason, piece.prompt_tokens or 0, len(piece.token_ids), chat)
        if tools is not None:
            body["choices"][0]["message"], body["choices"][0]["finish_reason"] = assistant_message(piece.text, tools,
                                                                                                  reason)
        return JSONResponse(body)

    async def _stream(route, req, prompt, sampling, rid, chat, tools) -> StreamingResponse | JSONResponse:
        pieces = backend.stream(req.model, prompt, sampling)
        started = time.monotonic()
        try:
            first = await anext(pieces, None)  # errors before the first byte still get a status code
        except BackendError as exc:
            response = _error_response(exc, prompt_param="messages" if chat else "prompt")
            metrics.requests.labels(route, req.model, str(response.status_code)).inc()
            return response
        metrics.ttft.labels(req.model).observe(time.monotonic() - started)

        async def events() -> AsyncIterator[bytes]:
            metrics.in_flight.inc()
            tokens, prompt_tokens, reason = 0, 0, None
            calls = ToolCallStream(tools.names) if tools is not None and tools.offered else None
            try:
                if chat:
                    yield _sse(_chunk(rid, req.model, None, None, chat, role=True))
                piece: Piece | None = first
                while piece is not None:  # stop strings were applied by the engine model
                    tokens += len(piece.token_ids)
                    if calls is not None and piece.text:
                        for event in _tool_events(rid, req.model, calls, *calls.feed(piece.text)):
                            yield event
                    elif piece.text:
                        yield _sse(_chunk(rid, req.model, piece.text, None, chat))
                    reason = piece.finish_reason or reason
                    prompt_tokens = piece.prompt_tokens or prompt_tokens
                    piece = await anext(pieces, None)
                if calls is not None:
                    for event in _tool_events(rid, req.model, calls, *calls.finish()):
                        yield event
                    if calls.calls and (reason or "length") == "stop":
                        reason = "tool_calls"
                yield _sse(_chunk(rid, req.model, "", reason or "length", chat))
                if req.include_usage:
                    yield _sse(_usage_chunk(rid, req.model, prompt_tokens, tokens, chat))
                yield b"data: [DONE]\n\n"
                metrics.requests.labels(route, req.model, "200").inc()
            except BackendError as exc:
                yield _sse({"error": {"message": str(exc), "type": exc.kind, "param": None, "code": exc.http_status}})
                metrics.requests.labels(route, req.model, f"stream-{exc.http_status}").inc()
            finally:
                metrics.in_flight.dec()
                metrics.tokens.labels(req.model).inc(tokens)
                metrics.latency.labels(route).observe(time.monotonic() - started)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        if req.tools not in (None, []) or req.tool_choice is not None:
            param = "tools" if req.tools not in (None, []) else "tool_choice"
            return openai_error(400, f"{param} is for /v1/chat/completions: a completion has no tool calls",
                                param=param)
        return await serve("/v1/completions", req, req.prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        try:
            tools = tool_request(req.tools, req.tool_choice, req.parallel_tool_calls)
        except ParamRefused as exc:
            metrics.requests.labels("/v1/chat/completions", req.model, "400").inc()
            return openai_error(400, str(exc), param=exc.param)
        return await serve("/v1/chat/completions", req, chat_messages(req.messages, tools), chat=True, tools=tools)

    return app


def _tool_events(rid: str, model: str, stream: ToolCallStream, content: str, calls: list) -> list[bytes]:
    """The chunks of one step of a tool-call stream: its content, then each call complete (OpenAI's
    ``delta.tool_calls[index]``, the whole call in one delta)."""
    events = [_sse(_chunk(rid, model, content, None, True))] if content else []
    first = stream.calls - len(calls)
    for k, call in enumerate(calls):
        chunk = _chunk(rid, model, None, None, True)
        chunk["choices"][0]["delta"] = {"tool_calls": [call.as_openai(index=first + k)]}
        events.append(_sse(chunk))
    return events


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def _body(rid: str, model: str, text: str, reason: str, prompt_tokens: int, completion_tokens: int,
          chat: bool) -> dict[str, Any]:
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
        # the engine model tokenizes the prompt and says how long it was
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def _usage_chunk(rid: str, model: str, prompt_tokens: int, completion_tokens: int, chat: bool) -> dict[str, Any]:
    """The last chunk of a stream asked for ``stream_options.include_usage``: no choices, the usage."""
    body = _body(rid, model, "", "length", prompt_tokens, completion_tokens, chat)
    return {**_chunk(rid, model, None, None, chat), "choices": [], "usage": body["usage"]}


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
