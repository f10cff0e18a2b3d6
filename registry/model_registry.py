"""Registered engine versions in the MLflow model registry: fingerprints, sources, aliases, tags.

A version is found by its ``fingerprint`` tag (so registering twice is a no-op), moves through the
aliases ``candidate`` -> ``canary`` -> ``production`` (stages are deprecated and never used), and
records where its artifact lives in its ``source`` and its ``manifest_uri`` tag.

What MLflow 3.17 accepts as a version ``source`` (measured):

- through an ``mlflow server``: ``s3://...`` URIs and ``runs:/<run_id>/<path>`` (with the same
  ``run_id``); a ``file://`` or plain local path is refused unless it lies inside the run's own
  artifact directory (never the case with proxied artifacts); ``http(s)://`` is refused;
- on a sqlite (or other database) URI used directly: anything, unvalidated.

So :func:`register_engine_version` first tries the given source (normally the store's manifest
URI); when a server refuses a local one, it logs that file into the run under ``engine/`` and
registers ``runs:/<run_id>/engine/manifest.json`` instead. :func:`version_source` gives the same
choice up front. The ``manifest_uri`` tag always holds the store's manifest URI.
"""

from __future__ import annotations

import logging
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.exceptions import MlflowException

from registry._client import ClientOrUri, error_code, mlflow_client
from registry.errors import ModelVersionNotFoundError, RegistryError

log = logging.getLogger(__name__)

ALIAS_CANDIDATE = "candidate"
ALIAS_CANARY = "canary"
ALIAS_PRODUCTION = "production"
ALIASES = (ALIAS_CANDIDATE, ALIAS_CANARY, ALIAS_PRODUCTION)

TAG_FINGERPRINT = "fingerprint"
TAG_MANIFEST_URI = "manifest_uri"
TAG_ENGINE_KIND = "engine_kind"
TAG_CODE_REVISION = "code_revision"
TAG_GATES = "gates"  # "passed": both gates passed (only gated engines are published)
# The tags a version is registered with, for machines: find it by fingerprint, fetch its manifest, tell its
# kind and code. What a person reads (gate figures and thresholds, the comparison, provenance, links) is
# the version's description; the figures themselves are the run's metrics.
VERSION_TAGS = (TAG_FINGERPRINT, TAG_MANIFEST_URI, TAG_ENGINE_KIND, TAG_CODE_REVISION, TAG_GATES)
RUN_MANIFEST_PATH = "engine/manifest.json"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class VersionInfo:
    """The registry record of one engine version."""

    model_name: str
    version: str
    source: str
    run_id: str | None
    tags: Mapping[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()

    @property
    def fingerprint(self) -> str | None:
        """The engine fingerprint tag."""
        return self.tags.get(TAG_FINGERPRINT)

    @property
    def manifest_uri(self) -> str:
        """Where the artifact's manifest lives (tag ``manifest_uri``, else the source)."""
        return self.tags.get(TAG_MANIFEST_URI) or self.source


def _check_name(value: str, what: str) -> str:
    if not _NAME.match(value):
        raise RegistryError(
            f"Invalid {what} '{value}': expected letters, digits and '._-', starting with a letter or digit."
        )
    return value


def version_source(manifest_uri: str, *, run_id: str, run_manifest_path: str = RUN_MANIFEST_PATH) -> str:
    """The version source MLflow accepts everywhere: the manifest URI for s3://, else ``runs:/<run_id>/<path>``."""
    if urllib.parse.urlparse(manifest_uri).scheme == "s3":
        return manifest_uri
    return f"runs:/{run_id}/{run_manifest_path}"


def find_version_by_fingerprint(client_or_uri: ClientOrUri, model_name: str, fingerprint: str) -> str | None:
    """The (lowest) version of ``model_name`` tagged with ``fingerprint``, or None."""
    _check_name(model_name, "model name")
    _check_name(fingerprint, "fingerprint")
    found = mlflow_client(client_or_uri).search_model_versions(
        f"name = '{model_name}' and tags.{TAG_FINGERPRINT} = '{fingerprint}'"
    )
    if not found:
        return None
    return str(min(int(v.version) for v in found))


def register_engine_version(
    client_or_uri: ClientOrUri,
    model_name: str,
    *,
    source: str,
    run_id: str | None = None,
    tags: Mapping[str, str] | None = None,
    fingerprint: str | None = None,
    manifest_uri: str | None = None,
    description: str | None = None,
) -> str:
    """Register an engine version (model created if missing); an existing fingerprint returns its version.

    ``fingerprint`` defaults to ``tags['fingerprint']``; ``manifest_uri`` to ``tags['manifest_uri']``,
    else ``source``. A local source (``file://`` or a path) that the tracking server refuses is
    replaced by ``runs:/<run_id>/engine/<name>`` after logging the local file into the run.
    """
    client = mlflow_client(client_or_uri)
    all_tags = {k: str(v) for k, v in (tags or {}).items()}
    fingerprint = fingerprint or all_tags.get(TAG_FINGERPRINT)
    if not fingerprint:
        raise RegistryError(
            f"No fingerprint for the new version of model '{model_name}' (source '{source}'): pass "
            f"fingerprint= or a '{TAG_FINGERPRINT}' tag."
        )
    existing = find_version_by_fingerprint(client, model_name, fingerprint)
    if existing is not None:
        log.info("model '%s' already has version %s with fingerprint %s", model_name, existing, fingerprint)
        return existing
    try:
        client.create_registered_model(model_name)
    except MlflowException as e:
        if error_code(e) != "RESOURCE_ALREADY_EXISTS":
            raise
    all_tags[TAG_FINGERPRINT] = fingerprint
    all_tags[TAG_MANIFEST_URI] = manifest_uri or all_tags.get(TAG_MANIFEST_URI) or source
    try:
        mv = _create_version(client, model_name, source, run_id, all_tags, description)
    except MlflowException as e:
        local = _local_path(source)
        if error_code(e) != "INVALID_PARAMETER_VALUE" or local is None or not run_id:
            raise RegistryError(
                f"MLflow refused to register model '{model_name}' with source '{source}' (run {run_id}): "
                f"{e.message}"
            ) from e
        source = _log_into_run(client, run_id, local)
        log.info("tracking server refused a local source; using %s instead", source)
        mv = _create_version(client, model_name, source, run_id, all_tags, description)
    log.info("registered model '%s' version %s (fingerprint %s, source %s)", model_name, mv.version, fingerprint, source)
    return str(mv.version)


def _create_version(client, model_name: str, source: str, run_id: str | None, tags: dict[str, str],
                    description: str | None):
    return client.create_model_version(
        model_name, source, run_id=run_id, tags=tags, description=description, await_creation_for=60
    )


def _local_path(source: str) -> Path | None:
    """The local file or folder a ``file://`` URI or plain path names, if it exists."""
    parsed = urllib.parse.urlparse(source)
    if parsed.scheme == "file":
        path = Path(urllib.parse.unquote(parsed.path))
    elif parsed.scheme == "":
        path = Path(source)
    else:
        return None
    return path if path.exists() else None


def _log_into_run(client, run_id: str, local: Path) -> str:
    """Log a local file or folder under the run's ``engine/`` artifacts; return its ``runs:/`` URI."""
    folder = RUN_MANIFEST_PATH.rsplit("/", 1)[0]
    if local.is_dir():
        client.log_artifacts(run_id, str(local), artifact_path=folder)
        return f"runs:/{run_id}/{folder}"
    client.log_artifact(run_id, str(local), artifact_path=folder)
    return f"runs:/{run_id}/{folder}/{local.name}"


def get_version(client_or_uri: ClientOrUri, model_name: str, version: str) -> VersionInfo:
    """The record of one version; ModelVersionNotFoundError if it does not exist."""
    try:
        mv = mlflow_client(client_or_uri).get_model_version(model_name, str(version))
    except MlflowException as e:
        if error_code(e) == "RESOURCE_DOES_NOT_EXIST":
            raise ModelVersionNotFoundError(
                f"Model '{model_name}' has no version '{version}' in the MLflow registry."
            ) from e
        raise
    return VersionInfo(
        model_name=model_name,
        version=str(mv.version),
        source=mv.source,
        run_id=mv.run_id or None,
        tags=dict(mv.tags or {}),
        aliases=tuple(mv.aliases or ()),
    )


def set_alias(client_or_uri: ClientOrUri, model_name: str, alias: str, version: str) -> None:
    """Point ``alias`` (candidate, canary or production) at ``version``."""
    _check_alias(alias)
    mlflow_client(client_or_uri).set_registered_model_alias(model_name, alias, str(version))


def delete_alias(client_or_uri: ClientOrUri, model_name: str, alias: str) -> None:
    """Remove ``alias`` from the model (no error if it is not set)."""
    _check_alias(alias)
    try:
        mlflow_client(client_or_uri).delete_registered_model_alias(model_name, alias)
    except MlflowException as e:
        if error_code(e) not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise


def get_version_by_alias(client_or_uri: ClientOrUri, model_name: str, alias: str) -> str | None:
    """The version ``alias`` points at, or None when the alias (or the model) does not exist."""
    _check_alias(alias)
    try:
        mv = mlflow_client(client_or_uri).get_model_version_by_alias(model_name, alias)
    except MlflowException as e:
        # A missing alias is INVALID_PARAMETER_VALUE in MLflow 3.17, a missing model RESOURCE_DOES_NOT_EXIST.
        if error_code(e) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE") and "not found" in e.message:
            return None
        raise
    return str(mv.version)


def set_version_tag(client_or_uri: ClientOrUri, model_name: str, version: str, key: str, value: str) -> None:
    """Set one tag on a model version."""
    mlflow_client(client_or_uri).set_model_version_tag(model_name, str(version), key, str(value))


def get_version_tags(client_or_uri: ClientOrUri, model_name: str, version: str) -> dict[str, str]:
    """All tags of a model version; ModelVersionNotFoundError if it does not exist."""
    return dict(get_version(client_or_uri, model_name, version).tags)


# MLflow 3.x's UI opens in its GenAI view, whose sidebar has no model registry and which files a run under
# "Evaluations"; links carry this query so they open the model-training view (3.17: `workflowType`).
UI_VIEW_QUERY = "?workflowType=machine_learning"


def version_ui_url(ui_base: str, model_name: str, version: str) -> str:
    """The MLflow UI page of a version (MLflow 3.x hash route ``#/models/<name>/versions/<v>``)."""
    name = urllib.parse.quote(model_name, safe="")
    return f"{ui_base.rstrip('/')}/#/models/{name}/versions/{version}{UI_VIEW_QUERY}"


def run_ui_url(ui_base: str, experiment_id: str, run_id: str, artifact: str | None = None) -> str:
    """The MLflow UI page of a run, or of one of its artifacts (``.../artifacts/<path>``)."""
    url = f"{ui_base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    return f"{url}/artifacts/{artifact}{UI_VIEW_QUERY}" if artifact else f"{url}{UI_VIEW_QUERY}"


# `mlflow ui` and `mlflow server` listen on this port unless told otherwise; the approval link of a
# database-backed store (no server of its own) assumes the UI runs there: see `ui_command`.
DEFAULT_UI_PORT = 5000
_LOCAL_STORES = ("sqlite:", "file:")


def ui_base_for(tracking_uri: str, ui_url: str | None = None) -> str | None:
    """The MLflow UI a person opens: ``ui_url`` if set, an HTTP tracking server itself, else (a sqlite or
    file store) ``http://127.0.0.1:5000``, where :func:`ui_command` starts it. None for other databases."""
    if ui_url:
        return ui_url.rstrip("/")
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    if tracking_uri.startswith(_LOCAL_STORES):
        return f"http://127.0.0.1:{DEFAULT_UI_PORT}"
    return None


def ui_command(tracking_uri: str, ui_url: str | None = None) -> str | None:
    """The command that serves the UI ``ui_base_for`` links to, for a local store without a server of its own."""
    if ui_url or not tracking_uri.startswith(_LOCAL_STORES):
        return None
    return f"mlflow ui --backend-store-uri {tracking_uri} --host 127.0.0.1 --port {DEFAULT_UI_PORT}"


def set_description(client_or_uri: ClientOrUri, model_name: str, version: str, markdown: str) -> None:
    """Replace a version's description (markdown, which the MLflow UI renders on the version page)."""
    mlflow_client(client_or_uri).update_model_version(model_name, str(version), description=markdown)


def _check_alias(alias: str) -> None:
    if alias not in ALIASES:
        raise RegistryError(f"Unknown alias '{alias}': expected one of {', '.join(ALIASES)}.")
