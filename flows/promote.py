"""The promote flow: approval -> fetch and verify -> stage -> gray release -> finish or roll back.

MLflow records the outcome: alias `canary` while the rollout runs, `production` when it finishes; a
rolled-back version is tagged `rollout` = `failed` with the reason. Triton model versions carry the
MLflow version number, so `<model>_engine` version 3 is registered version 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.states import Failed, State

from flows.spec import ReleaseSpec
from tasks.approve import approve_task
from tasks.errors import ApprovalRejected, RolloutAborted
from tasks.gray_release import RolloutReport, gray_release_task
from tasks.stage import fetch_engine, stage_task
from tasks.targets import Target, check_reachable, resolve_targets


@dataclass(frozen=True)
class PromoteResult:
    model_name: str
    version: str
    fingerprint: str
    endpoints: list[str]
    approved_by: str
    rollout: RolloutReport
    timeline_png: Path


def _targets(spec: ReleaseSpec) -> list[Target]:
    if spec.triton.endpoints:
        return resolve_targets(spec.triton)
    from flows.embedded import ensure_embedded

    server = ensure_embedded(spec.triton.model_repository)
    return resolve_targets(spec.triton, embedded_url=server.http_url)


@flow(name="promote", log_prints=True)
def promote_flow(spec: ReleaseSpec, version: str) -> PromoteResult | State:
    """Promote a published version of the spec's model into Triton through a gray release."""
    from registry import model_registry as mr
    from serving.engine import read_engine_info

    name, uri = spec.model_name, spec.mlflow.tracking_uri
    targets = _targets(spec)
    check_reachable(targets)
    info = mr.get_version(uri, name, version)

    try:
        approved_by = approve_task(spec.approval, tracking_uri=uri, model_name=name, version=version)
    except ApprovalRejected as exc:
        return Failed(message=str(exc))
    print(f"{name} version {version} approved by {approved_by}")

    device = "cuda" if spec.triton.device == "cuda" else "cpu" if spec.triton.device == "cpu" else "auto"
    engine_dir = fetch_engine(
        artifacts_uri=spec.artifacts.uri, model_name=name, fingerprint=info.fingerprint,
        cache_dir=spec.work_dir / "fetched", device=device,
    )
    mr.set_alias(uri, name, mr.ALIAS_CANARY, version)
    staged = stage_task(targets, model_name=name, engine_dir=engine_dir, version=int(version), triton=spec.triton)
    vocab = read_engine_info(engine_dir).model.vocab_size
    timeline = spec.work_dir / "reports" / f"rollout-{name}-v{version}.png"
    try:
        report = gray_release_task(targets, staged, rollout=spec.rollout, triton=spec.triton, vocab_size=vocab)
    except RolloutAborted as exc:
        _record_rollback(uri, name, version, info.run_id, exc, timeline)
        return Failed(message=f"{exc}. {name} version {version} is tagged rollout=failed; live version unchanged.")

    _record_success(uri, name, version, info.run_id, staged.live_version, report, timeline)
    return PromoteResult(name, version, info.fingerprint or "", [t.url for t in targets], approved_by, report, timeline)


def _attach_timeline(uri: str, run_id: str | None, report: RolloutReport, png: Path) -> None:
    from registry import tracking
    from tasks.rollout_plot import plot_timeline

    plot_timeline(report, png)
    create_markdown_artifact(
        key=f"rollout-{report.model_name.lower().replace('_', '-').replace('.', '-')}-v{report.candidate}",
        markdown=_rollout_markdown(report, png),
        description="gray release timeline",
    )
    if run_id:
        tracking.log_artifact_file(uri, run_id, png, artifact_path="rollout")
        tracking.log_metrics(uri, run_id, report.metrics)


def _rollout_markdown(report: RolloutReport, png: Path) -> str:
    rows = "\n".join(
        f"| {a.t_s:.1f} | {a.outcome} | {a.requests} | {a.success_rate:.3f} | {a.per_version} |" for a in report.analyses
    )
    return (
        f"# Rollout of {report.model_name} version {report.candidate}: {report.outcome}\n\n{report.reason}\n\n"
        f"| t (s) | outcome | requests | success rate | per version |\n| --- | --- | --- | --- | --- |\n{rows}\n\n"
        f"Timeline: `{png}`\n"
    )


def _record_success(uri, name, version, run_id, live, report, png) -> None:
    from registry import model_registry as mr

    _attach_timeline(uri, run_id, report, png)
    mr.set_alias(uri, name, mr.ALIAS_PRODUCTION, version)
    mr.delete_alias(uri, name, mr.ALIAS_CANARY)
    mr.set_version_tag(uri, name, version, "rollout", "succeeded")
    if live is not None and str(live) != str(version):
        mr.set_version_tag(uri, name, str(live), "superseded_by", str(version))
    print(f"{name} version {version} is production: router sends it 100% of traffic")


def _record_rollback(uri, name, version, run_id, exc: RolloutAborted, png) -> None:
    from registry import model_registry as mr

    if isinstance(exc.report, RolloutReport):
        _attach_timeline(uri, run_id, exc.report, png)
    mr.delete_alias(uri, name, mr.ALIAS_CANARY)
    mr.set_version_tag(uri, name, version, "rollout", "failed")
    mr.set_version_tag(uri, name, version, "rollout.reason", exc.reason[:5000])
