"""Approvals behind MLflow's basic-auth app: publish as the pipeline, approve as a person, verify, fetch.

Everything runs against a real ``mlflow server --app-name basic-auth`` (artifacts proxied to moto's
S3 server) started on loopback; the person's approval is the REST call the MLflow UI makes.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from services import Account, MlflowAuthServer, make_engine_folder

from flows.approval_events import WebhookReceiver, sign
from registry.approval import ApprovalPolicy, verify_approval
from registry.auth import AuthApi, MlflowCredentials, configure_release_permissions, version_tag_writers
from registry.errors import ApprovalNotAuthorizedError
from registry.model_registry import get_version, version_ui_url
from registry.promotion_checks import require_authorized_approval, require_complete
from registry.stores import artifact_key, open_store
from tasks.publish import publish

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def set_tag(auth: MlflowAuthServer, who: Account, model: str, version: str, key: str, value: str) -> requests.Response:
    """What the MLflow UI sends when a person adds a version tag."""
    return requests.post(f"{auth.tracking_uri}/api/2.0/mlflow/model-versions/set-tag", auth=who.auth, timeout=30,
                         json={"name": model, "version": version, "key": key, "value": value})


def admin_api(auth: MlflowAuthServer) -> AuthApi:
    return AuthApi(auth.tracking_uri, MlflowCredentials(auth.admin.username, auth.admin.password))


def policy(auth: MlflowAuthServer) -> ApprovalPolicy:
    return ApprovalPolicy(frozenset({auth.approver.username}), auth.publisher.username)


@pytest.fixture
def as_publisher(mlflow_auth_server: MlflowAuthServer, s3_env, monkeypatch: pytest.MonkeyPatch) -> MlflowAuthServer:
    """The environment of the release pipeline: publisher credentials, S3 at moto, small multipart parts."""
    for name, value in mlflow_auth_server.publisher.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ENGINEWRIGHT_S3_MULTIPART_THRESHOLD_MIB", "5")
    monkeypatch.setenv("ENGINEWRIGHT_S3_MULTIPART_CHUNKSIZE_MIB", "5")
    return mlflow_auth_server


def publish_new(auth: MlflowAuthServer, tmp_path: Path, bucket: str, *, seed: int = 0):
    model = f"tiny-{uuid.uuid4().hex[:8]}"
    configure_release_permissions(admin_api(auth), model, publisher=auth.publisher.username,
                                  approvers=[auth.approver.username])
    engine = make_engine_folder(tmp_path / "engine", big_mib=6, seed=seed)
    published = publish(
        model_name=model, tracking_uri=auth.tracking_uri, experiment=f"exp-{model}", artifacts_uri=f"s3://{bucket}/engines",
        engine_info=engine,
        params={"mlflow": {"tracking_uri": auth.tracking_uri.replace("http://", f"http://{auth.publisher.username}:"
                                                                     f"{auth.publisher.password}@")}},
        metrics={"validation_top1_agreement": 1.0}, reports={"validation.md": "all good"},
    )
    return model, engine, published


def test_publish_approve_verify_fetch(as_publisher: MlflowAuthServer, s3_bucket: str, tmp_path: Path,
                                      caplog: pytest.LogCaptureFixture) -> None:
    auth = as_publisher
    caplog.set_level(logging.DEBUG)
    model, engine, published = publish_new(auth, tmp_path, s3_bucket)
    version = published.version

    info = get_version(auth.tracking_uri, model, version)
    assert info.source == published.manifest_uri == f"s3://{s3_bucket}/engines/{model}/{engine.fingerprint}/manifest.json"
    assert info.fingerprint == engine.fingerprint and "candidate" in info.aliases
    assert info.tags["gates"] == "passed" and info.tags["engine_kind"] == "torch"
    assert info.tags["code_revision"]
    run = MlflowClient(auth.tracking_uri).get_run(info.run_id)
    assert run.data.tags["fingerprint"] == engine.fingerprint and run.data.tags["toolchain.cuda"] == "none"

    # The pipeline account cannot approve its own build; an account without rights cannot either.
    with pytest.raises(MlflowException, match="(?i)permission"):
        MlflowClient(auth.tracking_uri).set_model_version_tag(model, version, "approval", "approved")
    assert set_tag(auth, auth.outsider, model, version, "approval", "approved").status_code == 403
    assert version_tag_writers(admin_api(auth), model).keys() == {auth.admin.username, auth.approver.username}

    # `enginewright wait-approval` prints the UI link while it waits; the approver then approves.
    env = {**os.environ, **auth.publisher.env(), "ENGINEWRIGHT_APPROVERS": auth.approver.username,
           "ENGINEWRIGHT_PUBLISHER": auth.publisher.username,
           "ENGINEWRIGHT_MLFLOW_AUDITOR_USERNAME": auth.admin.username,
           "ENGINEWRIGHT_MLFLOW_AUDITOR_PASSWORD": auth.admin.password}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "wait-approval", "--tracking-uri", auth.tracking_uri, "--model", model,
         "--version", version, "--timeout", "60", "--poll", "0.3"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        link = version_ui_url(auth.server.ui_base, model, version)
        first = proc.stdout.readline()
        assert link in first, first
        assert proc.poll() is None, "wait-approval returned before anyone approved"
        assert set_tag(auth, auth.approver, model, version, "approved_by", "approver").ok
        assert set_tag(auth, auth.approver, model, version, "approval", "approved").ok
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = first + rest
    assert proc.returncode == 0, output
    assert f"{model} version {version} approved by approver (verified: only admin/approver can approve)" in output

    # Promotion's checks: the approval is verified, the artifact is complete and intact.
    verified = require_authorized_approval(auth.tracking_uri, model, version, policy=policy(auth), environ={
        "ENGINEWRIGHT_MLFLOW_AUDITOR_USERNAME": auth.admin.username,
        "ENGINEWRIGHT_MLFLOW_AUDITOR_PASSWORD": auth.admin.password})
    assert verified is not None and verified.decision.approved
    manifest = require_complete(f"s3://{s3_bucket}/engines", info)
    fetched = open_store(f"s3://{s3_bucket}/engines").get_tree(artifact_key(model, engine.fingerprint), tmp_path / "got")
    assert fetched == manifest
    assert (tmp_path / "got" / "weights" / "rank0.bin").read_bytes() == (Path(engine.path) / "weights/rank0.bin").read_bytes()

    # No password anywhere: run params, tags, artifacts (proxied to S3), version tags, logs, output.
    client = MlflowClient(auth.tracking_uri)
    texts = [str(run.data.params), str(run.data.tags), str(info.tags), caplog.text, output,
             auth.server.log_path.read_text(errors="replace")]
    artifacts_dir = Path(client.download_artifacts(info.run_id, "", str(tmp_path / "run-artifacts")))
    texts += [p.read_text(errors="replace") for p in artifacts_dir.rglob("*") if p.is_file()]
    assert any("all good" in t for t in texts), "run artifacts were not downloaded"
    assert run.data.params["mlflow.tracking_uri"] == auth.tracking_uri
    for password in auth.passwords:
        assert not [t[:80] for t in texts if password in t]


def test_approval_by_user_without_rights_does_not_count(as_publisher: MlflowAuthServer, s3_bucket: str,
                                                        tmp_path: Path) -> None:
    auth = as_publisher
    model, _, published = publish_new(auth, tmp_path, s3_bucket, seed=1)
    # Someone with EDIT on the model who is not an approver (e.g. granted by mistake) sets the tag.
    admin_api(auth).grant(auth.outsider.username, "registered_model", model, "EDIT")
    assert set_tag(auth, auth.outsider, model, published.version, "approval", "approved").ok
    with pytest.raises(ApprovalNotAuthorizedError, match=f"'{auth.outsider.username}' \\(EDIT on registered_model"):
        verify_approval(model, published.version, tracking_uri=auth.tracking_uri, policy=policy(auth),
                        auditor=admin_api(auth))
    # The publisher listed as an approver is refused outright.
    with pytest.raises(ApprovalNotAuthorizedError, match="approve its own builds"):
        verify_approval(model, published.version, tracking_uri=auth.tracking_uri, auditor=admin_api(auth),
                        policy=ApprovalPolicy(frozenset({auth.publisher.username}), auth.publisher.username))


def test_signed_webhook_becomes_event_and_forged_one_is_refused(
    as_publisher: MlflowAuthServer, s3_bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    auth = as_publisher
    model, _, published = publish_new(auth, tmp_path, s3_bucket, seed=2)
    secret = uuid.uuid4().hex
    events: list[tuple[str, dict, dict]] = []
    got = threading.Event()

    def emit(name, resource, payload):
        events.append((name, resource, payload))
        got.set()

    receiver = WebhookReceiver(secret, emit=emit).start()
    admin_client = MlflowClient(auth.tracking_uri)
    os.environ.update(auth.admin.env())  # webhooks are admin-only; restored by the fixture's monkeypatch
    try:
        hook = admin_client.create_webhook(name=f"approvals-{model}", url=receiver.url,
                                           events=["model_version_tag.set"], secret=secret)
    finally:
        os.environ.update(auth.publisher.env())
    try:
        time.sleep(1.2)  # the server's webhook cache (MLFLOW_WEBHOOK_CACHE_TTL=1 in tests/services.py)
        assert set_tag(auth, auth.approver, model, published.version, "approval", "approved").ok
        assert got.wait(15), f"no event within 15 s (receiver stats {receiver.stats})"
        name, resource, _ = events[0]
        assert name == "enginewright.approval.approved"
        assert resource["prefect.resource.id"] == f"mlflow.model-version.{model}.{published.version}"

        body = b'{"entity": "model_version_tag", "action": "set", "data": {"name": "x", "version": "1", ' \
               b'"key": "approval", "value": "approved"}}'
        now = str(int(time.time()))
        forged = {"X-MLflow-Delivery-Id": "d1", "X-MLflow-Timestamp": now,
                  "X-MLflow-Signature": sign("not-the-secret", "d1", now, body)}
        stale_ts = str(int(time.time()) - 3600)
        stale = {"X-MLflow-Delivery-Id": "d2", "X-MLflow-Timestamp": stale_ts,
                 "X-MLflow-Signature": sign(secret, "d2", stale_ts, body)}
        caplog.set_level(logging.WARNING, logger="flows.approval_events")
        for headers in (forged, stale, {}):
            assert requests.post(receiver.url, data=body, headers=headers, timeout=10).status_code == 401
        assert len(events) == 1 and receiver.stats.refused == 3
        assert "refused webhook" in caplog.text and "possible replay" in caplog.text
    finally:
        receiver.stop()
        os.environ.update(auth.admin.env())
        try:
            admin_client.delete_webhook(hook.webhook_id)
        finally:
            os.environ.update(auth.publisher.env())
