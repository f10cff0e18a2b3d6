"""The webhook receiver over HTTP (issue 23, finding 7): malformed headers answered, replays not acted on,
every accepted delivery logged without the secret, and a 503 (MLflow retries) when the event could not be
emitted. The emitter here records or fails; the real Prefect path is tests/test_deployments.py."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import httpx
import pytest

from flows.approval_events import SeenDeliveries, WebhookReceiver, approval_event_id, sign

SECRET = "the-receivers-secret"
BODY = (b'{"entity": "model_version_tag", "action": "set", "data": {"name": "m", "version": "3", '
        b'"key": "approval", "value": "approved"}}')


@pytest.fixture
def receiver(tmp_path: Path):
    emitted: list[tuple[str, dict, dict]] = []
    failing = {"on": False}

    def emit(event, resource, payload):
        if failing["on"]:
            raise ConnectionError("Prefect API unreachable")
        emitted.append((event, resource, payload))

    server = WebhookReceiver(SECRET, emit=emit, seen=SeenDeliveries(tmp_path / "seen.txt")).start()
    try:
        yield server, emitted, failing, tmp_path / "seen.txt"
    finally:
        server.stop()


def deliver(url: str, delivery_id: str, body: bytes = BODY) -> httpx.Response:
    now = str(int(time.time()))
    return httpx.post(url, content=body, timeout=10, headers={
        "X-MLflow-Delivery-Id": delivery_id, "X-MLflow-Timestamp": now,
        "X-MLflow-Signature": sign(SECRET, delivery_id, now, body)})


def raw(url: str, content_length: str) -> bytes:
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(f"POST / HTTP/1.1\r\nHost: {host}\r\nContent-Length: {content_length}\r\n\r\n{{}}".encode())
        return conn.recv(4096)


def test_a_replayed_delivery_is_acted_on_once_and_survives_a_restart(receiver, caplog):
    server, emitted, _, seen_file = receiver
    caplog.set_level(logging.INFO, logger="flows.approval_events")
    assert deliver(server.url, "d-1").status_code == 200
    for _ in range(2):
        again = deliver(server.url, "d-1")
        assert again.status_code == 200 and "duplicate" in again.text
    assert len(emitted) == 1 and server.stats.duplicates == 2
    assert "webhook delivery d-1 accepted: emitted enginewright.approval.approved" in caplog.text
    assert SECRET not in caplog.text
    assert "d-1" in SeenDeliveries(seen_file)  # a restarted receiver remembers it


def test_an_event_that_could_not_be_emitted_is_a_503_and_its_retry_goes_through(receiver):
    server, emitted, failing, _ = receiver
    failing["on"] = True
    assert deliver(server.url, "d-2").status_code == 503
    failing["on"] = False
    assert deliver(server.url, "d-2").status_code == 200  # MLflow's retry, same delivery id
    assert len(emitted) == 1


@pytest.mark.parametrize("length", ["abc", "-1", "99999999999999999999"])
def test_a_malformed_content_length_is_answered_at_once(receiver, length):
    server = receiver[0]
    started = time.monotonic()
    answer = raw(server.url, length)
    assert answer.startswith((b"HTTP/1.0 400", b"HTTP/1.0 413", b"HTTP/1.1 400", b"HTTP/1.1 413")), answer
    assert time.monotonic() - started < 3


def test_one_event_id_per_decision_on_a_version():
    resource = {"prefect.resource.id": "mlflow.model-version.m.3"}
    assert approval_event_id("enginewright.approval.approved", resource) == \
        approval_event_id("enginewright.approval.approved", dict(resource))
    assert approval_event_id("enginewright.approval.approved", resource) != \
        approval_event_id("enginewright.approval.rejected", resource)


def test_seen_deliveries_are_bounded(tmp_path):
    seen = SeenDeliveries(tmp_path / "seen.txt", limit=3)
    for i in range(5):
        seen.add(f"d{i}")
    assert "d0" not in seen and "d4" in seen
    assert "d1" not in SeenDeliveries(tmp_path / "seen.txt", limit=3)


def test_reconcile_emits_the_approval_of_versions_no_promotion_has_finished(tmp_path):
    """The poll path against MLflow's own sqlite store: approved without outcome -> emitted; approved and
    rolled out, or not approved -> not."""
    from mlflow import MlflowClient

    from flows.approval_events import reconcile

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model("m")
    for _ in range(3):
        client.create_model_version("m", source=str(tmp_path))
    client.set_model_version_tag("m", "1", "approval", "approved")
    client.set_model_version_tag("m", "1", "rollout", "succeeded")
    client.set_model_version_tag("m", "2", "approval", "approved")
    emitted: list = []
    assert reconcile(uri, "m", emit=lambda *args: emitted.append(args)) == ["2"]
    assert [(e, r["prefect.resource.id"]) for e, r, _ in emitted] == [
        ("enginewright.approval.approved", "mlflow.model-version.m.2")]
