"""The in-flight step's batched sampling (`serving.engine.step_sampling`) and the paged scheduler's log-probs:
every row its own parameters in one batch; a row's draw depends on its seed and position only; penalties,
`logit_bias`, `min_tokens` and token masks change the logits as vLLM's do; prompt and output log-probs are the
raw log-softmax of the tiny float32 model's own logits."""

from __future__ import annotations

import random

import pytest
import torch

from serving.engine import EngineLimits, build_engine, convert_checkpoint
from serving.engine.kv_cache import KVCacheConfig
from serving.engine.runner import load_engine
from serving.engine.sampling import SamplingParams, apply_token_mask, bitmask_words
from serving.engine.scheduler import GenRequest, Scheduler
from serving.engine.step_sampling import RowSampling, StepSampling, race_exponentials, sample_rows
from tasks.tiny_model import make_tiny_model

V = 64
CPU = torch.device("cpu")


def _sample(logits: torch.Tensor, rows: list[RowSampling]) -> list[int]:
    return sample_rows(logits, StepSampling.build(rows, logits.shape[-1], CPU)).tolist()


def test_plain_greedy_rows_build_nothing_and_take_the_argmax():
    logits = torch.randn(3, V)
    rows = [RowSampling(None, 1, 5), RowSampling(SamplingParams(temperature=0.0), 2, 6), RowSampling(None, 3, 7)]
    assert StepSampling.build(rows, V, CPU) is None
    assert _sample(logits, rows) == logits.argmax(-1).tolist()


def test_a_rows_draw_depends_on_its_seed_and_position_only():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    hot = SamplingParams(temperature=1.0)
    alone = _sample(logits[2:3], [RowSampling(hot, 42, 9)])
    mixed = _sample(logits, [RowSampling(None, 0, 1), RowSampling(SamplingParams(temperature=0.7, top_k=5), 7, 3),
                             RowSampling(hot, 42, 9), RowSampling(hot, 43, 9)])
    assert mixed[2] == alone[0]
    assert mixed[0] == int(logits[0].argmax())
    assert race_exponentials(torch.tensor([42, 42]), torch.tensor([9, 10]), V).unique(dim=0).shape[0] == 2


def test_draws_follow_the_softmax_of_the_scaled_logits():
    """Over 4,000 positions the frequencies of a 4-token softmax match its probabilities within 3 points."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    draws = 4000
    rows = [RowSampling(SamplingParams(temperature=1.0), 123, p) for p in range(draws)]
    counts = torch.bincount(torch.tensor(_sample(logits.expand(draws, 4), rows)), minlength=4).float() / draws
    assert torch.allclose(counts, logits.softmax(-1)[0], atol=0.03), counts


def test_top_k_and_top_p_per_row():
    logits = torch.tensor([[3.0, 2.9, 2.8, -5.0]])
    rows = [RowSampling(SamplingParams(temperature=1.0, top_k=2), 5, p) for p in range(200)]
    picks = _sample(logits.expand(200, 4), rows)
    assert set(picks) == {0, 1}
    rows = [RowSampling(SamplingParams(temperature=1.0, top_p=0.01), 5, p) for p in range(50)]
    assert set(_sample(logits.expand(50, 4), rows)) == {0}


def test_penalties_bias_min_tokens_and_masks_shape_the_logits():
    logits = torch.tensor([[1.0, 0.9, 0.8, 0.0]])
    greedy = {"temperature": 0.0}
    # token 0 was generated twice: a frequency penalty of 0.1 puts it below token 1
    assert _sample(logits, [RowSampling(SamplingParams(**greedy, frequency_penalty=0.1), 0, 4, tokens=(3, 0, 0),
                                        prompt_len=1, generated=2)]) == [1]
    # presence: once is enough
    assert _sample(logits, [RowSampling(SamplingParams(**greedy, presence_penalty=0.25), 0, 4, tokens=(3, 0, 1),
                                        prompt_len=1, generated=2)]) == [2]
    # repetition covers the prompt too: 1.0 / 1.5 < 0.8
    assert _sample(logits, [RowSampling(SamplingParams(**greedy, repetition_penalty=1.5), 0, 2, tokens=(0, 1),
                                        prompt_len=2)]) == [2]
    assert _sample(logits, [RowSampling(SamplingParams(**greedy, logit_bias=((3, 5.0),)), 0, 1)]) == [3]
    # min_tokens: the stop ids are barred while the output is shorter
    params = SamplingParams(**greedy, min_tokens=2)
    assert _sample(logits, [RowSampling(params, 0, 1, stop_ids=(0,), generated=1)]) == [1]
    assert _sample(logits, [RowSampling(params, 0, 1, stop_ids=(0,), generated=2)]) == [0]


class OnlyTokens:
    """A token mask allowing a fixed set of tokens (the `TokenMaskSource` protocol)."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed, self.accepted = allowed, []

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index] = 0
        for t in self.allowed:
            word = int(bitmask[index, t // 32]) | (1 << (t % 32))
            bitmask[index, t // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def accept_token(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return token_id in self.allowed

    def is_terminated(self) -> bool:
        return False


def test_token_masks_packed_or_boolean():
    logits = torch.randn(2, 70)
    packed = torch.zeros(1, bitmask_words(70), dtype=torch.int32)
    OnlyTokens({33, 63, 69}).fill_next_token_bitmask(packed, 0)
    masked = apply_token_mask(logits.clone(), packed, torch.tensor([1]))
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [33, 63, 69]
    assert torch.equal(masked[0], logits[0])
    allowed = torch.zeros(2, 70, dtype=torch.bool)
    allowed[:, 5] = True
    assert apply_token_mask(logits.clone(), allowed).argmax(-1).tolist() == [5, 5]
    rows = [RowSampling(None, 0, 1, token_mask=OnlyTokens({7})), RowSampling(None, 0, 1)]
    assert _sample(logits, rows) == [7, int(logits[1].argmax())]


# -- through the paged scheduler, on the tiny float32 model ---------------------------------------------------
LIMITS = EngineLimits(dtype="float32", max_batch_size=4, max_input_len=40, max_seq_len=80)
CONFIG = KVCacheConfig(block_size=8, num_blocks=24, max_num_tokens=16)


@pytest.fixture(scope="module")
def paged(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    ckpt = convert_checkpoint(make_tiny_model(root / "hf"), root / "ckpt", dtype="float32")
    engine = build_engine(ckpt, root / "engine", limits=LIMITS).path
    return load_engine(engine, config=CONFIG, device="cpu")


def _run(runner, requests: list[GenRequest]) -> None:
    sched = Scheduler(runner)
    for req in requests:
        sched.submit(req)
    sched.run_until_idle()


class Collected:
    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[dict[int, float]] = []
        self.prompt: dict[int, tuple[float, dict[int, float]]] = {}
        self.reason: str | None = None

    def request(self, prompt: list[int], max_tokens: int, **kw) -> GenRequest:
        def emit(ids, reason):
            self.ids += ids
            self.reason = reason or self.reason

        def on_logprobs(lp, top):
            self.logprobs.append(lp)
            self.tops.append(top)

        def on_prompt(first, lps, tops):
            for k, (lp, top) in enumerate(zip(lps, tops)):
                assert first + k not in self.prompt, "a prompt token's log-prob reported twice"
                self.prompt[first + k] = (lp, top)

        def fail(exc):
            raise AssertionError(f"request failed: {exc}")

        return GenRequest(prompt, max_tokens, emit, fail, on_logprobs=on_logprobs, on_prompt_logprobs=on_prompt, **kw)


def test_prompt_and_output_logprobs_are_the_models_log_softmax(paged):
    """A 37-token prompt (prefilled in 3 chunks beside another request) reports every token from the second on,
    once, and its output tokens' log-probs and top-3: all equal to the log-softmax of the teacher-forced logits."""
    rnd = random.Random(3)
    prompt = [rnd.randrange(1, 500) for _ in range(37)]
    got, other = Collected(), Collected()
    _run(paged, [other.request([5, 6, 7], 6), got.request(prompt, 5, top_logprobs=3)])
    assert sorted(got.prompt) == list(range(1, len(prompt)))
    whole = torch.log_softmax(paged.prefill_logits(prompt + got.ids), dim=-1)
    for j in range(1, len(prompt)):
        lp, top = got.prompt[j]
        assert abs(lp - float(whole[j - 1, prompt[j]])) < 1e-4
        assert list(top) == whole[j - 1].topk(3).indices.tolist()
    for k, token in enumerate(got.ids):
        assert abs(got.logprobs[k] - float(whole[len(prompt) - 1 + k, token])) < 1e-4
        assert max(got.tops[k].values()) == pytest.approx(float(whole[len(prompt) - 1 + k].max()), abs=1e-4)
    assert paged.allocator.free == CONFIG.num_blocks


def test_seeded_sampling_repeats_whatever_the_batch_and_penalties_apply(paged):
    params = SamplingParams(temperature=1.0, seed=11)
    alone, crowded = Collected(), Collected()
    _run(paged, [alone.request([9, 8, 7], 12, sampling=params)])
    neighbours = [Collected().request([3] * n, 10, sampling=SamplingParams(temperature=0.8)) for n in (2, 5)]
    _run(paged, [neighbours[0], crowded.request([9, 8, 7], 12, sampling=params), neighbours[1]])
    assert alone.ids == crowded.ids
    greedy, penalised = Collected(), Collected()
    _run(paged, [greedy.request([4, 4, 4], 16), penalised.request(
        [4, 4, 4], 16, sampling=SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=2.0))])
    assert len(set(penalised.ids)) > len(set(greedy.ids))
    banned = Collected()
    first = greedy.ids[0]
    _run(paged, [banned.request([4, 4, 4], 3, stop_token_ids=(first,),
                                sampling=SamplingParams(temperature=0.0, min_tokens=2))])
    assert first not in banned.ids[:2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_step_samples_the_same_tokens_on_cuda_as_on_the_cpu():
    """The counter-based draws, penalties, bias, min_tokens and a packed mask give the CPU's tokens on the GPU
    (pinned, non-blocking parameter copies), and the step's log-probs reach the host with them."""
    from serving.engine.step_sampling import StepLogprobs

    torch.manual_seed(3)
    logits = torch.randn(6, 1000)
    mask = OnlyTokens({5, 77, 900})
    rows = [RowSampling(None, 0, 1), RowSampling(SamplingParams(temperature=0.9, top_k=40, top_p=0.9), 123, 17),
            RowSampling(SamplingParams(temperature=1.3, presence_penalty=1.0, frequency_penalty=0.5,
                                       repetition_penalty=1.2), 2**63 + 5, 40, tokens=(1, 2, 3, 3, 9), prompt_len=2,
                        generated=3),
            RowSampling(SamplingParams(temperature=0.0, logit_bias=((11, 50.0),)), 0, 3),
            RowSampling(SamplingParams(temperature=0.7, min_tokens=4), 99, 8, stop_ids=(int(logits[4].argmax()),),
                        generated=1),
            RowSampling(SamplingParams(temperature=1.0), 7, 2, token_mask=mask)]
    cpu = _sample(logits, rows)
    cuda = sample_rows(logits.cuda(), StepSampling.build(rows, 1000, torch.device("cuda"))).tolist()
    assert cuda == cpu
    from serving.engine.sampling import chosen_logprobs

    chosen, top_v, top_i = chosen_logprobs(logits.cuda(), torch.tensor(cpu, device="cuda"), 3)
    host = StepLogprobs([0, 1], [3, 0], chosen[:2], top_v[:2], top_i[:2]).to_host()
    torch.cuda.synchronize()
    assert host.per_row(2)[0][0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[cpu[0]]), abs=1e-5)


def test_the_static_runners_sampler_refuses_what_only_the_step_serves():
    from serving.engine.errors import EngineLimitError
    from serving.engine.sampling import sample

    with pytest.raises(EngineLimitError, match="paged engine"):
        sample(torch.zeros(1, 4), SamplingParams(temperature=0.0, presence_penalty=1.0))
