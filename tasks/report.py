"""The release report a reviewer reads before approving: gate figures against their thresholds and
against the production version's recorded figures, latency distributions, validation divergence, links."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.perf_gate import PerfResult
from tasks.validate import ValidationResult

COMPARED = (
    ("perf_output_tokens_per_s", "output tokens/s", True),
    ("perf_ttft_p50_ms", "TTFT p50 ms", False),
    ("perf_ttft_p99_ms", "TTFT p99 ms", False),
    ("perf_tpot_p50_ms", "TPOT p50 ms", False),
    ("validation_top1_agreement", "top-1 agreement", True),
    ("validation_max_logit_error", "max logit error", False),
)


@dataclass(frozen=True)
class ReleaseReport:
    markdown: str
    images: list[Path]


def plot_latency_distributions(perf: PerfResult, path: Path) -> Path:
    """Histograms of TTFT and TPOT samples with the p50/p99 marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, samples, label, p50, p99 in (
        (axes[0], perf.ttft_samples_ms, "TTFT (ms)", perf.ttft_p50_ms, perf.ttft_p99_ms),
        (axes[1], perf.tpot_samples_ms, "TPOT (ms)", perf.tpot_p50_ms, perf.tpot_p99_ms),
    ):
        ax.hist(samples, bins=max(5, min(30, len(samples))), color="#4878d0")
        ax.axvline(p50, color="black", linestyle="--", label=f"p50 {p50:.2f}")
        ax.axvline(p99, color="red", linestyle=":", label=f"p99 {p99:.2f}")
        ax.set_xlabel(label)
        ax.set_ylabel("iterations")
        ax.legend()
    fig.suptitle(f"latency over {len(perf.ttft_samples_ms)} timed iterations, workload {perf.workload}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_validation_divergence(validation: ValidationResult, max_new_tokens: int, path: Path) -> Path:
    """Per prompt: how many greedy tokens matched the reference before the first divergence."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"identical": "#2ca02c", "tolerated": "#ff7f0e", "diverged": "#d62728"}
    matched = [max_new_tokens if c.divergence_position is None else c.divergence_position for c in validation.comparisons]
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.4 * len(matched)))
    labels = [c.prompt[:40] for c in validation.comparisons]
    ax.barh(labels, matched, color=[colors[c.status] for c in validation.comparisons])
    ax.set_xlim(0, max_new_tokens)
    ax.set_xlabel("greedy tokens identical to Hugging Face before the first divergence "
                  "(green identical, orange within top-N, red diverged)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _compare_row(key: str, label: str, higher_is_better: bool, candidate: dict[str, float],
                 production: dict[str, float] | None) -> str:
    value = candidate.get(key)
    if value is None:
        return ""
    if not production or key not in production:
        return f"| {label} | {value:.4g} | - | - |\n"
    base = production[key]
    ratio = value / base if base else float("inf")
    better = (ratio >= 1) if higher_is_better else (ratio <= 1)
    return f"| {label} | {value:.4g} | {base:.4g} | {ratio:.3f} {'better' if better else 'worse'} |\n"


def render_release_report(
    *,
    model_name: str,
    fingerprint: str,
    validation: ValidationResult,
    perf: PerfResult,
    validation_report: str,
    perf_report: str,
    production: tuple[str, dict[str, float]] | None,
    links: dict[str, str],
    images: dict[str, Path],
) -> str:
    """One markdown page: verdicts, figures vs thresholds (the gate reports), vs production, plots, links."""
    candidate = {**validation.metrics, **perf.metrics}
    prod_version, prod_metrics = production if production else (None, None)
    compare = "".join(_compare_row(k, label, hib, candidate, prod_metrics) for k, label, hib in COMPARED)
    heading = f"against production (version {prod_version}, recorded figures)" if prod_version else (
        "against production: no production version yet")
    lines = [
        f"# Release report: {model_name} `{fingerprint[:16]}`",
        "",
        (f"Validation: **{'passed' if validation.passed else 'FAILED'}** · Performance: "
         f"**{'passed' if perf.passed else 'FAILED'}**"),
        "",
        *(f"- {name}: {url}" for name, url in links.items()),
        "",
        f"## Candidate {heading}",
        "",
        "| figure | candidate | production | ratio |",
        "| --- | --- | --- | --- |",
        compare.rstrip("\n"),
        "",
        *(f"![{name}]({path.name})" for name, path in images.items()),
        "",
        validation_report.replace("# ", "## ", 1),
        perf_report.replace("# ", "## ", 1),
    ]
    return "\n".join(lines) + "\n"


def production_figures(tracking_uri: str, model_name: str) -> tuple[str, dict[str, float]] | None:
    """The production version's recorded gate figures (its `metric.*` tags), if there is one."""
    from registry import model_registry as mr
    from registry.errors import RegistryError

    try:
        version = mr.get_version_by_alias(tracking_uri, model_name, mr.ALIAS_PRODUCTION)
    except RegistryError:
        return None
    if version is None:
        return None
    tags = mr.get_version_tags(tracking_uri, model_name, version)
    return version, {k.removeprefix("metric."): float(v) for k, v in tags.items() if k.startswith("metric.")}
