"""The decoupled ``llm`` model's responses, sent off the scheduler thread and coalesced under load.

The scheduler thread only appends tokens to a request's ``Stream`` (a lock and a list append) after
each step; one sender thread builds and sends the responses. Each visit of the sender takes
everything a stream gathered since its last visit and sends it as ONE response: while the sender
keeps up that is one token per response (plain token streaming); when it falls behind (building a
response and the python backend's IPC cost ~0.1-0.3 ms, and 64 streams produce 64 tokens per ~1.5 ms
step), a response carries every token that waited, so the sender never becomes the throughput
ceiling and no token is dropped or reordered.

``stream_interval_s`` (the ``llm`` model's ``stream_interval_ms``; 0 by default) paces a stream's
middle responses: one goes out at least that long after the stream's previous response, carrying every
token gathered meanwhile (like TensorRT-LLM's and vLLM's ``stream_interval``, in time rather than steps).
A stream's first response and its final one are never held back, so TTFT and request latency do not
grow; fewer responses leave the sender idle more often, and with it the GIL to the scheduler thread.

A stream that is not streaming (``stream`` false) is sent once, when it finishes. A failure is sent
after the tokens that preceded it, as the final response.

Imports: stdlib only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

SendTokens = Callable[[list[int], "str | None"], None]  # (token ids, finish reason or None) -> one response
SendError = Callable[[str], None]  # message -> one final error response


@dataclass
class Stream:
    """What one request has produced and not yet sent."""

    send_tokens: SendTokens
    send_error: SendError
    streaming: bool
    tokens: list[int] = field(default_factory=list)
    reason: str | None = None
    error: str | None = None
    closed: bool = False  # the final response was taken by the sender
    last_sent: float | None = None  # monotonic time the sender last took from this stream

    def take(self, now: float) -> tuple[list[int], str | None, str | None]:
        tokens, self.tokens = self.tokens, []
        if self.reason is not None or self.error is not None:
            self.closed = True
        self.last_sent = now
        return tokens, self.reason, self.error

    def due(self, interval_s: float) -> float:
        """When the sender may take from this stream: now for its first and its final response."""
        if self.last_sent is None or self.reason is not None or self.error is not None:
            return 0.0
        return self.last_sent + interval_s


@dataclass
class OutboxStats:
    responses: int = 0
    tokens: int = 0
    largest_chunk: int = 0
    failed_sends: int = 0
    send_s: float = 0.0  # time spent building and sending responses (the sender thread's busy time)


class Outbox:
    """One sender thread for every stream of a model instance."""

    def __init__(self, name: str, log_error: Callable[[str], None], *, stream_interval_s: float = 0.0) -> None:
        if not stream_interval_s >= 0.0:
            raise ValueError(f"stream_interval_s={stream_interval_s!r} must be >= 0")
        self.log_error = log_error
        self.stream_interval_s = stream_interval_s
        self.cond = threading.Condition()
        self.ready: dict[int, Stream] = {}  # id(stream) -> stream, oldest first
        self.stopping = False
        self.stats = OutboxStats()
        self.thread = threading.Thread(target=self._main, name=f"send-{name}", daemon=True)
        self.thread.start()

    def open(self, send_tokens: SendTokens, send_error: SendError, *, streaming: bool) -> Stream:
        return Stream(send_tokens, send_error, streaming)

    def emit(self, stream: Stream, ids: list[int], reason: str | None) -> None:
        """New tokens of `stream` (its finish reason with the last ones). Any thread; never blocks on a send."""
        with self.cond:
            if stream.error is not None or stream.closed:
                return
            stream.tokens.extend(ids)
            stream.reason = reason
            if stream.streaming or reason is not None:
                self._ready(stream)

    def fail(self, stream: Stream, message: str) -> None:
        with self.cond:
            stream.error = message
            self._ready(stream)

    def _ready(self, stream: Stream) -> None:
        if stream.closed:
            return
        if id(stream) not in self.ready:
            self.ready[id(stream)] = stream
            self.cond.notify()
        elif stream.due(self.stream_interval_s) == 0.0:  # waiting out its interval, and now final
            self.cond.notify()

    def _main(self) -> None:
        while True:
            with self.cond:
                batch = self._wait_for_due()
                if batch is None:
                    return
            for stream, (tokens, reason, error) in batch:
                self._send(stream, tokens, reason, error)

    def _wait_for_due(self) -> list[tuple[Stream, tuple[list[int], str | None, str | None]]] | None:
        """Under the lock: take every ready stream that is due, waiting until one is; None once stopped
        with nothing left (stopping sends what is ready without waiting for the interval)."""
        while True:
            if not self.ready:
                if self.stopping:
                    return None
                self.cond.wait()
                continue
            now = time.monotonic()
            interval = 0.0 if self.stopping else self.stream_interval_s
            due = [s for s in self.ready.values() if s.due(interval) <= now]
            if due:
                for stream in due:
                    del self.ready[id(stream)]
                return [(stream, stream.take(now)) for stream in due]
            self.cond.wait(min(s.due(interval) for s in self.ready.values()) - now)

    def _send(self, stream: Stream, tokens: list[int], reason: str | None, error: str | None) -> None:
        started = time.perf_counter()
        try:
            if tokens and (stream.streaming or error is None):
                stream.send_tokens(tokens, None if error is not None else reason)
                self.stats.responses += 1
                self.stats.tokens += len(tokens)
                self.stats.largest_chunk = max(self.stats.largest_chunk, len(tokens))
            if error is not None:
                stream.send_error(error)
                self.stats.responses += 1
        except Exception as exc:  # noqa: BLE001 - one failed send must not stop the others
            self.stats.failed_sends += 1
            self.log_error(f"sending a response failed: {type(exc).__name__}: {exc}")
        self.stats.send_s += time.perf_counter() - started

    def stop(self, timeout_s: float = 30.0) -> None:
        """Send what is ready, then end the thread."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout_s)
