"""Step 6: the human gate. Wait until a person approves or rejects the version in the MLflow UI."""

from __future__ import annotations

import logging

from prefect import task

from tasks.errors import ApprovalRejected
from tasks.promote_spec import ApprovalSpec

log = logging.getLogger(__name__)


def approval_ui_base(spec: ApprovalSpec, tracking_uri: str) -> str | None:
    """The MLflow UI a person opens to approve: the spec's, else an HTTP tracking server's."""
    if spec.ui_url:
        return spec.ui_url.rstrip("/")
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return None


def approve(spec: ApprovalSpec, *, tracking_uri: str, model_name: str, version: str) -> str:
    """Return who approved; raise ApprovalRejected or the registry's timeout error otherwise."""
    from registry import approval, model_registry

    if spec.mode == "auto":
        approval.auto_approve(model_name, version, tracking_uri=tracking_uri)
        return "enginewright-auto"

    ui = approval_ui_base(spec, tracking_uri)
    link = model_registry.version_ui_url(ui, model_name, version) if ui else None
    where = f"open {link} and" if link else "in the MLflow UI,"
    print(
        f"waiting up to {spec.timeout_s:.0f} s for approval of {model_name} version {version}: "
        f"{where} set the version tag `approval` to `approved` or `rejected`",
        flush=True,
    )
    decision = approval.wait_for_approval(
        model_name,
        version,
        tracking_uri=tracking_uri,
        timeout_s=spec.timeout_s,
        poll_s=spec.poll_s,
        on_waiting=lambda msg: log.info("%s", msg),
    )
    if not decision.approved:
        raise ApprovalRejected(f"{model_name} version {version} was rejected in MLflow ({decision})")
    return verified_approver(tracking_uri, model_name, version, claimed=decision.decided_by)


def verified_approver(tracking_uri: str, model_name: str, version: str, *, claimed: str | None) -> str:
    """Who approved, once MLflow's permissions show only approvers could have (raises otherwise).

    On a server with the basic-auth app the approval tag counts only if every account able to
    write it is an approver and the publisher is not one (``registry.promotion``); without auth
    there are no accounts and the ``approved_by`` tag is all there is.
    """
    from registry.promotion import require_authorized_approval

    verified = require_authorized_approval(tracking_uri, model_name, version)
    if verified is None:
        return claimed or "unknown"
    who = "/".join(verified.possible_authors)
    return f"{claimed} (verified: only {who} can approve)" if claimed else f"one of {who}"


@task(name="approval", retries=0)
def approve_task(spec: ApprovalSpec, *, tracking_uri: str, model_name: str, version: str) -> str:
    """Wait for the approval decision on the version."""
    return approve(spec, tracking_uri=tracking_uri, model_name=model_name, version=version)
