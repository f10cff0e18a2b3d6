"""The registry path for real, end to end: release as the pipeline account into S3 (moto, over HTTP) and
an MLflow server behind its basic-auth app; approve through the REST API as an authorized person;
promote into a real Triton. A byte changed in S3 after publishing stops the promotion (the same release,
put back intact, then promotes)."""

from __future__ import annotations

import uuid
from pathlib import Path

import boto3
import pytest
import requests
from services import Account, MlflowAuthServer

from flows.promote import promote
from flows.release import release_flow
from flows.spec import ReleaseSpec, parse_spec
from registry import model_registry as mr
from registry.auth import AuthApi, MlflowCredentials, configure_release_permissions
from registry.errors import ChecksumMismatchError
from serving.triton.process import start_triton
from serving.triton.repository import init_repository, router_weights
from tasks.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    repo = init_repository(tmp_path_factory.mktemp("triton-s3") / "repository")
    server = start_triton(repo, log_path=repo.parent / "triton.log")
    yield server
    server.stop()


def approve_in_ui(auth: MlflowAuthServer, who: Account, model: str, version: str) -> None:
    """The REST calls the MLflow UI makes when a person adds the version tags."""
    for key, value in (("approved_by", who.username), ("approval", "approved")):
        reply = requests.post(f"{auth.tracking_uri}/api/2.0/mlflow/model-versions/set-tag", auth=who.auth,
                              json={"name": model, "version": version, "key": key, "value": value}, timeout=30)
        assert reply.ok, reply.text


def make_spec(tmp: Path, auth: MlflowAuthServer, bucket: str, triton, model: str, checkpoint: Path) -> ReleaseSpec:
    return parse_spec({
        "source": {"checkpoint": str(checkpoint)},
        "engine": {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128},
        "validation": {"max_new_tokens": 6, "prompts": ["The capital of France is", "Once upon a time"]},
        "perf": {"batch_size": 2, "input_len": 8, "output_len": 4, "iterations": 2},
        "mlflow": {"tracking_uri": auth.tracking_uri, "model_name": model},
        "artifacts": {"uri": f"s3://{bucket}/engines"},
        "approval": {"mode": "mlflow-tag", "timeout_s": 30, "poll_s": 0.5},
        "triton": {"endpoints": [{"url": triton.http_url, "model_repository": str(triton.model_repository)}]},
        "rollout": {"steps": [{"set_weight": 100}, {"analysis": {"requests": 4}}]},
        "work_dir": str(tmp / "work"),
    })


@pytest.fixture
def released(tmp_path, mlflow_auth_server, s3_env, s3_bucket, triton, prefect_harness, monkeypatch):
    auth = mlflow_auth_server
    model = f"tiny-s3-{uuid.uuid4().hex[:6]}"
    admin = AuthApi(auth.tracking_uri, MlflowCredentials(auth.admin.username, auth.admin.password))
    configure_release_permissions(admin, model, publisher=auth.publisher.username, approvers=[auth.approver.username])
    spec = make_spec(tmp_path, auth, s3_bucket, triton, model, make_tiny_model(tmp_path / "hf", seed=5))
    for name, value in auth.publisher.env().items():  # the release runs as the pipeline account
        monkeypatch.setenv(name, value)
    state = release_flow(spec, return_state=True)
    assert state.is_completed(), state.message
    version = state.result().published.version
    for name, value in {**auth.admin.env(), "ENGINEWRIGHT_APPROVERS": auth.approver.username,
                        "ENGINEWRIGHT_PUBLISHER": auth.publisher.username,
                        "ENGINEWRIGHT_MLFLOW_AUDITOR_USERNAME": auth.admin.username,
                        "ENGINEWRIGHT_MLFLOW_AUDITOR_PASSWORD": auth.admin.password}.items():
        monkeypatch.setenv(name, value)  # the promotion runs as the operators' account and audits the approval
    return spec, version


def test_tampered_object_stops_the_promotion_and_the_intact_one_promotes(released, mlflow_auth_server, s3_server,
                                                                          triton):
    """One release serves both paths (a release costs a minute on CI's two cores): a byte changed in S3 after
    publishing stops the promotion before anything is staged; with the object put back, the same approved
    version promotes into Triton."""
    spec, version = released
    approve_in_ui(mlflow_auth_server, mlflow_auth_server.approver, spec.model_name, version)
    bucket = spec.artifacts.uri.removeprefix("s3://").split("/")[0]
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    key = next(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"] if o["Key"].endswith(".pt"))
    intact = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    body = bytearray(intact)
    body[len(body) // 2] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))

    with pytest.raises(ChecksumMismatchError) as refused:
        promote(spec, version)
    message = str(refused.value)
    mismatch = refused.value.mismatched[0]
    assert key.endswith(mismatch.path) and mismatch.expected_sha256 != mismatch.actual_sha256
    assert f"expected sha256 {mismatch.expected_sha256}" in message and f"actual sha256 {mismatch.actual_sha256}" in message
    assert router_weights(triton.model_repository, spec.model_name) == {}, "nothing was staged"

    s3.put_object(Bucket=bucket, Key=key, Body=intact)
    result = promote(spec, version)
    assert router_weights(triton.model_repository, spec.model_name) == {int(version): 100}
    assert result.rollout.metrics["rollout_failed_requests"] == 0
    assert "production" in mr.get_version(spec.mlflow.tracking_uri, spec.model_name, version).aliases
