"""The gates' pieces on tiny models: EOS in the greedy comparison, the paired tests of the fixed evaluation,
the per-precision limits, and the perf gate's A/B against a production engine (a real engine slowed or made
to fail by tasks.fault_injection)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gate_faults import SlowedRunner

from serving.engine import build_engine, convert_checkpoint, load_engine
from serving.engine.build import EngineLimits
from tasks.evaluation import EvaluationScores, EvaluationSpec, compare_scores
from tasks.fault_injection import FaultyRunner
from tasks.gate_power import detectable, paired_bounds, sign_test_critical, t_quantile, units_for_power
from tasks.perf_gate import (
    PerfSpec,
    ab_verdict,
    check_rounds_can_decide,
    compare_runners,
    median_interval,
    planned_looks,
    render_report,
    settle,
)
from tasks.quality_budgets import PRECISION_BUDGETS, budget_for, quantized_precision
from tasks.tiny_model import make_tiny_model
from tasks.validate import ValidationSpec, _Side, compare_greedy, validate_engine

EOS = 1


def test_a_side_that_stops_at_eos_is_judged_with_top_n_tolerance():
    ref = _Side([5, 7, EOS], [{5: -0.1}, {7: -0.2, 9: -1.0}, {EOS: -0.3, 4: -0.9}])
    stops_early = _Side([5, 7, 4, 8], [{5: -0.1}, {7: -0.2}, {4: -0.5, EOS: -0.7}, {8: -0.1}])
    assert compare_greedy(reference=ref, engine=stops_early) == ("tolerated", 2)
    eos_unlikely = _Side([5, 7, 4], [{5: -0.1}, {7: -0.2}, {4: -0.5, 3: -0.7}])
    assert compare_greedy(reference=ref, engine=eos_unlikely) == ("diverged", 2)
    assert compare_greedy(reference=ref, engine=ref) == ("identical", None)


def test_power_sizes_the_sample_from_budget_spread_and_alpha():
    import math
    import random

    import scipy.stats

    assert t_quantile(0.99, 15) == pytest.approx(scipy.stats.t.ppf(0.99, 15), rel=1e-9)
    assert t_quantile(0.9, 1) == pytest.approx(scipy.stats.t.ppf(0.9, 1), rel=1e-9)
    n = units_for_power(math.log(1.05), 0.03, alpha=0.01)  # a 5% perplexity budget, passages' spread 0.03
    assert detectable(n, 0.03, 0.01) <= math.log(1.05) < detectable(n - 1, 0.03, 0.01)
    # simulated: n units of that spread, no true change, pass (upper bound within the budget) >= 90% of the time
    rng = random.Random(0)
    passes = sum(paired_bounds([rng.gauss(0, 0.03) for _ in range(n)], 0.01).verdict(math.log(1.05)) == "within"
                 for _ in range(2000))
    assert passes / 2000 >= 0.88
    assert sign_test_critical(8, 0.01) == 8 and sign_test_critical(6, 0.01) is None  # 2**-6 > 0.01


def scores(ppl_ratio: float, correct: list[bool], passages: int = 16) -> EvaluationScores:
    """Passages of 50 tokens each at production's NLL (2 nats/token) times log-ratio, the given item results."""
    import math

    nll = [50 * (2.0 + math.log(ppl_ratio) + 0.01 * ((i % 5) - 2)) for i in range(passages)]
    return EvaluationScores([x / 200 for x in nll], correct, nll, [50] * passages)


def test_the_evaluation_refuses_beyond_budget_and_undecided_and_passes_within():
    spec = EvaluationSpec(max_perplexity_increase=0.05, max_accuracy_drop_points=20, alpha=0.01)
    production = scores(1.0, [True] * 30 + [False] * 6)
    same = compare_scores(production, production, spec, production_version="3")
    assert same.passed and [p.verdict for p in same.parts] == ["within", "within"]
    slightly = scores(1.01, [True] * 29 + [False] * 7)  # 1% more perplexity, one item lost: within budget
    assert compare_scores(slightly, production, spec, production_version="3").passed
    worse = scores(1.15, [True] * 20 + [False] * 16)
    result = compare_scores(worse, production, spec, production_version="3")
    assert not result.passed and [p.verdict for p in result.parts] == ["beyond", "undecided"]
    assert any(f.startswith("fixed evaluation: perplexity change +15.00% against production version 3 (interval [+")
               and "evaluation.max_perplexity_increase +5.00%: beyond the budget: refused" in f
               for f in result.failures), result.failures
    assert any("cloze accuracy drop (points) +27.8" in f and "evaluation.on_inconclusive: refuse" in f
               for f in result.failures), result.failures
    held = compare_scores(worse, production, spec.model_copy(update={"on_inconclusive": "hold"}),
                          production_version="3")
    assert not held.passed and [p.name for p in held.held] == ["cloze"], "beyond still refuses; undecided is held"


def test_old_budget_fields_are_refused_naming_the_new_ones():
    with pytest.raises(ValueError, match="evaluation.max_nll_regression .* is replaced by "
                                         "evaluation.max_perplexity_increase"):
        EvaluationSpec(max_nll_regression=0.02)
    with pytest.raises(ValueError, match="max_accuracy_drop_points"):
        EvaluationSpec.model_validate({"max_accuracy_drop": 0.1})



def test_holding_an_undecided_gate_needs_a_person_to_approve():
    from flows.spec import SpecError, parse_spec

    spec = {"source": {"checkpoint": "/ckpt"}, "mlflow": {"tracking_uri": "sqlite:///m.db", "model_name": "m"},
            "artifacts": {"uri": "file:///a"}, "perf": {"on_inconclusive": "hold"}}
    with pytest.raises(SpecError, match="perf.on_inconclusive 'hold' publishes an undecided release for a person's "
                                        "review, but approval.mode is 'auto'"):
        parse_spec({**spec, "approval": {"mode": "auto"}})
    assert parse_spec({**spec, "approval": {"mode": "mlflow-tag"}}).perf.on_inconclusive == "hold"


def test_perf_verdict_is_a_sign_test_with_planned_looks():
    import math

    budget = 0.9
    logs = lambda ratios: [math.log(r) for r in ratios]
    assert ab_verdict(logs([0.5] * 8), budget, alpha=0.01) == "slower"  # p = 2**-8
    assert ab_verdict(logs([0.5] * 6), budget, alpha=0.01) == "undecided"  # 2**-6 > 0.01: too few rounds
    assert ab_verdict(logs([1.0] * 8), budget, alpha=0.01) == "within"
    # a burst makes one round very slow: it counts as one round below the budget, not as a large mean
    assert ab_verdict(logs([1.0] * 7 + [0.01]), budget, alpha=0.05) == "within"
    assert ab_verdict(logs([0.85, 1.1] * 6), budget, alpha=0.05) == "undecided"
    looks, alpha = planned_looks(PerfSpec(iterations=5, max_iterations=30, confidence=0.95))
    assert looks == [7, 14, 28, 30] and alpha == pytest.approx(0.05 / 4) and 2 ** -looks[0] < alpha
    assert median_interval(logs([1.0] * 3), 0.95)[1:] == (0.0, math.inf)  # too few rounds for an interval
    ratio, low, high = median_interval(logs([0.8, 0.9, 1.0, 1.1, 1.2, 0.95, 1.05, 1.0]), 0.95)
    assert ratio == pytest.approx(1.0) and low == pytest.approx(0.8) and high == pytest.approx(1.2)
    # the rounds ran out undecided: an interval wholly below the budget is slower, whatever the looks said
    assert settle("undecided", interval_high=0.89, budget=budget) == "slower"
    assert settle("undecided", interval_high=0.95, budget=budget) == "undecided"
    assert settle("within", interval_high=0.95, budget=budget) == "within"
    with pytest.raises(ValueError, match="perf.max_iterations 2 can never decide: .* asks for 5 rounds"):
        check_rounds_can_decide(PerfSpec(iterations=2, max_iterations=2), *planned_looks(PerfSpec(iterations=2,
                                                                                                  max_iterations=2)))


def test_quality_budgets_are_one_table_keyed_by_precision():
    assert {"float32", "bfloat16", "float16"} <= set(PRECISION_BUDGETS)
    assert budget_for("float32").peer_dtype is None
    assert budget_for("float32").extra_diverged_prompts == 0  # float32 must diverge nowhere HF float32 does not
    assert budget_for("bfloat16").extra_diverged_prompts == budget_for("bfloat16+fp8").extra_diverged_prompts == 1
    with pytest.raises(ValueError, match="engine.dtype='int3' has no quality budget"):
        budget_for("int3")
    fp8 = budget_for(quantized_precision("bfloat16", "fp8", lm_head=True))  # "bfloat16+fp8+lm_head"
    assert (fp8.peer_dtype, fp8.peer_quantization, fp8.peer_lm_head) == ("bfloat16", "fp8", True)
    assert budget_for("float32+int8-weight-only").peer_quantization == "int8-weight-only"
    with pytest.raises(ValueError, match="not <dtype>"):
        budget_for("float32+fp8+bias")


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gates")
    hf = make_tiny_model(root / "hf", seed=3)
    ckpt = convert_checkpoint(hf, root / "ckpt", dtype="float32")
    info = build_engine(ckpt, root / "engine", limits=EngineLimits(dtype="float32", max_batch_size=4,
                                                                   max_input_len=64, max_seq_len=128))
    return hf, Path(info.path)


PERF = PerfSpec(batch_size=2, input_len=8, output_len=8, warmup=1, iterations=4, max_iterations=12)


def test_perf_gate_refuses_an_engine_slower_than_production_in_the_same_run(tiny_engine):
    _, engine = tiny_engine
    production = load_engine(engine)
    same = compare_runners(load_engine(engine), production, PERF, production_version="1")
    # the same engine against itself: never slower; on a loaded 2-core machine its rounds may end undecided,
    # which refuses by default and names its interval (perf.on_inconclusive: hold would publish it for review)
    assert same.passed or same.inconclusive, same.failures
    assert same.passed or "holds the budget 1 - perf.max_slowdown = 0.90" in same.failures[0]
    assert same.rounds_needed == 9 and same.slowest_detected_within is not None
    assert same.throughput_ratio is not None and 0.5 < same.throughput_ratio < 2.0  # a loaded 2-core machine
    slow = SlowedRunner(load_engine(engine), factor=2)  # twice the work of each call: 2x slower under any load
    result = compare_runners(slow, production, PERF, production_version="1")
    assert not result.passed, result.stopped
    assert "production version 1's in the same run" in result.failures[0] and "perf.max_slowdown" in result.failures[0]
    assert "ABBA rounds" in result.failures[0] and "sign test" in result.failures[0]
    assert result.throughput_ratio is not None and result.throughput_ratio < 0.75
    assert result.production is not None and result.production.iterations == result.iterations
    report = render_report(result)
    assert "production v1 (same run)" in report and "interval" in report


def test_perf_gate_refuses_an_engine_that_returns_errors(tiny_engine):
    _, engine = tiny_engine
    failing = FaultyRunner(load_engine(engine), {"error_rate": 1.0})
    result = compare_runners(failing, None, PERF, skipped="no production version")
    assert not result.passed
    assert "error rate 1.00" in result.failures[0] and "perf.slo.max_error_rate" in result.failures[0]


def test_validation_refuses_an_engine_that_raises(tiny_engine):
    hf, engine = tiny_engine
    spec = ValidationSpec(prompts=["Once upon a time"], max_new_tokens=4, passages=["The quick brown fox."])
    good = validate_engine(engine, hf, spec)
    assert good.passed, good.failures
    failing = FaultyRunner(load_engine(engine), {"error_rate": 1.0})
    result = validate_engine(engine, hf, spec, runner=failing)
    assert not result.passed and "the engine raised RuntimeError: injected fault" in result.failures[0]
