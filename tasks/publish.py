"""Step 5: publish a gated engine: artifacts with a manifest, an MLflow run and a registered version.

Publishing is idempotent on the engine fingerprint: a fingerprint already registered is reported,
never registered or uploaded again.
"""

from __future__ import annotations

import json
import logging
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task

from registry.errors import StoreConfigError, UploadError
from tasks.version_page import VersionPage

log = logging.getLogger(__name__)

REPORT_FOLDER = "report"  # the run's one folder of reports and plots


@dataclass(frozen=True)
class PublishedVersion:
    model_name: str
    version: str
    fingerprint: str
    manifest_uri: str
    run_id: str | None
    already_existed: bool


def code_revision() -> str:
    """The git revision of this code, or 'unknown' outside a checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def publisher() -> str:
    """Who publishes: the MLflow account when one is set (``MLFLOW_TRACKING_USERNAME``), else the OS user."""
    import getpass
    import os

    return os.environ.get("MLFLOW_TRACKING_USERNAME") or getpass.getuser()


def spec_digest(params: dict[str, Any]) -> str:
    """sha256 of the spec as published (its JSON dump, keys sorted)."""
    import hashlib

    return hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()


def flatten(prefix: str, value: Any) -> dict[str, str]:
    """Nested spec values as MLflow params: dotted keys, string values, no ``user:password@`` in URIs."""
    from registry.auth import strip_userinfo

    if isinstance(value, dict):
        out: dict[str, str] = {}
        for key, sub in value.items():
            out.update(flatten(f"{prefix}.{key}" if prefix else str(key), sub))
        return out
    text = json.dumps(value, default=str) if isinstance(value, (list, tuple)) else str(value)
    return {prefix: strip_userinfo(text) if "://" in text else text}


def publish(
    *,
    model_name: str,
    tracking_uri: str,
    experiment: str,
    artifacts_uri: str,
    engine_info,
    params: dict[str, Any],
    metrics: dict[str, float],
    reports: dict[str, str],
    page: VersionPage | None = None,
    progress: Callable[[str, int], None] | None = None,
) -> PublishedVersion:
    """Upload the engine (manifest last), record the run, register the version as `candidate` with its page
    (the description a person decides from) when `page` is given."""
    from registry import model_registry, tracking
    from registry.stores import artifact_key, open_store

    fingerprint = engine_info.fingerprint
    existing = model_registry.find_version_by_fingerprint(tracking_uri, model_name, fingerprint)
    store = open_store(artifacts_uri)
    key = artifact_key(model_name, fingerprint)
    if existing is not None and store.has_manifest(key):
        log.info("fingerprint %s is already published as %s version %s", fingerprint, model_name, existing)
        return PublishedVersion(model_name, existing, fingerprint, store.manifest_uri(key), None, True)

    meta = {"model_name": model_name, "fingerprint": fingerprint, "toolchain": engine_info.toolchain}
    artifact = store.put_tree(Path(engine_info.path), key, manifest_meta=meta, progress=progress)
    log.info("artifact %s: %d files uploaded, %d already there%s", artifact.manifest_uri, artifact.uploaded_files,
             artifact.skipped_files, " (already published)" if artifact.already_existed else "")
    import socket

    from registry.tracking import TAG_RUN_USER, TAG_SOURCE_COMMIT, TAG_SOURCE_NAME, TAG_SOURCE_TYPE

    revision = code_revision()
    run_tags = {"fingerprint": fingerprint, "code_revision": revision, "manifest_uri": artifact.manifest_uri,
                "host": socket.gethostname(), "spec_sha256": spec_digest(params),
                TAG_RUN_USER: publisher(), TAG_SOURCE_NAME: "enginewright release", TAG_SOURCE_TYPE: "JOB"}
    if revision != "unknown":
        run_tags[TAG_SOURCE_COMMIT] = revision
    run_tags.update({f"toolchain.{k}": str(v) for k, v in engine_info.toolchain.items()})
    run_id = tracking.start_release_run(
        tracking_uri, experiment, run_name=f"{model_name}-{fingerprint[:12]}", params=flatten("", params),
        tags=run_tags,
    )
    try:
        tracking.log_metrics(tracking_uri, run_id, metrics)
        for name, text in reports.items():
            tracking.log_text(tracking_uri, run_id, text, f"{REPORT_FOLDER}/{name}")
        description = None
        if page is not None:
            run = (tracking.experiment_id_of_run(tracking_uri, run_id), run_id) if page.ui_base else None
            description = page.render(fingerprint=fingerprint, run=run, manifest_uri=artifact.manifest_uri,
                                      report_folder=REPORT_FOLDER)
        version = model_registry.register_engine_version(
            tracking_uri,
            model_name,
            source=artifact.manifest_uri,
            run_id=run_id,
            tags=version_tags(engine_info, artifact),
            description=description,
        )
        model_registry.set_alias(tracking_uri, model_name, model_registry.ALIAS_CANDIDATE, version)
    except BaseException:
        tracking.end_run(tracking_uri, run_id, status="FAILED")
        raise
    tracking.end_run(tracking_uri, run_id, status="FINISHED")
    return PublishedVersion(model_name, version, fingerprint, artifact.manifest_uri, run_id, False)


def version_tags(engine_info, artifact) -> dict[str, str]:
    """The version's tags, for machines (`registry.model_registry.VERSION_TAGS`); people read its description."""
    from registry import model_registry as mr

    return {
        mr.TAG_FINGERPRINT: engine_info.fingerprint,
        mr.TAG_MANIFEST_URI: artifact.manifest_uri,
        mr.TAG_ENGINE_KIND: str(getattr(engine_info, "kind", None) or "torch"),
        mr.TAG_CODE_REVISION: code_revision(),
        mr.TAG_GATES: "passed",
    }


# botocore's and urllib3's names for a connection that failed or timed out (imported lazily by the store)
TRANSIENT_ERROR_NAMES = frozenset({"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                                   "ConnectionClosedError", "ProtocolError"})


def is_retryable(exc: BaseException | None) -> bool:
    """Whether another try can help: an upload or connection failure, not a configuration error (a bad URI,
    a missing setting), which fails the same way every time."""
    if exc is None or isinstance(exc, StoreConfigError):
        return False
    return isinstance(exc, (UploadError, ConnectionError, TimeoutError)) or type(exc).__name__ in TRANSIENT_ERROR_NAMES


def _retry_when_retryable(_task: Any, _run: Any, state: Any) -> bool:
    return is_retryable(state.data if isinstance(state.data, BaseException) else None)


@task(name="publish", retries=2, retry_delay_seconds=5, retry_condition_fn=_retry_when_retryable)
def publish_task(**kwargs: Any) -> PublishedVersion:
    """Publish the engine artifacts, the MLflow run and the registered version."""
    return publish(**kwargs)
