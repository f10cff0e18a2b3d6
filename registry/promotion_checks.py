"""Checks a version must pass before it is promoted: a complete artifact, an authorized approval.

The promote flow (and its stage step) call these; each raises a ``RegistryError`` subclass whose
message names the version, the location and the setting involved.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from registry._client import ClientOrUri
from registry.approval import ApprovalPolicy, VerifiedApproval, verify_approval
from registry.errors import ApprovalNotAuthorizedError, IncompleteArtifactError, RegistryError
from registry.manifest import Manifest
from registry.model_registry import VersionInfo, get_version
from registry.stores import artifact_key, open_store

log = logging.getLogger(__name__)


def require_complete(artifacts_uri: str, version: VersionInfo) -> Manifest:
    """The manifest of the version's artifact; IncompleteArtifactError if the store has none.

    Also refuses a version without a fingerprint tag, a manifest recorded for another fingerprint,
    and a version whose ``manifest_uri`` tag points somewhere other than ``artifacts.uri``.
    """
    if not version.fingerprint:
        raise RegistryError(
            f"Model '{version.model_name}' version {version.version} has no 'fingerprint' tag: it was not "
            "published by enginewright and cannot be promoted."
        )
    store = open_store(artifacts_uri)
    key = artifact_key(version.model_name, version.fingerprint)
    expected = store.manifest_uri(key)
    recorded = version.manifest_uri
    if recorded and recorded.startswith(("s3://", "file://")) and recorded != expected:
        raise RegistryError(
            f"Model '{version.model_name}' version {version.version} records its manifest at '{recorded}' but "
            f"setting artifacts.uri='{artifacts_uri}' puts it at '{expected}': promote with the store it was "
            "published to."
        )
    manifest = store.read_manifest(key)  # IncompleteArtifactError when absent
    if manifest.meta.get("fingerprint") not in (None, version.fingerprint):
        raise IncompleteArtifactError(expected)
    return manifest


def require_authorized_approval(
    tracking_uri: ClientOrUri,
    model_name: str,
    version: str,
    *,
    policy: ApprovalPolicy | None = None,
    environ: Mapping[str, str] | None = None,
) -> VerifiedApproval | None:
    """Verify the approval against MLflow's permissions when the server runs the basic-auth app.

    Settings (environment): ``ENGINEWRIGHT_APPROVERS``, ``ENGINEWRIGHT_PUBLISHER`` and the admin
    account ``ENGINEWRIGHT_MLFLOW_AUDITOR_USERNAME`` / ``_PASSWORD`` used to read grants. A server
    without auth (or a sqlite URI) has no accounts, so nothing can be verified: returns None.
    A server with auth and any setting missing fails closed.
    """
    from registry.auth import AuthApi, MlflowCredentials, server_has_auth

    env = os.environ if environ is None else environ
    uri = tracking_uri if isinstance(tracking_uri, str) else tracking_uri.tracking_uri
    if not server_has_auth(uri):
        log.warning("MLflow at %s has no authentication: the approval of %s version %s cannot be attributed",
                    uri, model_name, version)
        return None
    policy = policy or ApprovalPolicy.from_env(env)
    auditor = MlflowCredentials.from_env("ENGINEWRIGHT_MLFLOW_AUDITOR", env)
    if policy is None or auditor is None:
        raise ApprovalNotAuthorizedError(
            f"MLflow at {uri} requires authentication, so approvals of '{model_name}' are checked against its "
            "permissions: set ENGINEWRIGHT_APPROVERS, ENGINEWRIGHT_PUBLISHER and "
            "ENGINEWRIGHT_MLFLOW_AUDITOR_USERNAME/_PASSWORD (an MLflow admin account)."
        )
    get_version(tracking_uri, model_name, version)
    return verify_approval(model_name, version, tracking_uri=tracking_uri, policy=policy,
                           auditor=AuthApi(uri, auditor))
