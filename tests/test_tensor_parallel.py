"""Tensor parallelism on the CPU (issue 52): a tiny float32 llama built with `tensor_parallel` 2 loads as two
gloo ranks (`load_engine` starts the worker rank and stops it with itself) and gives the single-process
engine's greedy tokens and its logits within float32 rounding (LOGITS_ATOL); the shards are the whole model's pieces; a size that does
not divide the heads is refused at build, naming both; a killed worker fails the next step with its rank and
PID, at once; the fit check counts a rank per GPU."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from serving.engine import EngineLimits, build_engine, convert_checkpoint, load_engine
from serving.engine.errors import EngineLimitError
from serving.engine.kv_cache import KVCacheConfig
from serving.engine.memory import estimate_engine_memory
from serving.engine.model import ModelArgs
from serving.engine.parallel import ParallelConfig, check_tensor_parallel
from serving.engine.parallel_shard import shard_state
from serving.engine.parallel_workers import WorkerRankError
from tasks.fit import DeviceMemory, rank_fit_problems
from tasks.tiny_model import make_tiny_model

LIMITS = EngineLimits(dtype="float32", max_batch_size=4, max_input_len=40, max_seq_len=80)
CONFIG = KVCacheConfig(block_size=8, num_blocks=24, max_num_tokens=32)
# float32 logits up to ~16 here (a float32 step there is 2e-6): wo's and w2's partial products summed by the
# all-reduce round differently from one GEMM over the whole row, by a few steps of the largest logits
LOGITS_ATOL = 2e-5
PROMPTS = [[5, 17, 300, 42, 9], [7] * 23, [100, 200, 300, 400, 500, 11, 12, 13, 14, 15, 16, 17, 18, 19, 3]]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    ckpt = convert_checkpoint(make_tiny_model(root / "hf", arch="qwen2"), root / "ckpt", dtype="float32")
    one = build_engine(ckpt, root / "tp1", limits=LIMITS, kv_cache=CONFIG).path
    two = build_engine(ckpt, root / "tp2", limits=LIMITS, kv_cache=CONFIG, tensor_parallel=2).path
    return ckpt, one, two


@pytest.fixture(scope="module")
def runners(built):
    _, one, two = built
    single = load_engine(one, device="cpu")
    parallel = load_engine(two, device="cpu")
    yield single, parallel
    parallel.close()
    assert all(p.poll() is not None for p in parallel.peers.procs)


def test_two_ranks_give_the_single_engines_tokens_and_logits(runners):
    """Greedy tokens equal (a batch of three, chunked prefill, decode steps run ahead on the broadcast tokens)
    and the logits of every position of each prompt within LOGITS_ATOL of the one-process engine's."""
    single, parallel = runners
    assert len(parallel.peers.procs) == 1 and parallel.model.args.n_kv_heads == single.model.args.n_kv_heads // 2
    want = single.generate(PROMPTS, max_new_tokens=12)
    got = parallel.generate(PROMPTS, max_new_tokens=12)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for prompt in PROMPTS:
        a, b = single.prefill_logits(prompt), parallel.prefill_logits(prompt)
        assert a.shape == b.shape == (len(prompt), 512)
        assert torch.allclose(a, b, rtol=0, atol=LOGITS_ATOL), (a - b).abs().max()


def test_the_shards_are_the_whole_models_pieces(built):
    """Each rank's wqkv holds its q, k and v heads; w2 its columns; the embedding its vocabulary rows; a
    row-parallel bias lives on rank 0 only; norms whole."""
    ckpt, _, _ = built
    state = {k: v for f in sorted(ckpt.glob("*.pt")) for k, v in torch.load(f, weights_only=True).items()}
    args = ModelArgs.from_dict(json.loads((ckpt / "checkpoint.json").read_text())["model"])
    ranks = [shard_state(state, args, ParallelConfig(rank=r, size=2)) for r in (0, 1)]
    q, kv = args.q_size, args.kv_size
    wqkv = state["layers.0.attention.wqkv.weight"]
    assert torch.equal(torch.cat([ranks[0]["layers.0.attention.wqkv.weight"][:q // 2],
                                  ranks[1]["layers.0.attention.wqkv.weight"][:q // 2]]), wqkv[:q])
    assert torch.equal(ranks[1]["layers.0.attention.wqkv.weight"][q // 2:q // 2 + kv // 2], wqkv[q + kv // 2:q + kv])
    assert torch.equal(torch.cat([r["layers.1.feed_forward.w2.weight"] for r in ranks], dim=1),
                       state["layers.1.feed_forward.w2.weight"])
    assert torch.equal(torch.cat([r["tok_embeddings.weight"] for r in ranks]), state["tok_embeddings.weight"])
    assert torch.equal(ranks[1]["norm.weight"], state["norm.weight"])


def test_a_size_that_does_not_divide_the_heads_is_refused_naming_both(built, tmp_path):
    ckpt, _, _ = built
    with pytest.raises(EngineLimitError, match=r"tensor_parallel=3 does not divide num_attention_heads=4"):
        build_engine(ckpt, tmp_path / "tp3", limits=LIMITS, tensor_parallel=3)
    args = ModelArgs.from_dict({**json.loads((ckpt / "checkpoint.json").read_text())["model"],
                                "n_heads": 8})
    with pytest.raises(EngineLimitError, match=r"tensor_parallel=4 does not divide num_key_value_heads=2"):
        check_tensor_parallel(args, 4)
    assert not (tmp_path / "tp3").exists()


def test_a_killed_worker_fails_the_next_step_naming_it(built):
    """SIGKILL of the worker rank: the next generate fails at once with its rank and PID, and so does every
    later one (no hang); close() still returns."""
    _, _, two = built
    runner = load_engine(two, device="cpu")
    try:
        pid = runner.peers.pids[0]
        assert runner.generate([PROMPTS[0]], max_new_tokens=2)[0].token_ids
        os.kill(pid, signal.SIGKILL)
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(WorkerRankError, match=rf"worker rank 1 \(pid {pid}\) exited with code -9"):
                runner.generate([PROMPTS[0]], max_new_tokens=2)
            assert time.monotonic() - started < 5
    finally:
        runner.close()


def test_the_fit_check_counts_every_gpu_of_a_tensor_parallel_engine(built):
    """Each rank holds half of the one-rank engine's estimate; two GPUs must each have room for a rank."""
    _, one, two = built
    whole, halves = estimate_engine_memory(one), estimate_engine_memory(two)
    assert (halves.ranks, halves.total_bytes) == (2, whole.total_bytes)
    assert halves.per_rank_bytes == -(-whole.total_bytes // 2)
    gpus = [DeviceMemory("gpu GPU-a", 1000, 100), DeviceMemory("gpu GPU-b", 1000, 600)]
    assert rank_fit_problems(gpus[1].room_bytes(), 2, gpus, where="http://t") == []
    [line] = rank_fit_problems(gpus[1].room_bytes() + 1, 2, gpus, where="http://t")
    assert line.startswith("http://t: a tensor_parallel=2 engine needs 2 GPUs with") and "1 of its 2 GPUs" in line
    [line] = rank_fit_problems(1, 2, gpus[:1], where="http://t")
    assert "1 of its 1 GPUs have that room" in line
