"""`enginewright` subcommands for the registry side: approvals, their webhook and permissions.

- ``wait-approval``: wait for (and verify) the approval of a version, printing its MLflow UI link;
- ``webhook-receiver``: serve the signed-webhook -> Prefect-event receiver;
- ``approval-webhook``: register that receiver with MLflow (``model_version_tag.set``; admin);
- ``approval-permissions``: set the publisher/approver grants of a registered model (admin).

Credentials come from the environment only (``MLFLOW_TRACKING_USERNAME`` / ``_PASSWORD`` for the
account running the command, ``ENGINEWRIGHT_WEBHOOK_SECRET`` for the webhook secret), never from
arguments, so they stay out of shell history and process listings.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from flows.cli import EXIT_GATE


def cmd_wait_approval(args: argparse.Namespace) -> int:
    from flows.interrupt import interruptible
    from tasks.approve import approve
    from tasks.errors import ApprovalRejected
    from tasks.promote_spec import ApprovalSpec

    spec = ApprovalSpec(mode="mlflow-tag", timeout_s=args.timeout, poll_s=args.poll, ui_url=args.ui_url)
    try:
        with interruptible(f"the approval of {args.model} version {args.version}") as sleep:
            who = approve(spec, tracking_uri=args.tracking_uri, model_name=args.model, version=str(args.version),
                          sleep=sleep)
    except ApprovalRejected as exc:
        print(f"enginewright: {exc}", file=sys.stderr)
        return EXIT_GATE
    print(f"{args.model} version {args.version} approved by {who}", flush=True)
    return 0


def _secret() -> str:
    from flows.approval_events import ENV_SECRET

    secret = os.environ.get(ENV_SECRET, "")
    if not secret:
        from registry.errors import RegistryError

        raise RegistryError(f"Set the webhook secret in the environment variable {ENV_SECRET}.")
    return secret


def cmd_webhook_receiver(args: argparse.Namespace) -> int:
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")  # its lines are no flow run's
    from flows.approval_events import SeenDeliveries, WebhookReceiver

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("flows.approval_events").setLevel(logging.INFO)  # each accepted delivery is logged
    receiver = WebhookReceiver(_secret(), host=args.host, port=args.port, max_age_s=args.max_age,
                               seen=SeenDeliveries(args.seen_file))
    print(f"approval webhook receiver listening on {receiver.url}", flush=True)
    try:
        receiver.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        receiver.server.server_close()
    return 0


def cmd_approval_webhook(args: argparse.Namespace) -> int:
    from registry._client import mlflow_client

    client = mlflow_client(args.tracking_uri)
    for hook in client.list_webhooks():
        if hook.name == args.name:
            client.delete_webhook(hook.webhook_id)
    hook = client.create_webhook(name=args.name, url=args.url, events=["model_version_tag.set"], secret=_secret(),
                                 description="enginewright approvals -> Prefect events")
    print(f"webhook {hook.webhook_id} posts model_version_tag.set to {args.url}")
    return 0


def cmd_approval_permissions(args: argparse.Namespace) -> int:
    from registry.auth import AuthApi, MlflowCredentials, configure_release_permissions
    from registry.errors import RegistryError

    admin = MlflowCredentials.from_env()
    if admin is None:
        raise RegistryError("Set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD to an MLflow admin account.")
    approvers = [a.strip() for a in args.approvers.split(",") if a.strip()]
    configure_release_permissions(AuthApi(args.tracking_uri, admin), args.model, publisher=args.publisher,
                                  approvers=approvers)
    print(f"model {args.model}: {args.publisher} publishes (cannot set version tags); approvers: {', '.join(approvers)}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the registry subcommands to the `enginewright` parser."""
    p = sub.add_parser("wait-approval", help="wait for a person to approve a version in the MLflow UI (prints the link)")
    p.add_argument("--tracking-uri", required=True, help="MLflow server URL")
    p.add_argument("--model", required=True, help="registered model name")
    p.add_argument("--version", required=True, help="model version")
    p.add_argument("--timeout", type=float, default=3600, help="seconds to wait (approval.timeout_s)")
    p.add_argument("--poll", type=float, default=5, help="seconds between two reads (approval.poll_s)")
    p.add_argument("--ui-url", default=None, help="MLflow UI base URL for the link (default: the tracking URI)")
    p.set_defaults(func=cmd_wait_approval)

    p = sub.add_parser("webhook-receiver", help="serve the MLflow webhook -> Prefect event receiver")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8787)
    p.add_argument("--max-age", type=float, default=300, help="oldest accepted webhook timestamp, seconds")
    p.add_argument("--seen-file", type=Path, default=None,
                   help="where the delivery ids acted on are kept across restarts (default: in memory only)")
    p.set_defaults(func=cmd_webhook_receiver)

    p = sub.add_parser("approval-webhook", help="register the receiver with MLflow for model_version_tag.set (admin)")
    p.add_argument("--tracking-uri", required=True)
    p.add_argument("--url", required=True, help="where the receiver listens, as MLflow reaches it")
    p.add_argument("--name", default="enginewright-approvals")
    p.set_defaults(func=cmd_approval_webhook)

    p = sub.add_parser("approval-permissions", help="grant publisher and approvers their rights on a model (admin)")
    p.add_argument("--tracking-uri", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--publisher", required=True, help="MLflow username the release pipeline publishes with")
    p.add_argument("--approvers", required=True, help="comma-separated MLflow usernames allowed to approve")
    p.set_defaults(func=cmd_approval_permissions)
