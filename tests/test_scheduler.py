"""The in-flight scheduler on the CPU (tiny float32 llama): same tokens as `generate`, requests admitted as live
ones finish, per-request max_tokens / stop tokens / seeds, failures isolated, the loop's lifecycle."""

from __future__ import annotations

import threading

import pytest

from serving.engine import (
    EngineLimitError,
    EngineLimits,
    SamplingParams,
    build_engine,
    convert_checkpoint,
    load_engine,
)
from serving.engine.scheduler import GenRequest, Scheduler, SchedulerStopped, collect
from tasks.tiny_model import make_tiny_model

LIMITS = EngineLimits(dtype="float32", max_batch_size=3, max_input_len=32, max_seq_len=64)
PROMPTS = [[0, 5, 6, 7], [0, 9, 10, 11, 12, 13, 14, 15], [0, 100], [0, 42, 283], [0, 7], [0, 1, 2, 3, 4, 5]]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    root = tmp_path_factory.mktemp("sched")
    ckpt = convert_checkpoint(make_tiny_model(root / "hf"), root / "ckpt", dtype="float32")
    return load_engine(build_engine(ckpt, root / "engine", limits=LIMITS).path, device="cpu")


def test_greedy_equals_generate_with_more_requests_than_slots(runner):
    """6 requests, 3 slots, unequal max_tokens: later requests join as earlier ones retire."""
    max_tokens = [5, 12, 3, 9, 7, 10]
    sched = Scheduler(runner)
    got = collect(sched, PROMPTS, max_tokens=max_tokens)
    for p, n, (ids, reason) in zip(PROMPTS, max_tokens, got):
        assert ids == runner.generate([p], max_new_tokens=n)[0].token_ids
        assert reason == "length"
    assert sched.stats.mixed_steps >= 2, "requests should be admitted in several waves"
    assert sched.stats.largest_batch == 3 and sched.live == 0


def test_stop_token_retires_early(runner):
    ref = runner.generate([PROMPTS[1]], max_new_tokens=10)[0].token_ids
    stop = ref[3]
    ids, reason = collect(Scheduler(runner), [PROMPTS[1]], max_tokens=10, stop_token_ids=[stop])[0]
    assert ids == ref[: ref.index(stop) + 1] and reason == "stop"


def test_stop_mid_flight_frees_the_slot_for_the_next_request(runner):
    """Tokens run one step ahead of the host: the step launched after a stop token is dropped, and the
    slot it frees serves a waiting request whose tokens equal `generate`; max_tokens=1 needs no decode."""
    ref = runner.generate([PROMPTS[1]], max_new_tokens=10)[0].token_ids
    stop = ref[2]
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[5]]
    max_tokens = [10, 9, 1, 8, 6]
    got = collect(Scheduler(runner), prompts, max_tokens=max_tokens, stop_token_ids=[stop])
    for p, n, (ids, reason) in zip(prompts, max_tokens, got):
        full = runner.generate([p], max_new_tokens=n)[0].token_ids
        want = full[: full.index(stop) + 1] if stop in full else full
        assert ids == want and reason == ("stop" if stop in full else "length")
    assert got[0][1] == "stop" and len(got[2][0]) == 1


def test_seeded_sampling_independent_of_batch_mates(runner):
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=7)
    alone = collect(Scheduler(runner), [PROMPTS[0]], max_tokens=12, sampling=params)[0][0]
    sched = Scheduler(runner)
    out: list[int] = []
    sched.submit(GenRequest(PROMPTS[3], 12, lambda ids, r: None, lambda e: None))  # greedy batch mate
    sched.submit(GenRequest(PROMPTS[0], 12, lambda ids, r: out.extend(ids), lambda e: None, params))
    sched.run_until_idle()
    assert out == alone
    greedy = runner.generate([PROMPTS[0]], max_new_tokens=12)[0].token_ids
    assert alone != greedy


def test_limits_checked_at_submit(runner):
    sched = Scheduler(runner)
    with pytest.raises(EngineLimitError, match="max_input_len=32"):
        sched.submit(GenRequest([1] * 33, 4, lambda *a: None, lambda e: None))
    with pytest.raises(EngineLimitError, match="max_seq_len=64"):
        sched.submit(GenRequest([1] * 30, 40, lambda *a: None, lambda e: None))
    with pytest.raises(EngineLimitError, match="vocab_size"):
        sched.submit(GenRequest([10**6], 4, lambda *a: None, lambda e: None))
    assert sched.idle()


def test_failed_step_fails_its_requests_and_loop_goes_on(runner, monkeypatch):
    sched = Scheduler(runner)
    errors: list[BaseException] = []
    calls = {"n": 0}

    def flaky(real):
        def launch(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("boom")
            return real(*args, **kwargs)
        return launch

    for name in ("forward", "forward_ahead"):
        monkeypatch.setattr(runner, name, flaky(getattr(runner, name)))
    sched.submit(GenRequest(PROMPTS[0], 8, lambda *a: None, errors.append))
    sched.run_until_idle()
    assert len(errors) == 1 and "boom" in str(errors[0])
    monkeypatch.undo()
    assert collect(sched, [PROMPTS[2]], max_tokens=4)[0][0] == runner.generate([PROMPTS[2]], max_new_tokens=4)[0].token_ids


def test_thread_streams_and_stop_fails_pending(runner):
    sched = Scheduler(runner)
    sched.start()
    done = threading.Event()
    stream: list[tuple[list[int], str | None]] = []

    def emit(ids, reason):
        stream.append((ids, reason))
        if reason:
            done.set()

    sched.submit(GenRequest(PROMPTS[4], 6, emit, lambda e: None))
    assert done.wait(30)
    assert [len(ids) for ids, _ in stream] == [1] * 6 and [r for _, r in stream] == [None] * 5 + ["length"]
    sched.stop()
    assert not sched.thread.is_alive()
    with pytest.raises(SchedulerStopped):
        sched.submit(GenRequest(PROMPTS[4], 6, emit, lambda e: None))


def test_while_waiting_work_is_done_on_the_loop_thread_and_drained_when_idle(runner):
    import collections
    import time

    pending: collections.deque = collections.deque()
    done_by: list[str] = []

    def work() -> bool:
        if not pending:
            return False
        pending.popleft()
        done_by.append(threading.current_thread().name)
        return True

    finished = threading.Event()

    def emit(ids: list[int], reason: str | None) -> None:
        pending.append(ids)
        if reason is not None:
            finished.set()

    sched = Scheduler(runner, while_waiting=work)
    sched.start(name="engine-loop")
    sched.submit(GenRequest(PROMPTS[0], 6, emit, print))
    assert finished.wait(30)
    deadline = time.monotonic() + 10
    while pending and time.monotonic() < deadline:
        time.sleep(0.01)
    sched.stop()
    assert len(done_by) == 6 and set(done_by) == {"engine-loop"}


def test_an_idle_loop_runs_drain_instead_of_while_waiting_and_counts_where_its_time_went(runner):
    import time

    drained_by: list[str] = []
    waited: list[str] = []
    finished = threading.Event()

    def while_waiting() -> bool:
        waited.append("asked")
        return False

    sched = Scheduler(runner, while_waiting=while_waiting,
                      drain=lambda: drained_by.append(threading.current_thread().name))
    sched.start(name="engine-loop")
    time.sleep(0.2)  # idle: drains once, then waits for work
    sched.submit(GenRequest(PROMPTS[0], 4, lambda ids, reason: reason and finished.set(), print))
    assert finished.wait(30)
    sched.stop()
    assert drained_by and set(drained_by) == {"engine-loop"}
    stats = sched.stats
    assert stats.mixed_s > 0 and stats.drain_s >= 0
    assert stats.mixed_forward_s <= stats.forward_s <= stats.busy_s
    assert waited  # asked while a step ran (GPU) or after each step (CPU): the drain replaces only the idle loop


def test_cancel_frees_the_slot_of_a_live_request_and_drops_a_waiting_one(runner):
    from serving.engine.scheduler import RequestCancelled

    sched = Scheduler(runner)  # 3 slots
    out: dict[int, list[int]] = {i: [] for i in range(5)}
    failed: dict[int, BaseException] = {}
    reqs = []
    for i in range(5):
        def emit(ids, reason, i=i):
            out[i].extend(ids)

        def fail(exc, i=i):
            failed[i] = exc

        reqs.append(GenRequest(PROMPTS[i], 12, emit, fail))
        sched.submit(reqs[-1])
    for _ in range(4):
        sched.step()
    sched.cancel(reqs[1])  # live, mid-flight
    sched.cancel(reqs[4])  # still waiting for a slot
    sched.run_until_idle()
    assert set(failed) == {1, 4} and all(isinstance(e, RequestCancelled) for e in failed.values())
    assert 0 < len(out[1]) < 12 and out[4] == []
    for i in (0, 2, 3):  # request 3 got the cancelled one's slot
        assert out[i] == runner.generate([PROMPTS[i]], max_new_tokens=12)[0].token_ids
    assert sched.stats.cancelled == 2 and sched.stats.failed == 0


@pytest.mark.parametrize("gap_s, together", [(0.3, True), (0.0, False)])
def test_an_idle_engine_admits_a_burst_of_arrivals_together_only_with_an_admit_gap(runner, gap_s, together):
    """Three requests arrive 40 ms apart at an idle engine: with a 300 ms gap they are prefilled in one
    call and decode in step; without one the first starts alone."""
    import time

    finished = threading.Semaphore(0)
    sched = Scheduler(runner, admit_gap_s=gap_s)  # 3 slots
    sched.start(name="engine-loop")
    try:
        for prompt in PROMPTS[:3]:
            sched.submit(GenRequest(prompt, 3, lambda ids, reason: reason and finished.release(), print))
            time.sleep(0.04)
        for _ in range(3):
            assert finished.acquire(timeout=30)
    finally:
        sched.stop()
    assert (sched.stats.mixed_steps == 1) is together
    # It waited out the arrivals 40 ms apart: the third came 80 ms after the first was submitted, and the loop
    # starts gathering when it wakes to the first (CI measured 79 ms), so half of that tells the two apart.
    assert (sched.stats.gather_s >= 0.04) is together


def test_a_lone_request_at_an_idle_engine_waits_one_gap(runner):
    finished = threading.Event()
    sched = Scheduler(runner, admit_gap_s=0.1)
    sched.start(name="engine-loop")
    try:
        sched.submit(GenRequest(PROMPTS[0], 2, lambda ids, reason: reason and finished.set(), print))
        assert finished.wait(30)
    finally:
        sched.stop()
    assert 0.1 <= sched.stats.gather_s < 0.5 and sched.stats.mixed_steps == 1


@pytest.mark.parametrize("every, second_prompt, admitted_at", [(4, [0, 100], 5), (1, [0, 100], 2),
                                                            (50, list(range(15)), 2)],
                         ids=["trickle-held", "every-step", "fills-the-budget"])
def test_a_busy_engine_admits_a_trickle_at_most_every_admit_every_steps(runner, every, second_prompt,
                                                                               admitted_at):
    """One request live, one arrives: a short prompt waits until `admit_every_steps` steps have passed since the
    last admission (a step with a prompt chunk is launched op by op; a trickle of them would make every step
    one), one that fills the step's token budget beside the live decode (16 - 1 tokens) joins at the next
    step; its tokens are the same either way."""
    from serving.engine.kv_cache import KVCacheConfig
    from serving.engine.runner import load_engine
    from serving.engine.scheduler import Scheduler

    engine = load_engine(runner.info.path, device="cpu", config=KVCacheConfig(8, 32, max_num_tokens=16))
    sched = Scheduler(engine, admit_every_steps=every)
    got: dict[str, list[int]] = {"a": [], "b": []}
    sched.submit(GenRequest(PROMPTS[0], 12, lambda ids, r: got["a"].extend(ids), print))
    sched.step()
    sched.submit(GenRequest(second_prompt, 4, lambda ids, r: got["b"].extend(ids), print))
    steps = 1
    while sched.stats.admitted < 2:
        sched.step()
        steps += 1
    assert steps == admitted_at and (sched.stats.held > 0) == (admitted_at > 2)
    sched.run_until_idle()
    assert got["a"] == runner.generate([PROMPTS[0]], max_new_tokens=12)[0].token_ids
    assert got["b"] == runner.generate([second_prompt], max_new_tokens=4)[0].token_ids


@pytest.mark.parametrize("bad", [0, -2, 1.5])
def test_a_bad_admit_every_steps_is_refused_by_name(runner, bad):
    with pytest.raises(ValueError, match=f"admit_every_steps={bad}"):
        Scheduler(runner, admit_every_steps=bad)


def test_a_negative_admit_gap_is_refused_by_name(runner):
    with pytest.raises(ValueError, match="admit_gap_s=-1"):
        Scheduler(runner, admit_gap_s=-1)


def test_the_queue_limit_and_the_lifecycle(runner):
    """`scheduler_loop.SchedulerLoop`: a request past `max_waiting` is refused as overloaded and
    nothing is queued; a request streams on the loop's thread; stop() fails what still waits, joins the
    thread and refuses what comes after."""
    from serving.engine.kv_cache import KVCacheConfig
    from serving.engine.runner import load_engine
    from serving.engine.scheduler import Scheduler, SchedulerFull

    engine = load_engine(runner.info.path, device="cpu", config=KVCacheConfig(8, 16, max_num_tokens=16))
    make = Scheduler
    failed: list[BaseException] = []
    sched = make(engine, max_waiting=1)
    sched.submit(GenRequest(PROMPTS[0], 4, lambda ids, r: None, failed.append))
    setting = "kv_cache.max_waiting=1"
    with pytest.raises(SchedulerFull, match=rf"resource exhausted: 1 requests already wait for admission \({setting}; "):
        sched.submit(GenRequest(PROMPTS[1], 4, lambda ids, r: None, failed.append))
    assert len(sched.waiting) == 1
    sched.run_until_idle()
    done = threading.Event()
    sched.start()
    sched.submit(GenRequest(PROMPTS[2], 3, lambda ids, r: r and done.set(), failed.append))
    assert done.wait(30) and not failed
    sched.stop()
    assert not sched.thread.is_alive()
    with pytest.raises(SchedulerStopped):
        sched.submit(GenRequest(PROMPTS[2], 3, lambda ids, r: None, failed.append))
    idle = make(engine)
    idle.submit(GenRequest(PROMPTS[3], 3, lambda ids, r: None, failed.append))
    idle.stop()  # never started: fails the waiting request on this thread
    assert [type(e) for e in failed] == [SchedulerStopped] and idle.idle()


def test_the_tighter_of_two_queue_limits_holds_and_names_its_setting(runner):
    """Triton's llm passes the release's `max_queue_size` on (`limit_waiting`); a looser one changes nothing."""
    from serving.engine.scheduler import SchedulerFull

    sched = Scheduler(runner, max_waiting=3)
    sched.limit_waiting(5, "max_queue_size")
    assert (sched.max_waiting, sched.max_waiting_setting) == (3, "kv_cache.max_waiting")
    sched.limit_waiting(1, "max_queue_size")
    sched.submit(GenRequest(PROMPTS[0], 4, lambda ids, r: None, lambda exc: None))
    with pytest.raises(SchedulerFull, match=r"1 requests already wait for admission \(max_queue_size=1; "):
        sched.submit(GenRequest(PROMPTS[1], 4, lambda ids, r: None, lambda exc: None))
    with pytest.raises(ValueError, match="max_queue_size=0 must be >= 1"):
        sched.limit_waiting(0, "max_queue_size")
    sched.stop()


def test_work_until_fills_the_devices_time_with_other_work_but_never_all_of_it(runner):
    """`_work_until(ready)`: items run while the event is not done, at least one, none past it (a step
    never waits for every pending send: the paged scheduler at 1,024 streams did and ran at the senders'
    pace); with nothing to do it returns at once."""

    class Event:
        def __init__(self, busy_polls: int) -> None:
            self.busy_polls = busy_polls

        def query(self) -> bool:
            self.busy_polls -= 1
            return self.busy_polls < 0

    for busy_polls, pending, want in ((3, 10, 4), (0, 10, 1), (5, 2, 2), (3, 0, 0)):
        left = [pending]

        def work(left: list[int] = left) -> bool:
            if not left[0]:
                return False
            left[0] -= 1
            return True

        Scheduler(runner, while_waiting=work)._work_until(Event(busy_polls))
        assert pending - left[0] == want, (busy_polls, pending)


def test_work_until_hands_the_wait_to_work_while_when_set(runner):
    """With `work_while` set (Triton's llm model with several busy senders), `_work_until` hands it a busy
    predicate that is true until the event is done, and runs no `while_waiting` item itself."""

    class Event:
        polls = 2

        def query(self) -> bool:
            self.polls -= 1
            return self.polls < 0

    seen: list[bool] = []
    sched = Scheduler(runner, while_waiting=lambda: seen.append(None) or True)

    def work_while(busy) -> None:
        while busy():
            seen.append(True)
        seen.append(False)

    sched.work_while = work_while
    sched._work_until(Event())
    assert seen == [True, True, False]


def test_an_asynchronous_loop_launches_every_step_holding_the_lock_the_intake_waits_for(runner, monkeypatch):
    """On CUDA (here: a loop told it is not synchronous) every launch of a step (prefill, decode, a paged
    mixed step) runs inside `launching()`, and `between_launches()` (Triton's request intake) waits while it
    is held; a synchronous loop (the CPU's) and `exclusive_launch = False` take no lock at all."""
    from serving.engine.kv_cache import KVCacheConfig
    from serving.engine.runner import load_engine
    from serving.engine.scheduler import Scheduler

    engine = load_engine(runner.info.path, device="cpu", config=KVCacheConfig(8, 16, max_num_tokens=16))
    make, launches = Scheduler, ("forward", "forward_ahead")
    monkeypatch.setattr(make, "synchronous", property(lambda self: False))
    sched = make(engine)
    held: list[bool] = []
    for name in launches:
        launch = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, _launch=launch, **k: held.append(sched._launch_lock.locked())
                            or _launch(*a, **k))
    done: list[str] = []
    for prompt in PROMPTS[:2]:
        sched.submit(GenRequest(prompt, 3, lambda ids, r: r and done.append(r), lambda e: None))
    sched.run_until_idle()
    assert done == ["length", "length"]
    assert len(held) >= 3 and all(held), held

    entered = threading.Event()

    def intake() -> None:
        with sched.between_launches():
            entered.set()

    with sched.launching():
        thread = threading.Thread(target=intake)
        thread.start()
        assert not entered.wait(0.2), "the intake ran while a step launched"
    assert entered.wait(5)
    thread.join(5)
    sched.exclusive_launch = False
    with sched.launching(), sched.between_launches():
        pass  # no lock: this would deadlock otherwise
    monkeypatch.undo()
    cpu = make(engine)
    assert cpu.synchronous
    with cpu.launching(), cpu.between_launches():
        pass


def test_a_loop_that_fails_answers_every_request_and_refuses_new_ones(runner, monkeypatch):
    """An error escaping a step (a bug, a failed device) ends the loop, but not silently: the requests it held,
    waiting and live, fail with EngineLoopFailed naming the error, and later submits are refused naming it too,
    so no client waits forever on a dead engine thread."""
    from serving.engine.kv_cache import KVCacheConfig
    from serving.engine.runner import load_engine
    from serving.engine.scheduler import Scheduler
    from serving.engine.scheduler_loop import EngineLoopFailed

    engine = load_engine(runner.info.path, device="cpu", config=KVCacheConfig(8, 16, max_num_tokens=16))
    sched = Scheduler(engine)
    steps = 0
    step = type(sched).step

    def breaking(self) -> None:
        nonlocal steps
        steps += 1
        if steps == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        step(self)

    monkeypatch.setattr(type(sched), "step", breaking)
    failures: list[BaseException] = []
    done = threading.Event()
    for prompt in PROMPTS[:3]:
        sched.submit(GenRequest(prompt, 20, lambda ids, r: None,
                                lambda e: failures.append(e) or (len(failures) == 3 and done.set())))
    errors: list[str] = []
    sched.log_error = errors.append
    sched.start()
    assert done.wait(10), failures
    sched.thread.join(5)
    assert not sched.thread.is_alive()
    assert all(isinstance(e, EngineLoopFailed) and "illegal memory access" in str(e) for e in failures), failures
    assert errors and "the scheduler loop failed: RuntimeError" in errors[0]
    with pytest.raises(SchedulerStopped, match="engine loop failed .*illegal memory access.*request not accepted"):
        sched.submit(GenRequest(PROMPTS[0], 2, lambda ids, r: None, lambda e: None))
