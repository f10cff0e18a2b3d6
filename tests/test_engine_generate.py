"""EngineRunner.generate: sampling, stop tokens, max tokens, limits, batching (tiny llama, CPU)."""

from __future__ import annotations

import pytest
import torch

from serving.engine import (
    EngineLimitError,
    EngineLimits,
    SamplingParams,
    build_engine,
    convert_checkpoint,
    load_engine,
)
from serving.engine.sampling import sample
from tasks.tiny_model import make_tiny_model

LIMITS = EngineLimits(dtype="float32", max_batch_size=2, max_input_len=32, max_seq_len=64)
PROMPTS = [[0, 5, 6, 7], [0, 9, 10, 11, 12, 13, 14, 15], [0, 100], [0, 42, 283]]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    ckpt = convert_checkpoint(make_tiny_model(root / "hf"), root / "ckpt", dtype="float32")
    return load_engine(build_engine(ckpt, root / "engine", limits=LIMITS).path, device="cpu")


def ids(gens) -> list[list[int]]:
    return [g.token_ids for g in gens]


def test_more_prompts_than_max_batch_are_chunked(runner):
    assert len(PROMPTS) > LIMITS.max_batch_size
    batched = ids(runner.generate(PROMPTS, max_new_tokens=10))
    alone = [ids(runner.generate([p], max_new_tokens=10))[0] for p in PROMPTS]
    assert batched == alone


def test_same_seed_same_output_other_seed_differs(runner):
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=1234)
    a = ids(runner.generate(PROMPTS, max_new_tokens=16, sampling=params))
    b = ids(runner.generate(PROMPTS, max_new_tokens=16, sampling=params))
    c = ids(runner.generate(PROMPTS, max_new_tokens=16, sampling=SamplingParams(1.0, 50, 0.95, seed=99)))
    assert a == b
    assert a != c  # 4 x 16 draws from peaked-but-not-one-hot distributions: equal by chance ~never
    greedy = ids(runner.generate(PROMPTS, max_new_tokens=16))
    assert a != greedy


def test_temperature_zero_and_top_k_one_equal_greedy(runner):
    greedy = ids(runner.generate(PROMPTS, max_new_tokens=12))
    for params in (SamplingParams(temperature=0.0, seed=1), SamplingParams(temperature=1e-4, seed=1),
                   SamplingParams(temperature=1.5, top_k=1, seed=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        assert ids(runner.generate(PROMPTS, max_new_tokens=12, sampling=params)) == greedy, params


def test_sample_top_k_and_top_p_restrict_support():
    """Pure function: 2000 draws never leave the top-k / nucleus set (the excluded mass is exactly 0).

    Without restriction every token shows up (odds of a false failure ~1e-10).
    """
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).expand(2000, 5)
    g = torch.Generator().manual_seed(0)
    top2 = sample(logits, SamplingParams(temperature=1.0, top_k=2), g)
    assert set(top2.tolist()) == {0, 1}
    # probs ~ [.64, .24, .09, .03, .01]: top_p=0.8 keeps {0, 1} (0.64 < 0.8 before token 1)
    nucleus = sample(logits, SamplingParams(temperature=1.0, top_p=0.8), g)
    assert set(nucleus.tolist()) == {0, 1}
    full = sample(logits, SamplingParams(temperature=1.0), g)
    assert set(full.tolist()) == {0, 1, 2, 3, 4}  # P(token 4, p~0.012, never drawn) ~ 0.988^2000 ~ 1e-10


def test_stop_tokens_end_rows_independently(runner):
    greedy = ids(runner.generate(PROMPTS[:2], max_new_tokens=12))
    stop = greedy[0][3]  # the 4th token of row 0
    gens = runner.generate(PROMPTS[:2], max_new_tokens=12, stop_token_ids=[stop])
    first = greedy[0].index(stop)
    assert gens[0].token_ids == greedy[0][: first + 1] and gens[0].finish_reason == "stop"
    if stop in greedy[1]:
        assert gens[1].token_ids == greedy[1][: greedy[1].index(stop) + 1]
    else:
        assert gens[1].token_ids == greedy[1] and gens[1].finish_reason == "length"
    assert len(gens[0].logprobs) == len(gens[0].token_ids)


def test_greedy_without_logprobs_gives_the_same_tokens(runner):
    """logprobs=False skips the log-softmax: the tokens, the stop handling and more prompts than live requests
    give what the path with log-probs gives."""
    sampled = runner.generate(PROMPTS, max_new_tokens=12)
    plain = runner.generate(PROMPTS, max_new_tokens=12, logprobs=False)
    assert ids(plain) == ids(sampled) and all(g.logprobs == [] for g in plain)
    stop = sampled[1].token_ids[4]
    with_stop = runner.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[stop])
    assert ids(runner.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[stop], logprobs=False)) == ids(with_stop)
    assert with_stop[1].finish_reason == "stop"
    # one prompt alone decodes as it did in the batch
    assert ids(runner.generate(PROMPTS[1:2], max_new_tokens=12, logprobs=False)) == ids(sampled[1:2])


def test_prefill_warm_up_runs_its_shapes_and_changes_no_output(runner):
    """The load's cold steps (a full batch of short prompts, two unequal ones, a mixed step) use blocks lent for
    the call only: generation after them is what it was."""
    before = ids(runner.generate(PROMPTS[:2], max_new_tokens=6))
    ran = runner.warm_up_prefill(typical_len=16)
    assert ran == [(LIMITS.max_batch_size, 16 * LIMITS.max_batch_size), (2, 8 + 16)]
    assert runner.allocator.free == runner.num_blocks
    assert ids(runner.generate(PROMPTS[:2], max_new_tokens=6)) == before


def test_max_new_tokens_exact(runner):
    for n in (1, 2, 7):
        gens = runner.generate(PROMPTS, max_new_tokens=n)
        assert all(len(g.token_ids) == n and g.finish_reason == "length" for g in gens)


def test_limit_errors_name_values_and_limits(runner):
    with pytest.raises(EngineLimitError, match=r"33 tokens > limits.max_input_len=32"):
        runner.generate([[1] * 33], max_new_tokens=1)
    with pytest.raises(EngineLimitError, match=r"prompt 0: prompt of 30 tokens \+ max_tokens=40 > limits.max_seq_len=64"):
        runner.generate([[1] * 30], max_new_tokens=40)
    with pytest.raises(EngineLimitError, match=r"token ids \[512\] outside \[0, vocab_size=512\)"):
        runner.generate([[0, 512]], max_new_tokens=1)
    with pytest.raises(EngineLimitError, match="max_new_tokens=0"):
        runner.generate([[0]], max_new_tokens=0)
    with pytest.raises(EngineLimitError, match="prompt 1: prompt is empty"):
        runner.generate([[0], []], max_new_tokens=1)
    with pytest.raises(EngineLimitError, match="limits.max_seq_len=64"):
        runner.prefill_logits([1] * 65)
    with pytest.raises(EngineLimitError, match="top_p=1.5"):
        SamplingParams(top_p=1.5)


def test_prefill_logits_accepts_up_to_max_seq_len(runner):
    assert runner.prefill_logits([3] * 64).shape == (64, 512)
