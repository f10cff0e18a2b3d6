"""Step 6: the human gate. Wait until a person approves or rejects the version in the MLflow UI.

The link to the version page is always given (printed, logged, and in the Prefect run's artifact): the
spec's `approval.ui_url`, an HTTP tracking server itself, or for the embedded sqlite store the `mlflow ui`
command on port 5000 and the link into it. A rejection changes nothing but the version's own record: the
`candidate` alias leaves it, and the error says which version stays live.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from tasks.errors import ApprovalRejected
from tasks.promote_spec import ApprovalSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApprovalLink:
    """Where a person decides: the version page, and the command that serves the UI when nothing does yet."""

    url: str | None
    ui_command: str | None

    def instructions(self, model_name: str, version: str) -> str:
        where = f"open {self.url} and" if self.url else "in the MLflow UI,"
        start = f" (start the UI with: {self.ui_command})" if self.ui_command else ""
        return (f"{where} add the version tag `approval` with the value `approved` or `rejected` to {model_name} "
                f"version {version}, and `approved_by` (or `rejected_by`) with your name{start}")


def approval_link(spec: ApprovalSpec, tracking_uri: str, model_name: str, version: str) -> ApprovalLink:
    """The version page's link (see `registry.model_registry.ui_base_for`) and, for a local store, the UI command."""
    from registry import model_registry as mr

    base = mr.ui_base_for(tracking_uri, spec.ui_url)
    url = mr.version_ui_url(base, model_name, version) if base else None
    return ApprovalLink(url, mr.ui_command(tracking_uri, spec.ui_url))


def await_decision(spec: ApprovalSpec, *, tracking_uri: str, model_name: str, version: str,
                   sleep: Callable[[float], None] = time.sleep):
    """The decision on the version, waiting for it (printing the link) when there is none yet.

    A rejection moves the `candidate` alias off the version and raises ApprovalRejected with a sentence
    saying that nothing changed and which version stays live. Returns the ApprovalDecision otherwise.
    """
    from registry import approval

    link = approval_link(spec, tracking_uri, model_name, version)
    decision = approval.read_decision(model_name, version, tracking_uri=tracking_uri)
    if decision is None:
        text = f"waiting up to {spec.timeout_s:.0f} s for approval: {link.instructions(model_name, version)}"
        print(text, flush=True)
        log.info("%s", text)
        decision = approval.wait_for_approval(
            model_name, version, tracking_uri=tracking_uri, timeout_s=spec.timeout_s, poll_s=spec.poll_s,
            by_grace_s=spec.by_grace_s, sleep=sleep,
        )
    _attach_link(model_name, version, link, decision)
    if not decision.approved:
        raise ApprovalRejected(rejection_sentence(tracking_uri, decision))
    return decision


def rejection_sentence(tracking_uri: str, decision) -> str:
    """'<model> version N was rejected by X (note): nothing changed; version M stays live ...' (alias moved)."""
    from registry import model_registry as mr

    name, version = decision.model_name, decision.version
    if mr.get_version_by_alias(tracking_uri, name, mr.ALIAS_CANDIDATE) == version:
        mr.delete_alias(tracking_uri, name, mr.ALIAS_CANDIDATE)
    live = mr.get_version_by_alias(tracking_uri, name, mr.ALIAS_PRODUCTION)
    who = f" by {decision.decided_by}" if decision.decided_by else ""
    note = f" (note: {decision.note})" if decision.note else ""
    stays = (f"version {live} stays live (alias `production`)" if live else "no version of it was live and none is")
    return (f"{name} version {version} was rejected in MLflow{who}{note}: nothing was staged or changed in Triton; "
            f"{stays}; the alias `candidate` no longer points at version {version}")


def _attach_link(model_name: str, version: str, link: ApprovalLink, decision) -> None:
    """Record the link and the decision as a markdown artifact of the Prefect run (when in one)."""
    if "prefect.context" not in sys.modules:  # no Prefect loaded, so no run: the CLI's wait before its flow
        return
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return
    from prefect.artifacts import create_markdown_artifact

    who = decision.decided_by or "(not named)"
    page = f"[{link.url}]({link.url})" if link.url else "the MLflow UI (no link: set `approval.ui_url`)"
    start = f"\n\nUI: `{link.ui_command}`" if link.ui_command else ""
    create_markdown_artifact(
        key=f"approval-{model_name.lower().replace('_', '-').replace('.', '-')}-v{version}",
        markdown=(f"# Approval of {model_name} version {version}: {decision.decision}\n\n"
                  f"Decided on {page} by {who}.{start}\n"),
        description="approval decision and the version page",
    )


def approve(spec: ApprovalSpec, *, tracking_uri: str, model_name: str, version: str,
            sleep: Callable[[float], None] = time.sleep) -> str:
    """Return who approved; raise ApprovalRejected or the registry's timeout error otherwise."""
    from registry import approval

    if spec.mode == "auto":
        approval.auto_approve(model_name, version, tracking_uri=tracking_uri)
        return "enginewright-auto"
    decision = await_decision(spec, tracking_uri=tracking_uri, model_name=model_name, version=version, sleep=sleep)
    return verified_approver(tracking_uri, model_name, version, claimed=decision.decided_by)


def verified_approver(tracking_uri: str, model_name: str, version: str, *, claimed: str | None) -> str:
    """Who approved, once MLflow's permissions show only approvers could have (raises otherwise).

    On a server with the basic-auth app the approval tag counts only if every account able to
    write it is an approver and the publisher is not one (``registry.promotion_checks``); without auth
    there are no accounts and the ``approved_by`` tag is all there is.
    """
    from registry.approval import NOT_NAMED
    from registry.promotion_checks import require_authorized_approval

    verified = require_authorized_approval(tracking_uri, model_name, version)
    if verified is None:
        return claimed or f"({NOT_NAMED}: no approved_by tag)"
    who = "/".join(verified.possible_authors)
    return f"{claimed} (verified: only {who} can approve)" if claimed else f"one of {who}"
