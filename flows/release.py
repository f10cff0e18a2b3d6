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
    engine = build_task(converted, spec.engine, spec.work_dir)
    report_dir = spec.work_dir / "reports" / engine.fingerprint[:16]
    print(f"engine {engine.fingerprint[:16]} built at {engine.path}")

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
    return ReleaseResult(published, checked.metrics, timed.metrics, report_dir)


def _gate_failed(gate: str, summary: str, report_path: Path) -> State:
    message = f"{gate} gate failed: {summary}. Nothing was published. Report: {report_path}"
    return Failed(message=message, data=GateFailure(gate, summary, report_path))
