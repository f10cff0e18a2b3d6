"""Speculative decoding by n-gram lookup (`serving.engine.speculative`, the scheduler's verification): the tokens,
finish reasons and log-probs of every request are those it gets without speculation (tiny float32 model on the
CPU), whether the drafts are accepted, partly accepted or rejected, in batches mixing drafting requests with
plain, sampled, penalised and guided ones, with stop tokens, `max_tokens` and preemption; the option's parsing
and where it is reported. The example model (SmolLM2-135M-Instruct) repeating a given text accepts drafts and
gives the same greedy tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

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
from serving.engine.kv_cache import KVCacheConfig
from serving.engine.loaded import loaded_configuration
from serving.engine.options import resolve_options
from serving.engine.scheduler import GenRequest, Scheduler
from serving.engine.speculative import (
    MAX_BACKOFF_STEPS,
    Drafter,
    NgramIndex,
    SpeculativeOptions,
    accepted_length,
    parse_speculative,
)
from serving.triton.models.params import check_parameters
from tasks.tiny_model import make_tiny_model

LIMITS = EngineLimits(dtype="float32", max_batch_size=12, max_input_len=40, max_seq_len=80)
NGRAM = {"method": "ngram", "max_draft": 4, "max_ngram": 3}


@dataclasses.dataclass
class Outcome:
    tokens: list[int] = dataclasses.field(default_factory=list)
    reason: str | None = None
    logprobs: list[float] = dataclasses.field(default_factory=list)
    tops: list[dict[int, float]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Ask:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams | None = None
    stop: tuple[int, ...] = ()
    top_logprobs: int = 0
    mask: Any = None


class AllBut:
    """A token mask (`sampling.TokenMaskSource`) that allows every token but a few: a guided request."""

    def __init__(self, banned: set[int], vocab: int) -> None:
        self.banned, self.vocab = banned, vocab

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index] = -1
        for t in self.banned:
            word = int(bitmask[index, t // 32]) & ~(1 << (t % 32)) & 0xFFFFFFFF
            bitmask[index, t // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def accept_token(self, token_id: int) -> bool:
        return token_id not in self.banned

    def is_terminated(self) -> bool:
        return False


def run(scheduler: Scheduler, asks: list[Ask]) -> list[Outcome]:
    out = [Outcome() for _ in asks]

    def sinks(o: Outcome):
        def emit(ids: list[int], reason: str | None) -> None:
            o.tokens.extend(ids)
            o.reason = reason or o.reason

        def on_logprobs(lp: float, top: dict[int, float]) -> None:
            o.logprobs.append(lp)
            o.tops.append(top)

        return emit, on_logprobs

    def fail(exc: BaseException) -> None:
        raise exc

    for ask, o in zip(asks, out):
        emit, on_logprobs = sinks(o)
        scheduler.submit(GenRequest(list(ask.prompt), ask.max_tokens, emit, fail, ask.sampling, ask.stop,
                                    top_logprobs=ask.top_logprobs, on_logprobs=on_logprobs, token_mask=ask.mask))
    scheduler.run_until_idle()
    return out


def assert_same(got: list[Outcome], want: list[Outcome], tolerance: float = 1e-4) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g.tokens, g.reason) == (w.tokens, w.reason), f"request {i}"
        assert g.logprobs == pytest.approx(w.logprobs, abs=tolerance), f"request {i}"
        assert [sorted(t) for t in g.tops] == [sorted(t) for t in w.tops], f"request {i}"
        for a, b in zip(g.tops, w.tops):
            assert [a[k] for k in sorted(a)] == pytest.approx([b[k] for k in sorted(b)], abs=tolerance)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("speculative")
    ckpt = convert_checkpoint(make_tiny_model(root / "hf"), root / "ckpt", dtype="float32")
    return build_engine(ckpt, root / "engine", limits=LIMITS).path


# -- the drafts ---------------------------------------------------------------------------------------------------
def test_a_draft_is_what_followed_the_latest_occurrence_of_the_longest_tail_found():
    assert NgramIndex(1, 3).draft([1, 2, 3, 9, 8, 1, 2, 3], 4) == [9, 8, 1, 2]
    assert NgramIndex(1, 3).draft([1, 2, 5, 1, 2, 6, 7, 1, 2], 2) == [6, 7], "the latest occurrence"
    assert NgramIndex(1, 3).draft([4, 2, 3, 7, 3, 5, 2, 3], 3) == [7, 3, 5], "the 2-gram (2, 3) before the 1-gram 3"
    assert NgramIndex(2, 3).draft([4, 2, 3, 7, 3], 3) == [], "no 2-gram ends in 7, 3 earlier"
    assert NgramIndex(1, 3).draft([5, 5], 4) == [5], "the tail is never its own match"
    index, tokens = NgramIndex(1, 2), [1, 2, 3]
    assert index.draft(tokens, 4) == []
    tokens += [1, 2]
    assert index.draft(tokens, 4) == [3, 1, 2], "indexed as the tokens grow"
    assert accepted_length([4, 5, 6], [4, 5, 7, 8]) == 2 and accepted_length([4], [4, 9]) == 1
    assert accepted_length([4, 5], [3, 5, 6]) == 0


def test_a_drafter_backs_off_after_misses_and_drafts_again_after_an_acceptance():
    drafter = Drafter(SpeculativeOptions(max_draft=2))
    assert drafter.propose([1, 2, 3], room=4) == [] and drafter.wait == 1, "nothing matches: one step off"
    assert drafter.propose([1, 2, 3, 1], room=4) == [] and drafter.due
    assert drafter.propose([1, 2, 3, 1, 2], room=4) == [3, 1], "max_draft"
    drafter.verified(0)
    assert (drafter.misses, drafter.wait) == (2, 2)
    drafter.passed()
    assert not drafter.due
    drafter.passed()
    assert drafter.propose([1, 2, 3, 1, 2], room=1) == [3], "the room the scheduler gives"
    drafter.verified(1)
    assert drafter.due and drafter.misses == 0
    for _ in range(12):
        drafter.verified(0)
    assert drafter.wait == MAX_BACKOFF_STEPS, "the back-off is capped"


def test_the_option_is_parsed_from_a_mapping_a_word_or_json_and_a_bad_one_is_refused_by_name():
    assert parse_speculative(None) is None and parse_speculative("off") is None and parse_speculative(" ") is None
    assert parse_speculative("ngram") == SpeculativeOptions()
    assert parse_speculative('{"max_draft": 6, "min_ngram": 2}') == SpeculativeOptions(max_draft=6, min_ngram=2)
    assert resolve_options(torch.device("cpu"), overrides={"speculative": NGRAM}).speculative == SpeculativeOptions()
    assert resolve_options(torch.device("cpu")).speculative is None, "off by default"
    for bad, message in [("eagle", r"speculative='eagle': expected 'off', one of \['ngram'\]"),
                         ({"method": "draft-model"}, r"speculative.method='draft-model': expected one of"),
                         ({"max_draft": 0}, r"speculative.max_draft=0: expected a whole number from 1 to 64"),
                         ({"min_ngram": 4, "max_ngram": 3}, r"speculative.min_ngram=4 > speculative.max_ngram=3"),
                         ({"lookahead": 3}, r"speculative: \['lookahead'\] are not known")]:
        with pytest.raises(EngineLimitError, match=message):
            resolve_options(torch.device("cpu"), overrides={"speculative": bad})
    with pytest.raises(ValueError, match=r"parameter speculative='\{\"max_draft\": 99\}': speculative.max_draft=99"):
        check_parameters({"speculative": '{"max_draft": 99}'})
    check_parameters({"speculative": '{"method": "ngram", "max_draft": 8}'})


def test_the_loaded_configuration_names_the_drafting(tiny):
    assert loaded_configuration(load_engine(tiny, device="cpu")).speculative == "off"
    loaded = loaded_configuration(load_engine(tiny, device="cpu", overrides={"speculative": NGRAM}))
    assert loaded.speculative == "ngram(max_draft=4, max_ngram=3, min_ngram=1)"


# -- the verification -----------------------------------------------------------------------------------------------
def mixed_batch(vocab: int) -> list[Ask]:
    return [
        Ask([0, 5, 6, 7, 5, 6, 7, 5], 20, top_logprobs=3),
        Ask([0, 9, 10, 11, 12, 13, 14, 15], 17),
        Ask([0, 100, 3, 100, 3], 12, SamplingParams(temperature=0.9, top_p=0.9, seed=11)),
        Ask([0, 42, 283, 42], 15, SamplingParams(temperature=0.0, repetition_penalty=1.3, min_tokens=3)),
        Ask([0, 7, 8, 7], 14, mask=AllBut({3, 4, 5}, vocab)),
        Ask([0, 1, 2, 3, 4, 5], 18, SamplingParams(temperature=0.7, seed=5), top_logprobs=2),
    ]


def oracle(reference: dict[tuple[int, ...], list[int]], wrong_every: int):
    """A `Drafter.propose` that drafts the tokens the request gets without speculation (the run `reference`), with
    its second draft token wrong at every `wrong_every`-th output position: drafts accepted whole, in part, not."""

    def propose(self: Drafter, tokens: list[int], room: int) -> list[int]:
        prompt = next(p for p in reference if tuple(tokens[:len(p)]) == p)
        done = len(tokens) - len(prompt)
        draft = reference[prompt][done:done + min(room, self.options.max_draft)]
        if len(draft) > 1 and done % wrong_every == 0:
            draft[1] = (draft[1] + 1) % 512
        return draft

    return propose


@pytest.mark.parametrize("step_ahead", [True, False])
def test_drafts_accepted_in_part_give_every_request_the_tokens_and_logprobs_it_gets_without_them(tiny, monkeypatch,
                                                                                                   step_ahead):
    """Six requests at once, their drafts in the rows the live cap of 12 leaves: greedy with top log-probs, greedy, two
    sampled with seeds, greedy with penalties and min_tokens, a guided one (never drafts); drafts that are right,
    right up to their second token, or too long for `max_tokens`; stop tokens end some mid-draft."""
    plain = load_engine(tiny, device="cpu")
    asks = mixed_batch(plain.info.model.vocab_size)
    first = run(Scheduler(plain), asks)
    stops = tuple({first[0].tokens[9], first[1].tokens[12]})  # stops two requests, maybe with drafted tokens after
    asks = [dataclasses.replace(a, stop=stops) if i < 2 else a for i, a in enumerate(asks)]
    fresh = lambda: [dataclasses.replace(a, mask=AllBut(a.mask.banned, a.mask.vocab)) if a.mask else a for a in asks]
    want = run(Scheduler(plain, step_ahead=step_ahead), fresh())
    assert want[0].reason == "stop" and want[5].reason == "length"
    monkeypatch.setattr(Drafter, "propose", oracle({tuple(a.prompt): w.tokens for a, w in zip(asks, want)}, 3))
    speculative = load_engine(tiny, device="cpu", overrides={"speculative": NGRAM})
    shared_table, decode_step = [], speculative.decode.step

    def decode(chunks, device_tokens=None):
        shared_table.append(len({id(table) for _, _, table in chunks}) < len(chunks))
        return decode_step(chunks, device_tokens)

    monkeypatch.setattr(speculative.decode, "step", decode)
    sched = Scheduler(speculative, step_ahead=step_ahead)
    got = run(sched, fresh())
    assert_same(got, want)
    s = sched.stats
    assert s.draft_steps > 0 and 0 < s.accepted_tokens < s.drafted_tokens, s
    assert s.steps < sum(len(w.tokens) for w in want) // 2, "accepted drafts saved steps"
    assert any(shared_table), "drafts were verified in decode-only steps (the decode graphs on CUDA)"
    assert speculative.allocator.free == plain.allocator.free, "every block given back"


def test_a_request_cancelled_by_its_emit_gets_no_accepted_token_past_it(tiny, monkeypatch):
    """What a stop string does (the `llm` model cancels the request from its `emit`): the accepted draft tokens
    after that token are not delivered."""
    from serving.engine.scheduler import RequestCancelled

    prompt = [0, 9, 10, 11, 12, 13, 14, 15]
    want = run(Scheduler(load_engine(tiny, device="cpu")), [Ask(prompt, 16)])[0].tokens
    monkeypatch.setattr(Drafter, "propose", oracle({tuple(prompt): want}, 100))
    sched = Scheduler(load_engine(tiny, device="cpu", overrides={"speculative": NGRAM}))
    got: list[int] = []
    failures: list[BaseException] = []

    def emit(ids: list[int], reason: str | None) -> None:
        got.extend(ids)
        if len(got) == 3:  # mid-draft: the step delivering tokens 2-6 stops at 3
            sched.cancel(request)

    request = GenRequest(prompt, 16, emit, failures.append)
    sched.submit(request)
    sched.run_until_idle()
    assert got == want[:3] and isinstance(failures[0], RequestCancelled)
    assert sched.stats.accepted_tokens > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_drafts_are_verified_in_the_decode_graphs_and_change_no_token(tiny, monkeypatch):
    """The same on CUDA (float32: tokens compare exactly; TF32 may move log-probs a little): steps of decodes and
    drafts replay the captured decode graphs."""
    plain = load_engine(tiny, device="cuda")
    asks = [a for a in mixed_batch(plain.info.model.vocab_size) if a.mask is None]
    want = run(Scheduler(plain), asks)
    monkeypatch.setattr(Drafter, "propose", oracle({tuple(a.prompt): w.tokens for a, w in zip(asks, want)}, 3))
    speculative = load_engine(tiny, device="cuda", overrides={"speculative": NGRAM})
    speculative.warm_up_decode()
    sched = Scheduler(speculative)
    assert_same(run(sched, asks), want, tolerance=1e-2)
    assert sched.stats.accepted_tokens > 0 and speculative.decode.graphs and speculative.decode.steps > 0


def test_preempted_drafting_requests_finish_with_the_same_tokens(tiny, monkeypatch):
    """Five requests of 58 positions (8 blocks of 8) over a pool of 12 blocks: requests are preempted while they
    draft, and finish as without speculation."""
    config = KVCacheConfig(block_size=8, num_blocks=12, max_num_tokens=24)
    asks = [Ask([0, 3 + i, 9, 3 + i, 9, 30 + i] * 3, 40) for i in range(5)]
    plain = load_engine(tiny, device="cpu", config=config)
    want = run(Scheduler(plain), asks)
    monkeypatch.setattr(Drafter, "propose", oracle({tuple(a.prompt): w.tokens for a, w in zip(asks, want)}, 4))
    sched = Scheduler(load_engine(tiny, device="cpu", config=config, overrides={"speculative": NGRAM}))
    assert_same(run(sched, asks), want)
    assert sched.stats.preempted > 0 and sched.stats.accepted_tokens > 0, sched.stats


def test_ngram_drafting_on_the_tiny_model_gives_the_tokens_it_gets_without(tiny):
    """The real drafter (the tiny model's continuations rarely repeat: drafts are mostly rejected). A prompt of 40
    distinct tokens gives its generated tokens something to match."""
    asks = [Ask(list(range(3, 43)), 38), Ask([1, 2, 3, 1, 2, 3, 1, 2], 30, stop=(7,)), Ask([0, 100], 25)]
    want = run(Scheduler(load_engine(tiny, device="cpu")), asks)
    sched = Scheduler(load_engine(tiny, device="cpu", overrides={"speculative": {"max_draft": 6, "min_ngram": 1}}))
    assert_same(run(sched, asks), want)
    assert sched.stats.drafted_tokens > 0


# -- the example model ----------------------------------------------------------------------------------------------
SMOL_LIMITS = EngineLimits(dtype="float32", max_batch_size=8, max_input_len=160, max_seq_len=224)
TEXT = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step."


@pytest.mark.slow
def test_smollm2_repeating_a_text_accepts_drafts_and_keeps_its_greedy_tokens(smollm2_checkpoint, tmp_path):
    from transformers import AutoTokenizer

    torch.set_num_threads(min(2, torch.get_num_threads()))
    engine = build_engine(convert_checkpoint(smollm2_checkpoint, tmp_path / "ckpt", dtype="float32"),
                          tmp_path / "engine", limits=SMOL_LIMITS).path
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    chats = [f"Repeat this text exactly: {TEXT}", "Name three colours."]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)
               for c in chats]
    eos = (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    asks = [Ask(prompts[0], 32, stop=eos, top_logprobs=2), Ask(prompts[1], 12, stop=eos)]
    want = run(Scheduler(load_engine(engine, device="cpu")), asks)
    assert TEXT[-40:] in tokenizer.decode(want[0].tokens), "the model repeats the text"
    sched = Scheduler(load_engine(engine, device="cpu", overrides={"speculative": NGRAM}))
    assert_same(run(sched, asks), want)
    assert sched.stats.accepted_tokens >= 8 and sched.stats.steps < len(want[0].tokens), sched.stats
