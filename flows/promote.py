"""The promote flow: approval -> fetch and verify -> stage -> gray release -> finish or roll back.

`promote` resolves the release spec into its plan once, says where the endpoints are (starting the embedded
Triton when the spec names none), and calls the steps of `tasks.promotion` in order; a rollout a killed run
left unfinished is recovered first (`recover_after_crash`).
MLflow records the outcome (`registry.rollout_record`): alias `canary` while the rollout runs,
`production` when it finishes; a version rolled back by the analysis is tagged `rollout` = `failed` with
`rollout.reason` and `rollout.analysis` (the figures) and marked `approval` = `rejected`. Engine models are
named by the MLflow version number, so engine model `<model>_v3` holds registered version 3.

`promote` is a plain function, so it also runs without Prefect (tests kill it with SIGKILL); inside a flow
the stage and gray-release steps run as Prefect tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from prefect import flow
from prefect.states import Failed, State

from flows.spec import ReleaseSpec
from tasks.errors import ApprovalRejected, RolloutAborted
from tasks.gray_release import gray_release_task
from tasks.promote_spec import RolloutSpec
from tasks.promotion import (
    PromoteResult,
    PromotionKind,
    PromotionPlan,
    PromotionSteps,
    RolloutInterrupted,
    StageFailed,
    approve_candidate,
    connect,
    converge_already_live,
    fetch_verified,
    finish_release,
    live_and_candidate,
    reconcile,
    recover_after_crash,
    release_gradually,
    stage_candidate,
    unfinished_rollout,
)
from tasks.rollout_state import read_journal
from tasks.stage import migrate_layout, stage_task
from tasks.targets import Target, check_reachable, resolve_targets

__all__ = ["PromoteResult", "RolloutInterrupted", "StageFailed", "connect_targets", "promote", "promote_flow",
           "recover_unfinished"]


def connect_targets(spec: ReleaseSpec) -> list[Target]:
    """The spec's endpoints, or the embedded Triton (started now if it is not running)."""
    if spec.triton.endpoints:
        return resolve_targets(spec.triton)
    from flows.embedded import ensure_embedded

    server = ensure_embedded(spec.triton.model_repository, load_timeout_s=spec.triton.load_timeout_s)
    return resolve_targets(spec.triton, embedded_url=server.http_url, embedded_metrics_url=server.metrics_url,
                           embedded_grpc_url=server.grpc_url)


def repositories(spec: ReleaseSpec) -> tuple[Path, ...]:
    """The model repositories the targets serve, known without starting or calling any server."""
    if spec.triton.endpoints:
        return tuple(t.model_repository for t in resolve_targets(spec.triton))
    return (Path(spec.triton.model_repository),)


@dataclass(frozen=True)
class Recovery:
    """What ``recover_unfinished`` did to a rollout a killed run left."""

    outcome: Literal["finished", "rolled_back"]
    serving: int | None  # the one version every endpoint serves now (None: nothing, it was a first release)
    line: str  # says it, for a person


def recover_unfinished(spec: ReleaseSpec) -> Recovery | None:
    """Reconcile a rollout a killed run left unfinished (starting the embedded Triton if it is down); None
    when every rollout of the spec's model had ended."""
    journal = read_journal(list(repositories(spec)), spec.model_name)
    if journal is None or journal.terminal:
        return None
    targets = connect_targets(spec)
    check_reachable(targets)
    migrate_layout(targets, spec.model_name, spec.triton.load_timeout_s)
    outcome = reconcile(spec.mlflow.tracking_uri, targets, journal, spec.triton.load_timeout_s)
    serving = journal.candidate if outcome == "finished" else journal.live
    done = "finished it" if outcome == "finished" else "rolled it back"
    return Recovery(outcome, serving, f"reconciled the unfinished {journal.kind} of {spec.model_name} version {journal.candidate} (phase "
            f"{journal.phase}, step {journal.step}, weights {journal.weights}): {done}; "
            + (f"version {serving} serves 100% of traffic on every endpoint and is MLflow's production"
               if serving is not None else "no version is served (it was the first release)"))


def plan_of(spec: ReleaseSpec, version: int, *, kind: PromotionKind, rollout: RolloutSpec | None,
            skip_approval: bool) -> PromotionPlan:
    """The spec's settings for one promotion of ``version``."""
    device = spec.triton.device if spec.triton.device in ("cuda", "cpu") else "auto"
    return PromotionPlan(
        model_name=spec.model_name, candidate=version, kind=kind, tracking_uri=spec.mlflow.tracking_uri,
        artifacts_uri=spec.artifacts.uri, approval=None if skip_approval else spec.approval, triton=spec.triton,
        engine=spec.engine, rollout=rollout or spec.rollout, hold=spec.rollout.hold, device=device,
        fetch_dir=spec.work_dir / "fetched",
        timeline_png=spec.work_dir / "reports" / f"{kind}-{spec.model_name}-v{version}.png",
        repositories=repositories(spec), connect=lambda: connect_targets(spec),
    )


def prefect_steps() -> PromotionSteps:
    """Inside a flow run: stage and gray release as Prefect tasks, the rollout table as the run's artifact."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return PromotionSteps()
    return PromotionSteps(stage=stage_task, gray_release=gray_release_task,
                          markdown_artifact=lambda key, markdown: create_markdown_artifact(
                              key=key, markdown=markdown, description="gray release timeline"))


def promote(spec: ReleaseSpec, version: int | str, *, kind: PromotionKind = "promote",
            rollout: RolloutSpec | None = None, skip_approval: bool = False) -> PromoteResult:
    """Reconcile any unfinished rollout, then approve, stage and gray-release `version` (plain function).

    Raises ApprovalRejected, StageFailed, RolloutAborted or RolloutInterrupted; each leaves every endpoint
    serving exactly one version and MLflow saying which and why.
    """
    plan = plan_of(spec, int(version), kind=kind, rollout=rollout, skip_approval=skip_approval)
    steps = prefect_steps()
    unfinished = unfinished_rollout(plan)
    approved_by = None
    if unfinished is None:
        approved_by = approve_candidate(plan)  # before any server starts: a rejected version starts nothing
        targets = connect(plan)
    else:
        targets = connect(plan)
        if (recovered := recover_after_crash(plan, targets, unfinished)) is not None:
            return recovered
    live, info = live_and_candidate(plan, targets)
    if live == plan.candidate:
        return converge_already_live(plan, targets, info)
    if approved_by is None:
        approved_by = approve_candidate(plan)
    engine_dir = fetch_verified(plan, targets, info, live)
    journal, staged = stage_candidate(plan, steps, targets, engine_dir, live, after=unfinished)
    report = release_gradually(plan, steps, targets, staged, journal, info)
    return finish_release(plan, steps, targets, journal, info, approved_by, report)


@flow(name="promote", log_prints=True)
def promote_flow(spec: ReleaseSpec, version: str) -> PromoteResult | State:
    """Promote a published version of the spec's model into Triton through a gray release."""
    try:
        return promote(spec, version)
    except (ApprovalRejected, RolloutAborted, RolloutInterrupted, StageFailed) as exc:
        suffix = (f" {spec.model_name} version {version} is tagged rollout=failed; live version unchanged."
                  if isinstance(exc, RolloutAborted) else "")
        return Failed(message=f"{exc}.{suffix}")
