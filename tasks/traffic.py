"""A steady stream of requests through the router while a rollout changes weights.

Each request is recorded with its time, the version the router chose, success and latency; analyses
read the records of their own window. Bounded by construction: it stops when told or after `max_requests`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestRecord:
    started_s: float
    latency_s: float
    version: int | None
    ok: bool
    error: str = ""
    endpoint: str = ""
    tokens: int = 0  # output tokens of a successful answer (0 when unknown or failed)
    prompt: str = ""  # which fixed prompt it was ("text:<j>" / "ids:<j>", tasks.canary_text), "" for others
    output_ids: tuple[int, ...] = ()  # the answer's token ids, kept for fixed prompts only


@dataclass
class TrafficLog:
    records: list[RequestRecord] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, record: RequestRecord) -> None:
        with self.lock:
            self.records.append(record)

    def count(self) -> int:
        with self.lock:
            return len(self.records)

    def since(self, index: int) -> list[RequestRecord]:
        with self.lock:
            return list(self.records[index:])


ERROR_BACKOFF_S = 0.05  # a failing endpoint answers fast; do not turn the stream into a flood

# (endpoint url, request number) -> (version, "" or error[, output tokens[, prompt key, output ids]])
SendFn = Callable[[str, int], tuple]


class TrafficGenerator:
    """`concurrency` threads sending requests round-robin over the endpoints until stopped: back to back, or
    paced to `rate_per_s` requests a second in all (the threads then only bound how many are in flight)."""

    def __init__(self, endpoints: list[str], send: SendFn, *, concurrency: int, max_requests: int = 100_000,
                 max_seconds: float = 3600.0, rate_per_s: float | None = None) -> None:
        self.endpoints = endpoints
        self.send = send
        self.concurrency = concurrency
        self.interval_s = 1.0 / rate_per_s if rate_per_s else 0.0
        self._next_send = time.monotonic()
        self.max_requests = max_requests
        self.deadline = time.monotonic() + max_seconds
        self.log = TrafficLog()
        self._stop = threading.Event()
        self._counter = 0
        self._counter_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.t0 = time.monotonic()

    def __enter__(self) -> TrafficGenerator:  # noqa: PYI034
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        for i in range(self.concurrency):
            thread = threading.Thread(target=self._loop, name=f"traffic-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def _next(self) -> int | None:
        """The next request's number, once its send time has come (None: stop)."""
        with self._counter_lock:
            if self._counter >= self.max_requests:
                return None
            self._counter += 1
            n = self._counter
            send_at = self._next_send = max(self._next_send + self.interval_s, time.monotonic())
        if self.interval_s and self._stop.wait(max(0.0, send_at - time.monotonic())):
            return None
        return n

    def _loop(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self.deadline:
            n = self._next()
            if n is None:
                return
            endpoint = self.endpoints[n % len(self.endpoints)]
            started = time.monotonic()
            tokens, prompt, ids = 0, "", ()
            try:
                answer = self.send(endpoint, n)
                version, error = answer[0], answer[1]
                tokens = int(answer[2]) if len(answer) > 2 else 0
                if len(answer) > 4:
                    prompt, ids = str(answer[3]), tuple(answer[4])
            except Exception as exc:  # noqa: BLE001 - every failure is a data point
                version, error = None, f"{type(exc).__name__}: {exc}"
            self.log.add(
                RequestRecord(started - self.t0, time.monotonic() - started, version, not error, error, endpoint,
                              tokens if not error else 0, prompt, ids if not error else ())
            )
            if error:
                self._stop.wait(ERROR_BACKOFF_S)

    def wait_for(self, count: int, *, timeout_s: float) -> list[RequestRecord]:
        """Block until `count` more requests have finished; return them."""
        start = self.log.count()
        deadline = time.monotonic() + timeout_s
        while self.log.count() - start < count and time.monotonic() < deadline:
            if not any(t.is_alive() for t in self._threads):
                break
            time.sleep(0.02)
        return self.log.since(start)[:count] if self.log.count() - start >= count else self.log.since(start)
