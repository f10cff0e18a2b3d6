"""The envelope gates' pieces on a tiny model: long prompts of the fixed texts, stop ids as served, the decode
and wide-batch comparisons, what a runner loaded against its record, and the served configuration against
production's. The faults through the real release flow: tests/test_release_envelope.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from gate_faults import decode_swaps_top2, rows_interfering

from serving.engine import build_engine, convert_checkpoint, load_engine
from serving.engine.build import EngineLimits
from serving.engine.kv_cache import KVCacheConfig
from serving.engine.loaded import loaded_configuration
from serving.engine.runner import Generation
from tasks.decode_check import DecodeLimits, check_timed_outputs, check_wide_batch
from tasks.envelope import envelope_lengths, long_prompt_ids, workload_lengths
from tasks.gate_specs import ServedSpec
from tasks.loaded_check import check_loaded
from tasks.served_config import compare_served, render_drift
from tasks.tiny_model import make_tiny_model
from tasks.validate import ValidationSpec, _hf_greedy, _hf_model, eos_token_ids, validate_engine

LIMITS = EngineLimits(dtype="float32", max_batch_size=6, max_input_len=96, max_seq_len=112)
PAGED = KVCacheConfig(block_size=16, num_blocks=48, max_num_tokens=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(HF checkpoint, an engine with the default KV cache, one with its pool set by hand)."""
    root = tmp_path_factory.mktemp("envelope")
    hf = make_tiny_model(root / "hf", seed=2)
    ckpt = convert_checkpoint(hf, root / "ckpt", dtype="float32")
    default = build_engine(ckpt, root / "default", limits=LIMITS).path
    paged = build_engine(ckpt, root / "paged", limits=LIMITS, kv_cache=PAGED).path
    return hf, Path(default), Path(paged)


def test_long_prompts_are_the_fixed_texts_cut_to_the_envelope(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny[0])
    texts = ["The river ran past the old mill.", "Nobody remembered who built the bridge."]
    lengths = envelope_lengths(2, max_input_len=96, max_seq_len=112, max_new_tokens=8, shortest=20)
    assert lengths[0] == 96 and 20 <= lengths[1] < 96  # the longest as near max_input_len as max_seq_len allows
    assert envelope_lengths(1, max_input_len=96, max_seq_len=100, max_new_tokens=8) == [92]
    ids = long_prompt_ids(tok, texts, 96)
    assert len(ids) == 96 and tok.decode(ids, skip_special_tokens=True).startswith("The river ran past the old mill.")
    assert workload_lengths(batch_size=3, input_len=8, max_input_len=96, max_seq_len=112, output_len=4) == [8, 8, 96]
    with pytest.raises(ValueError, match="max_seq_len=8 - max_new_tokens=8 leaves no position"):
        envelope_lengths(1, max_input_len=96, max_seq_len=8, max_new_tokens=8)


def test_stop_ids_are_the_served_engines_so_a_checkpoint_without_generation_config_runs_on(tiny, tmp_path):
    hf = tiny[0]
    assert eos_token_ids(hf) == [1]
    bare = shutil.copytree(hf, tmp_path / "bare")
    (bare / "generation_config.json").unlink()
    assert eos_token_ids(bare) == []  # config.json's eos_token_id is not what Triton's llm model stops at
    model = _hf_model(bare, "float32", "cpu")
    with torch.no_grad():  # every step's argmax is config.json's EOS
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.config.vocab_size))
        model.lm_head.bias[1] = 1e4
    side = _hf_greedy(model, [0, 5, 6], ValidationSpec(max_new_tokens=4), eos_token_ids(bare))
    assert len(side.tokens) == 4  # HF does not stop at an EOS the served engine would not stop at


def test_validation_runs_the_whole_envelope_and_passes_an_unchanged_engine(tiny):
    hf, static, _ = tiny
    spec = ValidationSpec(prompts=["Once upon a time", "def f(x):"], max_new_tokens=6,
                          passages=["The quick brown fox jumps over the lazy dog."])
    result = validate_engine(static, hf, spec)
    assert result.passed, result.failures
    assert [len(c.prompt) > 0 for c in result.comparisons] == [True] * 4  # 2 prompts + 2 long ones
    assert result.comparisons[2].prompt == "[fixed texts from #0, 96 tokens]"
    assert result.decode.positions == 4 * 6 and not result.decode.disagreements and result.decode.max_gap == 0
    assert result.wide_batch.rows == LIMITS.max_batch_size and not result.wide_batch.differences
    assert result.loaded.passed and result.metrics["validation_decode_disagreements"] == 0


def test_decode_only_and_wide_batch_faults_are_refused_with_their_evidence(tiny):
    hf, static, _ = tiny
    spec = ValidationSpec(prompts=["Once upon a time", "def f(x):"], max_new_tokens=6,
                          passages=["The quick brown fox jumps over the lazy dog."],
                          envelope={"long_prompts": 1})
    decode = validate_engine(static, hf, spec, runner=decode_swaps_top2(load_engine(static)))
    assert not decode.passed and all("free-running decode" in f for f in decode.failures), decode.failures
    assert "budget 0" in decode.failures[0] and "gap" in decode.failures[0]
    wide = validate_engine(static, hf, spec, runner=rows_interfering(load_engine(static), 3))
    assert [f[:11] for f in wide.failures] == ["wide batch:"], wide.failures
    assert "row 4 " in wide.failures[0] and "limits.max_batch_size=6" in wide.failures[0]  # (row 3 repeats row 0)


def test_rows_interfering_in_a_bfloat16_wide_batch_are_refused_by_the_decode_budget(tiny, tmp_path):
    """Reduced precision holds each batched row to the budget of a prompt alone: a bf16 engine passes, and
    the same engine with rows past the third leaking row 0's logits is refused, the rows' gap named."""
    hf = tiny[0]
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", dtype="bfloat16")
    bf16 = Path(build_engine(ckpt, tmp_path / "bf16", limits=dataclasses.replace(LIMITS, dtype="bfloat16")).path)
    spec = ValidationSpec(prompts=["Once upon a time", "def f(x):"], max_new_tokens=6,
                          passages=["The quick brown fox jumps over the lazy dog."], envelope={"long_prompts": 1})
    good = validate_engine(bf16, hf, spec)
    assert good.passed and good.wide_batch.figures.positions > 0, good.failures
    bad = validate_engine(bf16, hf, spec, runner=rows_interfering(load_engine(bf16), 3))
    wide = [f for f in bad.failures if f.startswith("wide batch:")]
    assert wide and "rows scored like the prompts alone" in wide[0] and "limits.max_batch_size=6" in wide[0], \
        bad.failures
    assert not any(f.startswith("free-running decode") for f in bad.failures)  # each prompt alone is right


def test_timed_outputs_are_checked_on_a_sample_by_the_decode_budget(tiny):
    hf, static, _ = tiny
    prompts = [[0, 5, 6, 7], [0, 9, 8], [0] + list(range(10, 60))]
    limits = DecodeLimits(max_disagreements=0, max_gap=1e-3, max_mean_logprob_delta=1e-3)
    good = load_engine(static).generate(prompts, max_new_tokens=4, logprobs=False)
    figures, failures = check_timed_outputs(hf, prompts, good, limits, sample=1)
    assert failures == [] and figures.positions == 2 * 4  # row 0 and the longest row
    bad = decode_swaps_top2(load_engine(static)).generate(prompts, max_new_tokens=4, top_logprobs=1)
    _, failures = check_timed_outputs(hf, prompts, bad, limits, sample=1)
    assert failures and "timed row 0 (4 tokens)" in failures[0]


def test_the_perf_gate_times_the_long_end_and_checks_what_it_timed(tiny):
    """The perf gate's workload ends with a row at the longest prompt both engines take; the candidate's timed
    generations are scored against HF float32: a decode fault that only the timed run shows is refused."""
    from tasks.gate_specs import PerfSpec
    from tasks.perf_gate import measure_engine

    hf, static, _ = tiny
    limits = DecodeLimits(max_disagreements=0, max_gap=1e-3, max_mean_logprob_delta=None)
    spec = PerfSpec(batch_size=2, input_len=8, output_len=4, warmup=0, iterations=2, check_outputs=1,
                    slo={"min_output_tokens_per_s": 0.01})  # no production: the candidate alone, timed twice
    good = measure_engine(static, spec, checkpoint=hf, decode_limits=limits)
    assert good.workload["prompt_lens"] == [8, LIMITS.max_input_len]  # max_seq_len 112 - 4 leaves 96 for the prompt
    assert good.outputs_checked and not any("timed outputs" in f for f in good.failures), good.failures
    faulty = measure_engine(static, spec, checkpoint=hf, decode_limits=limits,
                            runner=decode_swaps_top2(load_engine(static)))
    timed = [f for f in faulty.failures if f.startswith("timed outputs (perf.check_outputs): ")]
    # rows 0 and 1 (the first and the longest) scored: 8 tokens, the worst named with its evidence
    assert timed and "of 8 generated tokens are not HF's argmax" in timed[0], faulty.failures
    assert "prompt 'timed row 0 (8 random tokens)' token " in timed[0] and "gap" in timed[0], faulty.failures
    assert not faulty.passed
    short = measure_engine(static, spec.model_copy(update={"long_row": False, "check_outputs": 0}), None)
    assert short.workload["prompt_lens"] == [8, 8] and not short.outputs_checked


def test_a_reduced_precision_wide_batch_holds_each_row_to_the_decode_budget():
    """A row breaking a near-tie its own way passes; a row leaving HF's argmax by more than the gap, or more rows
    off HF's argmax than the per-row allowance, is refused with the evidence; float32 wants every row equal."""
    def gen(tokens):
        return Generation(token_ids=tokens, logprobs=[0.0] * len(tokens), top_logprobs=[{} for _ in tokens])

    hf = torch.full((3, 10), -10.0)  # HF float32 over [1, 2, x]: token 5 then a near-tie of 6 over 7, 8 far
    hf[1, 5], hf[2, 6], hf[2, 7] = 0.0, 0.0, -0.02
    alone = [gen([5, 6])]

    def batch(second):
        return lambda rows: [gen([5, second]) if r == 1 else alone[0] for r in range(len(rows))]

    def check(second, *, exact=False, disagreements=1, max_rows=None):
        return check_wide_batch(batch(second), [[1, 2]], alone, width=2, exact=exact, labels=["p"],
                                limits=DecodeLimits(disagreements, 0.05, None), reference_logits=lambda i, seq: hf,
                                max_rows=max_rows)

    tie = check(7)
    assert tie.passed and len(tie.differences) == 1 and len(tie.figures.disagreements) == 1
    assert tie.figures.max_gap == pytest.approx(0.02, abs=1e-6)
    far = check(8)
    assert "wide batch: 1 of 2 rows" in far.failures[0] and "largest gap 10 nats > budget 0.05" in far.failures[0]
    assert not check(7, disagreements=0).passed  # the allowance is per prompt, times the rows: 0 here
    assert "max_wide_batch_rows: at most 0" in check(7, max_rows=0).failures[0]
    exact = check(7, exact=True)
    assert "float32: every row must equal its output alone" in exact.failures[0]
    assert "row 1 (prompt 'p') at token 1: batched 7 vs alone 6" in exact.failures[0]


def test_the_runner_reports_what_it_loaded_and_a_kv_cache_the_record_lacks_is_refused(tiny):
    _, default, paged = tiny
    loaded = loaded_configuration(load_engine(default, device="cpu"))
    assert (loaded.kv_cache_dtype, loaded.weight_dtype, loaded.quantization) == ("float32", "float32", "none")
    runner = load_engine(paged, device="cpu")
    assert check_loaded(runner, "float32").passed
    fp8 = load_engine(paged, config=dataclasses.replace(PAGED, kv_cache_dtype="fp8"), device="cpu")
    check = check_loaded(fp8, "float32")
    assert check.loaded["kv_cache_dtype"] == "float8_e4m3fn" and check.loaded_precision == "float32+fp8-kv"
    assert "the runner loaded kv_cache_dtype 'float8_e4m3fn', the engine record" in check.failures[0]
    assert "the gate's budget is precision 'float32'" in check.failures[1]


def _served_copy(engine: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if (engine / name).is_file():
            shutil.copy(engine / name, dst / name)
    return dst


def test_served_configuration_against_production(tiny, tmp_path):
    hf, static, _ = tiny
    production = _served_copy(static, tmp_path / "production")
    (production / "chat_template.jinja").write_text("{{ messages }}")
    same = _served_copy(static, tmp_path / "same")
    (same / "chat_template.jinja").write_text("{{ messages }}")
    assert compare_served(same, production, ServedSpec(), checkpoint=hf, production_version="3").passed

    lost = _served_copy(static, tmp_path / "lost")  # no chat template; greedy defaults changed
    generation = json.loads((lost / "generation_config.json").read_text())
    (lost / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.2}))
    drift = compare_served(lost, production, ServedSpec(), checkpoint=hf, production_version="3")
    assert [d.part for d in drift.differences] == ["chat_template", "generation_defaults"]
    assert drift.failures[0].startswith("served configuration: chat_template lost against production version 3: "
                                        "production {{ messages }}, candidate (none)")
    assert "generation_defaults changed" in drift.failures[1] and '"temperature": 0.2' in drift.failures[1]
    accepted = compare_served(lost, production, ServedSpec(accept={"chat_template": "base model, no chat",
                                                                   "generation_defaults": "cooler"}),
                              checkpoint=hf, production_version="3")
    assert accepted.passed
    page = "\n".join(render_drift(accepted))
    assert "| chat_template | {{ messages }} | (none) | accepted: base model, no chat |" in page

    (lost / "generation_config.json").unlink()  # no stop ids at all; checked with no production too
    alone = compare_served(lost, None, ServedSpec(), checkpoint=hf, skipped="first release")
    assert "the engine stops at no token id" in alone.failures[0] and "config.json names [1]" in alone.failures[0]
