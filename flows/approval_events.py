"""MLflow approval webhooks -> Prefect events -> the promote deployment.

MLflow (>= 3.3) posts a signed webhook on ``model_version_tag.set``. This small receiver (stdlib
``http.server``) checks the signature (``X-MLflow-Signature: v1,<base64 HMAC-SHA256 of
"{delivery_id}.{timestamp}.{body}">``) and the timestamp's freshness, and for an ``approval`` tag
emits the Prefect event ``enginewright.approval.approved`` (or ``.rejected``) about the resource
``mlflow.model-version.<name>.<version>``. The trigger in ``deployments/prefect.yaml`` starts
:func:`promote_on_approval` from it. A bad signature is answered 401 and logged; the body of a
refused request is never acted on.

The path is at-least-once and idempotent. The event is posted to the Prefect API synchronously
(``POST /api/events``), and a delivery whose event could not be emitted is answered 503, so MLflow's
own retries apply; the event's id is derived from the decision and the version, so Prefect (which
ignores an event id it has seen) starts the promote deployment once however often it arrives. Delivery
ids already acted on are answered 200 and not acted on again (`SeenDeliveries`: bounded, optionally
persisted). MLflow retries only 3 times and keeps no outbox, so `reconcile_approvals` (scheduled in
``deployments/prefect.yaml``) emits the same event for every approved version without a ``rollout``
outcome: the promote deployment converges even if every webhook is lost.

A webhook says nothing about who set the tag: the promote flow still re-reads the tag and verifies it
against MLflow's permissions (``registry.promotion_checks``) before anything moves.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prefect import flow

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-MLflow-Signature"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
DELIVERY_ID_HEADER = "X-MLflow-Delivery-Id"
EVENT_PREFIX = "enginewright.approval"
RESOURCE_PREFIX = "mlflow.model-version"
MAX_BODY_BYTES = 1 << 20
ENV_SECRET = "ENGINEWRIGHT_WEBHOOK_SECRET"
MAX_SEEN_DELIVERIES = 10_000  # delivery ids remembered (MLflow retries within minutes; 300 s freshness window)
EVENT_ID_NAMESPACE = uuid.UUID("0b5e1f6e-2f0c-4a57-9d0e-6f1d3c0a2b71")  # of approval event ids
EMIT_TIMEOUT_S = 10.0

# emit(event_name, resource, payload)
EmitFn = Callable[[str, dict[str, str], dict[str, Any]], None]


class SignatureError(Exception):
    """A webhook request whose signature or timestamp does not check out."""


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """The ``X-MLflow-Signature`` value MLflow sends for this delivery."""
    content = f"{delivery_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret.encode(), content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify_signature(
    secret: str, headers: dict[str, str], body: bytes, *, max_age_s: float = 300, now: float | None = None
) -> None:
    """Raise SignatureError unless the headers carry a valid, fresh v1 signature of ``body``."""
    signature = headers.get(SIGNATURE_HEADER.lower())
    delivery_id = headers.get(DELIVERY_ID_HEADER.lower())
    timestamp = headers.get(TIMESTAMP_HEADER.lower())
    if not signature or not delivery_id or not timestamp:
        raise SignatureError("missing signature, delivery id or timestamp header")
    try:
        age = (time.time() if now is None else now) - int(timestamp)
    except ValueError:
        raise SignatureError(f"timestamp header '{timestamp[:32]}' is not a Unix time") from None
    if abs(age) > max_age_s:
        raise SignatureError(f"timestamp is {age:.0f} s old (more than {max_age_s:g} s): possible replay")
    expected = sign(secret, delivery_id, timestamp, body)
    if not any(hmac.compare_digest(expected, s.strip()) for s in signature.split(" ")):
        raise SignatureError(f"signature does not match (delivery {delivery_id[:64]})")


def approval_event(payload: dict[str, Any]) -> tuple[str, dict[str, str], dict[str, Any]] | None:
    """The Prefect event for an MLflow ``model_version_tag.set`` payload on ``approval``, else None."""
    if payload.get("entity") != "model_version_tag" or payload.get("action") != "set":
        return None
    data = payload.get("data") or {}
    if data.get("key") != "approval":
        return None
    decision = str(data.get("value", "")).strip().lower()
    if decision not in ("approved", "rejected"):
        return None
    name, version = str(data.get("name", "")), str(data.get("version", ""))
    if not name or not version:
        return None
    resource = {
        "prefect.resource.id": f"{RESOURCE_PREFIX}.{name}.{version}",
        "prefect.resource.name": f"{name} version {version}",
        "mlflow.model.name": name,
        "mlflow.model.version": version,
    }
    return f"{EVENT_PREFIX}.{decision}", resource, {"decision": decision, "mlflow_timestamp": payload.get("timestamp")}


def approval_event_id(event: str, resource: dict[str, str]) -> uuid.UUID:
    """One id per decision on one version: Prefect ignores an event id it has seen, so the webhook, its
    retries and the reconciliation's re-emissions start the promote deployment once."""
    return uuid.uuid5(EVENT_ID_NAMESPACE, f"{event}|{resource['prefect.resource.id']}")


def prefect_emit(event: str, resource: dict[str, str], payload: dict[str, Any]) -> None:
    """Post the event to the Prefect API in ``PREFECT_API_URL`` and wait for its answer; raise if it was not
    taken (Prefect's own ``emit_event`` queues it and drops it silently when the API is down)."""
    import httpx
    from prefect.events import Event
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if not api:
        raise RuntimeError("PREFECT_API_URL is not set: approval events need a Prefect server (its triggers start "
                           "the promote deployment)")
    body = Event(id=approval_event_id(event, resource), event=event, resource=resource, payload=payload)
    headers, auth = {}, None
    if PREFECT_API_KEY.value():
        headers["Authorization"] = f"Bearer {PREFECT_API_KEY.value()}"
    elif PREFECT_API_AUTH_STRING.value():
        user, _, password = PREFECT_API_AUTH_STRING.value().partition(":")
        auth = (user, password)
    reply = httpx.post(f"{api.rstrip('/')}/events", json=[body.model_dump(mode="json")], headers=headers, auth=auth,
                       timeout=EMIT_TIMEOUT_S)
    reply.raise_for_status()


class SeenDeliveries:
    """Delivery ids already acted on: the last ``limit`` in memory, and appended to ``path`` when given (one id
    a line, read back at start), so a replay within the freshness window is not acted on twice."""

    def __init__(self, path: Path | None = None, *, limit: int = MAX_SEEN_DELIVERIES) -> None:
        self.path, self.limit = path, limit
        self._ids: OrderedDict[str, None] = OrderedDict()
        if path is not None and path.is_file():
            for line in path.read_text().splitlines()[-limit:]:
                self._ids[line.strip()] = None
            path.write_text("".join(f"{i}\n" for i in self._ids))  # compacted to the last `limit`

    def __contains__(self, delivery_id: str) -> bool:
        return delivery_id in self._ids

    def add(self, delivery_id: str) -> None:
        self._ids[delivery_id] = None
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)
        if self.path is not None:
            with open(self.path, "a") as out:
                out.write(f"{delivery_id}\n")


@dataclass
class ReceiverStats:
    accepted: int = 0
    refused: int = 0
    emitted: int = 0
    duplicates: int = 0


class WebhookReceiver:
    """An HTTP server on ``host:port`` that turns signed approval webhooks into Prefect events."""

    def __init__(self, secret: str, *, host: str = "127.0.0.1", port: int = 0, emit: EmitFn = prefect_emit,
                 max_age_s: float = 300, seen: SeenDeliveries | None = None) -> None:
        if not secret:
            raise ValueError(f"empty webhook secret (setting {ENV_SECRET})")
        self.stats = ReceiverStats()
        self.seen = seen or SeenDeliveries()
        acting = threading.Lock()  # one delivery decided at a time: a replay racing its original waits
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = _content_length(self.headers.get("Content-Length"))
                if isinstance(length, str):
                    self.close_connection = True  # the body's end is unknown: nothing more is read
                    self._answer(400, length)
                    return
                if length > MAX_BODY_BYTES:
                    self.close_connection = True
                    self._answer(413, f"body of {length} bytes is over {MAX_BODY_BYTES}")
                    return
                body = self.rfile.read(length)
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    verify_signature(secret, headers, body, max_age_s=max_age_s)
                except SignatureError as e:
                    receiver.stats.refused += 1
                    log.warning("refused webhook from %s: %s", self.client_address[0], e)
                    self._answer(401, "invalid signature")
                    return
                delivery = headers[DELIVERY_ID_HEADER.lower()][:128]
                with acting:
                    self._act(delivery, body)

            def _act(self, delivery: str, body: bytes) -> None:
                if delivery in receiver.seen:
                    receiver.stats.duplicates += 1
                    log.info("webhook delivery %s was already acted on: not again", delivery)
                    self._answer(200, "duplicate delivery, already handled")
                    return
                try:
                    payload = json.loads(body)
                    found = approval_event(payload)
                except (ValueError, AttributeError):
                    self._answer(400, "not a JSON object")
                    return
                receiver.stats.accepted += 1
                if found is None:
                    log.info("webhook delivery %s accepted: %s.%s is not an approval decision", delivery,
                             payload.get("entity"), payload.get("action"))
                else:
                    event, resource, event_payload = found
                    try:
                        emit(event, resource, event_payload)
                    except Exception as e:  # noqa: BLE001 - MLflow retries on a 5xx
                        log.error("webhook delivery %s: could not emit %s for %s: %s", delivery, event,
                                  resource["prefect.resource.id"], e)
                        self._answer(503, "event not emitted; retry later")
                        return
                    receiver.stats.emitted += 1
                    log.info("webhook delivery %s accepted: emitted %s for %s", delivery, event,
                             resource["prefect.resource.id"])
                receiver.seen.add(delivery)
                self._answer(200, "ok")

            def _answer(self, status: int, text: str) -> None:
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("webhook receiver: " + fmt, *args)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> WebhookReceiver:
        """Serve on a background thread."""
        self._thread = threading.Thread(target=self.server.serve_forever, name="webhook-receiver", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve on this thread until interrupted."""
        self.server.serve_forever()

    def stop(self) -> None:
        """Stop serving and join the thread."""
        self.server.shutdown()
        self.server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)


def _content_length(raw: str | None) -> int | str:
    """The body's length, or why the header is refused (a number of bytes >= 0 is needed)."""
    text = (raw or "0").strip()
    if not text.isdigit():
        return f"Content-Length {text[:32]!r} is not a number of bytes"
    return int(text)


@flow(name="promote-on-approval", log_prints=True)
def promote_on_approval(spec_path: str, model_name: str, version: str):
    """Started by the approval event: promote ``version`` if it belongs to the spec's model."""
    from flows.promote import promote_flow
    from flows.spec import load_spec

    spec = load_spec(Path(spec_path))
    if spec.model_name != model_name:
        print(f"approval of {model_name} version {version} ignored: {spec_path} releases {spec.model_name}")
        return None
    return promote_flow(spec, version)


def approved_without_outcome(tracking_uri: str, model_name: str) -> list[str]:
    """Versions of ``model_name`` tagged approved that no promotion has finished with yet (no ``rollout`` tag)."""
    from registry._client import mlflow_client
    from registry.approval import APPROVED, TAG_APPROVAL
    from registry.rollout_record import TAG_ROLLOUT

    found = mlflow_client(tracking_uri).search_model_versions(
        f"name = '{model_name}' and tags.{TAG_APPROVAL} = '{APPROVED}'")
    return sorted((str(mv.version) for mv in found if TAG_ROLLOUT not in (mv.tags or {})), key=int)


def reconcile(tracking_uri: str, model_name: str, *, emit: EmitFn = prefect_emit) -> list[str]:
    """Emit the approval event of every approved version without an outcome (the same event id as its
    webhook's, so a version whose webhook arrived is not started again); return those versions."""
    versions = approved_without_outcome(tracking_uri, model_name)
    for version in versions:
        payload = {"entity": "model_version_tag", "action": "set",
                   "data": {"name": model_name, "version": version, "key": "approval", "value": "approved"}}
        found = approval_event(payload)
        if found is None:  # a model or version name approval_event cannot carry
            continue
        event, resource, event_payload = found
        emit(event, resource, {**event_payload, "source": "reconcile_approvals"})
        log.info("reconcile: emitted %s for %s", event, resource["prefect.resource.id"])
    return versions


@flow(name="reconcile-approvals", log_prints=True)
def reconcile_approvals(spec_path: str) -> list[str]:
    """Scheduled: the poll path behind the webhooks (see `reconcile`)."""
    from flows.spec import load_spec

    spec = load_spec(Path(spec_path))
    versions = reconcile(spec.mlflow.tracking_uri, spec.model_name)
    print(f"approved versions of {spec.model_name} without an outcome: {versions or 'none'}")
    return versions
