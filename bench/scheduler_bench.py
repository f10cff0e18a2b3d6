"""The served workload without Triton: `clients` closed-loop streams through the in-flight scheduler.

Each client sends its next request when the previous one finishes, as the served benchmark's gRPC
clients do, but here the requests go straight to `serving.engine.scheduler.Scheduler` on the calling
thread: no python backend, no response sender, no other thread wanting the GIL. The figure is the
served figure's ceiling for this engine; served / this separates what Triton's send path costs from
what the scheduler itself costs.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from serving.engine.timing import random_prompts


def bench_scheduler(runner: Any, *, clients: int, requests_per_client: int, prompt_len: int, gen_len: int,
                    seed: int = 0) -> dict[str, Any]:
    """Closed-loop clients through one Scheduler -> output tok/s, wall time and the scheduler's counters."""
    from serving.engine.scheduler import GenRequest, Scheduler

    vocab = runner.info.model.vocab_size
    prompts = random_prompts(clients * requests_per_client, prompt_len, vocab, seed)
    scheduler = Scheduler(runner)
    produced = [0]
    failures: list[str] = []

    def request(client: int, index: int) -> GenRequest:
        def emit(ids: list[int], reason: str | None) -> None:
            produced[0] += len(ids)
            if reason is not None and index + 1 < requests_per_client:
                scheduler.submit(request(client, index + 1))

        def fail(exc: BaseException) -> None:
            failures.append(f"{type(exc).__name__}: {exc}")

        return GenRequest(prompts[client * requests_per_client + index], gen_len, emit, fail)

    started = time.perf_counter()
    for client in range(clients):
        scheduler.submit(request(client, 0))
    scheduler.run_until_idle()
    wall = time.perf_counter() - started
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed in the scheduler benchmark, first: {failures[0]}")
    return {"clients": clients, "requests_per_client": requests_per_client, "output_tokens": produced[0],
            "wall_s": wall, "output_tok_s": produced[0] / wall, "stats": asdict(scheduler.stats)}
