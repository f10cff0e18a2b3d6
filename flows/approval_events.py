"""MLflow approval webhooks -> Prefect events -> the promote deployment.

MLflow (>= 3.3) posts a signed webhook on ``model_version_tag.set``. This small receiver (stdlib
``http.server``) checks the signature (``X-MLflow-Signature: v1,<base64 HMAC-SHA256 of
"{delivery_id}.{timestamp}.{body}">``) and the timestamp's freshness, and for an ``approval`` tag
emits the Prefect event ``enginewright.approval.approved`` (or ``.rejected``) about the resource
``mlflow.model-version.<name>.<version>``. The trigger in ``deployments/prefect.yaml`` starts
:func:`promote_on_approval` from it. A bad signature is answered 401 and logged; the body of a
refused request is never acted on.

Delivery is best effort (MLflow retries 3 times and keeps no outbox), and a webhook says nothing
about who set the tag: the promote flow still re-reads the tag and verifies it against MLflow's
permissions (``registry.promotion``) before anything moves.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import threading
import time
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


def prefect_emit(event: str, resource: dict[str, str], payload: dict[str, Any]) -> None:
    """Emit through Prefect's events client (the API in ``PREFECT_API_URL``)."""
    from prefect.events import emit_event

    emit_event(event=event, resource=resource, payload=payload)


@dataclass
class ReceiverStats:
    accepted: int = 0
    refused: int = 0
    emitted: int = 0


class WebhookReceiver:
    """An HTTP server on ``host:port`` that turns signed approval webhooks into Prefect events."""

    def __init__(self, secret: str, *, host: str = "127.0.0.1", port: int = 0, emit: EmitFn = prefect_emit,
                 max_age_s: float = 300) -> None:
        if not secret:
            raise ValueError(f"empty webhook secret (setting {ENV_SECRET})")
        self.stats = ReceiverStats()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY_BYTES:
                    self._answer(413, "body too large")
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
                receiver.stats.accepted += 1
                try:
                    found = approval_event(json.loads(body))
                except (ValueError, AttributeError):
                    self._answer(400, "not a JSON object")
                    return
                if found is not None:
                    event, resource, payload = found
                    try:
                        emit(event, resource, payload)
                    except Exception as e:  # noqa: BLE001 - MLflow retries on a 5xx
                        log.error("could not emit %s for %s: %s", event, resource["prefect.resource.id"], e)
                        self._answer(502, "event not emitted")
                        return
                    receiver.stats.emitted += 1
                    log.info("emitted %s for %s", event, resource["prefect.resource.id"])
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
