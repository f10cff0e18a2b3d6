"""Prefix caching of the paged KV cache (`serving.engine.prefix_cache`): the allocator's bookkeeping, and on the
CPU (tiny float32 llama) requests whose prompts start alike start from the cached blocks and still produce the
reference forward's greedy tokens (`tests.engine_reference`), through eviction and preemption; the setting through the release spec."""

from __future__ import annotations

import random

import pytest
from engine_reference import ReferenceEngine

from serving.engine import EngineLimits, build_engine, convert_checkpoint, load_engine
from serving.engine.kv_cache import BlockAllocator, KVCacheConfig, blocks_for
from serving.engine.prefix_cache import PrefixCachingAllocator, block_digests, reusable_blocks
from serving.engine.scheduler import Scheduler, collect
from tasks.tiny_model import make_tiny_model

LIMITS = EngineLimits(dtype="float32", max_batch_size=4, max_input_len=40, max_seq_len=80)
CONFIG = KVCacheConfig(block_size=8, num_blocks=20, max_num_tokens=24, prefix_caching=True)


# -- the allocator ----------------------------------------------------------------------------------
def test_block_digests_chain_each_block_to_the_ones_before_it():
    a = block_digests(list(range(20)), 4)
    assert len(a) == 5 and len(set(a)) == 5
    assert block_digests(list(range(20)), 4, start=2, parent=a[1]) == a[2:]
    b = block_digests([99] + list(range(1, 20)), 4)  # the first block differs: so do all after it
    assert not set(a) & set(b)
    assert reusable_blocks(16, 4) == 3 and reusable_blocks(17, 4) == 4 and reusable_blocks(1, 4) == 0


def test_a_released_cached_block_stays_until_a_block_is_needed_oldest_first():
    alloc = PrefixCachingAllocator(4)
    blocks = alloc.take(3)
    for b, d in zip(blocks, (b"a", b"b", b"c")):
        alloc.register(b, d)
    alloc.give_back([blocks[1]])
    alloc.give_back([blocks[0]])  # released after blocks[1]
    assert alloc.free == 3 and alloc.used == 1 and alloc.cached == 3
    assert alloc.lookup([b"a", b"b", b"x"]) == blocks[:2]
    assert alloc.evictable_among(blocks) == 2
    fresh = alloc.take(2)  # one free block, then the oldest released cached one: blocks[1]
    assert blocks[1] in fresh and alloc.evicted == 1
    assert alloc.lookup([b"a", b"b"]) == [blocks[0]]  # b's digest forgotten with its block
    alloc.acquire([blocks[0]])
    assert alloc.free == 0
    assert alloc.take(1) is None
    with pytest.raises(ValueError, match="double free"):
        alloc.give_back(fresh + fresh)


def test_a_digest_cached_twice_keeps_its_first_block_and_a_shared_block_outlives_one_holder():
    alloc = PrefixCachingAllocator(3)
    first, second = alloc.take(1)[0], alloc.take(1)[0]
    alloc.register(first, b"d")
    alloc.register(second, b"d")  # the same tokens computed by another request: it stays private
    alloc.give_back([second])
    assert alloc.lookup([b"d"]) == [first] and alloc.cached == 1 and alloc.free == 2
    alloc.acquire([first])  # a second holder
    alloc.give_back([first])
    assert alloc.free == 2  # still held once
    alloc.give_back([first])
    assert alloc.free == 3 and alloc.lookup([b"d"]) == [first]
    with pytest.raises(ValueError, match="not taken"):
        alloc.register(first, b"e")


# -- the scheduler on the CPU -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    hf = make_tiny_model(root / "hf")
    ckpt = convert_checkpoint(hf, root / "ckpt", dtype="float32")
    engine = build_engine(ckpt, root / "engine", limits=LIMITS).path
    return engine, ReferenceEngine(load_engine(engine, device="cpu"))


def shared_prefix_prompts(n: int, prefix_len: int, seed: int = 0) -> list[list[int]]:
    rnd = random.Random(seed)
    prefix = [rnd.randrange(1, 512) for _ in range(prefix_len)]
    return [prefix + [rnd.randrange(1, 512) for _ in range(rnd.randrange(1, 12))] for _ in range(n)]


def test_a_request_after_another_with_its_prefix_computes_only_the_rest(engines):
    engine, reference = engines
    paged = load_engine(engine, config=CONFIG, device="cpu")
    first, second = shared_prefix_prompts(2, 24)
    sched = Scheduler(paged)
    got = collect(sched, [first], max_tokens=6) + collect(sched, [second], max_tokens=6)
    want = reference.generate([first, second], max_new_tokens=6)
    assert [ids for ids, _ in got] == [r.token_ids for r in want]
    assert sched.stats.prefix_hit_tokens == 24  # three full blocks of 8, shared
    assert sched.stats.prefill_tokens == len(first) + len(second) - 24
    assert paged.allocator.free == CONFIG.num_blocks and paged.allocator.cached > 0


def test_a_prompt_of_whole_blocks_computes_its_last_block_itself(engines):
    engine, reference = engines
    paged = load_engine(engine, config=CONFIG, device="cpu")
    prompt = shared_prefix_prompts(1, 16)[0][:16]  # exactly two blocks
    sched = Scheduler(paged)
    got = collect(sched, [prompt], max_tokens=4) + collect(sched, [prompt], max_tokens=4)
    assert got[0] == got[1] and got[0][0] == reference.generate([prompt], max_new_tokens=4)[0].token_ids
    assert sched.stats.prefix_hit_tokens == 8  # the first block; the second holds the last prompt token


def test_a_burst_sharing_a_prefix_past_the_kv_budget_gives_the_reference_tokens(engines):
    """12 requests with a 24-token common prefix, 4 live at most, 20 blocks of 8: later requests start from the
    cached prefix, blocks run out (eviction, preemption), and every request ends with the reference forward's
    tokens; every block is free at the end (cached ones evictable)."""
    engine, reference = engines
    paged = load_engine(engine, config=CONFIG, device="cpu")
    prompts = shared_prefix_prompts(12, 24, seed=1)
    assert sum(blocks_for(len(p) + 30, CONFIG.block_size) for p in prompts) > CONFIG.num_blocks
    sched = Scheduler(paged)
    got = collect(sched, prompts, max_tokens=30)
    want = reference.generate(prompts, max_new_tokens=30)
    for i, ((ids, reason), ref) in enumerate(zip(got, want)):
        assert ids == ref.token_ids and reason == "length", f"request {i} diverged"
    s = sched.stats
    assert s.prefix_hit_tokens >= 8 * 24 and s.finished == 12 and s.failed == 0
    assert paged.allocator.free == CONFIG.num_blocks


def test_distinct_prompts_evict_the_oldest_cached_blocks_and_lose_nothing(engines):
    engine, reference = engines
    paged = load_engine(engine, config=CONFIG, device="cpu")
    rnd = random.Random(5)
    prompts = [[rnd.randrange(1, 512) for _ in range(33)] for _ in range(10)]  # 4 full blocks each, all distinct
    sched = Scheduler(paged)
    got = [collect(sched, [p], max_tokens=8)[0] for p in prompts]  # one after another: each leaves its blocks
    want = reference.generate(prompts, max_new_tokens=8)
    assert [ids for ids, _ in got] == [r.token_ids for r in want]
    assert sched.stats.prefix_hit_tokens == 0 and paged.allocator.evicted > 0
    again = collect(sched, [prompts[-1]], max_tokens=8)[0]  # the newest stayed cached
    assert again == got[-1] and sched.stats.prefix_hit_tokens == 32


def test_the_release_spec_turns_it_on_and_the_setting_round_trips():
    from tasks.engine_spec import EngineSpec
    from tasks.kind_torch import _kv_cache, _unquantized_keys

    off = EngineSpec(kv_cache={"num_blocks": 20})
    on = EngineSpec(kv_cache={"num_blocks": 20, "prefix_caching": True})
    assert _kv_cache(on).prefix_caching and not _kv_cache(off).prefix_caching
    assert on.model_dump(exclude=_unquantized_keys(on)) != off.model_dump(exclude=_unquantized_keys(off))
    assert KVCacheConfig.from_dict(_kv_cache(on).to_dict()).prefix_caching
    with pytest.raises(TypeError, match="prefix_caching='yes'"):
        KVCacheConfig.from_dict({**_kv_cache(on).to_dict(), "prefix_caching": "yes"})


def test_the_throughput_bench_serves_a_shared_prefix_from_the_cache_on_its_side():
    """`bench throughput --shared-prefix 12 --sides engine,engine-prefix-cache`: every prompt starts with the same 12
    ids; the prefix-caching side takes them from the cache after the first requests, both sides make every token."""
    from bench.throughput import ThroughputConfig, bench_throughput, workload

    cfg = ThroughputConfig(shape="tiny", requests=6, input_len=16, output_len=4, sides=("engine", "engine-prefix-cache"),
                           max_live=2, block_size=4, max_num_tokens=16, num_blocks=24, warmup_requests=0,
                           shared_prefix=12)
    work = workload(cfg, 512)
    assert len({tuple(p[:12]) for p, _ in work}) == 1 and len({tuple(p) for p, _ in work}) == 6
    report = bench_throughput(cfg, device="cpu", progress=lambda line: None)
    want = sum(n for _, n in work)
    plain, cached = report.sides
    assert plain.output_tokens == cached.output_tokens == want
    assert "from the prefix cache" in cached.note and "from the prefix cache" not in plain.note


@pytest.mark.parametrize("slice_positions", [1 << 18, 40], ids=["one-batch", "sliced"])
def test_prompts_behind_one_cached_prefix_attend_as_one_group(engines, monkeypatch, slice_positions):
    """After a first request caches a 16-token prefix, four prompts with tails of one length start from it in the
    same step: their chunks are one later-chunk group (one batched gather and SDPA, or slices of it), and each
    gives the reference forward's greedy tokens."""
    from serving.engine import step

    engine, reference = engines
    monkeypatch.setattr(step, "LATER_CHUNK_POSITIONS", slice_positions)
    groups: list[tuple[int, int]] = []
    build = step.build_step

    def spy(chunks, sample, block_size, device):
        step = build(chunks, sample, block_size, device)
        groups.extend(tuple(rows.shape) for rows, _, _ in step.later_groups)
        return step

    import serving.engine.runner as runner_module

    monkeypatch.setattr(runner_module, "build_step", spy)
    paged = load_engine(engine, config=CONFIG, device="cpu")
    prefix = shared_prefix_prompts(1, 16, seed=7)[0][:16]
    prompts = [prefix + [50 + i, 60 + i, 70 + i] for i in range(4)]
    sched = Scheduler(paged)
    collect(sched, [prefix + [1]], max_tokens=2)
    got = collect(sched, prompts, max_tokens=6)
    assert [ids for ids, _ in got] == [r.token_ids for r in reference.generate(prompts, max_new_tokens=6)]
    assert (4, 3) in groups, groups  # four chunks of three tokens after the 16 cached positions


def test_a_hit_on_the_oldest_cached_blocks_holds_them_before_taking_fresh_ones(engines):
    """The pool holds only cached blocks no request holds (all evictable), and the request that hits the oldest
    of them needs a fresh one too: taking it must not evict the very blocks the request starts from."""
    engine, reference = engines
    config = KVCacheConfig(block_size=8, num_blocks=10, max_num_tokens=24, prefix_caching=True)
    paged = load_engine(engine, config=config, device="cpu")
    rnd = random.Random(11)
    first = [rnd.randrange(1, 512) for _ in range(25)]
    other = [rnd.randrange(1, 512) for _ in range(40)]
    sched = Scheduler(paged)
    collect(sched, [first], max_tokens=8)  # 32 positions computed: 4 blocks cached
    collect(sched, [other], max_tokens=9)  # 48: the other 6 blocks cached, after the first's
    assert paged.allocator.free == 10 and paged.allocator.cached == 10
    again = first + [5]  # its first three blocks hit; its last two tokens need a fresh block
    got = collect(sched, [again], max_tokens=4)
    assert got[0][0] == reference.generate([again], max_new_tokens=4)[0].token_ids
    assert sched.stats.prefix_hit_tokens == 24 and paged.allocator.evicted == 1


def test_a_load_turns_prefix_caching_on_or_off_whatever_the_build_says(engines, tmp_path):
    """The `llm` model's `prefix_caching` parameter reaches the default loader: a paged engine built without it
    serves with it, one built with it serves without."""
    engine, _ = engines
    ckpt = engine.parent / "ckpt"
    plain = build_engine(ckpt, tmp_path / "plain", limits=LIMITS,
                         kv_cache=KVCacheConfig(block_size=8, num_blocks=20, max_num_tokens=24)).path
    assert type(load_engine(plain, device="cpu").allocator) is BlockAllocator
    assert isinstance(load_engine(plain, device="cpu", prefix_caching=True).allocator, PrefixCachingAllocator)
    cached = build_engine(ckpt, tmp_path / "cached", limits=LIMITS, kv_cache=CONFIG).path
    assert type(load_engine(cached, device="cpu", prefix_caching=False).allocator) is BlockAllocator
    assert isinstance(load_engine(engine, device="cpu", prefix_caching=True).allocator, PrefixCachingAllocator)


def test_the_kv_cache_manager_hands_out_block_ids_and_keeps_prefix_caching_behind_them():
    """`KVCacheManager`: a request's table grows by positions, its computed full blocks go into the cache, a later
    request with the same leading tokens is admitted from them (held, not copied), released blocks go back."""
    from serving.engine.kv_cache_manager import KVCacheManager, RequestBlocks

    kv = KVCacheManager(PrefixCachingAllocator(8), block_size=4)
    first, tokens = RequestBlocks(), list(range(10, 21))  # 11 tokens: two full blocks and three more
    assert kv.cached_positions(first, tokens) == 0 and kv.can_admit(first, 11, reserve=0)
    kv.admit(first, 11)
    assert len(first.table) == 3 and kv.free == 5
    assert kv.grow(first, 13) and len(first.table) == 4 and not kv.grow(first, 100) and len(first.table) == 4
    kv.cache_computed(first, tokens, computed=11)
    assert first.registered == 2
    second = RequestBlocks()
    assert kv.cached_positions(second, tokens[:9] + [99]) == 8  # its two leading blocks, not the last token's
    kv.admit(second, 10)
    assert second.table[:2] == first.table[:2] and second.table.row_key == second.table[2]
    kv.release(first)
    kv.release(second)
    assert kv.free == 8 and first.table == [] and second.registered == 0
    plain = KVCacheManager(BlockAllocator(4), block_size=4)
    assert plain.cached_positions(RequestBlocks(), tokens) == 0 and not plain.prefix_caching
