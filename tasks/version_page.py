"""The MLflow version page an approver decides from: the registered version's description (markdown,
which the MLflow UI renders on the page).

It holds what a person needs and nothing a machine reads: the verdict of each gate with its figures and
thresholds, the comparison with the version it would replace, who and what built it, and links to the
run's report and plots. Machines read the few version tags of `registry.model_registry.VERSION_TAGS`.
MLflow keeps at most 5000 characters of a description, so the page is a summary; the report is linked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from registry.model_registry import run_ui_url
from tasks.evaluation import EvaluationComparison, evaluation_verdict, part_format
from tasks.lm_eval_gate import LmEvalResult
from tasks.perf_gate import PerfResult, PerfSlo
from tasks.served_config import ServedDrift, render_drift
from tasks.validate import ValidationResult

MAX_DESCRIPTION_CHARS = 5000  # MLflow's column size for a model version's description

# (metric key, label, higher is better): the figures compared with the version this one would replace
COMPARED = (
    ("perf_output_tokens_per_s", "output tokens/s", True),
    ("perf_ttft_p50_ms", "TTFT p50 ms", False),
    ("perf_ttft_p99_ms", "TTFT p99 ms", False),
    ("perf_tpot_p50_ms", "TPOT p50 ms", False),
    ("eval_nats_per_byte", "fixed evaluation nats/byte", False),
    ("eval_choice_accuracy", "fixed evaluation cloze accuracy", True),
    ("validation_mean_kl", "mean KL to HF float32", False),
    ("validation_top1_agreement", "top-1 agreement", True),
    ("validation_max_logit_error", "max logit error", False),
)


@dataclass(frozen=True)
class Comparison:
    label: str
    candidate: float
    production: float | None
    change: str  # "same", "1.250x, better", "worse" (against 0), "-" (nothing to compare with)


@dataclass(frozen=True)
class Provenance:
    """Who and what built the version."""

    user: str
    host: str
    code_revision: str
    spec_sha256: str
    engine: str  # e.g. "torch float32, max batch 8, max seq 256"
    toolchain: dict[str, str]


def change_word(value: float, base: float, higher_is_better: bool) -> str:
    """How `value` compares with `base`: 'same' when equal, else the ratio and 'better' / 'worse'."""
    if math.isclose(value, base, rel_tol=1e-6, abs_tol=1e-12):
        return "same"
    better = value > base if higher_is_better else value < base
    word = "better" if better else "worse"
    return word if base == 0 else f"{value / base:.3f}x, {word}"


def compare_figures(candidate: dict[str, float], production: dict[str, float] | None) -> list[Comparison]:
    """One row per compared figure the candidate has; '-' where production has no such figure."""
    rows = []
    for key, label, higher_is_better in COMPARED:
        if key not in candidate:
            continue
        value = candidate[key]
        if not production or key not in production:
            rows.append(Comparison(label, value, None, "-"))
            continue
        rows.append(Comparison(label, value, production[key], change_word(value, production[key], higher_is_better)))
    return rows


def gate_rows(validation: ValidationResult, perf: PerfResult, slo: PerfSlo,
              evaluation: EvaluationComparison | None = None) -> list[tuple[str, str, str, str]]:
    """(gate, figure, value, threshold) for every checked figure of the gates."""
    t = validation.thresholds
    e = validation.engine
    diverged = sum(c.status == "diverged" for c in validation.comparisons)
    rows = [("validation", "tokenizer files and server tokenization", "equal" if validation.text_path.passed
             else "DIFFERENT", "equal to the checkpoint's")]
    if e is not None:
        rows += [
            ("validation", "mean KL to HF float32, nats/token", f"{e.mean_kl:.3g}", f"<= {t['max_mean_kl']:.3g}"),
            ("validation", "NLL difference to HF float32, nats/token", f"{e.nll_delta:+.3g}",
             f"\\|.\\| <= {t['max_nll_delta']:.3g}"),
            ("validation", "top-1 agreement (teacher-forced)", f"{e.top1_agreement:.4f}",
             f">= {1 - t['max_top1_disagreement']:.4f}"),
        ]
    rows.append(("validation", "prompts diverged from HF", f"{diverged} of {len(validation.comparisons)}",
                 f"<= {t['max_failed_prompts']:g}"))
    rows += envelope_rows(validation)
    for part in (evaluation.parts if evaluation else []):
        fmt = part_format(part.name)
        verdict = "held for review" if part.held else part.verdict
        rows.append(("fixed evaluation", f"{part.label} vs production", (f"{fmt(part.figure)} [{fmt(part.low)}, "
                     f"{fmt(part.high)}]: {verdict}"), (f"<= {fmt(part.budget)}; n {part.units} (90% power needs "
                     f"{part.needed}), detects {fmt(part.detectable)}")))
    if evaluation is not None and evaluation.skipped:
        rows.append(("fixed evaluation", "against production", "skipped", evaluation.skipped))
    if perf.throughput_ratio is not None:
        budget = 1 - float(perf.workload.get("max_slowdown", 0.0))
        low, high = perf.ratio_interval or (float("nan"), float("nan"))
        power = (f"; {perf.rounds} rounds (90% power needs {perf.rounds_needed}); passes >= "
                 f"{perf.slowest_detected_within:.3f}x with 90% power" if perf.rounds_needed is not None
                 and perf.slowest_detected_within is not None else "")
        rows.append(("performance", f"throughput / production v{perf.production_version} (same run)",
                     f"{perf.throughput_ratio:.3f} [{low:.3f}, {high:.3f}]: {perf_verdict(perf)}",
                     f">= {budget:.2f}{power}"))
    rows.append(("performance", "error rate", f"{perf.errors} of {perf.iterations}", f"<= {slo.max_error_rate:g}"))
    for value, bound, label, sign in (
        (perf.output_tokens_per_s, slo.min_output_tokens_per_s, "output tokens/s", ">="),
        (perf.ttft_p50_ms, slo.max_ttft_p50_ms, "TTFT p50 ms", "<="),
        (perf.ttft_p99_ms, slo.max_ttft_p99_ms, "TTFT p99 ms", "<="),
        (perf.tpot_p50_ms, slo.max_tpot_p50_ms, "TPOT p50 ms", "<="),
    ):
        rows.append(("performance", label, f"{value:.4g}", f"{sign} {bound:g}" if bound is not None else "not set"))
    return rows


def perf_verdict(perf: PerfResult) -> str:
    """The A/B's verdict in words: within, slower, undecided (refused) or held for review."""
    if perf.held:
        return "undecided, held for review"
    if perf.inconclusive:
        return "undecided, refused"
    return "within" if perf.passed else "slower" if perf.throughput_ratio is not None else "failed"


def held_for_review(perf: PerfResult, evaluation: EvaluationComparison | None) -> list[str]:
    """What the spec held for a person rather than refusing: each undecided figure with its interval."""
    held = [f"fixed evaluation {p.label} {part_format(p.name)(p.figure)}, interval [{part_format(p.name)(p.low)}, "
            f"{part_format(p.name)(p.high)}] holds its budget {part_format(p.name)(p.budget)}"
            for p in (evaluation.held if evaluation else [])]
    if perf.held and perf.throughput_ratio is not None and perf.ratio_interval:
        held.append(f"throughput {perf.throughput_ratio:.3f}x production, interval [{perf.ratio_interval[0]:.3f}, "
                    f"{perf.ratio_interval[1]:.3f}] holds its budget {1 - float(perf.workload['max_slowdown']):.2f}")
    return held


def envelope_rows(validation: ValidationResult) -> list[tuple[str, str, str, str]]:
    """The whole envelope's rows: free-running decode against HF, the wide batch, recorded = loaded."""
    rows = []
    d, lim = validation.decode, validation.decode_limits
    if d is not None and lim is not None:
        rows += [("validation", "generated tokens not HF's argmax (free-running decode)",
                  f"{len(d.disagreements)} of {d.positions}", f"<= {lim.max_disagreements}"),
                 ("validation", "largest gap to HF's argmax, nats", f"{d.max_gap:.3g}", f"<= {lim.max_gap:.3g}")]
    if validation.wide_batch is not None:
        w = validation.wide_batch
        rows.append(("validation", f"rows of a {w.rows}-row batch unlike their output alone",
                     f"{len(w.differences)}", "0 (float32), else each row within the decode budget"))
    if validation.loaded is not None:
        rows.append(("validation", "loaded = engine.json (dtypes, quantization, KV cache)",
                     "yes" if validation.loaded.passed else "NO", f"budget {validation.loaded.budget_precision}"))
    return rows
def lm_eval_section(result: LmEvalResult | None) -> list[str]:
    """The standard evals' lines of the page: each task's difference against production, interval and budget."""
    if result is None:
        return []
    if result.skipped:
        return [f"### Standard evals (lm-evaluation-harness): skipped ({result.skipped})", ""]
    return [
        f"### Standard evals (lm-evaluation-harness) against production: {_verdict(result.passed)}",
        "",
        "| task | metric | items | this version | production | difference [interval] | budget |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *(f"| {v.name} | {v.metric} | {v.items} | {v.candidate:.3f} | {v.production:.3f} | {v.difference:+.3f} "
          f"[{v.interval[0]:+.3f}, {v.interval[1]:+.3f}] | drop <= {v.budget:g} (or p >= {v.alpha:g}) |"
          for v in result.verdicts),
        *(f"- {failure}" for failure in result.failures),
        "",
    ]


def _link_line(name: str, uri: str) -> str:
    """A browser opens http(s) links only; an artifact store's `s3://` or `file://` URI is shown to copy."""
    return f"- [{name}]({uri})" if uri.startswith(("http://", "https://")) else f"- {name}: `{uri}`"


def _verdict(passed: bool) -> str:
    return "passed" if passed else "**FAILED**"


@dataclass(frozen=True)
class VersionPage:
    """What the version page says, gathered by the release flow; rendered by the publish step once the run
    exists (its links point into the run), and passed in the call that registers the version (the publishing
    account may create versions but not edit them)."""

    validation: ValidationResult
    perf: PerfResult
    slo: PerfSlo
    production: tuple[str, dict[str, float]] | None
    provenance: Provenance
    ui_base: str | None  # the MLflow UI, for links into the run; None: no links
    evaluation: EvaluationComparison | None = None
    measured: bool = False  # production's speed and evaluation figures are from this same run
    served: ServedDrift | None = None  # the served configuration against production's
    lm_eval: LmEvalResult | None = None  # the standard evals' verdicts (tasks/lm_eval_gate.py)

    def render(self, *, fingerprint: str, run: tuple[str, str] | None, manifest_uri: str, report_folder: str) -> str:
        """`run`: (experiment id, run id) of the release run, linked into when the UI is known."""
        links = {}
        if run and self.ui_base:
            def page(artifact: str | None = None) -> str:
                return run_ui_url(self.ui_base, *run, f"{report_folder}/{artifact}" if artifact else None)

            links = {
                "release report (gates, comparison, plots)": page("release-report.html"),
                "plot: latency distributions": page("latency.png"),
                "plot: validation divergence": page("validation-divergence.png"),
                "MLflow run (params, metrics, all artifacts)": page(),
            }
        links["engine artifact manifest"] = manifest_uri
        return render_version_page(fingerprint=fingerprint, validation=self.validation, perf=self.perf, slo=self.slo,
                                   production=self.production, provenance=self.provenance, links=links,
                                   evaluation=self.evaluation, measured=self.measured, served=self.served,
                                   lm_eval=self.lm_eval)


def render_version_page(
    *,
    fingerprint: str,
    validation: ValidationResult,
    perf: PerfResult,
    slo: PerfSlo,
    production: tuple[str, dict[str, float]] | None,
    provenance: Provenance,
    links: dict[str, str],
    evaluation: EvaluationComparison | None = None,
    measured: bool = False,
    served: ServedDrift | None = None,
    lm_eval: LmEvalResult | None = None,
) -> str:
    """The version's description: decision first, then gates, comparison, provenance and links."""
    replaced = production[0] if production else None
    passed = (validation.passed and perf.passed and (evaluation is None or evaluation.passed)
              and (lm_eval is None or lm_eval.passed))
    candidate = {**validation.metrics, **perf.metrics, **(evaluation.metrics if evaluation else {})}
    comparisons = compare_figures(candidate, production[1] if production else None)
    held = held_for_review(perf, evaluation)
    lines = [
        *([f"**Held for review: undecided, a person must judge.** {'; '.join(held)}.", ""] if held and passed else []),
        f"**Gates {'passed' if passed else 'FAILED'}.** "
        + (f"Approving promotes it in place of version {replaced} (alias `production`)." if replaced
           else "Approving makes it the first live version of this model."),
        "",
        ("To decide, add the version tag `approval` with the value `approved` or `rejected`, and `approved_by` "
         "(or `rejected_by`) with your name. Optional: `approval_note`."),
        "",
        (f"### Gates: validation {_verdict(validation.passed)}, performance {_verdict(perf.passed)}, fixed "
         f"evaluation {evaluation_verdict(evaluation).replace('FAILED', '**FAILED**')}"),
        "",
        "| gate | figure | value | threshold |",
        "| --- | --- | --- | --- |",
        *(f"| {g} | {f} | {v} | {t} |" for g, f, v, t in gate_rows(validation, perf, slo, evaluation)),
        *(f"- {failure}" for failure in [*validation.failures, *(evaluation.failures if evaluation else []),
                                         *perf.failures]),
        "",
        *lm_eval_section(lm_eval),
        (f"### Against version {replaced}, which it would replace" if replaced
         else "### Against production: no production version yet"),
        "",
        *([(f"Speed and the fixed evaluation: both versions measured side by side in this run; the rest as "
            f"recorded for version {replaced}."), ""] if replaced and measured else []),
    ]
    if replaced:
        lines += [
            f"| figure | this version | version {replaced} | change |",
            "| --- | --- | --- | --- |",
            *(f"| {c.label} | {c.candidate:.4g} | {'-' if c.production is None else f'{c.production:.4g}'} | "
              f"{c.change} |" for c in comparisons),
            "",
        ]
    if served is not None:
        lines += render_drift(served, heading="###")
    toolchain = ", ".join(f"{k} {v}" for k, v in sorted(provenance.toolchain.items()))
    lines += [
        "### Built",
        "",
        f"- by `{provenance.user}` on `{provenance.host}`, code revision `{provenance.code_revision[:12]}`",
        f"- spec sha256 `{provenance.spec_sha256[:16]}`, engine {provenance.engine}, fingerprint `{fingerprint[:16]}`",
        f"- toolchain: {toolchain}" if toolchain else "- toolchain: not recorded",
        "",
        "### Links",
        "",
        *(_link_line(name, url) for name, url in links.items()),
    ]
    text = "\n".join(lines) + "\n"
    if len(text) > MAX_DESCRIPTION_CHARS:  # a long failure list: keep the head and say where the rest is
        text = text[: MAX_DESCRIPTION_CHARS - 80].rsplit("\n", 1)[0] + "\n\n(cut here: see the release report)\n"
    return text
