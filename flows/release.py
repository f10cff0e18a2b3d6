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
        page=version_page(spec, checked, timed, production, engine.toolchain),
    )
    status = "already published as" if published.already_existed else "published as"
    print(f"{status} {published.model_name} version {published.version} ({published.manifest_uri})")
    review = write_release_report(spec, engine.fingerprint, checked, timed, published, report_dir, production)
    print(f"release report: {review}")
    return ReleaseResult(published, checked.metrics, timed.metrics, report_dir, cache_hits)


def write_release_report(spec: ReleaseSpec, fingerprint: str, checked, timed, published: PublishedVersion,
                         report_dir: Path, production) -> Path:
    """Render the reviewer's report with its plots (markdown, and HTML with the plots inline); attach it to
    the flow run and the MLflow run's `report/` folder."""
    from registry import model_registry as mr
    from registry import tracking
    from tasks import report
    from tasks.publish import REPORT_FOLDER

    uri = spec.mlflow.tracking_uri
    images = {
        "latency distributions": report.plot_latency_distributions(timed, report_dir / "latency.png"),
        "validation divergence": report.plot_validation_divergence(
            checked, spec.validation.max_new_tokens, report_dir / "validation-divergence.png"
        ),
    }
    ui = mr.ui_base_for(uri, spec.approval.ui_url)
    run_page = None
    if published.run_id and ui:
        run_page = mr.run_ui_url(ui, tracking.experiment_id_of_run(uri, published.run_id), published.run_id)
    links = {"artifacts (manifest)": published.manifest_uri, "MLflow tracking": uri}
    if ui:
        links["approve here"] = mr.version_ui_url(ui, spec.model_name, published.version)
    if published.run_id:
        links["MLflow run"] = run_page or published.run_id
    text = report.render_release_report(
        model_name=spec.model_name, fingerprint=fingerprint, validation=checked, perf=timed,
        validation_report=validate.render_report(checked), perf_report=perf_gate.render_report(timed),
        production=production, links=links, images=images,
    )
    path = save_report(report_dir, "release-report.md", text)
    html = report_dir / "release-report.html"
    html.write_text(report.render_html(text, images, title=f"Release report: {spec.model_name} {fingerprint[:16]}"))
    if published.run_id and not published.already_existed:
        for file in (html, path, *images.values()):
            tracking.log_artifact_file(uri, published.run_id, file, artifact_path=REPORT_FOLDER)
    return path


def version_page(spec: ReleaseSpec, checked, timed, production, toolchain: dict):
    """What the published version's page will say (rendered by the publish step, links into its run)."""
    import socket

    from registry import model_registry as mr
    from tasks.publish import code_revision, publisher, spec_digest
    from tasks.version_page import Provenance, VersionPage

    e = spec.engine
    built = Provenance(
        user=publisher(), host=socket.gethostname(), code_revision=code_revision(),
        spec_sha256=spec_digest(spec.model_dump(mode="json")),
        engine=f"{e.kind} {e.dtype}, max batch {e.max_batch_size}, max sequence {e.max_seq_len}",
        toolchain={k: str(v) for k, v in toolchain.items()},
    )
    return VersionPage(checked, timed, spec.perf.slo, production, built,
                       mr.ui_base_for(spec.mlflow.tracking_uri, spec.approval.ui_url))


def report_production(spec: ReleaseSpec):
    from tasks.report import production_figures

    return production_figures(spec.mlflow.tracking_uri, spec.model_name)


def _gate_failed(gate: str, summary: str, report_path: Path) -> State:
    message = f"{gate} gate failed: {summary}. Nothing was published. Report: {report_path}"
    return Failed(message=message, data=GateFailure(gate, summary, report_path))
