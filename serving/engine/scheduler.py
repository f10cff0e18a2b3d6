"""In-flight (continuous) batching over the static KV cache: one cache row ("slot") per live request.

Between decode steps the scheduler admits waiting requests into free slots (one packed prefill for
all of them, `EngineRunner.prefill`) and retires finished ones (stop token, their own `max_tokens`,
or the engine's `max_seq_len`); each decode step runs rows [0, highest launching slot] through
`EngineRunner.decode` (CUDA graphs per batch bucket on GPU), rows of free or finished slots computing
harmless garbage into their own cache rows (position 0, which a prefill rewrites before any decode
of a new request reads it). Slots are taken lowest first, so the decode batch stays compact.

The host runs one step ahead of the tokens (like vLLM's async scheduling): a step's sampled tokens
stay on the device and feed the next step directly, and the tokens come back through a pinned copy +
CUDA event that the host reads only after it has launched the following step. So the GPU decodes
step t+1 while the host delivers step t's tokens, and the one host sync per step no longer leaves
the GPU idle. A request that stops on a stop token has one step launched past it; those rows' tokens
are dropped (its cache row is garbage from then on).

The rows' inputs live on the device in the runner's `DecodeState` (token, position, active), and
the step's CUDA graph itself writes the greedy next tokens and moves the active rows' positions on
(`EngineRunner.decode_inplace`). The host only writes the state when rows change: admitted rows get
their first token and position, rows that stop launching are parked (position 0, inactive). A step of
greedy rows therefore costs the host one graph replay, one copy to a pinned buffer and one event:
few calls into torch, each of which lets go of the GIL and must win it back from any other busy
Python thread.

Each request carries its own sampling (greedy requests share one argmax; sampled requests with the
same parameters and no seed share one draw; a seeded request has its own `torch.Generator`, so its
output does not depend on what it was batched with), stop tokens and `max_tokens`. Tokens go out
through the request's `emit(new_ids, finish_reason)` callback (finish_reason None until the last
emit), called on the scheduler thread.

`while_waiting` (optional) is other work for the loop's thread: it is called, one item per call,
while a launched step still runs on the GPU and the thread would otherwise block on it (at least once
per step, so the work keeps moving when the host is the bottleneck), until it reports nothing left
after each step on the CPU (where nothing runs asynchronously), and likewise whenever the loop goes
idle, unless `drain` (optional) is given: then `drain()` is called instead. Triton's `llm` model sends
its responses there (`outbox.Outbox.send_next`, and `Outbox.drain` when idle).

`admit_gap_s` (0: off) is for bursts of arrivals at an idle engine, such as the next requests of
closed-loop clients whose previous ones ended together: admitting the first arrival at once would
start its prefill alone, the rest would follow in later prefills, and the groups would then decode
out of step (more, smaller decode steps, each prefill stalling the others). An idle engine therefore
admits once no request has arrived for `admit_gap_s` (or the slots are full, or GATHER_MAX_GAPS gaps
have passed). A lone request waits one gap; an engine with live requests never waits.

`admit_every_steps` (1: every step) is for arrivals at a busy engine. Closed-loop clients that have
drifted out of step (a gray release's weight changes do that) finish one or two at a time, and
admitting each at the next step runs a prefill per decode step: on an H200 the 1B engine at 64 clients
then spent 28 of 32 busy seconds launching prefills of about two prompts each and served a quarter of
the requests it served while the clients were in step (`bench rollout`). While requests are
live, waiting ones are therefore admitted at most once every `admit_every_steps` decode steps, unless
they outnumber the live ones by WAITING_SERVED_RATIO (a burst); an idle engine admits at once (after
`admit_gap_s`). This is text-generation-inference's `max_waiting_tokens` / `waiting_served_ratio`. A
request waits for its first token at most that many steps more; none waits when no other was admitted
in the last `admit_every_steps` steps.

The request, `submit` / `cancel`, the loop (`run_forever`, `start`, `stop`, `run_until_idle`) and the
refusal of a request past `max_waiting` (`SchedulerFull`) are `scheduler_loop.SchedulerLoop`'s, shared
with the paged scheduler. Thread model: `submit` is thread-safe; `run_forever` (or `start()`, which runs
it on a daemon thread) is the only code that touches the runner. `stop()` ends the loop, fails what is
still pending or live with `SchedulerStopped`, and joins the thread.

Imports: stdlib and torch only.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from serving.engine.sampling import SamplingParams, sample
from serving.engine.scheduler_loop import (  # noqa: F401 - the requests' vocabulary, imported from here too
    GATHER_MAX_GAPS,
    Emit,
    Fail,
    GenRequest,
    RequestCancelled,
    SchedulerFull,
    SchedulerLoop,
    SchedulerStopped,
)

HOST_BUFFERS = 4


@dataclass(eq=False)
class _Live:
    req: GenRequest
    slot: int
    next_pos: int  # cache position of the next decode step's input token (= tokens in the cache then)
    launched: int = 0  # tokens whose computation has been launched (prefill's first token included)
    generated: int = 0  # tokens delivered
    finished: bool = False
    generator: torch.Generator | None = None
    stop: frozenset[int] = field(default_factory=frozenset)


@dataclass
class _Launched:
    """Tokens on their way back to the host: one prefill or one decode step."""

    lives: list[_Live]
    index: list[int]  # where each live's token is in `tokens`
    tokens: torch.Tensor  # on the host (pinned on CUDA), filled once `ready` has fired
    ready: Any  # torch.cuda.Event, or None on the CPU (the copy was synchronous)


@dataclass
class SchedulerStats:
    steps: int = 0
    prefills: int = 0
    admitted: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    tokens: int = 0
    largest_batch: int = 0
    busy_s: float = 0.0  # inside step(): the three below, and the rest of the host work
    launch_s: float = 0.0  # admitting (prefill) and launching decode steps, GPU work queued, not awaited
    deliver_s: float = 0.0  # handing tokens to the requests' callbacks, waiting included
    wait_s: float = 0.0  # until a launched step's tokens reached the host (GPU busy; `while_waiting` ran)
    prefill_s: float = 0.0  # of launch_s: admitting (the prefill call returns once its GPU work is queued)
    drain_s: float = 0.0  # idle, finishing the `while_waiting` work (or `drain`)
    queued_s: float = 0.0  # summed over requests: from submit to admission
    gather_s: float = 0.0  # idle, letting a burst of arrivals finish (`admit_gap_s`)
    held: int = 0  # steps at which waiting requests were held back (`admit_every_steps`)


class Scheduler(SchedulerLoop):
    """Continuous batching driver of one `EngineRunner` (`prefill`, `decode`, `info.limits`); the queue and
    the loop are `scheduler_loop.SchedulerLoop`'s."""

    def __init__(self, runner: Any, *, max_prefill_tokens: int = 16384, idle_wait_s: float = 0.05,
                 on_error: Callable[[str], None] | None = None,
                 while_waiting: Callable[[], bool] | None = None, drain: Callable[[], None] | None = None,
                 admit_gap_s: float = 0.0, max_waiting: int | None = None, admit_every_steps: int = 1) -> None:
        super().__init__(runner, idle_wait_s=idle_wait_s, on_error=on_error, while_waiting=while_waiting,
                         drain=drain, admit_gap_s=admit_gap_s, max_waiting=max_waiting,
                         admit_every_steps=admit_every_steps)
        self.max_slots = self.capacity = int(runner.info.limits.max_batch_size)
        self.max_prefill_tokens = max(max_prefill_tokens, self.max_input_len)
        self.slots: list[_Live | None] = [None] * self.max_slots
        self.stats = SchedulerStats()
        self.inflight: collections.deque[_Launched] = collections.deque()
        self.state = runner.state  # the rows' decode inputs on the device (tokens, positions, active)
        self.state.reset()
        self.advancing: set[int] = set()  # rows whose `active` is 1 on the device
        pinned = self.device.type == "cuda"
        # host copies of launched tokens; at most 3 are in flight (prefill, decode, the one being read)
        self.host_buffers = [torch.zeros(self.max_slots, dtype=torch.long, pin_memory=pinned) for _ in range(HOST_BUFFERS)]
        self.host_events = [torch.cuda.Event() for _ in range(HOST_BUFFERS)] if pinned else []
        self.next_buffer = 0

    @property
    def live(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def synchronous(self) -> bool:
        return self.device.type != "cuda"  # on CUDA the host runs a step ahead of the tokens

    def _busy(self) -> bool:
        return self.live > 0 or bool(self.inflight)

    def _load(self) -> str:
        return f"{self.live} of {self.max_slots} slots live"

    @torch.no_grad()
    def step(self) -> None:
        """Admit what fits, launch one decode step for every live slot, then deliver the tokens of
        everything launched before it (the newest step's tokens are delivered by the next call)."""
        started = time.perf_counter()
        if self.cancels_pending:
            self._apply_cancels()
        with self.launching():
            self._admit()  # the admitted join this very decode step (their first token comes from prefill)
            launched = self._launch_decode()
        self.steps_since_admit += 1
        queued = time.perf_counter()
        while len(self.inflight) > (1 if launched else 0):
            self._deliver(self.inflight.popleft())
        done = time.perf_counter()
        self.stats.launch_s += queued - started
        self.stats.deliver_s += done - queued
        self.stats.busy_s += done - started

    # -- internals ----------------------------------------------------------------------------
    def _apply_cancels(self) -> None:
        dropped = self._take_cancelled_waiting()
        cancelled = RequestCancelled("the request was cancelled before it finished")
        for req in dropped:
            self.stats.cancelled += 1
            self._tell_failed(req, cancelled)
        for live in [s for s in self.slots if s is not None and s.req.cancelled and not s.finished]:
            self.stats.cancelled += 1
            self._retire(live)  # its slot is free now; its row is parked at the next launch
            self._tell_failed(live.req, cancelled)

    def _can_launch(self, live: _Live) -> bool:
        return (not live.finished and live.launched < live.req.max_tokens
                and live.next_pos + 1 < self.max_seq_len)

    def _admit(self) -> None:
        free = [i for i, s in enumerate(self.slots) if s is None]
        batch: list[tuple[int, GenRequest]] = []
        budget = self.max_prefill_tokens
        with self.cond:
            if not self._admission_due(self.live):
                self.stats.held += bool(self.waiting)
                return
            while self.waiting and len(batch) < len(free) and len(self.waiting[0].prompt_ids) <= budget:
                req = self.waiting.popleft()
                budget -= len(req.prompt_ids)
                batch.append((free[len(batch)], req))
        if not batch:
            return
        self.steps_since_admit = 0
        started = time.perf_counter()
        self.stats.queued_s += sum(started - req.queued_at for _, req in batch)
        rows, lives = [], []
        for slot, req in batch:
            live = _Live(req=req, slot=slot, next_pos=len(req.prompt_ids), launched=1,
                         stop=frozenset(req.stop_token_ids))
            if req.sampling is not None and not req.sampling.is_greedy and req.sampling.seed is not None:
                live.generator = torch.Generator(device=self.device)
                live.generator.manual_seed(req.sampling.seed)
            self.slots[slot] = live
            rows.append(slot)
            lives.append(live)
        try:
            logits = self.runner.prefill([req.prompt_ids for _, req in batch], rows)
            tokens = self._sample(logits, lives)
            rows_dev = self._on_device(rows)
            self.state.tokens[rows_dev] = tokens
            self.state.positions[rows_dev] = self._on_device([live.next_pos for live in lives])
            self.inflight.append(self._to_host(lives, list(range(len(lives))), tokens))
        except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving
            self._fail(lives, exc)
            return
        finally:
            self.stats.prefill_s += time.perf_counter() - started
        self.stats.prefills += 1
        self.stats.admitted += len(batch)

    def _launch_decode(self) -> bool:
        launched = [s for s in self.slots if s is not None and self._can_launch(s)]
        rows = [live.slot for live in launched]
        try:
            self._set_advancing(rows)
            if not rows:
                return False
            b = rows[-1] + 1
            logits = self.runner.decode_inplace(b, max(live.next_pos for live in launched) + 1)
            if any(live.req.sampling is not None and not live.req.sampling.is_greedy for live in launched):
                lives: list[_Live | None] = [None] * b
                for live in launched:
                    lives[live.slot] = live
                self.state.tokens[:b].copy_(self._sample(logits, lives))  # the graph wrote the argmax
            self.inflight.append(self._to_host(launched, rows, self.state.tokens[:b]))
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, the loop goes on
            self._fail(launched, exc)
            return False
        for live in launched:
            live.next_pos += 1
            live.launched += 1
        self.stats.steps += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(rows))
        return True

    def _set_advancing(self, rows: list[int]) -> None:
        """Make exactly `rows` active on the device: start the new ones, park the ones that stopped."""
        wanted = set(rows)
        start, park = sorted(wanted - self.advancing), sorted(self.advancing - wanted)
        if start:
            self.state.active[self._on_device(start)] = 1
        if park:
            idx = self._on_device(park)
            self.state.active[idx] = 0
            self.state.positions[idx] = 0
        self.advancing = wanted

    def _on_device(self, values: list[int]) -> torch.Tensor:
        """A long tensor on the device without a host sync (pinned, non-blocking copy on CUDA)."""
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _to_host(self, lives: list[_Live], index: list[int], tokens: torch.Tensor) -> _Launched:
        """Start copying `tokens` to the host (the next of the reused host buffers) without waiting."""
        i = self.next_buffer
        self.next_buffer = (i + 1) % HOST_BUFFERS
        host = self.host_buffers[i][: tokens.shape[0]]
        if self.device.type != "cuda":
            host.copy_(tokens)
            return _Launched(lives, index, host, None)
        host.copy_(tokens, non_blocking=True)
        ready = self.host_events[i]
        ready.record()
        return _Launched(lives, index, host, ready)

    def _sample(self, logits: torch.Tensor, lives: Sequence[_Live | None]) -> torch.Tensor:
        """Next token of every row, on the device: argmax for all, then sampled rows overwritten
        (grouped by params)."""
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
            idx = self._on_device(group)
            out[idx] = sample(logits[idx], params, None)
        return out

    def _deliver(self, done: _Launched) -> None:
        try:
            if done.ready is not None:
                waiting = time.perf_counter()
                self._work_until(done.ready)
                done.ready.synchronize()
                self.stats.wait_s += time.perf_counter() - waiting
            tokens = done.tokens.tolist()
        except Exception as exc:  # noqa: BLE001 - the step failed on the device
            self._fail(done.lives, exc)
            return
        for live, i in zip(done.lives, done.index):
            if not live.finished:
                self._deliver_token(live, tokens[i])

    def _deliver_token(self, live: _Live, token: int) -> None:
        live.generated += 1
        self.stats.tokens += 1
        reason = None
        if token in live.stop:
            reason = "stop"
        elif live.generated >= live.req.max_tokens or (live.generated == live.launched and not self._can_launch(live)):
            reason = "length"
        if reason is not None:
            self._retire(live)
            self.stats.finished += 1
        try:
            live.req.emit([token], reason)
        except Exception as exc:  # noqa: BLE001 - a broken callback must not stop the others
            self.log_error(f"request {live.req.request_id}: emit failed: {type(exc).__name__}: {exc}")
            if reason is None:
                self._fail_one(live, exc)
            else:  # already retired as finished
                self._tell_failed(live.req, exc)

    def _retire(self, live: _Live) -> None:
        live.finished = True
        if self.slots[live.slot] is live:
            self.slots[live.slot] = None

    def _fail(self, lives: Sequence[_Live], exc: BaseException) -> None:
        lives = [live for live in lives if not live.finished]
        if not lives:
            return
        self.log_error(f"step failed for {len(lives)} requests: {type(exc).__name__}: {exc}")
        for live in lives:
            self._fail_one(live, exc)

    def _fail_one(self, live: _Live, exc: BaseException) -> None:
        self._retire(live)
        self.stats.failed += 1
        self._tell_failed(live.req, exc)

    def _fail_live(self, exc: BaseException) -> None:
        self.inflight.clear()
        self._fail([s for s in self.slots if s is not None], exc)


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
