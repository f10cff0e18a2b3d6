"""MLflow's basic-auth app from the pipeline's side: credentials, users, grants, and who may write what.

MLflow records no author for a model-version tag (nor, trustworthily, for a run: ``CreateRun``'s
``user_id`` is whatever the client sends; measured on MLflow 3.17 with ``--app-name basic-auth``).
What the server *does* enforce with the authenticated user is authorization: ``SetModelVersionTag``
needs ``update`` on the version tier of the registered model (a ``registered_model_version`` grant,
falling back to the user's permission on the registered model itself). So the author of an
``approval`` tag is always one of the accounts that could write it, and :func:`version_tag_writers`
computes that set from the auth store. ``registry.approval.verify_approval`` accepts an approval
only when that set holds approvers (and admins) alone and never the publishing account.

Credentials travel only in ``Authorization`` headers; ``repr`` of :class:`MlflowCredentials` hides
the password, and nothing here logs, tags or stores one.
"""

from __future__ import annotations

import logging
import os
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import requests

from registry.errors import RegistryError

log = logging.getLogger(__name__)

READ, EDIT, MANAGE, DENY = "READ", "EDIT", "MANAGE", "DENY"
WRITE_PERMISSIONS = frozenset({EDIT, MANAGE})
RESOURCE_MODEL = "registered_model"
RESOURCE_MODEL_VERSION = "registered_model_version"
ENV_USERNAME = "MLFLOW_TRACKING_USERNAME"  # what MlflowClient itself sends
ENV_PASSWORD = "MLFLOW_TRACKING_PASSWORD"


class AuthError(RegistryError):
    """The MLflow auth app refused a request or answered something unusable."""


@dataclass(frozen=True)
class MlflowCredentials:
    """A basic-auth account of the MLflow server (the password never shows in ``repr``)."""

    username: str
    password: str = field(repr=False)

    def __repr__(self) -> str:
        return f"MlflowCredentials(username={self.username!r}, password='***')"

    @classmethod
    def from_env(cls, prefix: str = "MLFLOW_TRACKING", environ: Mapping[str, str] | None = None) -> MlflowCredentials | None:
        """``<prefix>_USERNAME`` / ``<prefix>_PASSWORD``, or None when the username is unset."""
        env = os.environ if environ is None else environ
        user = env.get(f"{prefix}_USERNAME")
        if not user:
            return None
        password = env.get(f"{prefix}_PASSWORD")
        if not password:
            raise AuthError(f"{prefix}_USERNAME is set to '{user}' but {prefix}_PASSWORD is empty.")
        return cls(user, password)


def strip_userinfo(uri: str) -> str:
    """``uri`` without ``user:password@`` (for anything that is logged or recorded)."""
    parsed = urllib.parse.urlsplit(uri)
    if not parsed.scheme or "@" not in parsed.netloc:
        return uri
    return urllib.parse.urlunsplit(parsed._replace(netloc=parsed.netloc.rsplit("@", 1)[1]))


class AuthApi:
    """REST calls to the basic-auth app of one MLflow server as one account."""

    def __init__(self, base_url: str, credentials: MlflowCredentials, *, timeout_s: float = 30) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise AuthError(f"MLflow auth needs an http(s) tracking URI, got '{strip_userinfo(base_url)}'.")
        self.base_url = base_url.rstrip("/")
        self.credentials = credentials
        self.timeout_s = timeout_s
        self._session = requests.Session()
        self._session.auth = (credentials.username, credentials.password)

    def __repr__(self) -> str:
        return f"AuthApi({self.base_url!r}, user={self.credentials.username!r})"

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        resp = self._session.request(method, f"{self.base_url}{path}", timeout=self.timeout_s, **kwargs)
        if resp.status_code in (401, 403):
            raise AuthError(
                f"MLflow at {self.base_url} refused {method} {path} for user '{self.credentials.username}' "
                f"(HTTP {resp.status_code})."
            )
        if resp.status_code >= 400:
            raise AuthError(f"MLflow at {self.base_url}: {method} {path} failed (HTTP {resp.status_code}): {resp.text[:300]}")
        return resp.json() if resp.content else {}

    def current_user(self) -> dict[str, Any]:
        """``{"username", "is_admin", ...}`` of the account itself."""
        return self._call("GET", "/api/2.0/mlflow/users/current")["user"]

    def create_user(self, username: str, password: str) -> None:
        """Create an account (admin only); an existing one is left as it is."""
        resp = self._session.post(f"{self.base_url}/api/2.0/mlflow/users/create",
                                  json={"username": username, "password": password}, timeout=self.timeout_s)
        if resp.status_code >= 400 and "already exists" not in resp.text.lower():
            raise AuthError(f"could not create MLflow user '{username}' (HTTP {resp.status_code}): {resp.text[:200]}")

    def grant(self, username: str, resource_type: str, resource_id: str, permission: str) -> None:
        """Set ``permission`` on a resource, replacing an earlier grant (``/api/3.0/mlflow/users/permissions/*``)."""
        target = {"username": username, "resource_type": resource_type, "resource_id": resource_id}
        try:
            self._call("POST", "/api/3.0/mlflow/users/permissions/grant", json={**target, "permission": permission})
        except AuthError as e:
            if "RESOURCE_ALREADY_EXISTS" not in str(e):
                raise
            self._call("POST", "/api/3.0/mlflow/users/permissions/revoke", json=target)
            self._call("POST", "/api/3.0/mlflow/users/permissions/grant", json={**target, "permission": permission})

    def permission(self, username: str, resource_type: str, resource_id: str) -> str:
        """The effective permission name the server resolves for a user on a resource."""
        return self._call("GET", "/api/3.0/mlflow/users/permissions/get", params={
            "username": username, "resource_type": resource_type, "resource_id": resource_id,
        })["permission"]

    def list_users(self) -> list[dict[str, Any]]:
        """Every account with its roles and their grants (admin only)."""
        return self._call("GET", "/api/2.0/mlflow/users/list")["users"]


def server_has_auth(tracking_uri: str, *, timeout_s: float = 10) -> bool:
    """Whether an http(s) MLflow server runs the basic-auth app (it answers 401 without credentials)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return False
    resp = requests.get(f"{tracking_uri.rstrip('/')}/api/2.0/mlflow/users/current", timeout=timeout_s)
    return resp.status_code == 401


def _grants(user: Mapping[str, Any], resource_type: str) -> list[tuple[str, str]]:
    """(pattern, permission) of every grant of ``resource_type`` in the user's roles."""
    found = []
    for role in user.get("roles") or ():
        for perm in role.get("permissions") or ():
            if perm.get("resource_type") == resource_type:
                found.append((str(perm.get("resource_pattern")), str(perm.get("permission"))))
    return found


def version_tag_writers(admin: AuthApi, model_name: str) -> dict[str, str]:
    """Accounts that can set a tag on versions of ``model_name``, each with why.

    Mirrors the server's rule for ``SetModelVersionTag``: admins always; otherwise a
    ``registered_model_version`` grant decides when the user has one (wildcard-only in MLflow),
    else the user's effective permission on the registered model (grants or ``default_permission``).
    """
    writers: dict[str, str] = {}
    for user in admin.list_users():
        name = str(user["username"])
        if user.get("is_admin"):
            writers[name] = "admin"
            continue
        version_grants = [p for pattern, p in _grants(user, RESOURCE_MODEL_VERSION) if pattern == "*"]
        if version_grants:
            if DENY not in version_grants and WRITE_PERMISSIONS.intersection(version_grants):
                writers[name] = f"{'/'.join(sorted(set(version_grants)))} on {RESOURCE_MODEL_VERSION} '*'"
            continue
        effective = admin.permission(name, RESOURCE_MODEL, model_name)
        if effective in WRITE_PERMISSIONS:
            writers[name] = f"{effective} on {RESOURCE_MODEL} '{model_name}'"
    return writers


def configure_release_permissions(
    admin: AuthApi, model_name: str, *, publisher: str, approvers: Iterable[str]
) -> None:
    """Set up the separation of duties for one registered model (idempotent, admin only).

    The model is created by the admin (a creator gets MANAGE, which would let the publisher grant
    itself writers); the publisher gets EDIT on it (register versions with their tags, move
    aliases) but READ on the version tier, so the server refuses its ``SetModelVersionTag``;
    approvers get EDIT on the model, hence on its version tags.
    """
    approvers = sorted(set(approvers))
    if publisher in approvers:
        raise AuthError(f"The publishing account '{publisher}' is also listed as an approver: it would approve its own builds.")
    resp = admin._session.post(f"{admin.base_url}/api/2.0/mlflow/registered-models/create",
                               json={"name": model_name}, timeout=admin.timeout_s)
    if resp.status_code >= 400 and "RESOURCE_ALREADY_EXISTS" not in resp.text:
        raise AuthError(f"could not create registered model '{model_name}' (HTTP {resp.status_code}): {resp.text[:200]}")
    admin.grant(publisher, RESOURCE_MODEL, model_name, EDIT)
    admin.grant(publisher, RESOURCE_MODEL_VERSION, "*", READ)
    for user in approvers:
        admin.grant(user, RESOURCE_MODEL, model_name, EDIT)
    log.info("permissions of model '%s': publisher %s (no version-tag writes), approvers %s",
             model_name, publisher, ", ".join(approvers))
