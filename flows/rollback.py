"""The rollback flow: return a model to an earlier published version the same safe way a promotion goes.

The earlier version is fetched again from the artifact store (checked against its manifest), staged beside
the live one on every endpoint, and traffic moves by the router: either through the spec's gray-release
plan (with analysis) or at once (`immediate`: one `set_weight: 100`). Journal, reconciliation and MLflow
records are a promotion's (`tasks.promotion` with kind `rollback`, `registry.rollout_record`): the target
version becomes `production`, the version rolled back from is tagged `rollout=rolled_back` and `rolled_back_to`.
"""

from __future__ import annotations

from prefect import flow
from prefect.states import Failed, State

from flows.promote import (
    PromoteResult,
    RolloutInterrupted,
    StageFailed,
    connect_targets,
    promote,
    recover_unfinished,
)
from flows.spec import ReleaseSpec
from registry.rollout_record import finished_versions, rejection_of
from tasks.errors import RolloutAborted, StepError
from tasks.promote_spec import RolloutSpec, SetWeight
from tasks.targets import fleet_live_version


class RollbackRefused(StepError):
    """No earlier version to go back to, or the version asked for cannot be served."""


def previous_version(spec: ReleaseSpec, live: int | None) -> int:
    """The newest version below `live` that once finished a rollout (MLflow tag rollout=succeeded)."""
    good = [v for v in finished_versions(spec.mlflow.tracking_uri, spec.model_name) if live is None or v < live]
    if not good:
        raise RollbackRefused(f"{spec.model_name}: no version below the live version {live} ever finished a rollout "
                              "(MLflow tag rollout=succeeded); pass --to VERSION")
    return max(good)


def rollback(spec: ReleaseSpec, to_version: int | str | None = None, *, immediate: bool = False) -> PromoteResult:
    """Go back to `to_version` (default: the previous production version) on every endpoint.

    A rollout a killed run left unfinished is reconciled first; when that rolled it back and no `to_version`
    was asked for, that was the rollback: the version it had replaced serves again, and nothing more moves."""
    name, uri = spec.model_name, spec.mlflow.tracking_uri
    recovered = recover_unfinished(spec)
    if recovered is not None:
        print(recovered.line)
        if recovered.outcome == "rolled_back" and to_version is None and recovered.serving is not None:
            return promote(spec, recovered.serving, kind="rollback", skip_approval=True)  # already live: converged
    live = fleet_live_version(connect_targets(spec), name)
    if live is None and to_version is None:
        raise RollbackRefused(f"{name} is not live on any endpoint; pass --to VERSION to serve one")
    target = int(to_version) if to_version is not None else previous_version(spec, live)
    note = rejection_of(uri, name, target)
    if note is not None:
        raise RollbackRefused(f"{name} version {target} is rejected in MLflow (approval=rejected: "
                              f"{note!r}); pick another --to VERSION")
    plan = RolloutSpec(steps=[SetWeight(set_weight=100)], concurrency=spec.rollout.concurrency) if immediate \
        else spec.rollout
    print(f"rolling {name} back from version {live} to version {target} "
          f"({'immediate switch' if immediate else 'gray release'})")
    return promote(spec, target, kind="rollback", rollout=plan, skip_approval=True)


@flow(name="rollback", log_prints=True)
def rollback_flow(spec: ReleaseSpec, to_version: str | None = None, immediate: bool = False) -> PromoteResult | State:
    """Return the spec's model to an earlier published version through the router."""
    try:
        return rollback(spec, to_version, immediate=immediate)
    except (RollbackRefused, RolloutAborted, RolloutInterrupted, StageFailed) as exc:
        return Failed(message=str(exc))
