"""The steps of a promotion (or of a rollback, which is a promotion of an earlier version), in the order the
promote flow calls them (``flows.promote.promote``)::

    unfinished = unfinished_rollout(plan)           # a journal a killed run left?
    if not unfinished: approved_by = approve_candidate(plan); targets = connect(plan)
    else:              targets = connect(plan); recover_after_crash(plan, targets, unfinished)  # may end here
    live, info = live_and_candidate(plan, targets)
    if live == candidate: return converge_already_live(plan, targets, info)
    (after a crash: approved_by = approve_candidate(plan))
    engine_dir = fetch_verified(plan, targets, info, live)
    journal, staged = stage_candidate(plan, steps, targets, engine_dir, live, after=unfinished)  # rolls back, raises
    report = release_gradually(plan, steps, targets, staged, journal, info)   # rolls back and raises on failure
    return finish_release(plan, steps, targets, journal, info, approved_by, report)

Approval comes before any server is started when nothing is unfinished (a rejected version starts
nothing); after a crash the fleet is reconciled first (that needs the servers), then approved.

Crash safety: every change is preceded by a record in the rollout journal (``tasks.rollout_state``),
written to every repository of the fleet. A run that finds an unfinished record first reconciles
(``reconcile``): ``finishing`` is completed, any other phase is rolled back to the live version on every
endpoint, and MLflow is brought in line (``registry.rollout_record``), before anything new starts. Every
way a rollout ends goes through ``tasks.rollback.roll_back`` or ``tasks.rollback.finish``; each raise leaves
every endpoint serving exactly one version and MLflow saying which and why.

Versions are ``int`` throughout; MLflow's string form is made only at the registry's boundary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from registry import model_registry as mr
from registry.model_registry import VersionInfo
from registry.promotion_checks import require_complete
from registry.rollout_record import (
    TAG_ROLLOUT_DECISION,
    Decision,
    record_canary,
    record_failure,
    record_hold,
    record_production,
    take_decision,
)
from tasks.approve import approve
from tasks.engine_kinds import kind_of
from tasks.engine_spec import EngineSpec
from tasks.errors import RolloutAborted, StepError
from tasks.fit import CandidateDoesNotFit, check_fits
from tasks.gray_release import DecideFn, RolloutReport, WeightChange, gray_release, step_weights
from tasks.promote_spec import ApprovalSpec, HoldSpec, RolloutSpec, TritonSpec
from tasks.rollback import finish, make_live, roll_back
from tasks.rollout_state import Journal, read_journal, write_journal
from tasks.stage import StagedVersion, fetch_engine, migrate_layout, stage
from tasks.targets import Target, check_reachable, fleet_live_version

log = logging.getLogger(__name__)

PromotionKind = Literal["promote", "rollback"]


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


@dataclass(frozen=True)
class PromotionPlan:
    """What one promotion does, resolved once from the release spec by the flow."""

    model_name: str
    candidate: int
    kind: PromotionKind
    tracking_uri: str
    artifacts_uri: str
    approval: ApprovalSpec | None  # None: no approval (a rollback to a version published before)
    triton: TritonSpec
    engine: EngineSpec
    rollout: RolloutSpec
    hold: HoldSpec  # the spec's, also when `rollout` is a rollback's immediate plan
    device: Literal["cuda", "cpu", "auto"]
    fetch_dir: Path
    timeline_png: Path
    repositories: tuple[Path, ...]  # the fleet's model repositories, known without starting any server
    connect: Callable[[], list[Target]]  # the endpoints, started (embedded Triton) where the spec says so


@dataclass(frozen=True)
class PromotionSteps:
    """The steps that run as Prefect tasks inside a flow and as plain functions outside one."""

    stage: Callable[..., StagedVersion] = stage
    gray_release: Callable[..., RolloutReport] = gray_release
    markdown_artifact: Callable[[str, str], None] | None = None  # (key, markdown): the run's report, in a flow


# ---------------------------------------------------------------- the steps, in the order the flow calls them


def unfinished_rollout(plan: PromotionPlan) -> Journal | None:
    """The journal of a rollout a killed run left unfinished (read without starting any server), else None."""
    journal = read_journal(list(plan.repositories), plan.model_name)
    return journal if journal is not None and not journal.terminal else None


def approve_candidate(plan: PromotionPlan) -> str:
    """Who approved the candidate (waits for a person when the spec says so; raises ApprovalRejected)."""
    if plan.approval is None:
        return "(rollback to an earlier published version)"
    approved_by = approve(plan.approval, tracking_uri=plan.tracking_uri, model_name=plan.model_name,
                          version=str(plan.candidate))
    print(f"{plan.model_name} version {plan.candidate} approved by {approved_by}")
    return approved_by


def connect(plan: PromotionPlan) -> list[Target]:
    """The fleet's endpoints, reachable, in the current repository layout (migrated before any read)."""
    targets = plan.connect()
    check_reachable(targets)
    migrate_layout(targets, plan.model_name, plan.triton.load_timeout_s)
    return targets


def recover_after_crash(plan: PromotionPlan, targets: list[Target], unfinished: Journal) -> PromoteResult | None:
    """Reconcile the rollout a killed run left. When it was this very promotion: its result if the
    reconciliation finished it, RolloutInterrupted if it rolled it back. Another rollout: None (go on)."""
    outcome = reconcile(plan.tracking_uri, targets, unfinished, plan.triton.load_timeout_s)
    if unfinished.candidate != plan.candidate or unfinished.kind != plan.kind:
        return None
    if outcome == "rolled_back":
        raise RolloutInterrupted(
            f"the previous {plan.kind} of {plan.model_name} version {plan.candidate} was interrupted in phase "
            f"{unfinished.phase!r} (step {unfinished.step}); every endpoint was rolled back to version "
            f"{unfinished.live} and MLflow tagged rollout=interrupted. Run the {plan.kind} again to retry.")
    info = mr.get_version(plan.tracking_uri, plan.model_name, str(plan.candidate))
    report = RolloutReport(plan.model_name, plan.candidate, unfinished.live,
                           reason="finished by reconciliation after a crash")
    return _result(plan, targets, info, "(approved before the crash)", report)


def live_and_candidate(plan: PromotionPlan, targets: list[Target]) -> tuple[int | None, VersionInfo]:
    """The version the fleet serves (None before the first release) and the candidate's MLflow record."""
    live = fleet_live_version(targets, plan.model_name)
    return live, mr.get_version(plan.tracking_uri, plan.model_name, str(plan.candidate))


def converge_already_live(plan: PromotionPlan, targets: list[Target], info: VersionInfo) -> PromoteResult:
    """The candidate is live already: converge every endpoint (idempotent) and make MLflow agree."""
    make_live(targets, plan.model_name, plan.candidate, plan.triton.load_timeout_s)
    record_production(plan.tracking_uri, plan.model_name, plan.candidate)
    report = RolloutReport(plan.model_name, plan.candidate, plan.candidate,
                           reason=f"version {plan.candidate} was already live")
    return _result(plan, targets, info, "(already live)", report)


def fetch_verified(plan: PromotionPlan, targets: list[Target], info: VersionInfo, live: int | None) -> Path:
    """The verified artifact (a version without its manifest is never promoted), and room for it on every
    endpoint; nothing has changed when this raises."""
    require_complete(plan.artifacts_uri, info)
    engine_dir = fetch_engine(artifacts_uri=plan.artifacts_uri, model_name=plan.model_name,
                              fingerprint=info.fingerprint, cache_dir=plan.fetch_dir, device=plan.device,
                              engine=plan.engine)
    try:
        check_fits(targets, engine_dir, device=plan.device, engine_kind=plan.engine.kind)
    except CandidateDoesNotFit as exc:
        record_failure(plan.tracking_uri, plan.model_name, plan.candidate, str(exc), {}, reject=False)
        raise StageFailed(f"{plan.model_name} version {plan.candidate} was not staged ({exc}); nothing changed, "
                          f"version {live} stays live; MLflow tagged rollout=failed") from exc
    return engine_dir


def stage_candidate(plan: PromotionPlan, steps: PromotionSteps, targets: list[Target], engine_dir: Path,
                    live: int | None, after: Journal | None) -> tuple[Journal, StagedVersion]:
    """Journal ``staging``, MLflow ``canary``, the candidate loaded beside the live version on every endpoint.
    A failure rolls every endpoint back and raises StageFailed."""
    repos = [t.model_repository for t in targets]
    journal = write_journal(repos, Journal(plan.model_name, plan.candidate, live, "staging", kind=plan.kind,
                                           endpoints=[t.url for t in targets], seq=after.seq if after else 0))
    record_canary(plan.tracking_uri, plan.model_name, plan.candidate)
    try:
        staged = steps.stage(targets, model_name=plan.model_name, engine_dir=engine_dir, version=plan.candidate,
                             triton=plan.triton, live=live, engine=plan.engine)
    except Exception as exc:
        reason = f"staging failed: {type(exc).__name__}: {exc}"
        roll_back(plan.tracking_uri, targets, journal, reason=reason, verdict="failed",
                  timeout_s=plan.triton.load_timeout_s)
        raise StageFailed(f"{plan.model_name} version {plan.candidate} was not staged ({reason}); every endpoint "
                          f"serves version {live} again; MLflow tagged rollout=failed") from exc
    return journal, staged


def release_gradually(plan: PromotionPlan, steps: PromotionSteps, targets: list[Target], staged: StagedVersion,
                      journal: Journal, info: VersionInfo) -> RolloutReport:
    """The gray release: traffic shifted step by step, each window analysed. A failed or aborted step rolls
    every endpoint back (MLflow says why, the timeline is attached) and raises its RolloutAborted."""
    vocab = kind_of(plan.engine).vocab_size(staged.engine_dir)
    try:
        return steps.gray_release(targets, staged, rollout=plan.rollout, triton=plan.triton, vocab_size=vocab,
                                  journal=journal, decide=_decider(plan))
    except RolloutAborted as exc:
        report = exc.report if isinstance(exc.report, RolloutReport) else None
        figures = report.figures() if report is not None else {}
        # the analysis judged the engine: reject it; a step that failed (a reload on one endpoint) may be the
        # infrastructure's fault: tag the failure, leave the approval as it is
        judged = plan.kind == "promote" and exc.reason.startswith("analysis")
        current = read_journal([t.model_repository for t in targets], plan.model_name) or journal
        roll_back(plan.tracking_uri, targets, current, reason=exc.reason, verdict="rejected" if judged else "failed",
                  figures=figures, timeout_s=plan.triton.load_timeout_s)
        if report is not None:
            report.weight_changes.append(WeightChange(time.monotonic() - report.t0,
                                                      step_weights(staged.live_version, staged.version, 0)
                                                      if staged.live_version is not None else {}))
            _attach_timeline(plan, steps, info.run_id, report)
        raise


def finish_release(plan: PromotionPlan, steps: PromotionSteps, targets: list[Target], journal: Journal,
                   info: VersionInfo, approved_by: str, report: RolloutReport) -> PromoteResult:
    """The candidate serves alone with all traffic on every endpoint, MLflow ``production``, the timeline
    attached to the version's run."""
    current = read_journal([t.model_repository for t in targets], plan.model_name) or journal  # the task's copy
    finish(plan.tracking_uri, targets, current, figures=report.figures(), timeout_s=plan.triton.load_timeout_s)
    _attach_timeline(plan, steps, info.run_id, report)
    return _result(plan, targets, info, approved_by, report)


# ---------------------------------------------------------------- crash recovery


def reconcile(tracking_uri: str, targets: list[Target], journal: Journal,
              timeout_s: float) -> Literal["finished", "rolled_back"]:
    """Bring Triton, the router and MLflow to one consistent state after a run died mid-rollout:
    ``finishing`` is completed, ``aborting`` completes its roll back, any other phase is rolled back."""
    print(f"reconciling an unfinished {journal.kind} of {journal.model_name} version {journal.candidate} "
          f"(phase {journal.phase}, step {journal.step})")
    if journal.phase == "finishing":
        finish(tracking_uri, targets, journal, timeout_s=timeout_s)
        return "finished"
    if journal.phase == "aborting":
        judged = journal.kind == "promote" and journal.reason.startswith("analysis")
        roll_back(tracking_uri, targets, journal, reason=journal.reason, figures=journal.figures,
                  verdict="rejected" if judged else "failed", timeout_s=timeout_s)
    else:
        reason = (f"interrupted in phase {journal.phase} (step {journal.step}, weights {journal.weights}); "
                  f"rolled back to version {journal.live}")
        roll_back(tracking_uri, targets, journal, reason=reason, verdict="interrupted", timeout_s=timeout_s)
    return "rolled_back"


# ---------------------------------------------------------------- helpers of the steps


def _result(plan: PromotionPlan, targets: list[Target], info: VersionInfo, approved_by: str,
            report: RolloutReport) -> PromoteResult:
    return PromoteResult(plan.model_name, str(plan.candidate), info.fingerprint or "", [t.url for t in targets],
                         approved_by, report, plan.timeline_png)


def _decider(plan: PromotionPlan) -> DecideFn:
    """Hold for a person: poll the MLflow version tag `rollout.decision` (continue / abort) until the timeout."""
    hold = plan.hold

    def decide(reason: str) -> Decision:
        record_hold(plan.tracking_uri, plan.model_name, plan.candidate, reason)
        print(f"analysis inconclusive ({reason}); holding the weight. Set the tag {TAG_ROLLOUT_DECISION}="
              f"continue or abort on {plan.model_name} version {plan.candidate} (timeout {hold.timeout_s:g} s -> "
              "abort)")
        deadline = time.monotonic() + hold.timeout_s
        while time.monotonic() < deadline:
            if (value := take_decision(plan.tracking_uri, plan.model_name, plan.candidate)) is not None:
                return value
            time.sleep(hold.poll_s)
        return "abort"

    return decide


def _attach_timeline(plan: PromotionPlan, steps: PromotionSteps, run_id: str | None, report: RolloutReport) -> None:
    from registry import tracking
    from tasks.rollout_plot import plot_timeline

    png = plan.timeline_png
    plot_timeline(report, png)
    if steps.markdown_artifact is not None:
        slug = report.model_name.lower().replace("_", "-").replace(".", "-")
        steps.markdown_artifact(f"rollout-{slug}-v{report.candidate}", rollout_markdown(report, png))
    if run_id:
        tracking.log_artifact_file(plan.tracking_uri, run_id, png, artifact_path="rollout")
        tracking.log_metrics(plan.tracking_uri, run_id, report.metrics)


def rollout_markdown(report: RolloutReport, png: Path) -> str:
    """The rollout's table of analyses, for the Prefect run's artifact."""
    rows = "\n".join(
        f"| {a.t_s:.1f} | {a.outcome} | {a.requests} | {a.success_rate:.3f} | {a.per_version} | {a.reason} |"
        for a in report.analyses
    )
    return (
        f"# Rollout of {report.model_name} version {report.candidate}: {report.outcome}\n\n{report.reason}\n\n"
        f"| t (s) | outcome | requests | success rate | per version | reason |\n"
        f"| --- | --- | --- | --- | --- | --- |\n{rows}\n\nTimeline: `{png}`\n"
    )

