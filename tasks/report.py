"""The release report a reviewer reads before approving: gate figures against their thresholds and
against the production version (speed and the fixed evaluation measured in the same run), latency distributions, validation divergence, links."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.evaluation import EvaluationComparison, evaluation_verdict
from tasks.evaluation import render_report as render_evaluation
from tasks.perf_gate import PerfResult
from tasks.validate import ValidationResult
from tasks.version_page import compare_figures


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
    from matplotlib.patches import Patch

    colors = {"identical": "#2ca02c", "tolerated": "#ff7f0e", "diverged": "#d62728"}
    matched = [max_new_tokens if c.divergence_position is None else c.divergence_position for c in validation.comparisons]
    fig, ax = plt.subplots(figsize=(9, max(2.6, 1.4 + 0.4 * len(matched))))
    labels = [c.prompt[:40] for c in validation.comparisons]
    ax.barh(labels, matched, color=[colors[c.status] for c in validation.comparisons])
    ax.set_xlim(0, max_new_tokens)
    ax.set_xlabel(f"greedy tokens identical to Hugging Face before the first divergence (of {max_new_tokens})")
    ax.set_title("validation: where each prompt's generation first differs from the reference", fontsize=9)
    ax.legend(handles=[Patch(color=c, label=s) for s, c in colors.items()], fontsize=7, loc="lower right")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def comparison_table(candidate: dict[str, float], production: dict[str, float] | None) -> list[str]:
    """Markdown rows: figure | candidate | production | change ('same' when equal)."""
    return [f"| {c.label} | {c.candidate:.4g} | {'-' if c.production is None else f'{c.production:.4g}'} | {c.change} |"
            for c in compare_figures(candidate, production)]


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
    evaluation: EvaluationComparison | None = None,
    measured: bool = False,
) -> str:
    """One markdown page: verdicts, figures vs thresholds (the gate reports), vs production, plots, links."""
    candidate = {**validation.metrics, **perf.metrics, **(evaluation.metrics if evaluation else {})}
    prod_version, prod_metrics = production if production else (None, None)
    compare = "\n".join(comparison_table(candidate, prod_metrics))
    source = "speed and fixed evaluation measured in this run" if measured else "recorded figures"
    heading = f"against production (version {prod_version}, {source})" if prod_version else (
        "against production: no production version yet")
    lines = [
        f"# Release report: {model_name} `{fingerprint[:16]}`",
        "",
        (f"Validation: **{'passed' if validation.passed else 'FAILED'}** · Fixed evaluation: "
         f"**{evaluation_verdict(evaluation)}** · Performance: "
         f"**{'FAILED' if not perf.passed else 'held for review' if perf.held else 'passed'}**"),
        "",
        *(f"- {name}: {_link(url)}" for name, url in links.items()),
        "",
        f"## Candidate {heading}",
        "",
        "| figure | candidate | production | change |",
        "| --- | --- | --- | --- |",
        compare,
        "",
        *(f"![{name}]({path.name})" for name, path in images.items()),
        "",
        validation_report.replace("# ", "## ", 1),
        *([render_evaluation(evaluation).replace("# ", "## ", 1)] if evaluation else []),
        perf_report.replace("# ", "## ", 1),
    ]
    return "\n".join(lines) + "\n"


def _link(url: str) -> str:
    """A web address as a markdown link (clickable in the HTML report too); other URIs as they are."""
    return f"[{url}]({url})" if url.startswith(("http://", "https://")) else url


def production_figures(tracking_uri: str, model_name: str) -> tuple[str, dict[str, float]] | None:
    """The production version's gate figures (its run's metrics; `metric.*` tags of older versions)."""
    from registry import model_registry as mr
    from registry import tracking
    from registry.errors import RegistryError

    try:
        version = mr.get_version_by_alias(tracking_uri, model_name, mr.ALIAS_PRODUCTION)
    except RegistryError:
        return None
    if version is None:
        return None
    info = mr.get_version(tracking_uri, model_name, version)
    figures = {k.removeprefix("metric."): float(v) for k, v in info.tags.items() if k.startswith("metric.")}
    if info.run_id:
        figures.update(tracking.run_metrics(tracking_uri, info.run_id))
    return version, figures


def render_html(markdown_text: str, images: dict[str, Path], *, title: str) -> str:
    """The report as one HTML page with its plots inline (MLflow's artifact viewer renders HTML, not the
    image links of a markdown file)."""
    import base64
    import html

    import markdown

    text = markdown_text
    for name, path in images.items():
        data = base64.b64encode(path.read_bytes()).decode()
        text = text.replace(f"![{name}]({path.name})", f"![{name}](data:image/png;base64,{data})")
    body = markdown.markdown(text, extensions=["tables"])
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title><style>"
            "body{font-family:sans-serif;font-size:14px;margin:1.5em;max-width:70em}"
            "table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;"
            "text-align:left}img{max-width:100%;display:block;margin:0.5em 0}code{background:#f4f4f4}"
            f"</style></head><body>{body}</body></html>\n")
