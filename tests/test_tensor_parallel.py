"""Tensor parallelism on the CPU (issue 52): a tiny float32 llama built with `tensor_parallel` 2 loads as two
gloo ranks (`load_engine` starts the worker rank and stops it with itself) and gives the single-process
engine's greedy tokens and its logits within 1e-5 (LOGITS_ATOL); the shards are the whole model's pieces; a size
that does not divide the heads is refused at build, naming both; a killed worker fails the next step with its rank and
PID, at once; the fit check counts a rank per GPU."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F

from serving.engine import EngineLimits, build_engine, convert_checkpoint, load_engine
from serving.engine.errors import EngineLimitError
from serving.engine.kv_cache import KVCacheConfig
from serving.engine.linear_float import RowParallelLinear
from serving.engine.memory import estimate_engine_memory
from serving.engine.model import ModelArgs
from serving.engine.parallel import SINGLE, ParallelConfig, check_tensor_parallel
from serving.engine.parallel_shard import shard_state
from serving.engine.parallel_workers import WorkerRankError
from tasks.fit import DeviceMemory, rank_fit_problems
from tasks.tiny_model import make_tiny_model

LIMITS = EngineLimits(dtype="float32", max_batch_size=4, max_input_len=40, max_seq_len=80)
CONFIG = KVCacheConfig(block_size=8, num_blocks=24, max_num_tokens=32)
# issue 52's bound on the max abs difference of the float32 logits, below the model's own float32 rounding: it
# holds because wo and w2 run the same float32 GEMMs at any size and round once, after the all-reduce
# (`linear_float.RowParallelLinear`; docs/engine.md has the measurement)
LOGITS_ATOL = 1e-5
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
        print(f"prompt of {len(prompt)}: max abs logit difference {(a - b).abs().max().item():.3g}")
        assert (a - b).abs().max().item() <= LOGITS_ATOL, (a - b).abs().max()


@pytest.mark.parametrize("size", [2, 4, 8])
def test_a_row_parallel_float32_product_is_the_same_at_every_size(size):
    """wo's and w2's float32 product (`RowParallelLinear`, 8 column groups as a model of 8 KV heads has) equals,
    bit for bit, the all-reduced sum of `size` ranks' shards, each its own RowParallelLinear of 8 / size groups;
    it lies within float32 rounding of the float64 product; one whole-row float32 GEMM rounds apart from any split."""
    gen = torch.Generator().manual_seed(size)
    k, n, groups = 1024, 96, 8
    weight, bias, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), 4 * torch.randn(5, k, generator=gen)
    whole = RowParallelLinear(k, n, groups=groups).requires_grad_(False)
    whole.load_state_dict({"weight": weight, "bias": bias})
    ranks = []
    for r in range(size):
        shard = RowParallelLinear(k // size, n, groups=groups // size).requires_grad_(False)
        cols = slice(r * k // size, (r + 1) * k // size)
        shard.load_state_dict({"weight": weight[:, cols], "bias": bias if r == 0 else torch.zeros_like(bias)})
        ranks.append(shard(x[:, cols]))
    one = SINGLE.all_reduce(whole(x))
    assert one.dtype == torch.float32 and torch.equal(one, sum(ranks[1:], ranks[0]).float())
    exact = x.double() @ weight.double().T + bias.double()
    eps = torch.finfo(torch.float32).eps
    # the textbook bound of a float32 sum of k // groups products, then one rounding of the float64 total
    bound = (k // groups) * eps * (x.double().abs() @ weight.double().abs().T) + eps * exact.abs()
    print(f"size {size}: float32 error against float64, grouped {(one.double() - exact).abs().max().item():.3g}, "
          f"one GEMM {(F.linear(x, weight, bias).double() - exact).abs().max().item():.3g}")
    assert torch.all((one.double() - exact).abs() <= bound)
    halves = sum(F.linear(x[:, r * k // 2:(r + 1) * k // 2], weight[:, r * k // 2:(r + 1) * k // 2]) for r in (0, 1))
    assert not torch.equal(halves + bias, F.linear(x, weight, bias)), "float32 GEMMs of two halves round apart"


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
