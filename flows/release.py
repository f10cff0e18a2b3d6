"""The release flow: convert -> build -> validate -> served configuration, fixed evaluation, standard evals (lm-eval)
and perf gate against production -> publish.

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
from tasks import evaluation, lm_eval_gate, perf_gate, validate
from tasks.build import build_task
from tasks.convert import convert_task
from tasks.gate_reference import ReferenceCache
from tasks.gate_runner import load_gate_runner_task
from tasks.production import production_engine
from tasks.publish import PublishedVersion, publish_task
from tasks.served_config import compare_served, render_drift


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
    """Build the engine from the spec's checkpoint, gate it (quality, the fixed evaluation and speed against
    the production version), and publish it."""
    converted = convert_task(spec.source.checkpoint, spec.engine, spec.work_dir)
    built = build_task(converted, spec.engine, spec.work_dir)
    engine = built.info
    cache_hits = [step for step, hit in (("convert", converted.reused), ("build", built.reused)) if hit]
    report_dir = spec.work_dir / "reports" / engine.fingerprint[:16]
    print(f"engine {engine.fingerprint} at {engine.path}; cache hits: {', '.join(cache_hits) or 'none'}")

    engine_dir = Path(engine.path)
    candidate = load_gate_runner_task(engine_dir)  # one load per engine, shared by the gates below
    references = ReferenceCache(spec.work_dir / "references", converted.source_digest)
    checked = validate.validate_task(engine_dir, spec.source.checkpoint, spec.validation, candidate, references)
    validation_report = save_report(report_dir, "validation.md", validate.render_report(checked))
    print(f"validation gate: {'passed' if checked.passed else 'FAILED'} {checked.metrics}")
    if not checked.passed:
        return _gate_failed("validation", "; ".join(checked.failures), validation_report)

    production = production_engine(tracking_uri=spec.mlflow.tracking_uri, model_name=spec.model_name,
                                   artifacts_uri=spec.artifacts.uri, cache_dir=spec.work_dir / "production")
    print(f"production: version {production.version} at {production.engine_dir}" if production.engine_dir
          else f"production: not compared ({production.skipped})")
    drift = compare_served(engine_dir, production.engine_dir, spec.served, checkpoint=spec.source.checkpoint,
                           production_version=production.version, skipped=production.skipped)
    drift_report = save_report(report_dir, "served-config.md", "\n".join(render_drift(drift, heading="#")) + "\n")
    print(f"served configuration: {'passed' if drift.passed else 'FAILED'}, {len(drift.differences)} difference(s)")
    if not drift.passed:
        return _gate_failed("served configuration", "; ".join(drift.failures), drift_report)
    production_runner = load_gate_runner_task(production.engine_dir) if production.engine_dir else None
    against = {"production_dir": production.engine_dir, "production_version": production.version,
               "skipped": production.skipped, "runner": candidate, "production_runner": production_runner}
    evaluated = evaluation.evaluation_task(engine_dir, spec.evaluation, **against)
    evaluation_report = save_report(report_dir, "evaluation.md", evaluation.render_report(evaluated))
    print(f"fixed evaluation: {'skipped' if evaluated.skipped else 'passed' if evaluated.passed else 'FAILED'} "
          f"{evaluated.metrics}")
    if not evaluated.passed:
        return _gate_failed("evaluation", "; ".join(evaluated.failures), evaluation_report)

    standard = lm_eval_gate.lm_eval_gate_task(engine_dir, spec.lm_eval, production_dir=production.engine_dir,
                                              production_version=production.version, skipped=production.skipped,
                                              work=spec.work_dir / "lm-eval" / engine.fingerprint[:16])
    standard_report = save_report(report_dir, "lm-eval.md", lm_eval_gate.render_report(standard))
    print(f"standard evals: {'skipped' if standard.skipped else 'passed' if standard.passed else 'FAILED'} "
          f"{standard.metrics}")
    if not standard.passed:
        return _gate_failed("lm-eval", "; ".join(standard.failures), standard_report)

    timed = perf_gate.perf_gate_task(engine_dir, spec.perf, **against, checkpoint=spec.source.checkpoint,
                                     decode_limits=checked.decode_limits)
    perf_report = save_report(report_dir, "performance.md", perf_gate.render_report(timed))
    print(f"performance gate: {'passed' if timed.passed else 'FAILED'} {timed.metrics}")
    if not timed.passed:
        return _gate_failed("performance", "; ".join(timed.failures), perf_report)

    compared, measured = compared_with_production(spec, production.engine_dir is not None, timed, evaluated)
    published = publish_task(
        model_name=spec.model_name,
        tracking_uri=spec.mlflow.tracking_uri,
        experiment=spec.mlflow.experiment,
        artifacts_uri=spec.artifacts.uri,
        engine_info=engine,
        params=spec.model_dump(mode="json"),
        metrics={**checked.metrics, **evaluated.metrics, **standard.metrics, **timed.metrics},
        reports={
            "validation.md": validation_report.read_text(),
            "validation.json": checked.to_json(),
            "evaluation.md": evaluation_report.read_text(),
            "lm-eval.md": standard_report.read_text(),
            "performance.md": perf_report.read_text(),
            "performance.json": timed.to_json(),
            "served-config.md": drift_report.read_text(),
        },
        page=version_page(spec, checked, timed, compared, engine.toolchain, evaluated, measured, drift, standard),
    )
    status = "already published as" if published.already_existed else "published as"
    print(f"{status} {published.model_name} version {published.version} ({published.manifest_uri})")
    review = write_release_report(spec, engine.fingerprint, checked, timed, published, report_dir, compared,
                                  evaluated, measured)
    print(f"release report: {review}")
    return ReleaseResult(published, checked.metrics, timed.metrics, report_dir, cache_hits)


def compared_with_production(spec: ReleaseSpec, timed_production: bool, timed, evaluated):
    """(version, figures) of the production version for the page and the report, and whether its speed and
    fixed-evaluation figures were measured in this run (they replace the recorded ones); None: no production."""
    recorded = report_production(spec)
    if not timed_production:
        return recorded, False
    p = evaluated.production
    scores = {"eval_nats_per_byte": p.mean_nats_per_byte, "eval_choice_accuracy": p.accuracy} if p else {}
    version = timed.production_version or (recorded[0] if recorded else "?")
    return (version, {**(recorded[1] if recorded else {}), **timed.production_metrics(), **scores}), True


def write_release_report(spec: ReleaseSpec, fingerprint: str, checked, timed, published: PublishedVersion,
                         report_dir: Path, production, evaluated=None, measured: bool = False) -> Path:
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
        production=production, links=links, images=images, evaluation=evaluated, measured=measured,
    )
    path = save_report(report_dir, "release-report.md", text)
    html = report_dir / "release-report.html"
    html.write_text(report.render_html(text, images, title=f"Release report: {spec.model_name} {fingerprint[:16]}"))
    if published.run_id and not published.already_existed:
        for file in (html, path, *images.values()):
            tracking.log_artifact_file(uri, published.run_id, file, artifact_path=REPORT_FOLDER)
    return path


def version_page(spec: ReleaseSpec, checked, timed, production, toolchain: dict, evaluated=None,
                 measured: bool = False, served=None, standard=None):
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
                       mr.ui_base_for(spec.mlflow.tracking_uri, spec.approval.ui_url), evaluated, measured, served,
                       lm_eval=standard)


def report_production(spec: ReleaseSpec):
    from tasks.report import production_figures

    return production_figures(spec.mlflow.tracking_uri, spec.model_name)


def _gate_failed(gate: str, summary: str, report_path: Path) -> State:
    message = f"{gate} gate failed: {summary}. Nothing was published. Report: {report_path}"
    return Failed(message=message, data=GateFailure(gate, summary, report_path))
