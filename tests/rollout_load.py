"""The rollout tests' steady load, sent from a process of its own (no tests here).

The test process also runs the controller: the rollout's own traffic threads, its analyses, Prefect's task
runs. A client thread beside them waits for their GIL, and that wait would count as Triton's latency. So the
load runs in a spawned child that imports only the traffic generator and the HTTP client; the parent marks
phases on the same clock (``time.monotonic`` is system-wide) and gets every record when the load stops.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from typing import Any

from tasks.traffic import RequestRecord

COUNT_EVERY_S = 0.02  # how often the child publishes how many requests have finished


def _send(name: str, url: str, n: int) -> tuple:
    from serving.triton.client import infer_ids

    r = infer_ids(url, name, [5 + n % 50, 6, 7, 8], max_tokens=4, timeout_s=30)
    return r.routed_version, "", len(r.output_ids)


def _child(urls: list[str], name: str, concurrency: int, max_requests: int, max_seconds: float,
           stop: Any, count: Any, ready: Any, out: Any) -> None:
    from functools import partial

    from tasks.traffic import TrafficGenerator

    gen = TrafficGenerator(urls, partial(_send, name), concurrency=concurrency, max_requests=max_requests,
                           max_seconds=max_seconds)
    gen.start()
    ready.set()
    while not stop.wait(COUNT_EVERY_S):
        count.value = gen.log.count()
    gen.stop()
    out.send((gen.t0, gen.log.since(0)))
    out.close()


class LoadProcess:
    """``concurrency`` clients calling the router ``name`` from a child process until ``stop``."""

    def __init__(self, urls: list[str], name: str, *, concurrency: int, max_requests: int, max_seconds: float) -> None:
        ctx = multiprocessing.get_context("spawn")  # the test process runs threads: never fork it
        self._stop, self._ready, self._count = ctx.Event(), ctx.Event(), ctx.Value("i", 0)
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, name="rollout-load", daemon=True,
                                 args=(urls, name, concurrency, max_requests, max_seconds, self._stop, self._count,
                                       self._ready, send))
        self.t0 = time.monotonic()
        self._records: list[RequestRecord] | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        self._proc.start()
        if not self._ready.wait(timeout_s):
            self._proc.kill()
            raise RuntimeError(f"the load process did not start within {timeout_s:g} s")
        self.t0 = time.monotonic()

    def count(self) -> int:
        return self._count.value

    def wait_for(self, count: int, *, timeout_s: float) -> None:
        """Block until ``count`` more requests have finished (or ``timeout_s``, or the child ended)."""
        start, deadline = self.count(), time.monotonic() + timeout_s
        while self.count() - start < count and time.monotonic() < deadline and self._proc.is_alive():
            time.sleep(COUNT_EVERY_S)

    def stop(self, timeout_s: float = 150.0) -> list[RequestRecord]:
        """Stop the clients and return every record, ``started_s`` on this object's ``t0``."""
        if self._records is None:
            self._stop.set()
            if not self._recv.poll(timeout_s):
                self._proc.kill()
                raise RuntimeError(f"the load process sent no records within {timeout_s:g} s of its stop")
            child_t0, records = self._recv.recv()
            self._proc.join(timeout=10)
            shift = child_t0 - self.t0
            self._records = [dataclasses.replace(r, started_s=r.started_s + shift) for r in records]
        return self._records

