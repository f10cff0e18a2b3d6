"""What one request may cost the front and Triton, checked before anything is parsed or tokenized.

`BodyLimit` (ASGI middleware) refuses a body over ``max_body_bytes`` with a 413 while it arrives, and a
malformed ``Content-Length`` with a 400, before FastAPI parses any JSON; `prompt_too_long` refuses a
prompt over ``max_prompt_chars`` with a 400 before it is sent to Triton (where the engine tokenizes it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_PROMPT_CHARS = 256 * 1024


@dataclass(frozen=True)
class FrontLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # --max-body-bytes
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS  # --max-prompt-chars

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.max_prompt_chars < 1:
            raise ValueError(f"--max-body-bytes={self.max_body_bytes} and --max-prompt-chars="
                             f"{self.max_prompt_chars} must be >= 1")


def prompt_too_long(prompt: str, limits: FrontLimits) -> str | None:
    """The refusal of a prompt over ``limits.max_prompt_chars``, or None."""
    if len(prompt) <= limits.max_prompt_chars:
        return None
    return (f"the prompt has {len(prompt)} characters, more than this server's limit of "
            f"{limits.max_prompt_chars} (--max-prompt-chars)")


Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class BodyLimit:
    """Read an HTTP request's body up to ``max_bytes`` before the app sees it; refuse one beyond."""

    def __init__(self, app: Any, *, max_bytes: int, error: Callable[..., Any]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.error = error  # (status, message, param=...) -> an ASGI response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            text = declared.decode("latin-1").strip()
            if not text.isdigit():
                await self.error(400, f"Content-Length {text[:32]!r} is not a number of bytes")(scope, receive, send)
                return
            if int(text) > self.max_bytes:
                await self._too_large(int(text), scope, receive, send)
                return
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > self.max_bytes:
                scope["_counted"] = True
                await self._too_large(total, scope, receive, send)
                return
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the client's disconnect
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, size: int, scope: Scope, receive: Receive, send: Send) -> None:
        message = (f"the request body ({'at least ' if scope.get('_counted') else ''}{size} bytes) is larger than "
                   f"this server's limit of {self.max_bytes} bytes (--max-body-bytes)")
        await self.error(413, message)(scope, receive, send)
