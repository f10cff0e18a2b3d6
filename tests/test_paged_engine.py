"""The paged KV cache on the CPU (tiny float32 llama): greedy tokens equal the reference forward's
(`tests.engine_reference`) with chunked prefill, more requests than fit at once and preemption; blocks given
back; the validation gate passes on it; impossible sizes refused with the numbers."""

from __future__ import annotations

import dataclasses
import itertools
import random
import re

import pytest
from engine_reference import ReferenceEngine

from serving.engine import EngineLimitError, EngineLimits, build_engine, convert_checkpoint, load_engine
from serving.engine.kv_cache import (
    BlockAllocator,
    KVCacheConfig,
    blocks_for,
    blocks_from_memory,
    check_kv_cache_config,
)
from serving.engine.sampling import SamplingParams
from serving.engine.scheduler import GenRequest, RequestCancelled, Scheduler, collect
from tasks.tiny_model import make_tiny_model

LIMITS = EngineLimits(dtype="float32", max_batch_size=4, max_input_len=40, max_seq_len=80)
# 8-position blocks; the pool holds 160 positions (two sequences of max_seq_len), each step 24 tokens
CONFIG = KVCacheConfig(block_size=8, num_blocks=20, max_num_tokens=24)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("paged")
    hf = make_tiny_model(root / "hf")
    ckpt = convert_checkpoint(hf, root / "ckpt", dtype="float32")
    engine = build_engine(ckpt, root / "engine", limits=LIMITS).path
    return hf, engine, ReferenceEngine(load_engine(engine, device="cpu")), load_engine(engine, config=CONFIG, device="cpu")


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(1, 512) for _ in range(rnd.randrange(1, LIMITS.max_input_len + 1))] for _ in range(n)]


def test_greedy_tokens_equal_the_reference_past_the_kv_budget(engines):
    """8 mixed-length requests (1-40 tokens, 24 new each): together they need more blocks than the pool of 20 and
    more live requests than the cap of 4, prompts longer than the step's budget prefill in chunks, and live
    requests get preempted when blocks run out: every one finishes with the reference forward's tokens."""
    _, _, reference, paged = engines
    prompts, max_tokens = _prompts(8), 24
    assert sum(blocks_for(len(p) + max_tokens, CONFIG.block_size) for p in prompts) > CONFIG.num_blocks
    sched = Scheduler(paged)
    got = collect(sched, prompts, max_tokens=max_tokens)
    want = reference.generate(prompts, max_new_tokens=max_tokens)
    for i, ((ids, reason), ref) in enumerate(zip(got, want)):
        assert ids == ref.token_ids, f"request {i} ({len(prompts[i])} prompt tokens) diverged"
        assert reason == "length"
    s = sched.stats
    assert s.finished == 8 and s.failed == 0 and s.preempted > 0 and s.admitted == 8 + s.preempted
    assert s.largest_batch <= 4 and s.peak_blocks <= CONFIG.num_blocks
    assert paged.allocator.free == CONFIG.num_blocks, "finished requests give their blocks back"
    assert paged.decode.steps > 0, "steps of decodes only went through cuda_graphs"
    assert 0 < s.ahead_steps < s.steps, "some decode steps ran one step ahead, the others synchronously"


def test_one_step_ahead_delivers_what_the_synchronous_steps_do(engines):
    """Decode steps launched from the device's unread samples: the same tokens and finish reasons as steps that
    wait for their tokens, through stop tokens met while the next step already runs (its token for a finished
    request is dropped), length finishes, preemptions and a cancel; every block given back."""
    _, _, reference, paged = engines
    prompts = _prompts(8, seed=3)
    plain = reference.generate(prompts, max_new_tokens=20)
    stops = sorted({ref.token_ids[j] for ref in plain[:4] for j in (3, 9)})  # tokens some requests meet early
    runs = []
    for ahead in (True, False):
        sched = Scheduler(paged, step_ahead=ahead)
        done: dict[int, tuple[list[int], str | None]] = {}

        def emitter(i: int, done: dict = done):
            def emit(ids: list[int], reason: str | None) -> None:
                got = done.setdefault(i, ([], None))[0]
                got.extend(ids)
                done[i] = (got, reason)
            return emit

        failed: list[BaseException] = []
        reqs = [GenRequest(p, 20, emitter(i), failed.append, stop_token_ids=stops) for i, p in enumerate(prompts)]
        for req in reqs:
            sched.submit(req)
        for _ in range(6):
            sched.step()
        sched.cancel(reqs[7])
        sched.run_until_idle()
        runs.append((done, [type(e).__name__ for e in failed], sched.stats))
        assert paged.allocator.free == CONFIG.num_blocks
    (ahead, ahead_failed, a), (sync, sync_failed, b) = runs
    assert a.ahead_steps > 0 and b.ahead_steps == 0
    assert ahead_failed == sync_failed == ["RequestCancelled"]
    assert {i: v for i, v in ahead.items() if i != 7} == {i: v for i, v in sync.items() if i != 7}
    assert any(reason == "stop" for _, reason in ahead.values()) and any(r == "length" for _, r in ahead.values())


class _EvenTokensThenEnd:
    """A token mask: only even token ids, and the grammar is complete after `length` tokens."""

    def __init__(self, length: int) -> None:
        self.length, self.accepted = length, []

    def fill_next_token_bitmask(self, bitmask, index: int) -> None:
        bitmask[index] = 0x55555555  # bits 0, 2, 4, ... of every word: the even ids

    def accept_token(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return token_id % 2 == 0

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


def test_steps_ahead_sample_host_read_rows_after_their_tokens_land(engines):
    """Requests whose sampling reads their tokens on the host (a token mask that ends the grammar mid-run, a
    repetition penalty, min_tokens) beside plain ones: decode steps still run one step ahead, sampled once the
    previous tokens are delivered, and every request gets what synchronous steps give it."""
    _, _, _, paged = engines
    prompts = _prompts(4, seed=5)
    runs = []
    for ahead in (True, False):
        sched = Scheduler(paged, step_ahead=ahead)
        masks = [_EvenTokensThenEnd(7), _EvenTokensThenEnd(30)]
        shaped = [(None, masks[0]), (SamplingParams(temperature=0.0, repetition_penalty=1.3), None),
                  (SamplingParams(temperature=0.8, seed=11, min_tokens=12), masks[1]), (None, None)]
        done: dict[int, list[int]] = {i: [] for i in range(4)}
        reasons: dict[int, str | None] = {}

        def emitter(i: int, done: dict = done, reasons: dict = reasons):
            def emit(ids: list[int], reason: str | None) -> None:
                done[i].extend(ids)
                reasons[i] = reason
            return emit

        failed: list[BaseException] = []
        for i, (prompt, (params, mask)) in enumerate(zip(prompts, shaped)):
            sched.submit(GenRequest(prompt, 20, emitter(i), failed.append, sampling=params, token_mask=mask))
        sched.run_until_idle()
        assert not failed and paged.allocator.free == CONFIG.num_blocks
        assert all(t % 2 == 0 for t in done[0] + done[2]), "masked rows sampled only allowed tokens"
        runs.append((done, reasons, sched.stats))
    (ahead_done, ahead_reasons, a), (sync_done, sync_reasons, b) = runs
    # once the prompts are in, every decode step but the last runs ahead (none did while such a row lived)
    assert a.ahead_steps >= a.steps - 6 and b.ahead_steps == 0
    assert ahead_done == sync_done and ahead_reasons == sync_reasons
    assert ahead_reasons[0] == "stop" and len(ahead_done[0]) == 7, "the grammar ended while a step ran ahead"


def test_chunked_prefill_of_a_long_prompt_mixed_with_decodes(engines):
    """A 40-token prompt arrives while another request decodes: with 24 tokens a step it prefills in two
    chunks beside the decode, and both keep the reference forward's tokens."""
    _, _, reference, paged = engines
    short, long_prompt = [5, 6, 7], _prompts(1, seed=3)[0][:1] * 40
    sched = Scheduler(paged)
    out: dict[str, list[int]] = {"short": [], "long": []}
    sched.submit(GenRequest(short, 12, lambda ids, r: out["short"].extend(ids), lambda e: None))
    sched.step()  # the short one is prefilled and decodes from here on
    sched.submit(GenRequest(long_prompt, 6, lambda ids, r: out["long"].extend(ids), lambda e: None))
    sched.run_until_idle()
    assert out["short"] == reference.generate([short], max_new_tokens=12)[0].token_ids
    assert out["long"] == reference.generate([long_prompt], max_new_tokens=6)[0].token_ids
    assert sched.stats.prefill_tokens >= 43 and sched.stats.preempted == 0


def test_generate_logprobs_stop_tokens_and_prefill_logits_match_the_reference(engines):
    _, _, reference, paged = engines
    prompts = _prompts(3, seed=1)
    ref = reference.generate(prompts, max_new_tokens=10, top_logprobs=3)
    stop = ref[0].token_ids[4]
    ref = reference.generate(prompts, max_new_tokens=10, top_logprobs=3, stop_token_ids=[stop])
    got = paged.generate(prompts, max_new_tokens=10, top_logprobs=3, stop_token_ids=[stop])
    for g, r in zip(got, ref):
        assert g.token_ids == r.token_ids and g.finish_reason == r.finish_reason
        assert g.logprobs == pytest.approx(r.logprobs, abs=1e-4)
        assert [sorted(t) for t in g.top_logprobs] == [sorted(t) for t in r.top_logprobs]
    assert got[0].finish_reason == "stop"
    seq = prompts[0] + ref[0].token_ids
    assert (paged.prefill_logits(seq) - reference.prefill_logits(seq)).abs().max() < 1e-4
    assert paged.allocator.free == CONFIG.num_blocks


def test_validation_gate_passes_on_a_pool_smaller_than_the_requests(engines):
    from tasks.validate import ValidationSpec, reference_run, validate_engine

    hf, engine, _, paged = engines
    spec = ValidationSpec(prompts=["Once upon a time", "The quick brown"], max_new_tokens=6,
                          passages=["The quick brown fox jumps over the lazy dog."])
    reference = reference_run(hf, spec, "float32", max_seq_len=LIMITS.max_seq_len)
    on_paged = validate_engine(engine, hf, spec, reference=reference, runner=paged)
    assert on_paged.passed, on_paged.failures
    assert on_paged.top1_agreement == 1.0


def test_cancel_frees_blocks_and_a_request_that_can_never_fit_is_refused_at_submit(engines):
    _, _, _, paged = engines
    sched = Scheduler(paged)
    failed: list[BaseException] = []
    req = GenRequest([1, 2, 3], 30, lambda ids, r: None, failed.append)
    sched.submit(req)
    sched.step()
    assert paged.allocator.free < CONFIG.num_blocks
    sched.cancel(req)
    sched.step()
    assert isinstance(failed[0], RequestCancelled) and paged.allocator.free == CONFIG.num_blocks
    with pytest.raises(EngineLimitError, match="max_tokens=79 > limits.max_seq_len=80"):
        sched.submit(GenRequest([1, 2], 79, lambda ids, r: None, failed.append))
    assert sched.idle()


def test_impossible_paged_sizes_are_refused_with_the_numbers(engines):
    _, engine, _, _ = engines
    with pytest.raises(EngineLimitError, match=r"has 9 blocks of 8 positions .* limits.max_seq_len=80 needs 10 blocks"):
        load_engine(engine, config=KVCacheConfig(block_size=8, num_blocks=9), device="cpu")
    with pytest.raises(EngineLimitError, match=r"kv_cache.free_mem_fraction=0.5 sizes the cache from CUDA's free "
                       r"memory, which device cpu does not have"):
        load_engine(engine, config=KVCacheConfig(free_mem_fraction=0.5), device="cpu")
    with pytest.raises(EngineLimitError, match=r"max_num_tokens=4 is smaller than one block \(kv_cache.block_size=8\)"):
        check_kv_cache_config(KVCacheConfig(block_size=8, max_num_tokens=4), num_blocks=100, max_seq_len=80,
                           max_batch_size=1, block_bytes=1)
    with pytest.raises(EngineLimitError, match="max_num_tokens=64 < limits.max_batch_size=128"):
        check_kv_cache_config(KVCacheConfig(block_size=8, max_num_tokens=64), num_blocks=100, max_seq_len=80,
                           max_batch_size=128, block_bytes=1)


def test_block_allocator_and_sizing_arithmetic():
    alloc = BlockAllocator(4)
    first = alloc.take(3)
    assert first == [0, 1, 2] and alloc.free == 1 and alloc.take(2) is None and alloc.free == 1
    alloc.give_back(first[:2])
    assert alloc.used == 1
    with pytest.raises(ValueError, match="block 0 is not taken"):
        alloc.give_back([0])
    assert blocks_for(1, 8) == 1 and blocks_for(8, 8) == 1 and blocks_for(9, 8) == 2
    # Llama-3.1-8B bf16, 32-position blocks: 4 MiB a block; 90% of 100 GiB free -> 23,040 blocks (737,280 tokens)
    block = 2 * 32 * 8 * 128 * 32 * 2
    assert block == 4 << 20 and blocks_from_memory(100 << 30, 0.9, block) == 23040


def test_spec_refuses_impossible_kv_cache_limits_and_the_build_records_them(engines, tmp_path):
    from pydantic import ValidationError

    from serving.engine import read_engine_info
    from tasks.engine_spec import EngineSpec

    with pytest.raises(ValidationError, match=r"kv_cache.num_blocks \(7\) x block_size \(32\) = 224 positions cannot "
                       r"hold one sequence of max_seq_len \(256, 8 blocks\)"):
        EngineSpec(max_seq_len=256, kv_cache={"num_blocks": 7})
    with pytest.raises(ValidationError, match=r"kv_cache.max_num_tokens \(512\) < max_batch_size \(1024\)"):
        EngineSpec(max_batch_size=1024, kv_cache={"max_num_tokens": 512})
    with pytest.raises(ValidationError, match=r"`paged` was renamed `kv_cache`.*engine.kv_cache"):
        EngineSpec(paged={"block_size": 16})
    assert EngineSpec().kv_cache.block_size == 32 and EngineSpec().kv_cache.num_blocks is None
    _, engine, _, _ = engines
    ckpt = engine.parent / "ckpt"
    with pytest.raises(EngineLimitError, match="kv_cache.max_num_tokens=2 < limits.max_batch_size=4"):
        build_engine(ckpt, tmp_path / "bad", limits=LIMITS, kv_cache=KVCacheConfig(block_size=1, max_num_tokens=2))
    built = build_engine(ckpt, tmp_path / "paged", limits=LIMITS, kv_cache=CONFIG)
    assert built.kv_cache == CONFIG and read_engine_info(built.path).kv_cache == CONFIG
    assert read_engine_info(engine).kv_cache == KVCacheConfig() and built.fingerprint != read_engine_info(engine).fingerprint
    assert load_engine(built.path, device="cpu").num_blocks == CONFIG.num_blocks
    # by default the pool has the room of max_batch_size sequences of max_seq_len: 4 x 80 / 32 -> 4 x 3 blocks
    assert load_engine(engine, device="cpu").num_blocks == 4 * blocks_for(80, 32)


def test_an_engine_folder_of_an_earlier_release_loads_with_its_kv_cache_mapped(engines, tmp_path):
    """engine.json of the release before `kv_cache`: one with `paged` loads with those settings, one with neither
    (the static cache) loads with a pool of that cache's room; both keep their fingerprint."""
    import json
    import shutil

    from serving.engine import read_engine_info, verify_engine
    from serving.engine.build import compute_fingerprint

    _, engine, reference, _ = engines
    prompt = [0, 5, 6, 7]
    want = reference.generate([prompt], max_new_tokens=8)[0].token_ids
    for name, record in (("paged", {"block_size": 8, "num_blocks": 20, "free_mem_fraction": 0.9,
                                    "max_num_tokens": 24, "max_waiting": None}), ("static", None)):
        old = tmp_path / name
        shutil.copytree(engine, old)
        d = json.loads((old / "engine.json").read_text())
        del d["kv_cache"]
        if record is not None:
            d["paged"] = record
        d["fingerprint"] = compute_fingerprint(d)
        (old / "engine.json").write_text(json.dumps(d))
        info = verify_engine(old)
        runner = load_engine(old, device="cpu")
        if record is not None:
            assert info.kv_cache == KVCacheConfig(block_size=8, num_blocks=20, free_mem_fraction=0.9, max_num_tokens=24)
            assert runner.num_blocks == 20
        else:
            assert info.kv_cache == KVCacheConfig() and runner.num_blocks == 4 * blocks_for(80, 32)
        assert runner.generate([prompt], max_new_tokens=8)[0].token_ids == want
        assert read_engine_info(old).fingerprint == d["fingerprint"]


def test_release_build_step_carries_the_kv_cache_settings(engines, tmp_path):
    """tasks.build: a spec's KV-cache settings reach engine.json and get a build key of their own."""
    from tasks.build import build
    from tasks.convert import convert
    from tasks.engine_spec import EngineSpec

    hf = engines[0]
    limits = {"dtype": "float32", "max_batch_size": 4, "max_input_len": 40, "max_seq_len": 80}
    default = EngineSpec(**limits)
    sized = EngineSpec(**limits, kv_cache={"block_size": 8, "num_blocks": 20, "max_num_tokens": 24})
    converted = convert(hf, default, tmp_path)
    on_default, on_sized = build(converted, default, tmp_path).info, build(converted, sized, tmp_path).info
    assert on_default.kv_cache == KVCacheConfig() and on_sized.kv_cache == CONFIG
    assert on_default.path != on_sized.path
    assert '"kv_cache"' in (on_default.path / "engine.json").read_text()


def test_throughput_bench_serves_every_request_on_both_sides(tmp_path):
    """`bench throughput` on the tiny shape (CPU): the engine with and without its step ahead deliver every
    requested token and report percentiles, under a pool smaller than the requests' total."""
    import json

    from bench.throughput import ThroughputConfig, bench_throughput, workload

    cfg = ThroughputConfig(shape="tiny", requests=6, input_len=8, output_len=4, spread=0.5,
                           sides=("engine", "engine-sync"), max_live=4, block_size=4, max_num_tokens=16,
                           num_blocks=6, warmup_requests=0)
    report = bench_throughput(cfg, device="cpu", out_json=tmp_path / "t.json", progress=lambda line: None)
    want = sum(n for _, n in workload(cfg, 512))
    assert [s.side for s in report.sides] == ["engine", "engine-sync"]
    for side in report.sides:
        assert side.output_tokens == want and side.output_tok_s > 0 and side.ttft_ms["p50"] <= side.ttft_ms["p99"]
        assert side.largest_batch <= 4
    assert json.loads((tmp_path / "t.json").read_text())["sides"][1]["side"] == "engine-sync"


@pytest.mark.parametrize("method", ["fp8", "int8-weight-only"])
def test_throughput_bench_runs_the_engine_on_quantized_weights(method):
    """`bench throughput --quantization`: the engine runs the quantized linears (the CPU's dequantizing path)
    and delivers every token."""
    from unittest import mock

    from bench.throughput import ThroughputConfig, bench_throughput, workload
    from serving.engine.linear_quantized import QuantLinear

    cfg = ThroughputConfig(shape="tiny", requests=4, input_len=6, output_len=3, max_live=4,
                           block_size=4, max_num_tokens=16, num_blocks=12, warmup_requests=0, quantization=method)
    seen: set[str] = set()
    reference = QuantLinear.reference

    def counted(layer: QuantLinear, x):
        seen.add(layer.method)
        return reference(layer, x)

    with mock.patch.object(QuantLinear, "reference", counted):
        report = bench_throughput(cfg, device="cpu", progress=lambda line: None)
    assert seen == {method}
    want = sum(n for _, n in workload(cfg, 512))
    assert [s.output_tokens for s in report.sides] == [want]
    assert report.config["quantization"] == method


def test_throughput_bench_on_an_fp8_kv_cache():
    """`bench throughput --kv-cache-dtype fp8`: the engine's pool is e4m3 and serves every token."""
    from unittest import mock

    from bench.throughput import ThroughputConfig, bench_throughput, workload
    from serving.engine.kv_cache import KV_FP8_DTYPE, PagedKVCache

    pools: list = []
    made = PagedKVCache.__init__

    def spy(self, **kw):
        made(self, **kw)
        pools.append(self.k[0].dtype)

    cfg = ThroughputConfig(shape="tiny", requests=4, input_len=6, output_len=3, max_live=4,
                           block_size=4, max_num_tokens=16, num_blocks=12, warmup_requests=0, kv_cache_dtype="fp8")
    with mock.patch.object(PagedKVCache, "__init__", spy):
        report = bench_throughput(cfg, device="cpu", progress=lambda line: None)
    assert pools == [KV_FP8_DTYPE]
    assert report.sides[0].output_tokens == sum(n for _, n in workload(cfg, 512))


def test_throughput_bench_at_a_poisson_rate_reports_goodput_against_slos():
    """`--request-rate`: requests arrive over time in a seeded Poisson process (the run lasts at least until the
    last arrival, TTFT counts from each request's own submit), both sides (the engine with and without its step
    ahead) serve them all on their own thread;
    `--goodput`: every request meets SLOs no request can miss, none meets a TTFT SLO none can meet."""
    import statistics

    from bench.throughput import (
        ThroughputConfig,
        arrivals,
        bench_throughput,
        met_slos,
        parse_slos,
        workload,
    )

    gaps = [b - a for a, b in itertools.pairwise(arrivals(ThroughputConfig(request_rate=50.0), 2000))]
    assert statistics.mean(gaps) == pytest.approx(0.02, rel=0.1) and min(gaps) >= 0
    assert arrivals(ThroughputConfig(), 3) == [0.0, 0.0, 0.0]
    assert parse_slos("ttft:500, tpot:50") == {"ttft": 500.0, "tpot": 50.0} and parse_slos("") == {}
    for bad, says in (("itl:5", "unknown SLO 'itl'"), ("ttft:x", "needs a number"), ("tpot:0", "more than 0")):
        with pytest.raises(ValueError, match=says):
            parse_slos(bad)
    assert met_slos(10.0, None, 20.0, 1.0) and not met_slos(10.0, 2.0, 20.0, 1.0) and met_slos(10.0, 2.0, None, None)

    base = {"shape": "tiny", "requests": 10, "input_len": 8, "output_len": 4, "sides": ("engine", "engine-sync"),
            "max_live": 4,
            "block_size": 4, "max_num_tokens": 16, "num_blocks": 16, "warmup_requests": 0, "request_rate": 25.0}
    last = arrivals(ThroughputConfig(**base), 10)[-1]
    want = sum(n for _, n in workload(ThroughputConfig(**base), 512))
    easy = bench_throughput(ThroughputConfig(**base, slo_ttft_ms=60_000, slo_tpot_ms=60_000), device="cpu",
                            progress=lambda line: None)
    for side in easy.sides:
        assert side.output_tokens == want and side.wall_s >= last
        assert side.met_slo == 10 and side.goodput_per_s == pytest.approx(10 / side.wall_s)
        assert side.ttft_ms["p50"] < last * 1e3 / 4, "TTFT counts from each request's own arrival"
    hard = bench_throughput(ThroughputConfig(**base, slo_ttft_ms=1e-6), device="cpu", progress=lambda line: None)
    assert [s.met_slo for s in hard.sides] == [0, 0] and all(s.goodput_per_s == 0 for s in hard.sides)


def test_1024_live_requests_at_max_seq_len_8192_on_the_h200s_pool():
    """Admission by blocks at the issue's scale, scheduling only (a stand-in forward): with max_seq_len 8192,
    1,024 requests of 128/128 and the pool the H200 run sized for Llama-3.1-8B (21,251 blocks of 32; a static
    cache of that memory holds 83 rows of 8192), every request is live at once."""
    from types import SimpleNamespace

    import torch

    from serving.engine.options import EngineOptions

    live = 1024
    runner = SimpleNamespace(
        info=SimpleNamespace(limits=SimpleNamespace(max_input_len=4096, max_seq_len=8192),
                             model=SimpleNamespace(vocab_size=8, kv_window=None)),
        max_live=live, config=KVCacheConfig(block_size=32, num_blocks=21251, max_num_tokens=8192),
        allocator=BlockAllocator(21251), device=torch.device("cpu"),
        forward=lambda chunks, sample: torch.zeros(len(sample), 8), model=SimpleNamespace(options=EngineOptions()))
    assert 21251 * 32 // 8192 == 83
    sched = Scheduler(runner)
    for _ in range(live):
        sched.submit(GenRequest([1] * 128, 20, lambda ids, reason: None, lambda exc: None))
    sched.run_until_idle()
    s = sched.stats
    assert s.largest_batch == live and s.finished == live and s.preempted == 0
    assert s.peak_blocks == live * blocks_for(128 + 19, 32) and runner.allocator.free == 21251


# a served paged build of the same checkpoint: CONFIG's pool, and at most 2 requests waiting for admission
SERVED = dataclasses.replace(CONFIG, max_waiting=2)


@pytest.fixture(scope="module")
def paged_build(engines):
    return build_engine(engines[1].parent / "ckpt", engines[1].parent / "engine-paged", limits=LIMITS, kv_cache=SERVED).path


def test_the_gates_load_the_engine_with_its_own_pool_and_the_fit_estimate_counts_it(engines, paged_build,
                                                                                     monkeypatch):
    """`load_engine` (the gates' loader and the llm model's default) follows engine.json; the validation gate,
    left to load the engine itself, gets the built pool and passes; the perf gate's measurement runs on it; the
    fit check's estimate is the pool: by default max_batch_size x max_seq_len, else the blocks the build fixed."""
    from serving.engine import read_engine_info, runner
    from serving.engine.kv_cache import kv_block_bytes
    from serving.engine.memory import estimate_engine_memory, kv_cache_bytes, pool_bytes
    from serving.engine.timing import time_generate
    from tasks.validate import ValidationSpec, reference_run, validate_engine

    hf, default_dir, _, _ = engines
    loaded: list = []
    load = runner.load_engine

    def recording(engine_dir, **options):
        loaded.append(load(engine_dir, **options))
        return loaded[-1]

    monkeypatch.setattr(runner, "load_engine", recording)
    spec = ValidationSpec(prompts=["Once upon a time"], max_new_tokens=6, passages=["The quick brown fox."])
    reference = reference_run(hf, spec, "float32", max_seq_len=LIMITS.max_seq_len)
    result = validate_engine(paged_build, hf, spec, reference=reference)
    assert result.passed, result.failures
    assert loaded[0].config == SERVED and loaded[0].num_blocks == 20
    cell = time_generate(loaded[0], batch=3, prompt_len=30, gen_len=4, repeats=1, warmup=0)  # 90 tokens: 4 steps
    assert cell.e2e_tok_s > 0 and cell.ttft_ms_p50 > 0

    a = read_engine_info(paged_build).model
    block = kv_block_bytes(n_layers=a.n_layers, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, block_size=8,
                           element_bytes=4)
    estimate = estimate_engine_memory(paged_build)
    assert estimate.kv_cache_bytes == 21 * block and "20 blocks of 8" in estimate.kv_cache
    room = kv_cache_bytes(n_layers=a.n_layers, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                          max_batch_size=4, max_seq_len=96, dtype="float32")  # 80 positions: 3 blocks of 32
    assert estimate_engine_memory(default_dir).kv_cache_bytes == room + room // 12  # and the padding rows' block
    by_memory = dataclasses.replace(read_engine_info(paged_build), kv_cache=dataclasses.replace(
        SERVED, num_blocks=None, free_mem_fraction=0.5))
    assert pool_bytes(by_memory)[0] == 2 * 10 * block  # one sequence of 80 = 10 blocks, within half the room


def test_a_full_admission_queue_refuses_as_overloaded_and_keeps_the_queued(engines, paged_build):
    """Served with `kv_cache.max_waiting` 2, a request arriving while 2 wait is refused at submit with words the
    OpenAI front turns into 429; the queued ones are untouched and finish; offline `generate` has no limit."""
    from serving.engine.runner import load_engine
    from serving.engine.scheduler import SchedulerFull
    from serving.llm_client import is_overload
    from serving.openai.backend import _error

    runner = load_engine(paged_build, device="cpu")
    sched = runner.scheduler()
    done: list[str] = []
    for i in range(2):
        sched.submit(GenRequest([1, 2, 3], 4, lambda ids, r, i=i: r and done.append(r), lambda e: None))
    with pytest.raises(SchedulerFull, match=r"2 requests already wait for admission \(kv_cache.max_waiting=2; 0 live, "
                       r"20 of 20 KV blocks free\)") as refused:
        sched.submit(GenRequest([4, 5], 4, lambda ids, r: None, lambda e: None))
    assert is_overload("", str(refused.value)) and _error(RuntimeError(str(refused.value)), "m").http_status == 429
    sched.run_until_idle()
    assert done == ["length", "length"] and runner.allocator.free == 20
    assert len(runner.generate(_prompts(5), max_new_tokens=2)) == 5
    with pytest.raises(EngineLimitError, match="kv_cache.max_waiting=0 must be >= 1"):
        check_kv_cache_config(dataclasses.replace(CONFIG, max_waiting=0), max_seq_len=80, max_batch_size=4, block_bytes=1)


def test_an_fp8_engine_gives_the_reference_forwards_tokens(engines, tmp_path):
    """Quantized weights through the paged steps (the FP8 target's engine; on the CPU the dequantizing path):
    the same greedy tokens as the reference forward of the same fp8 weights, past the KV budget."""
    from serving.engine.quantize import QuantInfo

    ckpt = convert_checkpoint(engines[0], tmp_path / "ckpt", dtype="float32", quantization=QuantInfo(method="fp8"))
    paged = load_engine(build_engine(ckpt, tmp_path / "paged", limits=LIMITS, kv_cache=CONFIG).path, device="cpu")
    reference = ReferenceEngine(paged)
    prompts = _prompts(6, seed=5)
    assert paged.info.quantization.method == "fp8"
    got, want = paged.generate(prompts, max_new_tokens=16), reference.generate(prompts, max_new_tokens=16)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_prompt_groups_in_a_row_are_read_as_views_and_give_the_gathered_result(engines):
    """A group of equal-length prompts whose tokens lie in a row is attended over views of q/k/v (and, when it
    is the whole step, its output is the layer's attention output), not gathered and scattered: the same
    logits as the gathering path, for a step that is one group, a group followed by a decode, and a group
    split by a decode (not in a row: gathered)."""
    import torch

    from serving.engine.step import build_step, paged_forward

    *_, paged = engines
    blocks = paged.allocator.take(6)
    try:
        tables = [blocks[0:2], blocks[2:4], blocks[4:6]]
        rnd = random.Random(3)
        toks = [[rnd.randrange(1, 512) for _ in range(5)] for _ in range(2)]
        whole = [(toks[0], 0, tables[0]), (toks[1], 0, tables[1])]
        prefix = ([7, 8, 9], 0, tables[2])
        paged_forward_args = (paged.model, paged.cache, paged.rope_cos, paged.rope_sin)
        paged.forward(list(whole) + [prefix], [0, 1, 2])  # the third sequence's first 3 positions, for a decode
        decode = ([11], 3, tables[2])
        cases = {"whole": (whole, [0, 1]), "group then decode": (whole + [decode], [0, 1, 2]),
                 "split by a decode": ([whole[0], decode, whole[1]], [0, 1, 2])}
        for name, (chunks, sample) in cases.items():
            step = build_step(chunks, sample, paged.config.block_size, paged.device)
            assert (step.fresh_firsts == (None,)) == (name == "split by a decode"), name
            gathered = dataclasses.replace(step, fresh_firsts=(None,) * len(step.fresh_groups))
            model, cache, cos, sin = paged_forward_args
            with torch.no_grad():
                got = paged_forward(model, step, cache, cos, sin)
                want = paged_forward(model, gathered, cache, cos, sin)
            assert torch.allclose(got, want, atol=1e-5, rtol=0), (name, (got - want).abs().max())
    finally:
        paged.allocator.give_back(blocks)


def test_throughput_bench_option_sides_set_the_engine_options_only_while_they_run():
    from bench.throughput import (
        OPTION_SIDES,
        ThroughputConfig,
        bench_throughput,
        check_sides,
        side_context,
        workload,
    )
    from serving.engine.model import ModelArgs
    from serving.engine.models.llama import Transformer
    from serving.engine.options import EngineOptions

    model = Transformer(ModelArgs("LlamaForCausalLM", 64, 16, 1, 2, 1, 8, 32, 1e-5, 64))
    base = model.options
    with side_context("engine-tile128", model):
        assert model.options.attention.tile_positions == 128
    assert model.options == base and base.attention.tile_positions is None
    for side, changes in OPTION_SIDES.items():
        with side_context(side, model):
            for name, value in changes.items():
                got = getattr(model.options, name)
                if name == "attention":
                    assert all(getattr(got, k) == v != getattr(base.attention, k) for k, v in value.items()), side
                else:
                    assert got == value != getattr(base, name), side
        assert model.options == base, side
    assert set(OPTION_SIDES) == {"engine-repeat-kv", "engine-pdl", "engine-precise-accum", "engine-no-prefetch",
                                 "engine-unscaled", "engine-sum-adds", "engine-kv-dot-bf16", "engine-fp8-warps4"}
    check_sides(("engine", "engine-sync", "engine-prefix-cache", "engine-torch-ops", "engine-repeat-kv",
                 "engine-pdl", "engine-unscaled", "engine-no-prefetch", "engine-precise-accum", "engine-tile64"))
    with side_context("engine-no-prefetch+tile64", model):
        assert model.options.attention == dataclasses.replace(EngineOptions().attention, prefetch_blocks=False,
                                                              tile_positions=64)
    assert model.options == base
    check_sides(("engine-no-prefetch+tile64+pdl",))
    for bad in ("engine-tile", "engine-tilex", "fast", "engine-no-prefetch+fast", "static", "paged"):
        with pytest.raises(ValueError, match=re.escape(f"unknown side {bad!r}")):
            check_sides(("engine", bad))
    cfg = ThroughputConfig(shape="tiny", requests=3, input_len=6, output_len=3, sides=("engine-tile32",),
                           max_live=4, block_size=4, max_num_tokens=16, num_blocks=12, warmup_requests=0)
    report = bench_throughput(cfg, device="cpu", progress=lambda line: None)
    assert report.sides[0].side == "engine-tile32"
    assert report.sides[0].output_tokens == sum(n for _, n in workload(cfg, 512))


def test_throughput_bench_at_a_users_max_seq_len_sets_the_engines_limit():
    """`--max-seq-len`: the engine's limit as a user sets it (its rotary tables and decode block tables span it),
    and a limit shorter than the requests is refused with the numbers."""
    from unittest import mock

    from bench.throughput import ThroughputConfig, bench_throughput, workload
    from serving.engine.runner import EngineRunner

    limits: list[int] = []
    made = EngineRunner.__init__

    def spy(self, info, *args, **kwargs):
        limits.append(info.limits.max_seq_len)
        made(self, info, *args, **kwargs)

    cfg = ThroughputConfig(shape="tiny", requests=3, input_len=6, output_len=3, max_live=4,
                           block_size=4, max_num_tokens=16, num_blocks=40, warmup_requests=0, max_seq_len=128)
    with mock.patch.object(EngineRunner, "__init__", spy):
        report = bench_throughput(cfg, device="cpu", progress=lambda line: None)
    assert limits == [128]
    assert [s.output_tokens for s in report.sides] == [sum(n for _, n in workload(cfg, 512))]
    with pytest.raises(ValueError, match="max_seq_len=8 is shorter than the longest request"):
        bench_throughput(dataclasses.replace(cfg, max_seq_len=8), device="cpu", progress=lambda line: None)


def test_warm_up_runs_a_mixed_step_and_gives_its_blocks_back(engines):
    """`warm_up_prefill` also runs one step of a decode, a new prompt and a prompt's second chunk (whose
    kernels would otherwise first compile under load), and lends its blocks only for the call."""
    from unittest import mock

    from serving.engine import runner

    *_, paged = engines
    steps = []
    build = runner.build_step

    def spy(chunks, sample, block_size, device):
        step = build(chunks, sample, block_size, device)
        steps.append((step.single_rows.shape[0], len(step.fresh_groups), len(step.later_groups)))
        return step

    with mock.patch.object(runner, "build_step", spy):
        paged.warm_up_prefill(typical_len=16)
    assert (1, 1, 1) in steps, steps
    assert paged.allocator.free == paged.num_blocks


def test_throughput_bench_repeats_each_sides_run_and_lists_every_runs_rate():
    from bench.throughput import ThroughputConfig, bench_throughput, workload

    cfg = ThroughputConfig(shape="tiny", requests=3, input_len=6, output_len=3, max_live=4,
                           block_size=4, max_num_tokens=16, num_blocks=12, warmup_requests=0, runs=2)
    side = bench_throughput(cfg, device="cpu", progress=lambda line: None).sides[0]
    assert len(side.run_tok_s) == 2 and side.run_tok_s[-1] == side.output_tok_s
    assert side.output_tokens == sum(n for _, n in workload(cfg, 512))
    assert "runs " in side.row()
    with pytest.raises(ValueError, match="runs=0"):
        bench_throughput(dataclasses.replace(cfg, runs=0), device="cpu", progress=lambda line: None)


def test_the_decode_only_step_gives_the_reference_forwards_logits(engines):
    """`cuda_graphs.paged_decode_logits` (the step the CUDA graphs capture; eager here) after a mixed prompt step:
    each row's logits are the reference forward's at that position, in float32 rounding."""
    from engine_reference import decode_step_logits

    _, _, reference, paged = engines
    prompts, tokens = _prompts(3, seed=9), [5, 9, 100]
    got = decode_step_logits(paged, prompts, tokens)
    for row, (prompt, token) in enumerate(zip(prompts, tokens)):
        want = reference.prefill_logits(prompt + [token])[-1]
        err = (got[row] - want).abs().max().item()
        print(f"decode step vs reference, row {row}: max abs err {err:.2e}")
        assert err < 1e-4
    assert paged.allocator.free == CONFIG.num_blocks
