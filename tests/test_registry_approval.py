"""Approvals: a person sets the version tag ``approval`` (here via the same REST call the UI makes)."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
import requests
from services import MlflowServer, mlflow_embedded, mlflow_server  # noqa: F401

from registry.approval import (
    AUTO_APPROVER,
    auto_approve,
    read_decision,
    reject,
    wait_for_approval,
)
from registry.embedded import EmbeddedLocations
from registry.errors import ApprovalTimeoutError, ModelVersionNotFoundError
from registry.model_registry import register_engine_version

pytestmark = pytest.mark.slow


def new_version(tracking_uri: str) -> tuple[str, str]:
    model = f"tiny-llama-{uuid.uuid4().hex[:8]}"
    fingerprint = f"fp-{uuid.uuid4().hex[:8]}"
    version = register_engine_version(tracking_uri, model, fingerprint=fingerprint,
                                      source=f"s3://releases/{model}/{fingerprint}/manifest.json")
    return model, version


def set_tag_via_rest(server: MlflowServer, model: str, version: str, key: str, value: str) -> None:
    """What the MLflow UI does when a person adds a version tag."""
    resp = requests.post(f"{server.tracking_uri}/api/2.0/mlflow/model-versions/set-tag",
                         json={"name": model, "version": version, "key": key, "value": value}, timeout=10)
    resp.raise_for_status()


def test_waits_until_a_person_approves(mlflow_server: MlflowServer) -> None:  # noqa: F811
    model, version = new_version(mlflow_server.tracking_uri)

    def person() -> None:
        time.sleep(1.5)
        set_tag_via_rest(mlflow_server, model, version, "approved_by", "alice")
        set_tag_via_rest(mlflow_server, model, version, "approval", "Approved")

    messages: list[str] = []
    thread = threading.Thread(target=person)
    thread.start()
    t0 = time.monotonic()
    decision = wait_for_approval(model, version, tracking_uri=mlflow_server.tracking_uri, timeout_s=30,
                                 poll_s=0.2, on_waiting=messages.append, ui_base=mlflow_server.ui_base)
    thread.join()
    assert decision.approved and decision.decision == "approved" and decision.decided_by == "alice"
    assert 1.4 < time.monotonic() - t0 < 10
    assert len(messages) == 1
    assert f"{mlflow_server.ui_base}/#/models/{model}/versions/{version}" in messages[0]


def test_rejection_is_returned(mlflow_server: MlflowServer) -> None:  # noqa: F811
    model, version = new_version(mlflow_server.tracking_uri)
    set_tag_via_rest(mlflow_server, model, version, "approval", "REJECTED")
    decision = wait_for_approval(model, version, tracking_uri=mlflow_server.tracking_uri, timeout_s=5, poll_s=0.2)
    assert decision.decision == "rejected" and not decision.approved


def test_times_out_naming_model_version_and_setting(
    mlflow_server: MlflowServer, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    model, version = new_version(mlflow_server.tracking_uri)
    set_tag_via_rest(mlflow_server, model, version, "approval", "looks good to me")
    with caplog.at_level(logging.WARNING, logger="registry.approval"), pytest.raises(ApprovalTimeoutError) as exc:
        wait_for_approval(model, version, tracking_uri=mlflow_server.tracking_uri, timeout_s=1, poll_s=0.2)
    message = str(exc.value)
    assert model in message and f"version {version}" in message and "approval.timeout_s" in message
    assert "'looks good to me'" in message
    ignored = [r for r in caplog.records if "ignoring the version tag approval=" in r.getMessage()]
    assert len(ignored) == 1  # logged once, not every poll


def test_missing_version_fails_fast(mlflow_server: MlflowServer) -> None:  # noqa: F811
    with pytest.raises(ModelVersionNotFoundError):
        wait_for_approval("no-such-model", "1", tracking_uri=mlflow_server.tracking_uri, timeout_s=5, poll_s=0.2)


def test_auto_approve_and_reject_leave_an_explicit_record(mlflow_embedded: EmbeddedLocations) -> None:  # noqa: F811
    uri = mlflow_embedded.tracking_uri
    model, version = new_version(uri)
    assert read_decision(model, version, tracking_uri=uri) is None
    decision = auto_approve(model, version, tracking_uri=uri)
    assert decision.approved and decision.decided_by == AUTO_APPROVER
    assert wait_for_approval(model, version, tracking_uri=uri, timeout_s=0, poll_s=1).decided_by == AUTO_APPROVER

    model, version = new_version(uri)
    reject(model, version, tracking_uri=uri, by="gray-release", note="error rate 12% > 1% at weight 10")
    decision = read_decision(model, version, tracking_uri=uri)
    assert decision is not None and decision.decision == "rejected"
    assert decision.decided_by == "gray-release" and decision.note.startswith("error rate")
