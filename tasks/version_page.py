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
from tasks.perf_gate import PerfResult, PerfSlo
from tasks.validate import ValidationResult

MAX_DESCRIPTION_CHARS = 5000  # MLflow's column size for a model version's description

# (metric key, label, higher is better): the figures compared with the version this one would replace
COMPARED = (
    ("perf_output_tokens_per_s", "output tokens/s", True),
    ("perf_ttft_p50_ms", "TTFT p50 ms", False),
    ("perf_ttft_p99_ms", "TTFT p99 ms", False),
    ("perf_tpot_p50_ms", "TPOT p50 ms", False),
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


def gate_rows(validation: ValidationResult, perf: PerfResult, slo: PerfSlo) -> list[tuple[str, str, str, str]]:
    """(gate, figure, value, threshold) for every checked figure of both gates."""
    t = validation.thresholds
    ratio = validation.perplexity_engine / validation.perplexity_reference
    diverged = sum(c.status == "diverged" for c in validation.comparisons)
    rows = [
        ("validation", "top-1 agreement (teacher-forced)", f"{validation.top1_agreement:.4f}",
         f">= {t['min_top1_agreement']:g}"),
        ("validation", "max prefill logit error", f"{validation.max_logit_error:.3g}", f"<= {t['max_logit_error']:g}"),
        ("validation", "perplexity ratio (engine / HF)", f"{ratio:.4f}", f"<= {t['max_perplexity_ratio']:g}"),
        ("validation", "prompts diverged from HF", f"{diverged} of {len(validation.comparisons)}",
         f"<= {t['max_failed_prompts']:g}"),
    ]
    for value, bound, label, sign in (
        (perf.output_tokens_per_s, slo.min_output_tokens_per_s, "output tokens/s", ">="),
        (perf.ttft_p50_ms, slo.max_ttft_p50_ms, "TTFT p50 ms", "<="),
        (perf.ttft_p99_ms, slo.max_ttft_p99_ms, "TTFT p99 ms", "<="),
        (perf.tpot_p50_ms, slo.max_tpot_p50_ms, "TPOT p50 ms", "<="),
    ):
        rows.append(("performance", label, f"{value:.4g}", f"{sign} {bound:g}" if bound is not None else "not set"))
    return rows


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
                                   production=self.production, provenance=self.provenance, links=links)


def render_version_page(
    *,
    fingerprint: str,
    validation: ValidationResult,
    perf: PerfResult,
    slo: PerfSlo,
    production: tuple[str, dict[str, float]] | None,
    provenance: Provenance,
    links: dict[str, str],
) -> str:
    """The version's description: decision first, then gates, comparison, provenance and links."""
    replaced = production[0] if production else None
    passed = validation.passed and perf.passed
    comparisons = compare_figures({**validation.metrics, **perf.metrics}, production[1] if production else None)
    lines = [
        f"**Gates {'passed' if passed else 'FAILED'}.** "
        + (f"Approving promotes it in place of version {replaced} (alias `production`)." if replaced
           else "Approving makes it the first live version of this model."),
        "",
        ("To decide, add the version tag `approval` with the value `approved` or `rejected`, and `approved_by` "
         "(or `rejected_by`) with your name. Optional: `approval_note`."),
        "",
        f"### Gates: validation {_verdict(validation.passed)}, performance {_verdict(perf.passed)}",
        "",
        "| gate | figure | value | threshold |",
        "| --- | --- | --- | --- |",
        *(f"| {g} | {f} | {v} | {t} |" for g, f, v, t in gate_rows(validation, perf, slo)),
        *(f"- {failure}" for failure in [*validation.failures, *perf.failures]),
        "",
        (f"### Against version {replaced}, which it would replace" if replaced
         else "### Against production: no production version yet"),
        "",
    ]
    if replaced:
        lines += [
            f"| figure | this version | version {replaced} | change |",
            "| --- | --- | --- | --- |",
            *(f"| {c.label} | {c.candidate:.4g} | {'-' if c.production is None else f'{c.production:.4g}'} | "
              f"{c.change} |" for c in comparisons),
            "",
        ]
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
        *(f"- [{name}]({url})" for name, url in links.items()),
    ]
    text = "\n".join(lines) + "\n"
    if len(text) > MAX_DESCRIPTION_CHARS:  # a long failure list: keep the head and say where the rest is
        text = text[: MAX_DESCRIPTION_CHARS - 80].rsplit("\n", 1)[0] + "\n\n(cut here: see the release report)\n"
    return text
