"""Fast checks of the approval plumbing: webhook signatures, event mapping, the deployment trigger."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from flows.approval_events import SignatureError, approval_event, sign, verify_signature
from registry.auth import MlflowCredentials, strip_userinfo
from tasks.publish import flatten

REPO = Path(__file__).resolve().parents[1]


def headers(secret: str, body: bytes, *, ts: int | None = None) -> dict[str, str]:
    stamp = str(int(time.time()) if ts is None else ts)
    return {"x-mlflow-delivery-id": "d", "x-mlflow-timestamp": stamp, "x-mlflow-signature": sign(secret, "d", stamp, body)}


def test_signature_checks() -> None:
    body = b'{"a": 1}'
    verify_signature("s3cret", headers("s3cret", body), body)
    for bad in (headers("other", body), headers("s3cret", body, ts=int(time.time()) - 400), {}):
        with pytest.raises(SignatureError):
            verify_signature("s3cret", bad, body)
    with pytest.raises(SignatureError):
        verify_signature("s3cret", headers("s3cret", body), body + b" ")


def test_only_approval_tags_become_events() -> None:
    payload = {"entity": "model_version_tag", "action": "set",
               "data": {"name": "m", "version": "3", "key": "approval", "value": "Approved"}}
    name, resource, _ = approval_event(payload)
    assert name == "enginewright.approval.approved" and resource["prefect.resource.id"] == "mlflow.model-version.m.3"
    assert approval_event({**payload, "data": {**payload["data"], "key": "note"}}) is None
    assert approval_event({**payload, "data": {**payload["data"], "value": "maybe"}}) is None
    assert approval_event({**payload, "entity": "model_version"}) is None


def test_prefect_yaml_trigger_matches_the_event() -> None:
    from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger

    doc = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    promote = next(d for d in doc["deployments"] if d["name"] == "promote-on-approval")
    trigger = DeploymentEventTrigger.model_validate(promote["triggers"][0])
    assert "enginewright.approval.approved" in trigger.expect
    module, func = promote["entrypoint"].split(":")
    assert func in (REPO / module).read_text()
    _, resource, _ = approval_event({"entity": "model_version_tag", "action": "set",
                                     "data": {"name": "m", "version": "1", "key": "approval", "value": "approved"}})
    pattern = trigger.match.model_dump()["prefect.resource.id"]
    pattern = pattern[0] if isinstance(pattern, list) else pattern
    assert resource["prefect.resource.id"].startswith(pattern.rstrip("*"))


def test_credentials_stay_out_of_records() -> None:
    assert strip_userinfo("http://bob:pw@host:5000/x") == "http://host:5000/x"
    assert "pw" not in json.dumps(flatten("", {"mlflow": {"tracking_uri": "https://bob:pw@h/"}, "n": [1]}))
    assert "pw" not in repr(MlflowCredentials("bob", "pw"))
