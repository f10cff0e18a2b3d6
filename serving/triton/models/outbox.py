"""The decoupled ``llm`` model's responses: gathered per stream, sent by the engine thread while the
GPU computes, coalesced under load.

The scheduler hands each request's new tokens to its ``Stream`` (``emit``, a list append under a lock).
Sending is pumped: ``send_next`` builds and sends ONE response, for one stream that is due, and the
engine thread calls it while it would otherwise block on the GPU (``Scheduler(while_waiting=...)``),
and drains it whenever the engine is idle. So responses cost the engine no GPU time and no other
thread competes with it for the GIL (a separate sender thread did: every torch call releases the
GIL, and winning it back from a busy sender cost the scheduler up to the switch interval each time;
at 64 streams that, not the GPU, set the served pace).

Each response carries every token its stream gathered since its last one: while the engine keeps
up that is one token per response; when it does not (a response costs the python backend ~0.3 ms,
and 64 streams produce 64 tokens per ~1.4 ms step), a response carries all that waited, so sending
never becomes the throughput ceiling and no token is dropped or reordered. A stream's first response
and its final one go before any middle response (they set TTFT and when a client's next request can
start), in the order they became due; middle responses go oldest first.

``stream_interval_s`` (the ``llm`` model's ``stream_interval_ms``; 0 by default) paces a stream's
middle responses: one goes out at least that long after the stream's previous response (like
TensorRT-LLM's and vLLM's ``stream_interval``, in time rather than steps). First and final responses
are never held back.

``send_while`` (``busy_senders`` > 1; the ``llm`` model's ``busy_senders``) sends on that many threads while a
step computes, for an engine whose streams make more responses a step than one thread sends in a step's time
(1,024 streams of a paged engine: ~1,024 tokens in a ~24 ms step, ~80 sends of ~0.3 ms): the engine thread
waits on the GPU then, not on the GIL, and the helpers stop when the step's tokens are ready.

``drain`` (run by an idle engine) sends everything due on ``idle_senders`` threads at once: nothing
else wants the GIL then, and a send is mostly a round trip to Triton's process, which releases the
GIL while it waits and which Triton serves on a thread pool. Closed-loop clients' requests end
together, so an idle engine has a burst of final responses to send before the next requests can
come; sent one at a time, 64 of them took ~20 ms of every wave on the H200. One stream is never in
two sends at once (``Stream.sending``), so its responses stay in order.

A stream that is not streaming (``stream`` false) is sent once, when it finishes. A failure is sent
after the tokens that preceded it, as the final response.

Cancellation: a stream opened with ``is_cancelled`` (the request's) is asked, at most every
``CANCEL_CHECK_S`` and first that long after it opened, whether its client has gone, when
``send_next`` has nothing due (one question per call: each is a round trip to Triton; ``drain`` asks
none, so a burst of new requests does not hold back their admission); if so its ``on_cancel`` runs (the model stops the request in the
scheduler, which frees its slot and fails it; the failure is its final response).

Imports: stdlib only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

CANCEL_CHECK_S = 1.0  # each question is a round trip to Triton; a freed slot can wait a second
SendTokens = Callable[[list[int], "str | None", str], None]  # (token ids, finish reason or None, text) -> a response
SendError = Callable[[str, bool], None]  # (message, cancelled) -> one final error response


@dataclass(eq=False)
class Stream:
    """What one request has produced and not yet sent."""

    send_tokens: SendTokens
    send_error: SendError
    streaming: bool
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # the tokens' text, when the model detokenizes as it emits
    reason: str | None = None
    error: str | None = None
    cancelled: bool = False  # the error is a cancellation
    closed: bool = False  # the final response was taken
    last_sent: float | None = None  # monotonic time of its last response
    is_cancelled: Callable[[], bool] | None = None
    on_cancel: Callable[[], None] | None = None
    checked_at: float = 0.0  # monotonic time of its last cancellation check
    sending: bool = False  # a sender has taken its tokens and not yet finished sending them

    @property
    def urgent(self) -> bool:
        """Its first response, or its final one."""
        return self.last_sent is None or self.reason is not None or self.error is not None

    def take(self, now: float) -> tuple[list[int], str | None, str | None, str]:
        tokens, self.tokens = self.tokens, []
        text, self.text = self.text, ""
        if self.reason is not None or self.error is not None:
            self.closed = True
        self.last_sent = now
        return tokens, self.reason, self.error, text


@dataclass
class OutboxStats:
    responses: int = 0
    tokens: int = 0
    largest_chunk: int = 0
    failed_sends: int = 0
    send_s: float = 0.0  # time spent building and sending responses


class Outbox:
    """Every stream of one model instance; ``send_next`` is called by one thread (the engine's), ``drain`` and
    ``send_while`` add helper threads."""

    def __init__(self, name: str, log_error: Callable[[str], None], *, stream_interval_s: float = 0.0,
                 idle_senders: int = 1, busy_senders: int = 1) -> None:
        if not stream_interval_s >= 0.0:
            raise ValueError(f"stream_interval_s={stream_interval_s!r} must be >= 0")
        for setting, value in (("idle_senders", idle_senders), ("busy_senders", busy_senders)):
            if value < 1:
                raise ValueError(f"{setting}={value!r} must be >= 1")
        self.name = name
        self.log_error = log_error
        self.stream_interval_s = stream_interval_s
        self.idle_senders = idle_senders
        self.busy_senders = busy_senders
        most = max(idle_senders, busy_senders)
        self.helpers = ThreadPoolExecutor(most - 1, thread_name_prefix=f"send-{name}") if most > 1 else None
        self.lock = threading.Lock()
        # id(stream) -> stream with something to send, oldest first: first and final responses apart from the
        # middle ones, so that picking the next send does not scan every ready stream under the lock and the GIL
        self.urgent: dict[int, Stream] = {}
        self.middle: dict[int, Stream] = {}
        self.watched: dict[int, Stream] = {}  # open streams that can be asked whether they were cancelled
        self.stats = OutboxStats()

    def open(self, send_tokens: SendTokens, send_error: SendError, *, streaming: bool,
             is_cancelled: Callable[[], bool] | None = None, on_cancel: Callable[[], None] | None = None) -> Stream:
        stream = Stream(send_tokens, send_error, streaming, is_cancelled=is_cancelled, on_cancel=on_cancel,
                        checked_at=time.monotonic())  # first asked a whole interval after it opened
        if is_cancelled is not None and on_cancel is not None:
            with self.lock:
                self.watched[id(stream)] = stream
        return stream

    def discard(self, stream: Stream) -> None:
        """`stream`'s request was answered outside the outbox (refused at submit): never send or ask for it
        again (asking Triton whether an answered request was cancelled crashes the server)."""
        with self.lock:
            stream.closed = True
            self.watched.pop(id(stream), None)
            self.urgent.pop(id(stream), None)
            self.middle.pop(id(stream), None)

    def emit(self, stream: Stream, ids: list[int], reason: str | None, text: str = "") -> None:
        """New tokens of `stream` and their text (its finish reason with the last ones). Never sends."""
        with self.lock:
            if stream.error is not None or stream.closed:
                return
            stream.tokens.extend(ids)
            stream.text += text
            stream.reason = reason
            if stream.streaming or reason is not None:
                self._queue(stream)

    def fail(self, stream: Stream, message: str, *, cancelled: bool = False) -> None:
        with self.lock:
            if stream.closed:
                return
            stream.error = message
            stream.cancelled = cancelled
            self._queue(stream)

    def _queue(self, stream: Stream) -> None:
        """`stream` has something to send (lock held): among the urgent ones once it is urgent."""
        key = id(stream)
        if stream.urgent:
            self.middle.pop(key, None)
            self.urgent.setdefault(key, stream)
        elif key not in self.urgent:
            self.middle.setdefault(key, stream)

    def pending(self) -> int:
        return len(self.urgent) + len(self.middle)

    def send_next(self, *, ask: bool = True) -> bool:
        """Send one response: a first or final one if any waits, else the oldest middle one that is due;
        with none due, ask one stream whether it was cancelled (unless `ask` is false). False when there
        was nothing to do."""
        with self.lock:
            now = time.monotonic()
            stream = self._next_due(now)
            if stream is not None:
                taken = self._take(stream, now)
                stream.sending = True
            else:
                stream = self._next_to_check(now) if ask else None
                if stream is None:
                    return False
                stream.checked_at = now
                taken = None
        if taken is None:
            self._check_cancelled(stream)
        else:
            try:
                self._send(stream, *taken)
            finally:
                with self.lock:
                    stream.sending = False
        return True

    def drain(self) -> None:
        """Send everything due, on every idle sender at once; return when nothing is left. Asks no
        stream whether it was cancelled: an idle engine has requests waiting to be admitted, or none."""
        helpers = [self.helpers.submit(self._send_all) for _ in range(self.idle_senders - 1)] if self.helpers else []
        self._send_all()
        for helper in helpers:
            helper.result()

    def _send_all(self) -> None:
        while self.send_next(ask=False):
            pass

    def send_while(self, busy: Callable[[], bool]) -> None:
        """Send due responses while `busy()` holds (the engine's step computes on the GPU), on `busy_senders`
        threads at once: this one does at least one item (`send_next`, which may ask a stream whether it was
        cancelled), the helpers only send; each stops once `busy()` is false or nothing is due, and this
        returns when all have."""
        helpers = [self.helpers.submit(self._send_while, busy) for _ in range(self.busy_senders - 1)] \
            if self.helpers is not None else []
        if self.send_next():
            while busy() and self.send_next():
                pass
        for helper in helpers:
            helper.result()

    def _send_while(self, busy: Callable[[], bool]) -> None:
        while busy() and self.send_next(ask=False):
            pass

    def close(self) -> None:
        """Stop the idle senders (after `flush`)."""
        if self.helpers is not None:
            self.helpers.shutdown(wait=True)

    def _take(self, stream: Stream, now: float) -> tuple[list[int], str | None, str | None, str]:
        taken = stream.take(now)
        if stream.closed:
            self.watched.pop(id(stream), None)
        return taken

    def _next_to_check(self, now: float) -> Stream | None:
        return next((s for s in self.watched.values() if s.checked_at + CANCEL_CHECK_S <= now), None)

    def _check_cancelled(self, stream: Stream) -> None:
        try:
            cancelled = bool(stream.is_cancelled())
            stop_asking = cancelled
        except Exception as exc:  # noqa: BLE001 - an old backend, or the request is gone
            self.log_error(f"asking whether a request was cancelled failed: {type(exc).__name__}: {exc}")
            cancelled, stop_asking = False, True
        if stop_asking:
            with self.lock:
                self.watched.pop(id(stream), None)
        if cancelled:
            stream.on_cancel()

    def flush(self) -> None:
        """Send everything that waits, paced or not (unloading)."""
        with self.lock:
            streams = [*self.urgent.values(), *self.middle.values()]
            self.urgent, self.middle = {}, {}
            taken = [(stream, self._take(stream, time.monotonic())) for stream in streams]
        for stream, (tokens, reason, error, text) in taken:
            self._send(stream, tokens, reason, error, text)

    def _next_due(self, now: float) -> Stream | None:
        """The first urgent stream not being sent, else the oldest due middle one; taken out of its queue. Streams
        being sent (at most one a sender) are skipped; with `stream_interval_s` so are middle ones not yet due."""
        for queue in (self.urgent, self.middle):
            for key, stream in queue.items():
                if not stream.sending and (queue is self.urgent
                                           or stream.last_sent + self.stream_interval_s <= now):
                    del queue[key]
                    return stream
        return None

    def _send(self, stream: Stream, tokens: list[int], reason: str | None, error: str | None, text: str = "") -> None:
        started = time.perf_counter()
        responses, sent_tokens, failed = 0, 0, False
        try:
            if tokens and (stream.streaming or error is None):
                stream.send_tokens(tokens, None if error is not None else reason, text)
                responses, sent_tokens = 1, len(tokens)
            if error is not None:
                stream.send_error(error, stream.cancelled)
                responses += 1
        except Exception as exc:  # noqa: BLE001 - one failed send must not stop the others
            failed = True
            self.log_error(f"sending a response failed: {type(exc).__name__}: {exc}")
        with self.lock:  # several idle senders may finish at once
            stats = self.stats
            stats.responses += responses
            stats.tokens += sent_tokens
            stats.largest_chunk = max(stats.largest_chunk, sent_tokens)
            stats.failed_sends += failed
            stats.send_s += time.perf_counter() - started
