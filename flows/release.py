"""The release flow: convert -> build -> validate -> perf gate -> publish.

A failed gate ends the run in a Failed state whose message is the gate's summary; the full report
is saved beside the work and attached to the flow run as a markdown artifact.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.states import Failed, State

from flows.spec import ReleaseSpec
from tasks import perf_gate, validate
from tasks.build import build_task
from tasks.convert import convert_task
from tasks.publish import PublishedVersion, publish_task


@dataclass(frozen=True)
class ReleaseResult:
    published: PublishedVersion
    validation_metrics: dict[str, float]
    perf_metrics: dict[str, float]
    report_dir: Path
    cache_hits: list[str]


@dataclass(frozen=True)
class GateFailure:
    gate: str
    summary: str
    report_path: Path


def save_report(report_dir: Path, name: str, text: str) -> Path:
    report_dir.mkdir(parents=True, exist_ok=True)
    path = report_dir / name
    path.write_text(text)
    create_markdown_artifact(markdown=text, key=name.replace(".", "-").replace("_", "-"), description=name)
    return path


@flow(name="release", log_prints=True)
def release_flow(spec: ReleaseSpec) -> ReleaseResult | State:
    """Build the engine from the spec's checkpoint, gate it twice, and publish it."""
    converted = convert_task(spec.source.checkpoint, spec.engine, spec.work_dir)
    built = build_task(converted, spec.engine, spec.work_dir)
    engine = built.info
    cache_hits = [step for step, hit in (("convert", converted.reused), ("build", built.reused)) if hit]
    report_dir = spec.work_dir / "reports" / engine.fingerprint[:16]
    print(f"engine {engine.fingerprint} at {engine.path}; cache hits: {', '.join(cache_hits) or 'none'}")

    checked = validate.validate_task(Path(engine.path), spec.source.checkpoint, spec.validation)
    validation_report = save_report(report_dir, "validation.md", validate.render_report(checked))
    print(f"validation gate: {'passed' if checked.passed else 'FAILED'} {checked.metrics}")
    if not checked.passed:
        return _gate_failed("validation", "; ".join(checked.failures), validation_report)

    timed = perf_gate.perf_gate_task(Path(engine.path), spec.perf)
    perf_report = save_report(report_dir, "performance.md", perf_gate.render_report(timed))
    print(f"performance gate: {'passed' if timed.passed else 'FAILED'} {timed.metrics}")
    if not timed.passed:
        return _gate_failed("performance", "; ".join(timed.failures), perf_report)

    production = report_production(spec)
    published = publish_task(
        model_name=spec.model_name,
        tracking_uri=spec.mlflow.tracking_uri,
        experiment=spec.mlflow.experiment,
        artifacts_uri=spec.artifacts.uri,
        engine_info=engine,
        params=spec.model_dump(mode="json"),
        metrics={**checked.metrics, **timed.metrics},
        reports={
            "validation.md": validation_report.read_text(),
            "validation.json": checked.to_json(),
            "performance.md": perf_report.read_text(),
            "performance.json": timed.to_json(),
        },
    )
    status = "already published as" if published.already_existed else "published as"
    print(f"{status} {published.model_name} version {published.version} ({published.manifest_uri})")
    review = write_release_report(spec, engine.fingerprint, checked, timed, published, report_dir, production)
    print(f"release report: {review}")
    return ReleaseResult(published, checked.metrics, timed.metrics, report_dir, cache_hits)


def write_release_report(spec: ReleaseSpec, fingerprint: str, checked, timed, published: PublishedVersion,
                         report_dir: Path, production) -> Path:
    """Render the reviewer's report with its plots; attach it to the flow run and the MLflow run."""
    from registry import model_registry as mr
    from registry import tracking
    from tasks import report

    images = {
        "latency distributions": report.plot_latency_distributions(timed, report_dir / "latency.png"),
        "validation divergence": report.plot_validation_divergence(
            checked, spec.validation.max_new_tokens, report_dir / "validation-divergence.png"
        ),
    }
    links = {"artifacts (manifest)": published.manifest_uri, "MLflow tracking": spec.mlflow.tracking_uri}
    if spec.mlflow.tracking_uri.startswith("http"):
        base = spec.approval.ui_url or spec.mlflow.tracking_uri
        links["approve here"] = mr.version_ui_url(base.rstrip("/"), spec.model_name, published.version)
    if published.run_id:
        links["MLflow run"] = published.run_id
    text = report.render_release_report(
        model_name=spec.model_name, fingerprint=fingerprint, validation=checked, perf=timed,
        validation_report=validate.render_report(checked), perf_report=perf_gate.render_report(timed),
        production=production, links=links, images=images,
    )
    path = save_report(report_dir, "release-report.md", text)
    if published.run_id:
        for file in (path, *images.values()):
            tracking.log_artifact_file(spec.mlflow.tracking_uri, published.run_id, file, artifact_path="report")
    return path


def report_production(spec: ReleaseSpec):
    from tasks.report import production_figures

    return production_figures(spec.mlflow.tracking_uri, spec.model_name)


def _gate_failed(gate: str, summary: str, report_path: Path) -> State:
    message = f"{gate} gate failed: {summary}. Nothing was published. Report: {report_path}"
    return Failed(message=message, data=GateFailure(gate, summary, report_path))
