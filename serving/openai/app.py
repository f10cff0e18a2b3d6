"""The FastAPI app: /v1/models, /v1/completions, /v1/chat/completions (with server-sent events), /health, /metrics.

Every error, ours or FastAPI's (unknown route, wrong method, invalid JSON, a body over the limit), is
OpenAI's error object; a backend failure gets the status of its `BackendError` class (400, 404, 429,
503, 504; 500 only for a bug of ours), with Retry-After where trying again later helps. A stream that
fails after its first byte ends with an SSE ``error`` event carrying that status as ``code``.
"""

from __future__ import annotations

import asyncio
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

from serving.openai.backend import BackendError, ClientError, Piece, Prompt, TritonBackend
from serving.openai.choices import Job, jobs_for, merged
from serving.openai.errors import client_error, scrubbed
from serving.openai.limits import BodyLimit, FrontLimits, prompt_too_long
from serving.openai.responses import Choice, Shape
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


def _in_openai_terms(exc: BackendError, *, chat: bool, model: str) -> tuple[str, str | None]:
    """The message and ``param`` of a backend failure as an OpenAI client should read them (`errors`)."""
    if isinstance(exc, ClientError):
        return client_error(str(exc), chat=chat, model=model)
    return scrubbed(str(exc), model), None


def _error_response(exc: BackendError, *, chat: bool, model: str) -> JSONResponse:
    if exc.http_status >= 500 and exc.http_status != 503:  # ours to look into: say what it was
        LOG.warning("answering %d: %s (%s)", exc.http_status, exc, exc.status)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.http_status in RETRY_LATER else None
    message, param = _in_openai_terms(exc, chat=chat, model=model)
    return openai_error(exc.http_status, message, kind=exc.kind, param=param, headers=headers)


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

    async def serve(route: str, req: CompletionRequest | ChatCompletionRequest, prompts: list[Prompt], chat: bool,
                    tools: ToolRequest | None = None):
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
        for prompt in prompts:
            too_long = prompt_too_long(prompt_chars(prompt), limits)
            if too_long is not None:
                metrics.requests.labels(route, req.model, "400").inc()
                return openai_error(400, too_long, param="messages" if chat else "prompt")
        jobs = jobs_for(req, prompts, chat, guided_decoding=guide)
        shape = Shape(rid=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", model=req.model, chat=chat,
                      logprobs=bool(req.logprobs) if chat else req.logprobs is not None,
                      top_n=(req.top_logprobs or 0) if chat else (req.logprobs or 0))
        if req.stream:
            return await _stream(route, req, jobs, shape, tools)
        started = time.monotonic()
        metrics.in_flight.inc()
        try:
            pieces = await asyncio.gather(*(backend.complete(req.model, job.prompt, job.sampling) for job in jobs))
        except BackendError as exc:
            response = _error_response(exc, chat=chat, model=req.model)
            metrics.requests.labels(route, req.model, str(response.status_code)).inc()
            return response
        finally:
            metrics.in_flight.dec()
        choices = [job.gathered(piece, req.n) for job, piece in zip(jobs, pieces)]
        metrics.requests.labels(route, req.model, "200").inc()
        metrics.tokens.labels(req.model).inc(sum(c.tokens for c in choices))
        metrics.latency.labels(route).observe(time.monotonic() - started)
        prompt_tokens = sum(c.prompt_tokens for job, c in zip(jobs, choices) if job.choice == 0)
        body = shape.body(choices, prompt_tokens)
        if tools is not None:
            for item in body["choices"]:
                item["message"], item["finish_reason"] = assistant_message(item["message"]["content"], tools,
                                                                           item["finish_reason"])
        return JSONResponse(body)

    async def _stream(route: str, req: Any, jobs: list[Job], shape: Shape,
                      tools: ToolRequest | None) -> StreamingResponse | JSONResponse:
        pieces = merged([backend.stream(req.model, job.prompt, job.sampling) for job in jobs])
        started = time.monotonic()
        try:
            first = await anext(pieces, None)  # errors before the first byte still get a status code
        except BackendError as exc:
            response = _error_response(exc, chat=shape.chat, model=req.model)
            metrics.requests.labels(route, req.model, str(response.status_code)).inc()
            return response
        metrics.ttft.labels(req.model).observe(time.monotonic() - started)

        async def events() -> AsyncIterator[bytes]:
            metrics.in_flight.inc()
            choices = [Choice(index=job.index(req.n)) for job in jobs]
            parsers = [ToolCallStream(tools.names) if tools is not None and tools.offered else None for _ in jobs]
            try:
                if shape.chat:
                    for c in choices:
                        yield _sse(shape.chunk(c.index, None, None, role=True))
                item: tuple[int, Piece] | None = first
                while item is not None:  # stop strings were applied by the engine model
                    k, piece = item
                    for chunk in jobs[k].chunks(piece, choices[k], shape):
                        for out in _tool_chunks(shape, chunk, parsers[k]) if parsers[k] is not None else [chunk]:
                            yield _sse(out)
                    item = await anext(pieces, None)
                for c, parser in zip(choices, parsers):
                    if parser is not None:
                        for out in _tool_chunks(shape, shape.chunk(c.index, "", None), parser, last=True):
                            yield _sse(out)
                        if parser.calls and c.finish_reason == "stop":
                            c.finish_reason = "tool_calls"
                    yield _sse(shape.chunk(c.index, "", c.finish_reason or "length"))
                if req.include_usage:
                    prompt_tokens = sum(c.prompt_tokens for job, c in zip(jobs, choices) if job.choice == 0)
                    yield _sse(shape.usage_chunk(prompt_tokens, sum(c.tokens for c in choices)))
                yield b"data: [DONE]\n\n"
                metrics.requests.labels(route, req.model, "200").inc()
            except BackendError as exc:
                message, param = _in_openai_terms(exc, chat=shape.chat, model=req.model)
                yield _sse({"error": {"message": message, "type": exc.kind, "param": param, "code": exc.http_status}})
                metrics.requests.labels(route, req.model, f"stream-{exc.http_status}").inc()
            finally:
                metrics.in_flight.dec()
                metrics.tokens.labels(req.model).inc(sum(c.tokens for c in choices))
                metrics.latency.labels(route).observe(time.monotonic() - started)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        if req.tools not in (None, []) or req.tool_choice is not None:
            param = "tools" if req.tools not in (None, []) else "tool_choice"
            return openai_error(400, f"{param} is for /v1/chat/completions: a completion has no tool calls",
                                param=param)
        return await serve("/v1/completions", req, req.prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        try:
            tools = tool_request(req.tools, req.tool_choice, req.parallel_tool_calls)
        except ParamRefused as exc:
            metrics.requests.labels("/v1/chat/completions", req.model, "400").inc()
            return openai_error(400, str(exc), param=exc.param)
        return await serve("/v1/chat/completions", req, [chat_messages(req.messages, tools)], chat=True, tools=tools)

    return app


def _tool_chunks(shape: Shape, chunk: dict[str, Any], parser: ToolCallStream, *, last: bool = False
                 ) -> list[dict[str, Any]]:
    """A chat chunk of a choice offered tools, its text passed through the call parser (`last`: the parser's
    remainder at the end instead): the content left (with the chunk's log-probs), then each call it completed
    as OpenAI's ``delta.tool_calls[index]``, the whole call in one delta."""
    choice = chunk["choices"][0]
    content, calls = parser.finish() if last else parser.feed(choice["delta"].get("content") or "")
    out = []
    if content or choice["logprobs"]:
        choice["delta"] = {"content": content}
        out.append(chunk)
    first = parser.calls - len(calls)
    for k, call in enumerate(calls):
        call_chunk = shape.chunk(choice["index"], None, None)
        call_chunk["choices"][0]["delta"] = {"tool_calls": [call.as_openai(index=first + k)]}
        out.append(call_chunk)
    return out


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()

