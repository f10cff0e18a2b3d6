"""The rollback flow: return a model to an earlier published version the same safe way a promotion goes.

The earlier version is fetched again from the artifact store (checked against its manifest), staged beside
the live one on every endpoint, and traffic moves by the router: either through the spec's gray-release
plan (with analysis) or at once (`immediate`: one `set_weight: 100`). Journal, reconciliation and MLflow
records are those of `flows.promote` with kind `rollback`: the target version becomes `production`, the
version rolled back from is tagged `rollout=rolled_back` and `rolled_back_to`.
"""

from __future__ import annotations

from prefect import flow
from prefect.states import Failed, State

from flows.promote import PromoteResult, RolloutInterrupted, StageFailed, promote
from flows.spec import ReleaseSpec
from tasks.errors import RolloutAborted, StepError
from tasks.promote_spec import RolloutSpec, SetWeight


class RollbackRefused(StepError):
    """No earlier version to go back to, or the version asked for cannot be served."""


def previous_version(spec: ReleaseSpec, live: int) -> str:
    """The newest version below `live` that once finished a rollout (MLflow tag rollout=succeeded)."""
    from registry._client import mlflow_client

    client = mlflow_client(spec.mlflow.tracking_uri)
    good = [int(mv.version) for mv in client.search_model_versions(f"name = '{spec.model_name}'")
            if (mv.tags or {}).get("rollout") in ("succeeded", "rolled_back") and int(mv.version) < live]
    if not good:
        raise RollbackRefused(f"{spec.model_name}: no version below the live version {live} ever finished a rollout "
                              "(MLflow tag rollout=succeeded); pass --to VERSION")
    return str(max(good))


def rollback(spec: ReleaseSpec, to_version: str | None = None, *, immediate: bool = False) -> PromoteResult:
    """Go back to `to_version` (default: the previous production version) on every endpoint."""
    from flows.promote import _targets
    from registry import model_registry as mr
    from tasks.targets import fleet_live_version

    name, uri = spec.model_name, spec.mlflow.tracking_uri
    live = fleet_live_version(_targets(spec), name)
    if live is None and to_version is None:
        raise RollbackRefused(f"{name} is not live on any endpoint; pass --to VERSION to serve one")
    target = to_version or previous_version(spec, live)
    tags = mr.get_version_tags(uri, name, target)
    if tags.get("approval", "").lower() == "rejected":
        raise RollbackRefused(f"{name} version {target} is rejected in MLflow (approval=rejected: "
                              f"{tags.get('approval_note', '')!r}); pick another --to VERSION")
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
