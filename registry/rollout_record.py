"""A rollout's record in the MLflow model registry: the tags and aliases a promotion or rollback writes.

While a rollout runs the candidate holds the alias ``canary``; when it finishes it becomes ``production``
and is tagged ``rollout`` = ``succeeded`` (the version it replaced gets ``superseded_by``, and after a
rollback also ``rollout`` = ``rolled_back`` and ``rolled_back_to``). A rollout that fails is tagged
``rollout`` = ``failed`` with ``rollout.reason`` and ``rollout.analysis`` (the figures, JSON); one that the
analysis judged is also rejected (``approval`` = ``rejected`` by ``enginewright-rollout``). A rollout killed
midway and rolled back by the next run is tagged ``rollout`` = ``interrupted``. An inconclusive analysis
writes ``rollout.hold`` and waits for a person's ``rollout.decision`` (``continue`` / ``abort``), which is
marked ``(used)`` once read. These names are what existing deployments carry: never rename one.

Versions are ``int`` here, as everywhere inside a promotion; MLflow's own string form is made at the call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from registry import approval
from registry import model_registry as mr
from registry._client import ClientOrUri, mlflow_client

TAG_ROLLOUT = "rollout"
TAG_ROLLOUT_REASON = "rollout.reason"
TAG_ROLLOUT_ANALYSIS = "rollout.analysis"
TAG_ROLLOUT_HOLD = "rollout.hold"
TAG_ROLLOUT_DECISION = "rollout.decision"
TAG_SUPERSEDED_BY = "superseded_by"
TAG_ROLLED_BACK_TO = "rolled_back_to"

SUCCEEDED = "succeeded"
FAILED = "failed"
INTERRUPTED = "interrupted"
ROLLED_BACK = "rolled_back"
FINISHED = (SUCCEEDED, ROLLED_BACK)  # values of `rollout` on a version that once served all traffic

DECISIONS = ("continue", "abort")
USED_SUFFIX = " (used)"  # appended to a `rollout.decision` once read, so one decision is used once
ROLLOUT_AUTHOR = "enginewright-rollout"  # who rejects a version the analysis judged
MAX_TAG_VALUE = 5000  # characters MLflow keeps of a model-version tag's value

Decision = Literal["continue", "abort"]


def _clip(text: str) -> str:
    return text[:MAX_TAG_VALUE]


def record_canary(uri: ClientOrUri, name: str, version: int) -> None:
    """The candidate is being rolled out: alias ``canary``."""
    mr.set_alias(uri, name, mr.ALIAS_CANARY, str(version))


def record_production(uri: ClientOrUri, name: str, version: int) -> None:
    """The version serves all traffic: alias ``production`` (nothing else changes)."""
    mr.set_alias(uri, name, mr.ALIAS_PRODUCTION, str(version))


def record_success(uri: ClientOrUri, name: str, version: int, live: int | None,
                   kind: Literal["promote", "rollback"]) -> None:
    """``version`` finished its rollout and replaced ``live``."""
    record_production(uri, name, version)
    mr.delete_alias(uri, name, mr.ALIAS_CANARY)
    mr.set_version_tag(uri, name, str(version), TAG_ROLLOUT, SUCCEEDED)
    if live is not None and live != version:
        mr.set_version_tag(uri, name, str(live), TAG_SUPERSEDED_BY, str(version))
        if kind == "rollback":
            mr.set_version_tag(uri, name, str(live), TAG_ROLLOUT, ROLLED_BACK)
            mr.set_version_tag(uri, name, str(live), TAG_ROLLED_BACK_TO, str(version))


def record_failure(uri: ClientOrUri, name: str, version: int, reason: str, figures: Mapping[str, Any], *,
                   reject: bool) -> None:
    """The rollout of ``version`` failed for ``reason``; ``reject`` also rejects the version (the analysis
    judged the engine, not the infrastructure)."""
    mr.delete_alias(uri, name, mr.ALIAS_CANARY)
    mr.set_version_tag(uri, name, str(version), TAG_ROLLOUT, FAILED)
    mr.set_version_tag(uri, name, str(version), TAG_ROLLOUT_REASON, _clip(reason))
    if figures:
        mr.set_version_tag(uri, name, str(version), TAG_ROLLOUT_ANALYSIS, _clip(json.dumps(figures, default=str)))
    if reject:
        approval.reject(name, str(version), tracking_uri=uri, by=ROLLOUT_AUTHOR, note=_clip(reason))


def record_interrupted(uri: ClientOrUri, name: str, version: int, reason: str) -> None:
    """A run died during the rollout of ``version`` and the next one rolled it back."""
    if mr.get_version_by_alias(uri, name, mr.ALIAS_CANARY) == str(version):
        mr.delete_alias(uri, name, mr.ALIAS_CANARY)
    mr.set_version_tag(uri, name, str(version), TAG_ROLLOUT, INTERRUPTED)
    mr.set_version_tag(uri, name, str(version), TAG_ROLLOUT_REASON, _clip(reason))


def record_hold(uri: ClientOrUri, name: str, version: int, reason: str) -> None:
    """The analysis was inconclusive: say why on the version, where a person decides."""
    mr.set_version_tag(uri, name, str(version), TAG_ROLLOUT_HOLD, _clip(reason))


def take_decision(uri: ClientOrUri, name: str, version: int) -> Decision | None:
    """A person's unused ``rollout.decision`` (marked used as it is read), or None while there is none."""
    value = mr.get_version_tags(uri, name, str(version)).get(TAG_ROLLOUT_DECISION, "").strip().lower()
    if value not in DECISIONS:
        return None
    mr.set_version_tag(uri, name, str(version), TAG_ROLLOUT_DECISION, f"{value}{USED_SUFFIX}")
    return value  # type: ignore[return-value]


def finished_versions(uri: ClientOrUri, name: str) -> list[int]:
    """The versions of ``name`` that once finished a rollout (``rollout`` succeeded or later rolled back)."""
    return sorted(int(mv.version) for mv in mlflow_client(uri).search_model_versions(f"name = '{name}'")
                  if (mv.tags or {}).get(TAG_ROLLOUT) in FINISHED)


def rejection_of(uri: ClientOrUri, name: str, version: int) -> str | None:
    """The approval note when ``version`` is rejected (``approval`` = ``rejected``), else None."""
    tags = mr.get_version_tags(uri, name, str(version))
    if tags.get(approval.TAG_APPROVAL, "").lower() != approval.REJECTED:
        return None
    return tags.get(approval.TAG_APPROVAL_NOTE, "")
