"""The human gate: wait for a person to set the version tag ``approval`` in the MLflow UI.

OSS MLflow has no approval workflow of its own, so the decision is a model-version tag:
``approval`` = ``approved`` or ``rejected``, optionally with ``approved_by`` / ``rejected_by`` and
``approval_note``. Automatic approval writes the same tags, so the record is explicit either way.

Read as a person writes them in the UI:
- tag names and values are case-insensitive (``Approval`` = ``Approved`` counts; a warning names the
  tag as the UI shows it, so the record can be tidied);
- who decided is read when the decision is seen; if ``approved_by`` / ``rejected_by`` is not set yet,
  the tags are read again once a second for up to ``BY_GRACE_S`` seconds, so a person who sets
  ``approval`` first and their name within those seconds is named. After that the decision stands
  without a name ("not named").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone

from mlflow.exceptions import MlflowException

from registry._client import ClientOrUri, mlflow_client
from registry.errors import (
    ApprovalNotAuthorizedError,
    ApprovalTimeoutError,
    ModelVersionNotFoundError,
    RegistryError,
)
from registry.model_registry import get_version, version_ui_url

log = logging.getLogger(__name__)

TAG_APPROVAL = "approval"
TAG_APPROVED_BY = "approved_by"
TAG_REJECTED_BY = "rejected_by"
TAG_APPROVAL_NOTE = "approval_note"
APPROVED = "approved"
REJECTED = "rejected"
AUTO_APPROVER = "enginewright-auto"
NOT_NAMED = "not named"
BY_GRACE_S = 10.0
_BY_TAG = {APPROVED: TAG_APPROVED_BY, REJECTED: TAG_REJECTED_BY}


def tag_value(tags: Mapping[str, str], name: str) -> tuple[str | None, str | None]:
    """``(name as written, value)`` of the tag ``name`` compared case-insensitively; exact spelling first."""
    if name in tags:
        return name, tags[name]
    for key, value in tags.items():
        if key.strip().lower() == name:
            return key, value
    return None, None


@dataclass(frozen=True)
class ApprovalDecision:
    """A person's (or the automatic) decision on one version."""

    model_name: str
    version: str
    decision: str  # "approved" or "rejected"
    decided_by: str | None
    note: str | None
    observed_at: datetime  # when enginewright saw the decision (MLflow tags carry no timestamp)

    @property
    def approved(self) -> bool:
        """Whether the version was approved."""
        return self.decision == APPROVED


def read_decision(model_name: str, version: str, *, tracking_uri: ClientOrUri) -> ApprovalDecision | None:
    """The decision recorded on the version now, or None if the ``approval`` tag is unset or not a decision."""
    return read_decision_from_tags(model_name, version, get_version(tracking_uri, model_name, version).tags)


def wait_for_approval(
    model_name: str,
    version: str,
    *,
    tracking_uri: ClientOrUri,
    timeout_s: float,
    poll_s: float = 5.0,
    on_waiting: Callable[[str], None] | None = None,
    ui_base: str | None = None,
    by_grace_s: float = BY_GRACE_S,
    sleep: Callable[[float], None] = time.sleep,
) -> ApprovalDecision:
    """Poll the version tag ``approval`` until approved/rejected; ApprovalTimeoutError after ``timeout_s``.

    ``on_waiting`` is called once, with a message saying what to do (and the UI link when
    ``ui_base`` is given), the first time the version is seen undecided. A decision seen without its
    ``approved_by`` / ``rejected_by`` is re-read for up to ``by_grace_s`` seconds for the name. Every
    pause between polls is a call of ``sleep`` (where a caller lets Ctrl-C end the wait).
    """
    if timeout_s < 0 or poll_s <= 0:
        raise RegistryError(
            f"Invalid approval timing timeout_s={timeout_s}, poll_s={poll_s} (settings approval.timeout_s, "
            "approval.poll_s): expected timeout_s >= 0 and poll_s > 0."
        )
    client = mlflow_client(tracking_uri)
    deadline = time.monotonic() + timeout_s
    announced = False
    warned: set[tuple[str, str | None]] = set()
    last_value: str | None = None
    while True:
        tags = _read_tags(client, model_name, version)
        if tags is not None:
            key, last_value = tag_value(tags, TAG_APPROVAL)
            decision = read_decision_from_tags(model_name, version, tags)
            if key is not None and (key, last_value) not in warned:
                warned.add((key, last_value))
                _warn_spelling(model_name, version, key, last_value, decision)
            if decision is not None:
                if decision.decided_by is None and by_grace_s > 0:
                    decision = _wait_for_name(client, decision, by_grace_s, sleep)
                log.info("model '%s' version %s %s by %s", model_name, version, decision.decision,
                         decision.decided_by or f"({NOT_NAMED}: no {_BY_TAG[decision.decision]} tag)")
                return decision
            if not announced:
                announced = True
                if on_waiting is not None:
                    on_waiting(_waiting_message(model_name, version, timeout_s, ui_base))
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ApprovalTimeoutError(model_name, str(version), timeout_s, last_value=last_value)
        sleep(min(poll_s, remaining))


def _read_tags(client, model_name: str, version: str) -> Mapping[str, str] | None:
    try:
        return get_version(client, model_name, version).tags
    except ModelVersionNotFoundError:
        raise
    except MlflowException as e:  # a server restart during a long wait is not a decision
        log.warning("could not read model '%s' version %s (will retry): %s", model_name, version, e.message)
        return None


def _warn_spelling(model_name: str, version: str, key: str, value: str | None,
                   decision: ApprovalDecision | None) -> None:
    where = f"model '{model_name}' version {version}"
    if decision is None:
        log.warning("ignoring the version tag %s='%s' on %s: expected the value 'approved' or 'rejected'",
                    key, value, where)
    elif key != TAG_APPROVAL:
        log.warning("reading the version tag '%s' (as the MLflow UI shows it) as '%s' on %s: tag names are read "
                    "case-insensitively; rename it to '%s' to keep the record tidy", key, TAG_APPROVAL, where,
                    TAG_APPROVAL)


def _wait_for_name(client, decision: ApprovalDecision, grace_s: float,
                   sleep: Callable[[float], None]) -> ApprovalDecision:
    """Re-read the tags once a second for up to ``grace_s`` until the decider's name appears."""
    deadline = time.monotonic() + grace_s
    log.info("model '%s' version %s is %s; waiting up to %g s for its %s tag", decision.model_name,
             decision.version, decision.decision, grace_s, _BY_TAG[decision.decision])
    while time.monotonic() < deadline:
        sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        tags = _read_tags(client, decision.model_name, decision.version)
        again = read_decision_from_tags(decision.model_name, decision.version, tags) if tags is not None else None
        if again is not None and (again.decision != decision.decision or again.decided_by is not None):
            return again  # named, or changed its mind within the grace: the newer reading counts
    return decision


def read_decision_from_tags(model_name: str, version: str, tags: Mapping[str, str]) -> ApprovalDecision | None:
    """The decision in a version's tags, or None if there is none (names and values case-insensitive)."""
    _, value = tag_value(tags, TAG_APPROVAL)
    if value is None or value.strip().lower() not in _BY_TAG:
        return None
    decision = value.strip().lower()
    by = tag_value(tags, _BY_TAG[decision])[1]
    return ApprovalDecision(
        model_name=model_name,
        version=str(version),
        decision=decision,
        decided_by=(by.strip() or None) if by is not None else None,
        note=tag_value(tags, TAG_APPROVAL_NOTE)[1],
        observed_at=datetime.now(timezone.utc),
    )


def record_decision(
    model_name: str,
    version: str,
    decision: str,
    *,
    tracking_uri: ClientOrUri,
    by: str,
    note: str | None = None,
) -> None:
    """Write a decision as tags (who and note first, then ``approval`` itself, which pollers react to)."""
    if decision not in _BY_TAG:
        raise RegistryError(f"Invalid approval decision '{decision}': expected 'approved' or 'rejected'.")
    client = mlflow_client(tracking_uri)
    get_version(client, model_name, version)  # clear error for a missing version
    client.set_model_version_tag(model_name, str(version), _BY_TAG[decision], by)
    if note is not None:
        client.set_model_version_tag(model_name, str(version), TAG_APPROVAL_NOTE, note)
    client.set_model_version_tag(model_name, str(version), TAG_APPROVAL, decision)


def auto_approve(
    model_name: str, version: str, *, tracking_uri: ClientOrUri, note: str | None = None
) -> ApprovalDecision:
    """Approve without a person (``approval.mode=auto``): tags ``approval=approved``, ``approved_by=enginewright-auto``."""
    client = mlflow_client(tracking_uri)
    record_decision(model_name, version, APPROVED, tracking_uri=client, by=AUTO_APPROVER,
                    note=note or "approval.mode=auto")
    decision = read_decision(model_name, version, tracking_uri=client)
    assert decision is not None
    return decision


def reject(model_name: str, version: str, *, tracking_uri: ClientOrUri, by: str, note: str) -> None:
    """Mark a version rejected (e.g. after a failed gray release), with who and why."""
    record_decision(model_name, version, REJECTED, tracking_uri=tracking_uri, by=by, note=note)


def _waiting_message(model_name: str, version: str, timeout_s: float, ui_base: str | None) -> str:
    where = f" at {version_ui_url(ui_base, model_name, version)}" if ui_base else " in the MLflow UI"
    return (
        f"Waiting up to {timeout_s:g} s (approval.timeout_s) for a decision on model '{model_name}' "
        f"version {version}: set the version tag 'approval' to 'approved' or 'rejected'{where}."
    )


# -- who approved: permissions, not tags -------------------------------------------------------

ENV_APPROVERS = "ENGINEWRIGHT_APPROVERS"
ENV_PUBLISHER = "ENGINEWRIGHT_PUBLISHER"
ENV_AUDITOR_PREFIX = "ENGINEWRIGHT_MLFLOW_AUDITOR"


@dataclass(frozen=True)
class ApprovalPolicy:
    """Who may approve (MLflow usernames) and which account publishes (never an approver)."""

    approvers: frozenset[str]
    publisher: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ApprovalPolicy | None:
        """``ENGINEWRIGHT_APPROVERS`` (comma-separated) and ``ENGINEWRIGHT_PUBLISHER``; None if unset."""
        import os

        env = os.environ if environ is None else environ
        names = frozenset(n.strip() for n in env.get(ENV_APPROVERS, "").split(",") if n.strip())
        if not names:
            return None
        return cls(names, env.get(ENV_PUBLISHER) or None)


@dataclass(frozen=True)
class VerifiedApproval:
    """An approval whose possible authors are all approvers (MLflow records no single author)."""

    decision: ApprovalDecision
    possible_authors: tuple[str, ...]  # accounts that could have set the tag; every one an approver or admin
    claimed_by: str | None  # the `approved_by` tag, as written (not evidence)


def verify_approval(
    model_name: str,
    version: str,
    *,
    tracking_uri: ClientOrUri,
    policy: ApprovalPolicy,
    auditor,
) -> VerifiedApproval:
    """Accept the version's ``approval=approved`` only if nobody but approvers (and admins) could have set it.

    ``auditor`` is a ``registry.auth.AuthApi`` of an MLflow admin (listing users and their grants
    needs one). Raises ApprovalNotAuthorizedError when the version is not approved, when the
    publishing account (or any account outside ``policy.approvers``) can write version tags of the
    model, or when no approver can.
    """
    from registry.auth import version_tag_writers

    if policy.publisher and policy.publisher in policy.approvers:
        raise ApprovalNotAuthorizedError(
            f"The publishing account '{policy.publisher}' ({ENV_PUBLISHER}) is also an approver ({ENV_APPROVERS}): "
            "it could approve its own builds."
        )
    decision = read_decision(model_name, version, tracking_uri=tracking_uri)
    if decision is None or not decision.approved:
        state = decision.decision if decision else "not decided"
        raise ApprovalNotAuthorizedError(f"Model '{model_name}' version {version} is not approved ({state}).")
    writers = version_tag_writers(auditor, model_name)
    problems = []
    if policy.publisher and policy.publisher in writers:
        problems.append(f"the publishing account '{policy.publisher}' can set version tags "
                        f"({writers[policy.publisher]}), so it could have approved its own build")
    outsiders = sorted(u for u, why in writers.items() if u not in policy.approvers and why != "admin"
                       and u != policy.publisher)
    if outsiders:
        problems.append("accounts outside the approvers can set version tags: "
                        + ", ".join(f"'{u}' ({writers[u]})" for u in outsiders))
    if not any(u in policy.approvers for u in writers):
        problems.append("no approver can set version tags")
    if problems:
        raise ApprovalNotAuthorizedError(
            f"The approval of model '{model_name}' version {version} does not count: "
            + "; ".join(problems)
            + f". MLflow records no author for a tag, so an approval counts only when every account able to "
            f"write it is an approver ({ENV_APPROVERS}={','.join(sorted(policy.approvers))})."
        )
    log.info("approval of model '%s' version %s verified: only %s could set it", model_name, version,
             ", ".join(sorted(writers)))
    return VerifiedApproval(decision, tuple(sorted(writers)), decision.decided_by)
