"""The loop of the in-flight scheduler: the request, its errors, the queue and the loop's lifecycle.

`scheduler.Scheduler` decides how requests are admitted, launched and delivered (blocks, chunked prefill); what
a caller sees lives here:

- `GenRequest`: prompt, limits, sampling, and the callbacks its tokens (`emit(new_ids, finish_reason)`,
  finish_reason None until the last emit) and its failure (`fail(exc)`) go to, called on the loop's thread;
- `submit` (any thread): checked first (`check`: a request the engine can never serve raises
  `EngineLimitError` naming the value and the limit; nothing is queued), refused with `SchedulerFull`
  when `max_waiting` requests already wait (overload: retry later) and with `SchedulerStopped` while
  stopping; `cancel` (any thread): the request leaves the queue or its live state at the next step and
  fails with `RequestCancelled`;
- `run_forever` (or `start()`, which runs it on a daemon thread): step while there is work, wait on the
  queue's condition when there is none. After each step of a synchronous loop (`synchronous`: the step
  waited for its tokens, nothing runs on the device now) `while_waiting` is called until it reports
  nothing left; whenever the loop goes idle, `drain()` (or `while_waiting` until done). An idle loop with
  `admit_gap_s` lets a burst of arrivals finish before stepping (at most GATHER_MAX_GAPS gaps, or until
  the burst fills `capacity`), so the burst is admitted together and decodes in step;
- `admit_every_steps` (1: every step) is for arrivals at a busy engine: while requests are live, waiting ones
  are admitted at most once every that many steps, with the exceptions `scheduler.Scheduler._admission_due`
  names (its doc says why);
- `launching()` (the loop's thread, around launching a step) and `between_launches()` (any other thread, around
  Python work that can wait a few milliseconds, such as Triton's request intake, which checks `launch_waits()`
  between its items) share one `launch_lock.LaunchLock` on CUDA, launches first: a step's eager launches give
  the interpreter lock up at every torch op, and while another thread runs Python each launch waits up to the
  switch interval to win it back (hundreds of ops a prompt step), so the GPU waited for the host. Off CUDA
  (`synchronous`) a step is its own compute and neither takes the lock; `exclusive_launch = False` turns it off;
- `stop()`: ends the loop, fails what is still waiting or live with `SchedulerStopped`, joins the thread; a loop
  that fails (an error escapes a step) fails them with `EngineLoopFailed` and refuses new requests;
  `run_until_idle()`: steps on the caller's thread until nothing waits or lives (tests, offline use), which
  `collect(scheduler, prompts, ...)` runs over a list of prompts.

`scheduler.Scheduler` provides `step()`, `_busy()` (live or launched work), `_fail_live(exc)`, `_admission_due`, `capacity` (live
requests at most) and `stats` (with `drain_s` and `gather_s`), and may wrap each request in its own
queue item (`_waiting_item`, `_request_of`).

Thread model: `submit` and `cancel` take `cond`; everything else runs on the loop's thread, the only
code that touches the runner.

Imports: stdlib and torch only (through the sampling parameters).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from serving.engine.errors import EngineError, EngineLimitError
from serving.engine.launch_lock import LaunchLock
from serving.engine.sampling import SamplingParams, TokenMaskSource

GATHER_MAX_GAPS = 10  # an idle engine waits for a burst of arrivals at most this many `admit_gap_s`
Emit = Callable[[list[int], "str | None"], None]
Fail = Callable[[BaseException], None]
LogprobSink = Callable[[float, "dict[int, float]"], None]
# (log-probs of prompt tokens [first, first + k), their top alternatives) for k prompt tokens
PromptLogprobSink = Callable[[int, "list[float]", "list[dict[int, float]]"], None]


class SchedulerStopped(EngineError):
    """The scheduler stopped before the request finished."""


class EngineLoopFailed(SchedulerStopped):
    """The scheduler's loop failed (an error escaped a step): the requests it held fail with this."""


class SchedulerFull(EngineError):
    """The queue of requests waiting for admission is at its limit: the request is refused, not queued. The
    message carries "resource exhausted", the words clients and the OpenAI front read as overload (429)."""


class RequestCancelled(EngineError):
    """The request was cancelled (its client went away) before it finished."""


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
    cancelled: bool = False  # set by cancel()
    queued_at: float = 0.0  # perf_counter time it was submitted
    top_logprobs: int = 0  # alternatives reported with each chosen token's log-prob (`on_logprobs`)
    on_logprobs: LogprobSink | None = None  # each chosen token's raw log-prob and its top alternatives
    # each prompt token's raw log-prob given the tokens before it (from the second token on), and its alternatives
    on_prompt_logprobs: PromptLogprobSink | None = None
    # what constrains its tokens (a grammar matcher; `sampling.TokenMaskSource`): asked for the allowed tokens
    # before each of its sampling steps, told each token chosen; the paged scheduler serves it
    token_mask: TokenMaskSource | None = None


class SchedulerLoop:
    """The queue, the loop and its lifecycle of an in-flight scheduler (see the module doc)."""

    THREAD_NAME = "enginewright-scheduler"
    MAX_WAITING_SETTING = "max_waiting"  # how the queue limit is spelled where the user sets it
    capacity: int  # live requests at most (the subclass sets it)
    stats: Any  # the subclass's stats dataclass: drain_s and gather_s are added to here

    def __init__(self, runner: Any, *, idle_wait_s: float, on_error: Callable[[str], None] | None,
                 while_waiting: Callable[[], bool] | None, drain: Callable[[], None] | None,
                 admit_gap_s: float, max_waiting: int | None, admit_every_steps: int = 1) -> None:
        if not admit_gap_s >= 0.0:
            raise ValueError(f"admit_gap_s={admit_gap_s!r} must be >= 0")
        if not isinstance(admit_every_steps, int) or admit_every_steps < 1:
            raise ValueError(f"admit_every_steps={admit_every_steps!r} must be an integer >= 1")
        self.admit_every_steps = admit_every_steps
        self.steps_since_admit = admit_every_steps  # steps since the last admission
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"{self.MAX_WAITING_SETTING}={max_waiting!r} must be >= 1 (or None: no limit)")
        self.runner = runner
        self.admit_gap_s = admit_gap_s
        self.max_waiting = max_waiting
        self.max_waiting_setting = self.MAX_WAITING_SETTING
        self.while_waiting = while_waiting or (lambda: False)
        # optional: `work_while(busy)` does the other work itself while `busy()` (a step computes), on as many
        # threads as it likes; set by Triton's llm model for several senders (Outbox.send_while)
        self.work_while: Callable[[Callable[[], bool]], None] | None = None
        self.exclusive_launch = True  # see `launching`
        self._launch_lock = LaunchLock()
        self.drain = drain
        limits = runner.info.limits
        self.max_input_len = int(limits.max_input_len)
        self.max_seq_len = int(limits.max_seq_len)
        self.vocab_size = int(runner.info.model.vocab_size)
        self.device = runner.device
        self.idle_wait_s = idle_wait_s
        self.log_error = on_error or (lambda msg: None)
        self.waiting: collections.deque[Any] = collections.deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.failure: EngineLoopFailed | None = None  # set when the loop failed (`run_forever`)
        self.thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.cancels_pending = 0

    # -- what a subclass provides ----------------------------------------------------------------
    @property
    def synchronous(self) -> bool:
        """Whether a step returns with nothing left running on the device (then the loop does its other work)."""
        return True

    def step(self) -> None:
        raise NotImplementedError

    def _busy(self) -> bool:
        """Live requests, or launched work whose tokens are not delivered yet."""
        raise NotImplementedError

    def _fail_live(self, exc: BaseException) -> None:
        raise NotImplementedError

    def _load(self) -> str:
        """What holds the engine now, for a refusal's message."""
        return ""

    def _waiting_item(self, req: GenRequest) -> Any:
        """What the queue holds for `req`."""
        return req

    def _request_of(self, item: Any) -> GenRequest:
        return item

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

    def _exclusive(self) -> bool:
        return self.exclusive_launch and not self.synchronous

    def launching(self) -> contextlib.AbstractContextManager[Any]:
        """Held by the loop's thread while it launches a step on CUDA (see the module doc)."""
        return self._launch_lock.launching() if self._exclusive() else contextlib.nullcontext()

    def between_launches(self) -> contextlib.AbstractContextManager[Any]:
        """Held by another thread around Python work that may wait for a launch to finish (never while holding
        anything the loop's thread takes first: `cond`, a request's callbacks' locks). Work of many items
        checks `launch_waits()` between them and leaves when it is true."""
        return self._launch_lock.between() if self._exclusive() else contextlib.nullcontext()

    def wait_out_launch(self) -> None:
        """Another thread: return once the loop's thread neither launches nor waits to (at once off CUDA)."""
        if self._exclusive():
            self._launch_lock.wait_out_launch()

    def launch_waits(self) -> bool:
        """Whether the loop's thread waits to launch a step (work `between_launches` should step aside)."""
        return self._exclusive() and self._launch_lock.launch_waits()

    def limit_waiting(self, limit: int, setting: str) -> None:
        """Refuse requests past ``limit`` waiting ones, where that is tighter than the limit so far; refusals
        then name ``setting``."""
        if limit < 1:
            raise ValueError(f"{setting}={limit!r} must be >= 1")
        if self.max_waiting is None or limit < self.max_waiting:
            self.max_waiting, self.max_waiting_setting = limit, setting

    def submit(self, req: GenRequest) -> None:
        """Queue a request (checked first: a bad one raises here, nothing is queued)."""
        self.check(req.prompt_ids, req.max_tokens)
        item = self._waiting_item(req)
        with self.cond:
            if self.failure is not None:
                raise SchedulerStopped(f"{self.failure}; request not accepted")
            if self.stopping:
                raise SchedulerStopped("the scheduler is stopping; request not accepted")
            if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
                raise SchedulerFull(f"resource exhausted: {len(self.waiting)} requests already wait for admission "
                                    f"({self.max_waiting_setting}={self.max_waiting}; {self._load()}): try again later")
            if req.request_id is None:
                req.request_id = next(self._ids)
            req.queued_at = time.perf_counter()
            self.waiting.append(item)
            self.cond.notify()

    def cancel(self, req: GenRequest) -> None:
        """Stop `req` at the next step (any thread): it leaves the queue or its live state, and fails
        with RequestCancelled. A finished request is left alone."""
        with self.cond:
            req.cancelled = True
            self.cancels_pending += 1
            self.cond.notify()

    def idle(self) -> bool:
        with self.cond:
            return not self.waiting and not self._busy()

    # -- the loop (one thread) ----------------------------------------------------------------
    def start(self, name: str | None = None) -> threading.Thread:
        self.thread = threading.Thread(target=self.run_forever, name=name or self.THREAD_NAME, daemon=True)
        self.thread.start()
        return self.thread

    def run_forever(self) -> None:
        """The loop (see the module doc). An error that escapes a step (a bug, a failed device) does not end it
        silently: it is logged, every request waiting or live fails with `EngineLoopFailed`, and `submit` refuses
        new ones naming it, so clients get an answer instead of waiting forever."""
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - see the docstring
            self._fail_loop(exc)

    def _fail_loop(self, exc: BaseException) -> None:
        self.log_error(f"the scheduler loop failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        failure = EngineLoopFailed(f"the engine loop failed ({type(exc).__name__}: {exc}); the model must be "
                                   "reloaded")
        with self.cond:
            self.stopping = True
            self.failure = failure
        try:
            self._fail_all(failure)
        except Exception as cleanup:  # noqa: BLE001 - the live state may be what broke
            self.log_error(f"failing the live requests after the loop failed: {type(cleanup).__name__}: {cleanup}")
        self._drain()

    def _loop(self) -> None:
        while True:
            if self.idle():
                started = time.perf_counter()
                self._drain()
                self.stats.drain_s += time.perf_counter() - started
            elif self.synchronous:  # nothing runs on the device: this is the time for the other work
                self._pump()
            with self.cond:
                while not self.stopping and not self.waiting and not self._busy():
                    self.cond.wait(self.idle_wait_s)
                if self.stopping:
                    break
                if self.admit_gap_s and not self._busy():
                    self._gather_arrivals()
            self.step()
        self._fail_all(SchedulerStopped("the scheduler stopped (model unloading) before the request finished"))
        self._drain()

    def _gather_arrivals(self) -> None:
        """Idle, with requests waiting (`cond` held): let a burst of arrivals finish before admitting it,
        so that it is admitted together and decodes in step. Waits while requests keep coming at most
        `admit_gap_s` apart, for at most GATHER_MAX_GAPS gaps, or until they fill `capacity`."""
        started = time.perf_counter()
        deadline = started + GATHER_MAX_GAPS * self.admit_gap_s
        while len(self.waiting) < self.capacity and not self.stopping:
            seen = len(self.waiting)
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            self.cond.wait(min(self.admit_gap_s, left))
            if len(self.waiting) == seen:
                break
        self.stats.gather_s += time.perf_counter() - started

    def _drain(self) -> None:
        if self.drain is not None:
            self.drain()
        else:
            self._pump()

    def _work_until(self, ready: Any) -> None:
        """Run `while_waiting` items until the device work behind `ready` (a CUDA event) is done, at least one
        item: the host's other work fills the time the GPU computes, and a step never waits on all of it.
        With `work_while` set, that does the work instead."""
        if self.work_while is not None:
            self.work_while(lambda: not ready.query())
            return
        if not self.while_waiting():
            return
        while not ready.query() and self.while_waiting():
            pass

    def _pump(self) -> None:
        while self.while_waiting():
            pass

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

    # -- failures -----------------------------------------------------------------------------
    def _take_cancelled_waiting(self) -> list[Any]:
        """The queue items of cancelled requests, taken out of the queue (loop thread)."""
        with self.cond:
            self.cancels_pending = 0
            dropped = [item for item in self.waiting if self._request_of(item).cancelled]
            for item in dropped:
                self.waiting.remove(item)
        return dropped

    def _tell_failed(self, req: GenRequest, exc: BaseException) -> None:
        try:
            req.fail(exc)
        except Exception as cb_exc:  # noqa: BLE001
            self.log_error(f"request {req.request_id}: fail callback: {cb_exc}")

    def _fail_all(self, exc: BaseException) -> None:
        with self.cond:
            pending = list(self.waiting)
            self.waiting.clear()
        for item in pending:
            self._tell_failed(self._request_of(item), exc)
        self._fail_live(exc)


def collect(scheduler: SchedulerLoop, prompts: Sequence[Sequence[int]], *, max_tokens: int | Sequence[int],
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
