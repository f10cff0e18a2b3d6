"""The version page (description) and the release report's wording and HTML form, as plain functions."""

from __future__ import annotations

from pathlib import Path

from tasks.evaluation import EvaluationScores, EvaluationSpec, compare_scores
from tasks.output_distribution import Continuation, PassageDistances
from tasks.perf_gate import PerfResult, PerfSlo
from tasks.report import comparison_table, render_html
from tasks.text_path import TokenizerCheck
from tasks.token_stats import DistanceFigures
from tasks.validate import PromptComparison, ValidationResult
from tasks.version_page import Provenance, VersionPage, change_word


def results() -> tuple[ValidationResult, PerfResult]:
    figures = DistanceFigures(positions=200, mean_kl=1.5e-6, nll_reference=2.0, nll_other=2.0001,
                              top1_agreement=1.0, max_logit_error=0.0)
    validation = ValidationResult(
        passed=True, precision="float32",
        comparisons=[PromptComparison("Once upon a time", "identical", None, None, None, "a", "a")],
        engine=figures, peer=None, peer_diverged_prompts=0, text_path=TokenizerCheck({}, 3),
        thresholds={"max_failed_prompts": 0, "max_mean_kl": 1e-5, "max_nll_delta": 1e-3,
                    "max_top1_disagreement": 0.005, "peer_factor": 0.0})
    perf = PerfResult(passed=True, output_tokens_per_s=812.0, ttft_p50_ms=5.0, ttft_p99_ms=9.0, tpot_p50_ms=1.2,
                      tpot_p99_ms=2.0, workload={"batch_size": 4, "max_slowdown": 0.1}, failures=[], iterations=6,
                      production_version="3", throughput_ratio=1.02, ratio_interval=(0.98, 1.06),
                      rounds=6, rounds_needed=10, slowest_detected_within=0.94)
    return validation, perf


def test_equal_figures_are_the_same_and_zero_is_not_infinitely_worse() -> None:
    assert change_word(0.0, 0.0, higher_is_better=False) == "same"
    assert change_word(1.0, 1.0, higher_is_better=True) == "same"
    assert change_word(2.0, 1.0, higher_is_better=True) == "2.000x, better"
    assert change_word(0.5, 0.0, higher_is_better=False) == "worse"
    rows = comparison_table({"validation_max_logit_error": 0.0, "validation_top1_agreement": 1.0},
                            {"validation_max_logit_error": 0.0, "validation_top1_agreement": 1.0})
    assert rows == ["| top-1 agreement | 1 | 1 | same |", "| max logit error | 0 | 0 | same |"]


def test_the_page_holds_verdicts_thresholds_comparison_provenance_and_links() -> None:
    validation, perf = results()
    built = Provenance("alice", "build-7", "0123456789abcdef", "f" * 64, "torch float32", {"torch": "2.13.0"})
    scores = EvaluationScores([1.0] * 16, [True] * 30 + [False] * 6, [100.0] * 16, [50] * 16)
    distances = PassageDistances([0.0] * 16, [0.0] * 16, [Continuation([5] * 8, [5] * 8, [])] * 48)
    evaluated = compare_scores(scores, scores, EvaluationSpec(), production_version="3", distances=distances)
    page = VersionPage(validation, perf, PerfSlo(min_output_tokens_per_s=50), ("3", {"perf_output_tokens_per_s": 406.0}),
                       built, "http://127.0.0.1:5000", evaluated, measured=True)
    text = page.render(fingerprint="abc" * 10, run=("1", "r1"),
                       manifest_uri="file:///a/manifest.json", report_folder="report")
    assert text.startswith("**Gates passed.** Approving promotes it in place of version 3 (alias `production`).")
    assert "### Gates: validation passed, performance passed, fixed evaluation passed" in text
    assert "| validation | mean KL to HF float32, nats/token | 1.5e-06 | <= 1e-05 |" in text
    assert "| validation | top-1 agreement (teacher-forced) | 1.0000 | >= 0.9950 |" in text
    assert "| fixed evaluation | perplexity change vs production | +0.00% [+0.00%, +0.00%]: within | <= +5.00%; n 16 " \
           "(90% power needs 8), detects +" in text
    assert "| fixed evaluation | cloze accuracy drop (points) vs production | +0.0 pt [+0.0 pt, +0.0 pt]: within | " \
           "<= +20.0 pt; n 36 (90% power needs 32), detects +" in text
    assert "| performance | throughput / production v3 (same run) | 1.020 [0.980, 1.060]: within | >= 0.90; 6 rounds " \
           "(90% power needs 10); passes >= 0.940x with 90% power |" in text
    assert "| performance | error rate | 0 of 6 | <= 0 |" in text
    assert "| fixed evaluation | greedy disagreement with production (8 tokens, 3 prompts a passage) vs production | " \
           "0 [0, 0]: within | <= 0.2; n 48 (90% power needs 32), detects " in text
    assert "(cut here" not in text, "every gate's row fits MLflow's 5000 characters"
    assert "both versions measured side by side in this run" in text
    assert "| performance | output tokens/s | 812 | >= 50 |" in text
    assert "| performance | TTFT p50 ms | 5 | not set |" in text
    assert "| output tokens/s | 812 | 406 | 2.000x, better |" in text
    assert "- by `alice` on `build-7`, code revision `0123456789ab`" in text and "torch 2.13.0" in text
    assert ("- [release report (gates, comparison, plots)](http://127.0.0.1:5000/#/experiments/1/runs/r1/artifacts/"
            "report/release-report.html?workflowType=machine_learning)") in text
    assert "- [MLflow run (params, metrics, all artifacts)](http://127.0.0.1:5000/#/experiments/1/runs/r1?workflowType=machine_learning)" in text
    assert "- engine artifact manifest: `file:///a/manifest.json`" in text  # no link a browser will not open


def test_an_undecided_gate_held_for_review_says_so_first_with_its_interval() -> None:
    validation, perf = results()
    perf.inconclusive = perf.held = True
    perf.ratio_interval = (0.85, 0.97)
    built = Provenance("alice", "build-7", "0123456789abcdef", "f" * 64, "torch float32", {"torch": "2.13.0"})
    page = VersionPage(validation, perf, PerfSlo(), ("3", {}), built, None)
    text = page.render(fingerprint="abc" * 10, run=None, manifest_uri="file:///a/manifest.json", report_folder="r")
    assert text.startswith("**Held for review: undecided, a person must judge.** throughput 1.020x production, "
                           "interval [0.850, 0.970] holds its budget 0.90.\n\n**Gates passed.**"), text
    assert "1.020 [0.850, 0.970]: undecided, held for review" in text


def test_the_html_report_carries_its_plots_inline(tmp_path: Path) -> None:
    png = tmp_path / "latency.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\nfake")
    html = render_html("# Report\n\n| a | b |\n| --- | --- |\n| 1 | 2 |\n\n![latency](latency.png)\n",
                       {"latency": png}, title="Report")
    assert "<table>" in html and '<img alt="latency" src="data:image/png;base64,iVBORw0KGgpmYWtl"' in html
    assert "latency.png" not in html


def test_the_page_shows_the_standard_evals_difference_interval_and_budget() -> None:
    from tasks.gate_specs import LmEvalTaskSpec
    from tasks.lm_eval_gate import LmEvalResult, paired_verdict

    validation, perf = results()
    built = Provenance("alice", "build-7", "0123456789abcdef", "f" * 64, "torch float32", {})
    task = LmEvalTaskSpec(name="enginewright_capitals", limit=40, max_drop=0.05)
    verdict = paired_verdict(task, {i: 0.0 for i in range(40)}, {i: float(i < 20) for i in range(40)}, alpha=0.05)
    page = VersionPage(validation, perf, PerfSlo(), ("3", {}), built, None, lm_eval=LmEvalResult([verdict], None, "3"))
    text = page.render(fingerprint="abc" * 10, run=None, manifest_uri="file:///m.json", report_folder="report")
    assert text.startswith("**Gates FAILED.**")
    assert "### Standard evals (lm-evaluation-harness) against production: **FAILED**" in text
    assert "| enginewright_capitals | exact_match | 40 | 0.000 | 0.500 | -0.500 [-0.632, -0.368] | drop <= 0.05 " \
           "(or p >= 0.05) |" in text, text
    skipped = VersionPage(validation, perf, PerfSlo(), None, built, None, lm_eval=LmEvalResult(skipped="first release"))
    assert "### Standard evals (lm-evaluation-harness): skipped (first release)" in skipped.render(
        fingerprint="a" * 16, run=None, manifest_uri="file:///m.json", report_folder="report")
