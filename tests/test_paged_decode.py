"""The paged engine's decode-only steps (serving/engine/cuda_graphs.py): block tables kept on the device and
updated by the entries that changed, logits equal to the mixed step's (CPU, float32); on CUDA, the captured
graphs give the eager step's tokens (bf16, more requests than live, blocks reused)."""

from __future__ import annotations

import dataclasses
import functools
import random
import tempfile
from pathlib import Path

import pytest
import torch

from serving.engine import (
    EngineLimits,
    build_engine,
    convert_checkpoint,
    load_engine,
)
from serving.engine.cuda_graphs import decode_buckets, is_decode_only
from serving.engine.kv_cache import KV_FP8_DTYPE, KVCacheConfig
from serving.engine.linears import apply_options
from serving.engine.quantize import QuantInfo
from serving.engine.runner import EngineRunner
from serving.engine.scheduler import Scheduler, collect
from serving.engine.step import build_step, paged_forward
from tasks.tiny_model import make_tiny_model


@functools.cache
def _engine(dtype: str, quantization: str, max_input_len: int) -> Path:
    """The tiny HF model as an engine folder of `dtype` (one per arguments, in a temporary folder)."""
    root = Path(tempfile.mkdtemp(prefix="paged-decode-"))
    quant = QuantInfo(method=quantization) if quantization != "none" else None
    ckpt = convert_checkpoint(make_tiny_model(root / "hf"), root / "ckpt", dtype=dtype, quantization=quant)
    limits = EngineLimits(dtype=dtype, max_batch_size=1, max_input_len=max_input_len, max_seq_len=max_input_len + 34)
    return build_engine(ckpt, root / "engine", limits=limits).path


def _paged(device: str, *, graphs: bool = True, num_blocks: int = 24, live: int = 6, kv_cache_dtype: str = "auto",
           quantization: str = "none", max_num_tokens: int = 64, input_len: int = 30, **options):
    """A runner of the tiny model (bf16 on CUDA, float32 on the CPU) with `live` requests at most on a pool of
    `num_blocks` blocks of 16; `options`: `EngineOptions` fields changed from the resolved ones."""
    engine = _engine("bfloat16" if device == "cuda" else "float32", quantization, input_len)
    base = load_engine(engine, device=device, config=KVCacheConfig(block_size=16, num_blocks=num_blocks,
                                                                   max_num_tokens=max_num_tokens))
    info = dataclasses.replace(base.info, limits=dataclasses.replace(base.info.limits, max_batch_size=live))
    if options:
        apply_options(base.model, dataclasses.replace(base.model.options, **options))
    runner = EngineRunner(info, base.model, base.device, dataclasses.replace(base.config, kv_cache_dtype=kv_cache_dtype))
    runner.decode.use_graphs = graphs and runner.decode.use_graphs
    return runner


def test_decode_steps_send_only_changed_table_entries_and_match_the_mixed_step():
    runner = _paged("cpu")
    bs, graphs = runner.config.block_size, runner.decode
    blocks = [runner.allocator.take(2) for _ in range(3)]  # three sequences of up to 32 positions
    prompt = [[random.Random(i).randrange(1, 512) for _ in range(15)] for i in range(3)]
    prefill = build_step([(p, 0, b) for p, b in zip(prompt, blocks)], [0, 1, 2], bs, runner.device)
    paged_forward(runner.model, prefill, runner.cache, runner.rope_cos, runner.rope_sin)
    chunks = [([7], 15, b) for b in blocks]  # position 15: the last of each first block
    assert is_decode_only(chunks, [0, 1, 2]) and not is_decode_only(chunks, [0, 2]) and \
        not is_decode_only([([1, 2], 0, blocks[0])], [0])
    keys, toks, poss, updates = graphs._host_inputs(chunks)
    assert keys == [b[0] for b in blocks] and toks == [7] * 3 and poss == [15] * 3
    assert updates == keys + [0, 0, 0] + keys  # each row's first entry, once
    assert graphs._host_inputs(chunks)[3] == []  # nothing changed
    assert graphs._host_inputs([([7], 16, blocks[1])])[3] == [blocks[1][0], 1, blocks[1][1]]  # a block opened
    fresh = list(blocks[2])  # another sequence (another list) on the same first block: its whole row again
    assert graphs._host_inputs([([7], 16, fresh)])[3] == [fresh[0]] * 2 + [0, 1] + fresh

    step = build_step(chunks, [0, 1, 2], bs, runner.device)
    saved = [t.clone() for t in runner.cache.k + runner.cache.v]
    want = paged_forward(runner.model, step, runner.cache, runner.rope_cos, runner.rope_sin)
    for t, s in zip(runner.cache.k + runner.cache.v, saved):
        t.copy_(s)
    graphs.written.clear()
    got = graphs.step(chunks)
    assert (got - want).abs().max() < 1e-4
    assert decode_buckets(6) == [1, 2, 4, 6] and decode_buckets(1024)[-1] == 1024 and graphs.bucket(3) == 4


def _graphs_against_eager(prompts: list[list[int]], **paged: object) -> list:
    """The same requests through captured decode graphs and through the eager decode step (each on a fresh
    runner): both deliver the same tokens, every bucket was captured, nothing preempted; -> the tokens."""
    outs, steps = [], []
    for graphs in (True, False):
        runner = _paged("cuda", graphs=graphs, **paged)
        runner.warm_up_decode()
        sched = Scheduler(runner)
        outs.append(collect(sched, prompts, max_tokens=30))
        steps.append((runner.decode.steps, len(runner.decode.graphs), sched.stats.preempted))
        assert runner.allocator.free == runner.num_blocks
    assert outs[0] == outs[1], steps
    assert steps[0][0] > 30 and steps[0][1] == len(decode_buckets(6)) and steps[1][1] == 0, steps
    return outs[0]


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, 512) for _ in range(rng.randrange(5, 31))] for _ in range(10)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the decode graphs are captured there")
def test_captured_decode_graphs_give_the_eager_steps_tokens_on_cuda():
    """bf16 tiny shape: 10 requests of 5-30 prompt tokens, 30 new each, 6 live at most on a pool of 24 blocks
    of 16 (preemption and reuse of first blocks): graphs and the eager decode step deliver the same tokens."""
    _graphs_against_eager(_prompts())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the decode graphs are captured there")
def test_captured_decode_graphs_over_an_fp8_kv_cache_give_the_eager_steps_tokens_on_cuda():
    """As above with `kv_cache.kv_cache_dtype="fp8"` (e4m3 pools: the rotation kernel stores clamped e4m3, the
    attention kernel converts it back): graphs and the eager decode step deliver the same tokens. What the pools
    hold and what the kernels read from them is checked against torch references on CUDA in
    tests/test_paged_rope.py and tests/test_paged_attention.py, teacher-forced agreement with the unrounded pool
    on the CPU in tests/test_paged_kv_fp8.py. No token floor against another path here: this tiny checkpoint's
    large weights make e4m3's rounding flip greedy tokens within a few steps whatever computes them (33 of 300
    tokens as over a float32 pool with torch ops on the CPU; 80 of 300 between the kernels and the torch ops over
    the same e4m3 pool on an H100)."""
    assert _paged("cuda", kv_cache_dtype="fp8").cache.k[0].dtype == KV_FP8_DTYPE
    _graphs_against_eager(_prompts(), kv_cache_dtype="fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the decode graphs are captured there")
def test_decode_graphs_launched_with_pdl_give_the_same_tokens_and_logprobs_on_cuda():
    """`EngineOptions.decode_pdl`: the same kernels, each allowed to start while the one before it drains (each waits
    for it before touching memory), so the same values to the bit: tokens and log-probs equal."""
    from serving.engine.pdl import supported

    outs = []
    for pdl in (False, True):
        runner = _paged("cuda", decode_pdl=pdl)
        assert runner.decode.pdl == (pdl and supported(runner.device))
        runner.warm_up_decode()
        outs.append(runner.generate(_prompts(), max_new_tokens=30, top_logprobs=1))
    assert [g.token_ids for g in outs[1]] == [g.token_ids for g in outs[0]]
    assert [g.logprobs for g in outs[1]] == [g.logprobs for g in outs[0]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the FP8 tensor cores and row kernels")
def test_rows_scaled_before_the_fp8_gemms_give_the_same_tokens_and_logprobs_on_cuda():
    """`EngineOptions.prescale_rows`: the norms and SiLU * up hand the FP8 GEMMs of wqkv, w13 and w2 their rows
    already scaled to e4m3, the values the GEMMs' own scaling kernel computes, so the same results to the bit:
    the logits of a 100-token prompt step and 30 tokens of 80 requests decoded together (96-row graphs, past
    the decode rows)."""
    rng = random.Random(2)
    prompt = [rng.randrange(1, 512) for _ in range(100)]
    prompts = [[rng.randrange(1, 512) for _ in range(rng.randrange(5, 31))] for _ in range(80)]
    results = []
    for scaled in (False, True):
        runner = _paged("cuda", quantization="fp8", num_blocks=400, live=96, max_num_tokens=256, input_len=100,
                        prescale_rows=scaled)
        runner.warm_up_decode()
        results.append((runner.prefill_logits(prompt), runner.generate(prompts, max_new_tokens=30, top_logprobs=1)))
    (logits, out), (logits_scaled, out_scaled) = results
    assert torch.equal(logits_scaled, logits)
    assert [g.token_ids for g in out_scaled] == [g.token_ids for g in out]
    assert [g.logprobs for g in out_scaled] == [g.logprobs for g in out]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the row kernels run there")
def test_row_kernels_keep_the_paged_steps_logits_on_cuda():
    """bf16 tiny shape: a mixed step's logits of every position (`prefill_logits`) and 8 decode steps' logits
    (graphs) with the row kernels (norms, rotations + K/V write, SiLU * up) against the same engine with the
    torch ops they replace: within bf16 noise (this tiny checkpoint's large weights give logits of large magnitude:
    a relative difference of up to 3%), the same greedy tokens almost everywhere."""
    from bench.throughput import torch_row_ops

    rng = random.Random(1)
    prompt = [rng.randrange(1, 512) for _ in range(30)]
    prompts = [[rng.randrange(1, 512) for _ in range(rng.randrange(5, 31))] for _ in range(4)]
    results = []
    for fused in (True, False):
        with torch_row_ops() if not fused else torch.no_grad():
            runner = _paged("cuda")
            logits = runner.prefill_logits(prompt).float()
            decoded = runner.generate(prompts, max_new_tokens=8, top_logprobs=1)
        results.append((logits, decoded))
    (fused_logits, fused_out), (torch_logits, torch_out) = results
    rel = float((fused_logits - torch_logits).norm() / torch_logits.norm())
    agree = float((fused_logits.argmax(-1) == torch_logits.argmax(-1)).float().mean())
    assert rel < 3e-2 and agree >= 0.9, (rel, agree)
    same_so_far = []  # each chosen token's log-prob on both sides, while the two sequences still agree
    for f, t in zip(fused_out, torch_out):
        for j, (a, b) in enumerate(zip(f.logprobs, t.logprobs)):
            if f.token_ids[:j] != t.token_ids[:j]:
                break
            same_so_far.append((a, b))
    # bf16's spacing at these logits' magnitude (tens) is 0.125-0.25: the log-probs agree to about that
    assert len(same_so_far) >= 16 and max(abs(a - b) for a, b in same_so_far) < 0.3, same_so_far
