"""In-flight batching over the paged KV cache: chunked prefill mixed with decodes under a token budget.

Each step computes at most `max_num_tokens` tokens for at most `max_live` live requests (the engine's
`max_batch_size`). It fills the budget in this order, as vLLM's scheduler does:

1. the live requests, oldest first: a decoding request its one token, a request still prefilling the next
   chunk of its prompt (as much of it as the budget has left);
2. waiting requests, first come first served, while the budget, the live cap and the free blocks allow:
   the first chunk of each prompt. While requests are live, waiting ones join at most once every
   `admit_every_steps` steps, unless those the live cap lets in would fill the step's token budget
   (`_admission_due`): a step with a prompt chunk in it is launched op by op from Python (a decode-only step
   is one CUDA graph), so closed-loop clients whose requests end a few at a time, each joining at the next
   step, turn most steps into slow mixed ones.

Blocks come from the KV-cache manager (`kv_cache_manager.KVCacheManager`: block ids in, block ids out; prefix
caching behind it), taken as a request's positions grow and given back when it finishes. A request is admitted only
while its first chunk's blocks, plus one block in reserve for each live request (their next decode may open a
block), are free. When a live request needs a block and none is free, the newest live request is preempted: its
blocks go back and it returns to the front of the queue with its prompt and every token it has delivered, to be
prefilled again (recompute; nothing it has delivered changes for greedy decoding). So blocks running out means
queueing, never an out-of-memory error. A request that could never fit (its prompt + `max_tokens` need more blocks
than the whole pool) is refused at `submit` with the numbers. With `max_waiting` (the engine's
`kv_cache.max_waiting` when served), a request that arrives while that many already wait is refused at `submit` with
`SchedulerFull` (overload: Triton's `llm` model answers UNAVAILABLE, the OpenAI front 429), so a burst past the KV
budget costs clients a retry, never the server its memory.

Tokens go out through the request's (`scheduler_loop.GenRequest`) `emit(new_ids, finish_reason)`, and, when it
asks (`on_logprobs`), each token's log-prob and top log-probs. Each request is held as a
`scheduler_requests.ScheduledRequest`: what it has computed and what it still wants, no prefill and decode phases;
a step gives each live request its next chunk of uncomputed tokens, samples its sampled rows together
(`scheduler_requests.sample_next`) and hands out the log-probs asked for, the prompt's too
(`scheduler_requests.step_logprobs`, `scheduler_requests.report_prompt_logprobs`).

One step ahead (`step_ahead`, on by default): while every live request decodes and nothing waiting could
be admitted, a step is launched before the previous step's tokens reach the host: its input tokens are the
previous step's samples, read on the device (`EngineRunner.forward_ahead`), and the host delivers those
tokens while the GPU computes, instead of leaving the GPU idle while it reads, delivers and plans. The
requests a pending token finishes by length are left out of the next step; one that meets a stop token has
already been given the next step's row, whose token is dropped (its blocks go back once it is delivered: the
stream runs that step before any later one can reuse them). A step that needs the tokens on the host (an
admission, a cancel, a block only a preemption would free, a request whose sampling reads its tokens on the
host: penalties, `min_tokens` or a token mask) waits for them first; log-probs travel with the tokens.

Speculative decoding (the engine option `speculative`, `speculative.py`): a decoding request without a token mask
drafts up to `max_draft` tokens by n-gram lookup in its own tokens, in the rows the live cap leaves; its last token
and each draft token are then single-token chunks of the step (decode rows: a decode-only step stays one CUDA
graph), every position picked by its own sampling rule, and the picks up to the first that differs from the draft,
plus that one, are delivered (`_deliver_picks`): the same tokens as without the draft. A step with drafts waits for
its tokens; a request that drafts at the next step keeps the step before it from running ahead.

The queue, `submit` / `cancel`, the loop (`run_forever`, `start`, `stop`, `run_until_idle`), `while_waiting`
/ `drain` (Triton's `llm` model sends its responses there) and `admit_gap_s` (an idle engine lets a burst of
arrivals finish, so it is admitted in one step) are `scheduler_loop.SchedulerLoop`'s. On CUDA `while_waiting`
runs while a step computes, until its tokens are ready (at least one item a step), never all of it between
steps: with a thousand live requests, sending every stream's response before the next step would set the pace
(docs/throughput.md); sent in the GPU's time, each response carries what its stream gathered meanwhile.
Off CUDA the steps are synchronous and the loop pumps between them.

Thread model: `submit` and `cancel` are thread-safe; `run_forever` (or `start()`) / `run_until_idle` is
the only code that touches the runner. `stop()` fails what is pending or live with `SchedulerStopped`.

Imports: stdlib and torch only.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from serving.engine.errors import EngineLimitError
from serving.engine.kv_cache import blocks_for
from serving.engine.kv_cache_manager import KVCacheManager
from serving.engine.scheduler_loop import (  # noqa: F401 - the requests' vocabulary, imported from here too
    Emit,
    EngineLoopFailed,
    Fail,
    GenRequest,
    RequestCancelled,
    SchedulerFull,
    SchedulerLoop,
    SchedulerStopped,
    collect,
)
from serving.engine.scheduler_requests import (
    ScheduledRequest,
    report_prompt_logprobs,
    sample_next,
    step_logprobs,
)
from serving.engine.speculative import accepted_length, verified_rows
from serving.engine.step import ChunkPlan
from serving.engine.step_sampling import StepLogprobs


@dataclass
class _Ahead:
    """A decode step launched whose sampled tokens the host has not read yet."""

    seqs: list[ScheduledRequest]  # its rows, in order
    tokens: torch.Tensor  # [N] on the device
    host: torch.Tensor  # [N] on the host (pinned on CUDA), filled by a non-blocking copy after the step
    ready: Any  # a torch.cuda.Event recorded after that copy; None off CUDA (the copy was synchronous)
    logprobs: StepLogprobs | None = None  # its rows' log-probs, copied to the host with the tokens


@dataclass
class SchedulerStats:
    steps: int = 0
    admitted: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    preempted: int = 0
    held: int = 0  # planned steps at which waiting requests were held back (`admit_every_steps`)
    tokens: int = 0  # delivered
    prefill_tokens: int = 0  # computed in chunks of more than one token, or a prompt's single last token
    decode_tokens: int = 0
    largest_batch: int = 0  # live requests in one step
    peak_blocks: int = 0
    drain_s: float = 0.0  # idle, finishing the `while_waiting` work (or `drain`)
    gather_s: float = 0.0  # idle, letting a burst of arrivals finish (`admit_gap_s`)
    busy_s: float = 0.0  # inside step(): the three below and the rest
    plan_s: float = 0.0  # choosing the step's chunks, taking blocks
    forward_s: float = 0.0  # building the inputs, launching the forward and sampling (the GPU runs behind)
    wait_s: float = 0.0  # then waiting for the step's tokens to reach the host
    deliver_s: float = 0.0  # handing the tokens to the requests' callbacks
    ahead_steps: int = 0  # decode steps launched before the previous step's tokens were read
    mixed_steps: int = 0  # steps with a prefill chunk in them (the others are decode-only)
    mixed_s: float = 0.0  # their forward + wait
    mixed_forward_s: float = 0.0  # their forward alone (the GPU waits when this outgrows their compute)
    mixed_forward_cpu_s: float = 0.0  # the loop thread's CPU time in it (the rest: waiting for the GIL or a core)
    launch_wait_s: float = 0.0  # waiting for the launch lock (`launching`) while the intake held it
    prefix_hit_tokens: int = 0  # prompt positions taken from the prefix cache instead of computed
    draft_steps: int = 0  # steps that verified drafts (speculative decoding)
    drafted_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of those, accepted (each delivered without a step of its own)


class Scheduler(SchedulerLoop):
    """Continuous batching driver of one `runner.EngineRunner`; the queue and the loop are
    `scheduler_loop.SchedulerLoop`'s."""

    THREAD_NAME = "enginewright-scheduler"
    MAX_WAITING_SETTING = "kv_cache.max_waiting"

    def __init__(self, runner: Any, *, idle_wait_s: float = 0.05,
                 on_error: Callable[[str], None] | None = None,
                 while_waiting: Callable[[], bool] | None = None, drain: Callable[[], None] | None = None,
                 admit_gap_s: float = 0.0, max_waiting: int | None = None, step_ahead: bool = True,
                 admit_every_steps: int = 1) -> None:
        super().__init__(runner, idle_wait_s=idle_wait_s, on_error=on_error, while_waiting=while_waiting,
                         drain=drain, admit_gap_s=admit_gap_s, max_waiting=max_waiting,
                         admit_every_steps=admit_every_steps)
        self.step_ahead = step_ahead and hasattr(runner, "forward_ahead")
        self.ahead: _Ahead | None = None
        self.max_live = self.capacity = runner.max_live
        self.max_num_tokens = runner.config.max_num_tokens
        self.block_size = runner.config.block_size
        self.kv = KVCacheManager(runner.allocator, self.block_size,  # block ids in, block ids out
                                 window=runner.info.model.kv_window)
        self.running: list[ScheduledRequest] = []
        self.stats = SchedulerStats()
        self.speculative = runner.model.options.speculative  # `speculative.SpeculativeOptions`, None: off

    @property
    def synchronous(self) -> bool:
        return self.device.type != "cuda"  # on CUDA `while_waiting` runs while each step computes

    def check(self, prompt_ids: Sequence[int], max_tokens: int) -> None:
        """Raise EngineLimitError naming the value and the limit when the engine can never serve it (also:
        more blocks than the whole pool)."""
        super().check(prompt_ids, max_tokens)
        need = blocks_for(len(prompt_ids) + max_tokens, self.block_size)
        if need > self.kv.num_blocks:
            raise EngineLimitError(f"prompt of {len(prompt_ids)} tokens + max_tokens={max_tokens} needs {need} KV "
                                   f"blocks of {self.block_size} positions; the whole paged cache has "
                                   f"{self.kv.num_blocks}")

    def _waiting_item(self, req: GenRequest) -> ScheduledRequest:
        return ScheduledRequest.of(req, self.speculative)

    def _request_of(self, item: ScheduledRequest) -> GenRequest:
        return item.req

    @property
    def live(self) -> int:
        return len(self.running)

    def _busy(self) -> bool:
        return bool(self.running)

    def _load(self) -> str:
        return f"{len(self.running)} live, {self.kv.free} of {self.kv.num_blocks} KV blocks free"

    @torch.no_grad()
    def step(self) -> None:
        """Plan one step under the token budget, run it, deliver the tokens it sampled. One step ahead: while
        only decodes run, launch the next step from the device's samples, then deliver the previous one's."""
        started = time.perf_counter()
        self.steps_since_admit += 1
        if self.ahead is not None:
            rows = self._next_ahead_rows(self.ahead)
            if rows:
                self._run_ahead(self.ahead, rows)
                self.stats.busy_s += time.perf_counter() - started
                return
            self._land(self.ahead)
        if self.cancels_pending:
            self._apply_cancels()
        planning = time.perf_counter()
        plan = self._plan()
        self.stats.plan_s += time.perf_counter() - planning
        if plan:
            self._run(plan)
        self.stats.busy_s += time.perf_counter() - started

    # -- planning -----------------------------------------------------------------------------
    def _plan(self) -> list[tuple[ScheduledRequest, int]]:
        budget = self.max_num_tokens
        plan: list[tuple[ScheduledRequest, int]] = []
        preempted = False
        spare_rows = self.max_live - len(self.running)  # the decode graphs' rows no live request takes: for drafts
        for seq in list(self.running):
            if budget == 0:
                break
            if not seq.live:  # preempted for an older request's block
                continue
            n = min(seq.remaining, budget)
            if not self._grow(seq, seq.computed + n):
                preempted = True
                continue
            if seq.drafter is not None and n == seq.remaining == 1:
                seq.draft = self._draft(seq, min(budget - 1, spare_rows))
                spare_rows -= len(seq.draft)
            plan.append((seq, n))
            budget -= n + len(seq.draft)
        with self.cond:
            admitting = self._admission_due(len(self.running))
            self.stats.held += bool(self.waiting) and not admitting
        while admitting and budget and not preempted and len(self.running) < self.max_live:
            with self.cond:
                if not self.waiting:
                    break
                seq = self.waiting[0]
                start = 0 if seq.wants_prompt_logprobs else self.kv.cached_positions(seq.kv, seq.tokens)
                n = min(len(seq.tokens) - start, budget)
                if not self.kv.can_admit(seq.kv, start + n, reserve=len(self.running)):
                    break
                self.waiting.popleft()
            self.kv.admit(seq.kv, start + n)
            self.stats.prefix_hit_tokens += start
            seq.computed = start
            seq.live = True
            self.running.append(seq)
            self.stats.admitted += 1
            self.steps_since_admit = 0
            plan.append((seq, n))
            budget -= n
        return plan

    def _draft(self, seq: ScheduledRequest, budget: int) -> list[int]:
        """`seq`'s draft for this step (at most `budget` tokens), its blocks taken: never past its `max_tokens` or
        the engine's `max_seq_len`, and only from blocks its table holds or that are free beyond one for each live
        request (a draft never preempts)."""
        spare = max(0, self.kv.free - len(self.running))
        room = min(budget, seq.req.max_tokens - seq.generated - 1, self.max_seq_len - len(seq.tokens) - 1,
                   (len(seq.kv.table) + spare) * self.block_size - seq.computed - 1)
        draft = seq.drafter.propose(seq.tokens, room) if seq.drafter is not None else []
        if draft:
            self.kv.grow(seq.kv, seq.computed + 1 + len(draft))
        return draft

    def _admission_due(self, live: int) -> bool:
        """Whether waiting requests may join now (`cond` held): none live, `admit_every_steps` steps since the
        last admission, or the prompts the live cap lets in fill what the budget leaves beside the decodes."""
        if live == 0 or self.steps_since_admit >= self.admit_every_steps:
            return True
        room, tokens = self.max_num_tokens - live, 0
        for seq in itertools.islice(self.waiting, self.max_live - live):
            tokens += seq.remaining
            if tokens >= room:
                return True
        return False

    def _grow(self, seq: ScheduledRequest, positions: int) -> bool:
        """Give `seq` the blocks for `positions`, preempting the newest live requests while none are free.
        False when `seq` itself was the newest and went back to the queue."""
        while not self.kv.grow(seq.kv, positions):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: ScheduledRequest) -> None:
        self.running.remove(seq)
        seq.live = False
        seq.draft = []
        self.kv.release(seq.kv)
        seq.computed = 0
        self.stats.preempted += 1
        with self.cond:
            self.waiting.appendleft(seq)

    # -- one step ahead ----------------------------------------------------------------------
    def _may_run_ahead(self, plan: list[tuple[ScheduledRequest, int]], sampling: list[int]) -> bool:
        """Whether this step may be launched and left unread: decodes only, of every live request."""
        return (self.step_ahead and len(plan) == len(self.running) == len(sampling)
                and all(n == 1 for _, n in plan) and self._nothing_needs_the_tokens())

    def _nothing_needs_the_tokens(self) -> bool:
        """No live request drafts at the next step (while the live cap leaves rows for drafts), and nothing waiting
        could be admitted (or may be yet: `admit_every_steps`). Log-probs travel with the tokens; a request whose
        sampling reads its tokens on the host samples after they land (`_run_ahead`)."""
        drafts = self.speculative is not None and len(self.running) < self.max_live
        if any(drafts and seq.drafter is not None and seq.drafter.due for seq in self.running):
            return False
        with self.cond:
            return (not self.waiting or len(self.running) >= self.max_live
                    or not self._admission_due(len(self.running)))

    def _next_ahead_rows(self, ahead: _Ahead) -> list[ScheduledRequest]:
        """The requests the step after `ahead` decodes, launched before its tokens are read: every one still
        live that its unread token does not finish by length. [] when that step cannot be planned without
        those tokens: a cancel, an admission, a block that would need a preemption."""
        if self.cancels_pending or not self._nothing_needs_the_tokens():
            return []
        rows = [s for s in ahead.seqs if s.live
                and s.generated + 1 < s.req.max_tokens and len(s.tokens) + 1 < self.max_seq_len]
        need = sum(self.kv.blocks_needed(s.kv, s.computed + 1) for s in rows)
        return rows if need <= self.kv.free else []

    def _launch_unread(self, seqs: list[ScheduledRequest], logits: torch.Tensor) -> _Ahead:
        """Sample `seqs`' next tokens from `logits` and start copying them to the host; their positions count
        as computed from here."""
        tokens = sample_next(logits, seqs, [seq.computed + 1 for seq in seqs])
        logprobs = step_logprobs(logits, tokens, seqs)
        for seq in seqs:
            seq.computed += 1
            self.kv.slide(seq.kv, seq.computed)
            if seq.generated > 0:
                self.stats.decode_tokens += 1
            else:  # a one-token prompt
                self.stats.prefill_tokens += 1
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            logprobs = logprobs.to_host() if logprobs is not None else None
            ready = torch.cuda.Event()
            ready.record()
        else:
            host, ready = tokens.clone(), None
        self.stats.steps += 1
        self.stats.ahead_steps += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(seqs))
        self.stats.peak_blocks = max(self.stats.peak_blocks, self.kv.used)
        return _Ahead(seqs, tokens, host, ready, logprobs)

    def _run_ahead(self, prev: _Ahead, rows: list[ScheduledRequest]) -> None:
        """Launch the decode step of `rows` on `prev`'s unread samples, then deliver `prev`'s tokens. When a row's
        sampling reads its tokens on the host (a token mask, penalties, min_tokens), the step is sampled only after
        that delivery: the GPU runs the forward while the host delivers and the grammar computes the next mask."""
        started = time.perf_counter()
        sample_after_landing = any(seq.needs_host for seq in rows)
        try:
            where = {id(seq): i for i, seq in enumerate(prev.seqs)}
            for seq in rows:
                self._grow(seq, seq.computed + 1)  # never preempts: `_next_ahead_rows` counted the free blocks
                if seq.drafter is not None:
                    seq.drafter.passed()
            chunks: list[ChunkPlan] = [([0], seq.computed, seq.kv.table) for seq in rows]
            asked = time.perf_counter()
            with self.launching():
                self.stats.launch_wait_s += time.perf_counter() - asked
                logits = self.runner.forward_ahead(chunks, prev.tokens, [where[id(seq)] for seq in rows])
                if not sample_after_landing:
                    self.ahead = self._launch_unread(rows, logits)
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, the loop goes on
            self.ahead = None
            self._fail(list(prev.seqs), exc)
            return
        self.stats.forward_s += time.perf_counter() - started
        self._land(prev)
        if sample_after_landing:
            self._sample_landed(rows, logits)

    def _sample_landed(self, rows: list[ScheduledRequest], logits: torch.Tensor) -> None:
        """Sample the launched step of `rows` now that their previous tokens are delivered; a row that those tokens
        finished is sampled unconstrained and never delivered."""
        started = time.perf_counter()
        try:
            with self.launching():
                self.ahead = self._launch_unread(rows, logits)
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, the loop goes on
            self.ahead = None
            self._fail([seq for seq in rows if seq.live], exc)
        self.stats.forward_s += time.perf_counter() - started

    def _land(self, ahead: _Ahead) -> None:
        """Wait for `ahead`'s tokens and deliver them to its requests that are still live."""
        waiting = time.perf_counter()
        if ahead.ready is not None:
            self._work_until(ahead.ready)
            ahead.ready.synchronize()
        tokens = ahead.host.tolist()
        delivering = time.perf_counter()
        self.stats.wait_s += delivering - waiting
        if self.ahead is ahead:
            self.ahead = None
        extras = ahead.logprobs.per_row(len(tokens)) if ahead.logprobs is not None else [None] * len(tokens)
        for seq, token, extra in zip(ahead.seqs, tokens, extras):
            if seq.live:
                self._deliver(seq, token, extra)
        self._drop_retired()
        self.stats.deliver_s += time.perf_counter() - delivering

    # -- running ------------------------------------------------------------------------------
    def _run(self, plan: list[tuple[ScheduledRequest, int]]) -> None:
        chunks: list[ChunkPlan] = [(seq.tokens[seq.computed:seq.computed + n], seq.computed, seq.kv.table)
                                   for seq, n in plan]
        sampling = [i for i, (seq, n) in enumerate(plan) if seq.computed + n == len(seq.tokens)]
        echoing = [i for i, (seq, n) in enumerate(plan) if seq.reports_prompt(n)]
        drafting = [i for i in sampling if plan[i][0].draft]
        # each draft token a single-token chunk after the plan's, sampled: a decode row apiece (every row's K/V is
        # written before any row attends, so each sees the draft tokens before it), in the decode graphs
        chunks += [([token], seq.computed + 1 + j, seq.kv.table)
                   for seq in (plan[i][0] for i in drafting) for j, token in enumerate(seq.draft)]
        if not echoing and not drafting and self._may_run_ahead(plan, sampling):
            started = time.perf_counter()
            try:
                with self.launching():
                    self.ahead = self._launch_unread([seq for seq, _ in plan], self.runner.forward(chunks, sampling))
            except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, the loop goes on
                self._fail([seq for seq, _ in plan], exc)
            self.stats.forward_s += time.perf_counter() - started
            return
        self.stats.peak_blocks = max(self.stats.peak_blocks, self.kv.used)
        self.stats.largest_batch = max(self.stats.largest_batch, len(plan))
        started = time.perf_counter()
        started_cpu = time.thread_time()
        try:
            lives = [plan[i][0] for i in sampling]
            positions = [plan[i][0].computed + plan[i][1] for i in sampling]
            before: list[list[int]] = []
            sample = sampling + list(range(len(plan), len(chunks)))  # the draft tokens' rows last
            with self.launching():
                self.stats.launch_wait_s += time.perf_counter() - started
                if echoing:  # [N + the echoing chunks' tokens, V]
                    logits = self.runner.forward(chunks, sample, every_token=echoing)
                    prompt_logits, logits = logits[len(sample):], logits[:len(sample)]
                else:
                    logits = self.runner.forward(chunks, sample)  # [N, V]
                if drafting:
                    rows, owners, positions, before = verified_rows([s.draft for s in lives], positions, len(sampling))
                    logits, lives = logits[torch.tensor(rows, device=logits.device)], [lives[k] for k in owners]
                tokens = sample_next(logits, lives, positions, before)
                ready = torch.cuda.Event() if tokens.is_cuda else None
                if ready is not None:
                    ready.record()
            logprobs = step_logprobs(logits, tokens, lives)
            extras = logprobs.per_row(len(lives)) if logprobs is not None else None
            if echoing:
                report_prompt_logprobs([plan[i] for i in echoing], prompt_logits, self.log_error)
            waiting, waiting_cpu = time.perf_counter(), time.thread_time()
            if ready is not None:
                self._work_until(ready)
            token_list = tokens.tolist()
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, the loop goes on
            self._fail([seq for seq, _ in plan], exc)
            return
        delivering = time.perf_counter()
        self.stats.forward_s += waiting - started
        self.stats.wait_s += delivering - waiting
        self.stats.steps += 1
        self.stats.draft_steps += bool(drafting)
        if len(sampling) != len(plan) or any(n != 1 for _, n in plan):
            self.stats.mixed_steps += 1
            self.stats.mixed_s += delivering - started
            self.stats.mixed_forward_s += waiting - started
            self.stats.mixed_forward_cpu_s += waiting_cpu - started_cpu
        for seq, n in plan:
            seq.computed += n
            if n == 1 and seq.generated > 0:
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += n
            self.kv.cache_computed(seq.kv, seq.tokens, seq.computed)
        k = 0
        for i in sampling:
            seq = plan[i][0]
            picks = len(seq.draft) + 1
            self._deliver_picks(seq, token_list[k:k + picks], extras[k:k + picks] if extras else [None] * picks)
            k += picks
        for seq, _ in plan:  # after delivery: a draft's rejected positions are no longer computed
            self.kv.slide(seq.kv, seq.computed)
        self._drop_retired()
        self.stats.deliver_s += time.perf_counter() - delivering

    def _deliver_picks(self, seq: ScheduledRequest, picks: list[int],
                       extras: list[tuple[float, dict[int, float]] | None]) -> None:
        """Deliver what `seq` picked this step: its one token, or, with a draft, the picks up to the first that differs
        from the draft (`speculative.accepted_length`) and that one; each accepted draft token's K/V is computed
        (the K/V of the rest is overwritten later: `seq.computed` stays before it, its blocks stay in its table)."""
        draft, seq.draft = seq.draft, []
        accepted = accepted_length(draft, picks) if draft else 0
        if draft and seq.drafter is not None:
            seq.drafter.verified(accepted)
            self.stats.drafted_tokens += len(draft)
            self.stats.accepted_tokens += accepted
        for j in range(accepted + 1):
            if j and (not seq.live or seq.req.cancelled):
                break
            seq.computed += j < accepted
            self._deliver(seq, picks[j], extras[j])

    def _deliver(self, seq: ScheduledRequest, token: int, extra: tuple[float, dict[int, float]] | None) -> None:
        seq.tokens.append(token)
        seq.generated += 1
        self.stats.tokens += 1
        if seq.live:
            self.kv.cache_computed(seq.kv, seq.tokens, seq.computed)
        reason = None
        mask = seq.req.token_mask
        if mask is not None and not mask.accept_token(token):
            self._fail_one(seq, EngineLimitError(f"token {token} was sampled outside its token mask"))
            return
        if token in seq.stop or (mask is not None and mask.is_terminated()):
            reason = "stop"
        elif seq.generated >= seq.req.max_tokens or len(seq.tokens) >= self.max_seq_len:
            reason = "length"
        if reason is not None:
            self._retire(seq)
            self.stats.finished += 1
        try:
            if extra is not None:
                seq.req.on_logprobs(*extra)
            seq.req.emit([token], reason)
        except Exception as exc:  # noqa: BLE001 - a broken callback must not stop the others
            self.log_error(f"request {seq.req.request_id}: emit failed: {type(exc).__name__}: {exc}")
            if reason is None:
                self._fail_one(seq, exc)
            else:
                self._tell_failed(seq.req, exc)

    def _retire(self, seq: ScheduledRequest) -> None:
        """Give `seq`'s blocks back; it leaves `running` at the next `_drop_retired`."""
        if seq.live:
            seq.live = False
            self.kv.release(seq.kv)

    def _drop_retired(self) -> None:
        if any(not seq.live for seq in self.running):
            self.running = [seq for seq in self.running if seq.live]

    def _apply_cancels(self) -> None:
        dropped = self._take_cancelled_waiting()
        dropped += [seq for seq in self.running if seq.req.cancelled]
        cancelled = RequestCancelled("the request was cancelled before it finished")
        for seq in dropped:
            self._retire(seq)
            self.stats.cancelled += 1
            self._tell_failed(seq.req, cancelled)
        self._drop_retired()

    def _fail(self, seqs: Sequence[ScheduledRequest], exc: BaseException) -> None:
        if not seqs:
            return
        self.log_error(f"step failed for {len(seqs)} requests: {type(exc).__name__}: {exc}")
        for seq in seqs:
            self._fail_one(seq, exc)
        self._drop_retired()

    def _fail_one(self, seq: ScheduledRequest, exc: BaseException) -> None:
        self._retire(seq)
        self.stats.failed += 1
        self._tell_failed(seq.req, exc)

    def _fail_live(self, exc: BaseException) -> None:
        self.ahead = None
        self._fail(list(self.running), exc)

