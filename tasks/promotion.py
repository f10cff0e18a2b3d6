"""Promotion as a state machine: reconcile -> approve -> fetch -> stage -> gray -> finish or roll back.

One promotion (or rollback, which is a promotion of an earlier version) of ``candidate`` into every
endpoint of a fleet. The states and what moves between them::

    open ──clean──> approve ──> connect ──> live? ──> fetch ──> stage ──> gray ──> finish ──> done
      └─unfinished journal─> connect ──> reconcile ──> live? ──> approve ──> fetch ...
                                            │            └─ already live: converge, production ──> done
                                            └─ the same rollout: finished ──> done, else RolloutInterrupted
    fetch (does not fit) / stage (failed): StageFailed;  gray (aborted) ──> roll back: RolloutAborted

Approval comes before any server is started when nothing is unfinished (a rejected version starts
nothing); after a crash the fleet is reconciled first (that needs the servers), then approved.

Crash safety: every change is preceded by a record in the rollout journal (``tasks.rollout_state``),
written to every repository of the fleet. A run that finds an unfinished record first reconciles:
``finishing`` is completed, any other phase is rolled back to the live version on every endpoint, and
MLflow is brought in line (``registry.rollout_record``), before anything new starts. Each raise leaves
every endpoint serving exactly one version and MLflow saying which and why.

Versions are ``int`` throughout; MLflow's string form is made only at the registry's boundary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from registry import model_registry as mr
from registry.model_registry import VersionInfo
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
from tasks.approve import approve
from tasks.engine_kinds import kind_of
from tasks.engine_spec import EngineSpec
from tasks.errors import RolloutAborted, StepError
from tasks.fit import CandidateDoesNotFit, check_fits
from tasks.gray_release import DecideFn, RolloutReport, gray_release
from tasks.promote_spec import ApprovalSpec, HoldSpec, RolloutSpec, TritonSpec
from tasks.rollback import make_live, restore_live
from tasks.rollout_state import Journal, read_journal, write_journal
from tasks.stage import StagedVersion, StagingRolledBack, fetch_engine, migrate_layout, stage
from tasks.targets import Target, check_reachable, fleet_live_version

log = logging.getLogger(__name__)

PromotionKind = Literal["promote", "rollback"]
State = Literal["open", "approve", "connect", "reconcile", "live", "fetch", "stage", "gray", "finish", "roll_back",
                "done"]


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


@dataclass
class Promotion:
    """One run of the state machine; `run` walks it from ``open`` to ``done`` (or raises)."""

    plan: PromotionPlan
    steps: PromotionSteps = field(default_factory=PromotionSteps)
    previous: Journal | None = None
    targets: list[Target] = field(default_factory=list)
    approved_by: str | None = None
    live: int | None = None
    info: VersionInfo | None = None
    engine_dir: Path | None = None
    journal: Journal | None = None
    staged: StagedVersion | None = None
    report: RolloutReport | None = None
    aborted: RolloutAborted | None = None
    result: PromoteResult | None = None

    def run(self) -> PromoteResult:
        state: State = "open"
        while state != "done":
            log.debug("%s version %d: %s", self.plan.model_name, self.plan.candidate, state)
            state = getattr(self, f"_{state}")()
        assert self.result is not None
        return self.result

    @property
    def unfinished(self) -> bool:
        return self.previous is not None and not self.previous.terminal

    @property
    def repos(self) -> list[Path]:
        return [t.model_repository for t in self.targets]

    # ------------------------------------------------------------------ the states

    def _open(self) -> State:
        self.previous = read_journal(list(self.plan.repositories), self.plan.model_name)
        return "connect" if self.unfinished else "approve"

    def _approve(self) -> State:
        p = self.plan
        if p.approval is None:
            self.approved_by = "(rollback to an earlier published version)"
        else:
            self.approved_by = approve(p.approval, tracking_uri=p.tracking_uri, model_name=p.model_name,
                                       version=str(p.candidate))
            print(f"{p.model_name} version {p.candidate} approved by {self.approved_by}")
        return "fetch" if self.targets else "connect"

    def _connect(self) -> State:
        self.targets = self.plan.connect()
        check_reachable(self.targets)
        migrate_layout(self.targets, self.plan.model_name, self.plan.triton.load_timeout_s)  # before any read
        return "reconcile" if self.unfinished else "live"

    def _reconcile(self) -> State:
        p, previous = self.plan, self.previous
        assert previous is not None
        done = reconcile(p.tracking_uri, self.targets, previous, p.triton.load_timeout_s)
        if previous.candidate != p.candidate or previous.kind != p.kind:
            return "live"
        if done == "rolled_back":
            raise RolloutInterrupted(
                f"the previous {p.kind} of {p.model_name} version {p.candidate} was interrupted in phase "
                f"{previous.phase!r} (step {previous.step}); every endpoint was rolled back to version "
                f"{previous.live} and MLflow tagged rollout=interrupted. Run the {p.kind} again to retry.")
        info = mr.get_version(p.tracking_uri, p.model_name, str(p.candidate))
        report = RolloutReport(p.model_name, p.candidate, previous.live,
                               reason="finished by reconciliation after a crash")
        self.result = self._result(info, "(approved before the crash)", report)
        return "done"

    def _live(self) -> State:
        """Already live: converge (idempotent) and make MLflow agree; else approve (after a crash) or fetch."""
        p = self.plan
        self.live = fleet_live_version(self.targets, p.model_name)
        self.info = mr.get_version(p.tracking_uri, p.model_name, str(p.candidate))
        if self.live == p.candidate:
            make_live(self.targets, p.model_name, p.candidate, p.triton.load_timeout_s)
            record_production(p.tracking_uri, p.model_name, p.candidate)
            report = RolloutReport(p.model_name, p.candidate, self.live,
                                   reason=f"version {p.candidate} was already live")
            self.result = self._result(self.info, "(already live)", report)
            return "done"
        return "fetch" if self.approved_by is not None else "approve"

    def _fetch(self) -> State:
        """The verified artifact (a version without its manifest is never promoted), and room for it."""
        p, info = self.plan, self.info
        assert info is not None
        require_complete(p.artifacts_uri, info)
        self.engine_dir = fetch_engine(artifacts_uri=p.artifacts_uri, model_name=p.model_name,
                                       fingerprint=info.fingerprint, cache_dir=p.fetch_dir, device=p.device,
                                       engine=p.engine)
        try:
            check_fits(self.targets, self.engine_dir, device=p.device, engine_kind=p.engine.kind)
        except CandidateDoesNotFit as exc:
            record_failure(p.tracking_uri, p.model_name, p.candidate, str(exc), {}, reject=False)
            raise StageFailed(f"{p.model_name} version {p.candidate} was not staged ({exc}); nothing changed, "
                              f"version {self.live} stays live; MLflow tagged rollout=failed") from exc
        return "stage"

    def _stage(self) -> State:
        p = self.plan
        journal = Journal(p.model_name, p.candidate, self.live, "staging", kind=p.kind,
                          endpoints=[t.url for t in self.targets], seq=self.previous.seq if self.previous else 0)
        self.journal = write_journal(self.repos, journal)
        record_canary(p.tracking_uri, p.model_name, p.candidate)
        try:
            self.staged = self.steps.stage(self.targets, model_name=p.model_name, engine_dir=self.engine_dir,
                                           version=p.candidate, triton=p.triton, live=self.live, engine=p.engine)
        except Exception as exc:
            rolled_back = isinstance(exc, StagingRolledBack)
            cause = exc.__cause__ if rolled_back and exc.__cause__ is not None else exc
            reason = f"staging failed: {type(cause).__name__}: {cause}"
            write_journal(self.repos, journal, phase="aborting", reason=reason)
            if not rolled_back:  # stage() could not roll back (or never got to): try again, raise if it fails
                restore_live(self.targets, p.model_name, self.live, p.triton.load_timeout_s)
            record_failure(p.tracking_uri, p.model_name, p.candidate, reason, {}, reject=False)
            write_journal(self.repos, journal, phase="aborted")
            raise StageFailed(f"{p.model_name} version {p.candidate} was not staged ({reason}); every endpoint "
                              f"serves version {self.live} again; MLflow tagged rollout=failed") from exc
        return "gray"

    def _gray(self) -> State:
        p = self.plan
        assert self.engine_dir is not None and self.journal is not None
        vocab = kind_of(p.engine).vocab_size(self.engine_dir)
        try:
            self.report = self.steps.gray_release(self.targets, self.staged, rollout=p.rollout, triton=p.triton,
                                                  vocab_size=vocab, journal=self.journal, decide=self._decider())
        except RolloutAborted as exc:
            self.aborted = exc
            return "roll_back"
        return "finish"

    def _finish(self) -> State:
        p, info = self.plan, self.info
        assert info is not None and self.report is not None and self.journal is not None
        journal = read_journal(self.repos, p.model_name) or self.journal  # the task may have worked on a copy
        self._attach_timeline(info.run_id, self.report)
        record_success(p.tracking_uri, p.model_name, p.candidate, self.live, p.kind)
        print(f"{p.model_name} version {p.candidate} is production: router sends it 100% of traffic")
        write_journal(self.repos, journal, phase="done")
        self.result = self._result(info, self.approved_by or "", self.report)
        return "done"

    def _roll_back(self) -> State:
        """gray_release rolled every endpoint back already; record why, then raise its RolloutAborted."""
        p, info, exc = self.plan, self.info, self.aborted
        assert info is not None and exc is not None and self.journal is not None
        journal = read_journal(self.repos, p.model_name) or self.journal
        report = exc.report if isinstance(exc.report, RolloutReport) else None
        if report is not None:
            self._attach_timeline(info.run_id, report)
        figures = report.figures() if report is not None else {}
        # the analysis judged the engine: reject it; a step that failed (a reload on one endpoint) may be the
        # infrastructure's fault: tag the failure, leave the approval as it is
        record_failure(p.tracking_uri, p.model_name, p.candidate, exc.reason, figures,
                       reject=p.kind == "promote" and exc.reason.startswith("analysis"))
        write_journal(self.repos, journal, phase="aborted")
        raise exc

    # ------------------------------------------------------------------ helpers

    def _result(self, info: VersionInfo, approved_by: str, report: RolloutReport) -> PromoteResult:
        p = self.plan
        return PromoteResult(p.model_name, str(p.candidate), info.fingerprint or "", [t.url for t in self.targets],
                             approved_by, report, p.timeline_png)

    def _decider(self) -> DecideFn:
        """Hold for a person: poll the MLflow version tag `rollout.decision` (continue / abort) until the timeout."""
        p, hold = self.plan, self.plan.hold

        def decide(reason: str) -> Decision:
            record_hold(p.tracking_uri, p.model_name, p.candidate, reason)
            print(f"analysis inconclusive ({reason}); holding the weight. Set the tag {TAG_ROLLOUT_DECISION}="
                  f"continue or abort on {p.model_name} version {p.candidate} (timeout {hold.timeout_s:g} s -> abort)")
            deadline = time.monotonic() + hold.timeout_s
            while time.monotonic() < deadline:
                if (value := take_decision(p.tracking_uri, p.model_name, p.candidate)) is not None:
                    return value
                time.sleep(hold.poll_s)
            return "abort"

        return decide

    def _attach_timeline(self, run_id: str | None, report: RolloutReport) -> None:
        from registry import tracking
        from tasks.rollout_plot import plot_timeline

        png = self.plan.timeline_png
        plot_timeline(report, png)
        if self.steps.markdown_artifact is not None:
            slug = report.model_name.lower().replace("_", "-").replace(".", "-")
            self.steps.markdown_artifact(f"rollout-{slug}-v{report.candidate}", rollout_markdown(report, png))
        if run_id:
            tracking.log_artifact_file(self.plan.tracking_uri, run_id, png, artifact_path="rollout")
            tracking.log_metrics(self.plan.tracking_uri, run_id, report.metrics)


def reconcile(tracking_uri: str, targets: list[Target], journal: Journal,
              timeout_s: float) -> Literal["finished", "rolled_back"]:
    """Bring Triton, the router and MLflow to one consistent state after a run died mid-rollout."""
    name, repos = journal.model_name, [t.model_repository for t in targets]
    print(f"reconciling an unfinished {journal.kind} of {name} version {journal.candidate} "
          f"(phase {journal.phase}, step {journal.step})")
    if journal.phase == "finishing":
        make_live(targets, name, journal.candidate, timeout_s)
        record_success(tracking_uri, name, journal.candidate, journal.live, journal.kind)
        print(f"{name} version {journal.candidate} is production: router sends it 100% of traffic")
        write_journal(repos, journal, phase="done")
        return "finished"
    restore_live(targets, name, journal.live, timeout_s)
    if journal.phase == "aborting":
        record_failure(tracking_uri, name, journal.candidate, journal.reason, journal.figures,
                       reject=journal.kind == "promote" and journal.reason.startswith("analysis"))
        write_journal(repos, journal, phase="aborted")
    else:
        reason = (f"interrupted in phase {journal.phase} (step {journal.step}, weights {journal.weights}); "
                  f"rolled back to version {journal.live}")
        record_interrupted(tracking_uri, name, journal.candidate, reason)
        write_journal(repos, journal, phase="interrupted", reason=reason)
    return "rolled_back"


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

