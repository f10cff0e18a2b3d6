"""In-flight (continuous) batching over the static KV cache: one cache row ("slot") per live request.

Between decode steps the scheduler admits waiting requests into free slots (one packed prefill for
all of them, `EngineRunner.prefill`) and retires finished ones (stop token, their own `max_tokens`,
or the engine's `max_seq_len`); each decode step runs rows [0, highest live slot] through
`EngineRunner.decode` (CUDA graphs per batch bucket on GPU), rows of free slots computing harmless
garbage into their own cache rows. Slots are taken lowest first, so the decode batch stays compact.

Each request carries its own sampling (greedy requests share one argmax; sampled requests with the
same parameters and no seed share one draw; a seeded request has its own `torch.Generator`, so its
output does not depend on what it was batched with), stop tokens and `max_tokens`. Tokens go out
through the request's `emit(new_ids, finish_reason)` callback (finish_reason None until the last
emit), called on the scheduler thread after every step: one host sync per step.

Thread model: `submit` is thread-safe; `run_forever` (or `start()`, which runs it on a daemon
thread) is the only code that touches the runner. `stop()` ends the loop, fails what is still
pending or live with `SchedulerStopped`, and joins the thread.

Imports: stdlib and torch only.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from serving.engine.errors import EngineError, EngineLimitError
from serving.engine.sampling import SamplingParams, sample

Emit = Callable[[list[int], "str | None"], None]
Fail = Callable[[BaseException], None]


class SchedulerStopped(EngineError):
    """The scheduler stopped before the request finished."""


@dataclass
class GenRequest:
    """One request: prompt, limits and sampling, and where its tokens go."""

    prompt_ids: Sequence[int]
    max_tokens: int
    emit: Emit
    fail: Fail
    sampling: SamplingParams | None = None  # None or greedy params: argmax
    stop_token_ids: Sequence[int] = ()
    request_id: Any = None


@dataclass
class _Live:
    req: GenRequest
    pos: int  # cache position where `last` goes at the next decode step (= tokens in the cache)
    last: int = 0  # the last generated token (the next decode input)
    generated: int = 0
    generator: torch.Generator | None = None
    stop: frozenset[int] = field(default_factory=frozenset)


@dataclass
class SchedulerStats:
    steps: int = 0
    prefills: int = 0
    admitted: int = 0
    finished: int = 0
    failed: int = 0
    tokens: int = 0
    largest_batch: int = 0
    busy_s: float = 0.0


class Scheduler:
    """Continuous batching driver of one `EngineRunner` (`prefill`, `decode`, `info.limits`)."""

    def __init__(self, runner: Any, *, max_prefill_tokens: int = 16384, idle_wait_s: float = 0.05,
                 on_error: Callable[[str], None] | None = None) -> None:
        self.runner = runner
        limits = runner.info.limits
        self.max_slots = int(limits.max_batch_size)
        self.max_input_len = int(limits.max_input_len)
        self.max_seq_len = int(limits.max_seq_len)
        self.vocab_size = int(runner.info.model.vocab_size)
        self.max_prefill_tokens = max(max_prefill_tokens, self.max_input_len)
        self.idle_wait_s = idle_wait_s
        self.device = runner.device
        self.log_error = on_error or (lambda msg: None)
        self.slots: list[_Live | None] = [None] * self.max_slots
        self.waiting: collections.deque[GenRequest] = collections.deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.stats = SchedulerStats()
        self._ids = itertools.count()

    # -- submission (any thread) --------------------------------------------------------------
    def check(self, prompt_ids: Sequence[int], max_tokens: int) -> None:
        """Raise EngineLimitError naming the value and the limit when the engine cannot serve it."""
        n = len(prompt_ids)
        if n == 0:
            raise EngineLimitError("prompt is empty; a prompt needs at least one token")
        if max_tokens < 1:
            raise EngineLimitError(f"max_tokens={max_tokens} must be >= 1")
        if n > self.max_input_len:
            raise EngineLimitError(f"prompt of {n} tokens > limits.max_input_len={self.max_input_len}")
        if n + max_tokens > self.max_seq_len:
            raise EngineLimitError(f"prompt of {n} tokens + max_tokens={max_tokens} > limits.max_seq_len="
                                   f"{self.max_seq_len}")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineLimitError(f"token ids {bad[:5]} outside [0, vocab_size={self.vocab_size})")

    def submit(self, req: GenRequest) -> None:
        """Queue a request (checked first: a bad one raises here, nothing is queued)."""
        self.check(req.prompt_ids, req.max_tokens)
        with self.cond:
            if self.stopping:
                raise SchedulerStopped("the scheduler is stopping; request not accepted")
            if req.request_id is None:
                req.request_id = next(self._ids)
            self.waiting.append(req)
            self.cond.notify()

    @property
    def live(self) -> int:
        return sum(s is not None for s in self.slots)

    def idle(self) -> bool:
        with self.cond:
            return not self.waiting and self.live == 0

    # -- the loop (one thread) ----------------------------------------------------------------
    def start(self, name: str = "enginewright-scheduler") -> threading.Thread:
        self.thread = threading.Thread(target=self.run_forever, name=name, daemon=True)
        self.thread.start()
        return self.thread

    def run_forever(self) -> None:
        while True:
            with self.cond:
                while not self.stopping and not self.waiting and self.live == 0:
                    self.cond.wait(self.idle_wait_s)
                if self.stopping:
                    break
            self.step()
        self._fail_all(SchedulerStopped("the scheduler stopped (model unloading) before the request finished"))

    def stop(self, timeout_s: float = 30.0) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout_s)
        else:
            self._fail_all(SchedulerStopped("the scheduler stopped before the request finished"))

    def run_until_idle(self) -> None:
        """Step until nothing waits or lives (tests and offline use, on the caller's thread)."""
        while not self.idle():
            self.step()

    @torch.no_grad()
    def step(self) -> None:
        """Admit what fits, then one decode step for every live slot."""
        started = time.perf_counter()
        self._admit()  # the admitted join this very decode step (their first token came from prefill)
        if self.live:
            self._decode()
        self.stats.busy_s += time.perf_counter() - started

    # -- internals ----------------------------------------------------------------------------
    def _admit(self) -> None:
        free = [i for i, s in enumerate(self.slots) if s is None]
        batch: list[tuple[int, GenRequest]] = []
        budget = self.max_prefill_tokens
        with self.cond:
            while self.waiting and len(batch) < len(free) and len(self.waiting[0].prompt_ids) <= budget:
                req = self.waiting.popleft()
                budget -= len(req.prompt_ids)
                batch.append((free[len(batch)], req))
        if not batch:
            return
        lives = []
        for slot, req in batch:
            live = _Live(req=req, pos=len(req.prompt_ids), stop=frozenset(req.stop_token_ids))
            if req.sampling is not None and not req.sampling.is_greedy and req.sampling.seed is not None:
                live.generator = torch.Generator(device=self.device)
                live.generator.manual_seed(req.sampling.seed)
            self.slots[slot] = live
            lives.append(live)
        try:
            logits = self.runner.prefill([req.prompt_ids for _, req in batch], [slot for slot, _ in batch])
            tokens = self._sample(logits, lives)
        except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving
            self._fail([slot for slot, _ in batch], exc)
            return
        self.stats.prefills += 1
        self.stats.admitted += len(batch)
        for (slot, _), live, tok in zip(batch, lives, tokens):
            self._deliver(slot, live, tok, advance=False)

    def _decode(self) -> None:
        rows = [i for i, s in enumerate(self.slots) if s is not None]
        b = rows[-1] + 1
        tokens = [0] * b
        positions = [0] * b
        for i in rows:
            live = self.slots[i]
            tokens[i], positions[i] = live.last, live.pos
        lives = [self.slots[i] for i in range(b)]
        try:
            tok_t = torch.tensor(tokens, dtype=torch.long)
            pos_t = torch.tensor(positions, dtype=torch.long)
            if self.device.type == "cuda":
                tok_t, pos_t = tok_t.pin_memory(), pos_t.pin_memory()
            logits = self.runner.decode(tok_t.to(self.device, non_blocking=True),
                                        pos_t.to(self.device, non_blocking=True), max(positions) + 1)  # [b, V]
            sampled = self._sample(logits, lives)
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, the loop goes on
            self._fail(rows, exc)
            return
        self.stats.steps += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(rows))
        for i in rows:
            self._deliver(i, self.slots[i], sampled[i])

    def _sample(self, logits: torch.Tensor, lives: Sequence[_Live | None]) -> list[int]:
        """Next token of every row: argmax for all, then sampled rows overwritten (grouped by params)."""
        out = logits.argmax(dim=-1)  # [b]
        groups: dict[SamplingParams, list[int]] = {}
        for row, live in enumerate(lives):
            if live is None or live.req.sampling is None or live.req.sampling.is_greedy:
                continue
            if live.generator is not None:
                out[row] = sample(logits[row:row + 1], live.req.sampling, live.generator)[0]
            else:
                groups.setdefault(live.req.sampling, []).append(row)
        for params, group in groups.items():
            idx = torch.tensor(group, device=logits.device)
            out[idx] = sample(logits[idx], params, None)
        return out.tolist()  # the one host sync of the step

    def _deliver(self, slot: int, live: _Live, token: int, *, advance: bool = True) -> None:
        live.last = token
        live.pos += advance  # a decode step wrote the previous `last` at `pos`
        live.generated += 1
        self.stats.tokens += 1
        reason = None
        if token in live.stop:
            reason = "stop"
        elif live.generated >= live.req.max_tokens or live.pos + 1 >= self.max_seq_len:
            reason = "length"
        if reason is not None:
            self.slots[slot] = None
            self.stats.finished += 1
        try:
            live.req.emit([token], reason)
        except Exception as exc:  # noqa: BLE001 - a broken callback must not stop the others
            self.log_error(f"request {live.req.request_id}: emit failed: {type(exc).__name__}: {exc}")
            if reason is None:
                self.slots[slot] = None
                self.stats.failed += 1
            try:
                live.req.fail(exc)
            except Exception as cb_exc:  # noqa: BLE001
                self.log_error(f"request {live.req.request_id}: fail callback: {cb_exc}")

    def _fail(self, slots: Sequence[int], exc: BaseException) -> None:
        self.log_error(f"step failed for {len(slots)} requests: {type(exc).__name__}: {exc}")
        for i in slots:
            live = self.slots[i]
            self.slots[i] = None
            if live is None:
                continue
            self.stats.failed += 1
            try:
                live.req.fail(exc)
            except Exception as cb_exc:  # noqa: BLE001
                self.log_error(f"request {live.req.request_id}: fail callback: {cb_exc}")

    def _fail_all(self, exc: BaseException) -> None:
        with self.cond:
            pending = list(self.waiting)
            self.waiting.clear()
        for req in pending:
            try:
                req.fail(exc)
            except Exception as cb_exc:  # noqa: BLE001
                self.log_error(f"request {req.request_id}: fail callback: {cb_exc}")
        self._fail([i for i, s in enumerate(self.slots) if s is not None], exc)


def collect(scheduler: Scheduler, prompts: Sequence[Sequence[int]], *, max_tokens: int | Sequence[int],
            sampling: SamplingParams | None = None, stop_token_ids: Sequence[int] = ()
            ) -> list[tuple[list[int], str]]:
    """Run prompts through `scheduler` on this thread -> [(token ids, finish reason)] (tests, offline)."""
    out: list[tuple[list[int], str | None]] = [([], None) for _ in prompts]
    limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)

    def emitter(i: int) -> Emit:
        def emit(ids: list[int], reason: str | None) -> None:
            out[i][0].extend(ids)
            if reason is not None:
                out[i] = (out[i][0], reason)
        return emit

    def fail(exc: BaseException) -> None:
        raise exc

    for i, p in enumerate(prompts):
        scheduler.submit(GenRequest(list(p), limits[i], emitter(i), fail, sampling, tuple(stop_token_ids)))
    scheduler.run_until_idle()
    return [(ids, reason or "length") for ids, reason in out]
