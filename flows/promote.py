"""The promote flow: approval -> fetch and verify -> stage -> gray release -> finish or roll back.

MLflow records the outcome: alias `canary` while the rollout runs, `production` when it finishes; a
version rolled back by the analysis is tagged `rollout` = `failed` with `rollout.reason` and
`rollout.analysis` (the figures) and marked `approval` = `rejected`. Engine models are named by the
MLflow version number, so engine model `<model>_v3` holds registered version 3.

Crash safety: every change is preceded by a record in the rollout journal (`tasks.rollout_state`). A run
that finds an unfinished record first reconciles: `finishing` is completed, any other phase is rolled back
to the live version on every endpoint, and MLflow is brought in line, before anything new starts.
The same logic is a plain function (`promote`), so it also runs without Prefect (tests kill it with SIGKILL).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from prefect import flow
from prefect.states import Failed, State

from flows.spec import ReleaseSpec
from registry import model_registry as mr
from registry.promotion import require_complete
from registry.rollout_record import (
    TAG_ROLLOUT_DECISION,
    Decision,
    record_canary,
    record_failure,
    record_hold,
    record_interrupted,
    record_production,
    record_success,
    take_decision,
)
from tasks.engine_kinds import kind_of
from tasks.errors import ApprovalRejected, RolloutAborted, StepError
from tasks.fit import CandidateDoesNotFit, check_fits
from tasks.gray_release import RolloutReport, gray_release, gray_release_task
from tasks.promote_spec import RolloutSpec
from tasks.rollout_state import Journal, read_journal, write_journal
from tasks.stage import StagingRolledBack, fetch_engine, migrate_layout, stage, stage_task
from tasks.targets import Target, check_reachable, fleet_live_version, resolve_targets

log = logging.getLogger(__name__)



class RolloutInterrupted(StepError):
    """A previous run was killed mid-rollout; this run rolled every endpoint back and stopped."""


class StageFailed(StepError):
    """The candidate could not be staged on every endpoint; all endpoints were rolled back."""


@dataclass(frozen=True)
class PromoteResult:
    model_name: str
    version: str
    fingerprint: str
    endpoints: list[str]
    approved_by: str
    rollout: RolloutReport
    timeline_png: Path


def connect_targets(spec: ReleaseSpec) -> list[Target]:
    if spec.triton.endpoints:
        return resolve_targets(spec.triton)
    from flows.embedded import ensure_embedded

    server = ensure_embedded(spec.triton.model_repository, load_timeout_s=spec.triton.load_timeout_s)
    return resolve_targets(spec.triton, embedded_url=server.http_url, embedded_metrics_url=server.metrics_url)


def _repositories(spec: ReleaseSpec) -> list[Path]:
    """The model repositories the targets serve, known without starting or calling any server."""
    if spec.triton.endpoints:
        return [t.model_repository for t in resolve_targets(spec.triton)]
    return [Path(spec.triton.model_repository)]


def _approve(spec: ReleaseSpec, version: int) -> str:
    from tasks.approve import approve

    approved_by = approve(spec.approval, tracking_uri=spec.mlflow.tracking_uri, model_name=spec.model_name,
                          version=str(version))
    print(f"{spec.model_name} version {version} approved by {approved_by}")
    return approved_by


def _in_flow() -> bool:
    from prefect.context import FlowRunContext

    return FlowRunContext.get() is not None


def promote(spec: ReleaseSpec, version: int | str, *, kind: Literal["promote", "rollback"] = "promote",
            rollout: RolloutSpec | None = None, skip_approval: bool = False) -> PromoteResult:
    """Reconcile any unfinished rollout, then approve, stage and gray-release `version` (plain function).

    Raises ApprovalRejected, StageFailed, RolloutAborted or RolloutInterrupted; each leaves every endpoint
    serving exactly one version and MLflow saying which and why.
    """
    name, uri, cand = spec.model_name, spec.mlflow.tracking_uri, int(version)
    rollout = rollout or spec.rollout
    timeline = spec.work_dir / "reports" / f"{kind}-{name}-v{cand}.png"
    previous = read_journal(_repositories(spec), name)
    unfinished = previous is not None and not previous.terminal

    approved_by = "(rollback to an earlier published version)"
    if not skip_approval and not unfinished:  # no server is started for a version that may be rejected
        approved_by = _approve(spec, cand)
    targets = connect_targets(spec)
    check_reachable(targets)
    migrate_layout(targets, name, spec.triton.load_timeout_s)  # before anything reads the repositories
    repos = [t.model_repository for t in targets]

    if previous is not None and unfinished:
        done = reconcile(spec, targets, previous)
        if previous.candidate == cand and previous.kind == kind:
            if done == "finished":
                info = mr.get_version(uri, name, str(cand))
                report = RolloutReport(name, cand, previous.live, reason="finished by reconciliation after a crash")
                return PromoteResult(name, str(cand), info.fingerprint or "", [t.url for t in targets],
                                     "(approved before the crash)", report, timeline)
            raise RolloutInterrupted(
                f"the previous {kind} of {name} version {cand} was interrupted in phase {previous.phase!r} "
                f"(step {previous.step}); every endpoint was rolled back to version {previous.live} and MLflow "
                f"tagged rollout=interrupted. Run the {kind} again to retry.")

    live = fleet_live_version(targets, name)
    info = mr.get_version(uri, name, str(cand))
    if live == cand:  # already live: converge (idempotent) and make MLflow agree
        from tasks.rollback import make_live

        make_live(targets, name, cand, spec.triton.load_timeout_s)
        record_production(uri, name, cand)
        report = RolloutReport(name, cand, live, reason=f"version {cand} was already live")
        return PromoteResult(name, str(cand), info.fingerprint or "", [t.url for t in targets], "(already live)",
                             report, timeline)

    if not skip_approval and unfinished:  # reconciled first (that needs the servers), then approved
        approved_by = _approve(spec, cand)

    device = "cuda" if spec.triton.device == "cuda" else "cpu" if spec.triton.device == "cpu" else "auto"
    require_complete(spec.artifacts.uri, info)  # a version without its manifest is never promoted
    engine_dir = fetch_engine(
        artifacts_uri=spec.artifacts.uri, model_name=name, fingerprint=info.fingerprint,
        cache_dir=spec.work_dir / "fetched", device=device, engine=spec.engine,
    )
    try:
        check_fits(targets, engine_dir, device=device, engine_kind=spec.engine.kind)
    except CandidateDoesNotFit as exc:
        record_failure(uri, name, cand, str(exc), {}, reject=False)
        raise StageFailed(f"{name} version {cand} was not staged ({exc}); nothing changed, version {live} "
                          "stays live; MLflow tagged rollout=failed") from exc
    journal = Journal(name, cand, live, "staging", kind=kind, endpoints=[t.url for t in targets],
                      seq=previous.seq if previous else 0)
    write_journal(repos, journal)
    record_canary(uri, name, cand)
    try:
        if _in_flow():
            staged = stage_task(targets, model_name=name, engine_dir=engine_dir, version=cand, triton=spec.triton,
                                live=live, engine=spec.engine)
        else:
            staged = stage(targets, model_name=name, engine_dir=engine_dir, version=cand, triton=spec.triton, live=live,
                           engine=spec.engine)
    except Exception as exc:
        rolled_back = isinstance(exc, StagingRolledBack)
        cause = exc.__cause__ if rolled_back and exc.__cause__ is not None else exc
        reason = f"staging failed: {type(cause).__name__}: {cause}"
        write_journal(repos, journal, phase="aborting", reason=reason)
        if not rolled_back:  # stage() could not roll back (or never got to): try again, raise if it fails
            from tasks.rollback import restore_live

            restore_live(targets, name, live, spec.triton.load_timeout_s)
        record_failure(uri, name, cand, reason, {}, reject=False)
        write_journal(repos, journal, phase="aborted")
        raise StageFailed(f"{name} version {cand} was not staged ({reason}); every endpoint serves version "
                          f"{live} again; MLflow tagged rollout=failed") from exc

    vocab = kind_of(spec.engine).vocab_size(engine_dir)
    decide = _decider(spec, cand)
    try:
        args = {"rollout": rollout, "triton": spec.triton, "vocab_size": vocab, "journal": journal, "decide": decide}
        report = gray_release_task(targets, staged, **args) if _in_flow() else gray_release(targets, staged, **args)
    except RolloutAborted as exc:
        journal = read_journal(repos, name) or journal  # the task may have worked on a copy
        report = exc.report if isinstance(exc.report, RolloutReport) else None
        if report is not None:
            _attach_timeline(uri, info.run_id, report, timeline)
        figures = report.figures() if report is not None else {}
        # the analysis judged the engine: reject it; a step that failed (a reload on one endpoint) may be the
        # infrastructure's fault: tag the failure, leave the approval as it is
        record_failure(uri, name, cand, exc.reason, figures,
                        reject=kind == "promote" and exc.reason.startswith("analysis"))
        write_journal(repos, journal, phase="aborted")
        raise
    journal = read_journal(repos, name) or journal
    _attach_timeline(uri, info.run_id, report, timeline)
    record_success(uri, name, cand, live, kind)
    write_journal(repos, journal, phase="done")
    return PromoteResult(name, str(cand), info.fingerprint or "", [t.url for t in targets], approved_by, report,
                         timeline)


def reconcile(spec: ReleaseSpec, targets: list[Target], journal: Journal) -> Literal["finished", "rolled_back"]:
    """Bring Triton, the router and MLflow to one consistent state after a run died mid-rollout."""
    from tasks.rollback import make_live, restore_live

    uri, name, repos = spec.mlflow.tracking_uri, journal.model_name, [t.model_repository for t in targets]
    timeout = spec.triton.load_timeout_s
    print(f"reconciling an unfinished {journal.kind} of {name} version {journal.candidate} "
          f"(phase {journal.phase}, step {journal.step})")
    if journal.phase == "finishing":
        make_live(targets, name, journal.candidate, timeout)
        record_success(uri, name, journal.candidate, journal.live, journal.kind)
        write_journal(repos, journal, phase="done")
        return "finished"
    restore_live(targets, name, journal.live, timeout)
    if journal.phase == "aborting":
        record_failure(uri, name, journal.candidate, journal.reason, journal.figures,
                        reject=journal.kind == "promote" and journal.reason.startswith("analysis"))
        write_journal(repos, journal, phase="aborted")
    else:
        reason = (f"interrupted in phase {journal.phase} (step {journal.step}, weights {journal.weights}); "
                  f"rolled back to version {journal.live}")
        record_interrupted(uri, name, journal.candidate, reason)
        write_journal(repos, journal, phase="interrupted", reason=reason)
    return "rolled_back"


def _decider(spec: ReleaseSpec, version: int):
    """Hold for a person: poll the MLflow version tag `rollout.decision` (continue / abort) until the timeout."""
    hold = spec.rollout.hold

    def decide(reason: str) -> Decision:
        uri, name = spec.mlflow.tracking_uri, spec.model_name
        record_hold(uri, name, version, reason)
        print(f"analysis inconclusive ({reason}); holding the weight. Set the tag {TAG_ROLLOUT_DECISION}=continue or "
              f"abort on {name} version {version} (timeout {hold.timeout_s:g} s -> abort)")
        deadline = time.monotonic() + hold.timeout_s
        while time.monotonic() < deadline:
            if (value := take_decision(uri, name, version)) is not None:
                return value
            time.sleep(hold.poll_s)
        return "abort"

    return decide


def _attach_timeline(uri: str, run_id: str | None, report: RolloutReport, png: Path) -> None:
    from registry import tracking
    from tasks.rollout_plot import plot_timeline

    plot_timeline(report, png)
    if _in_flow():
        from prefect.artifacts import create_markdown_artifact

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
        f"| {a.t_s:.1f} | {a.outcome} | {a.requests} | {a.success_rate:.3f} | {a.per_version} | {a.reason} |"
        for a in report.analyses
    )
    return (
        f"# Rollout of {report.model_name} version {report.candidate}: {report.outcome}\n\n{report.reason}\n\n"
        f"| t (s) | outcome | requests | success rate | per version | reason |\n"
        f"| --- | --- | --- | --- | --- | --- |\n{rows}\n\nTimeline: `{png}`\n"
    )


@flow(name="promote", log_prints=True)
def promote_flow(spec: ReleaseSpec, version: str) -> PromoteResult | State:
    """Promote a published version of the spec's model into Triton through a gray release."""
    try:
        return promote(spec, version)
    except (ApprovalRejected, RolloutAborted, RolloutInterrupted, StageFailed) as exc:
        suffix = (f" {spec.model_name} version {version} is tagged rollout=failed; live version unchanged."
                  if isinstance(exc, RolloutAborted) else "")
        return Failed(message=f"{exc}.{suffix}")
