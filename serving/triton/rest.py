"""Minimal JSON-over-HTTP helper for Triton's REST API (stdlib only, one short-lived connection per call).

Connections are closed after every call: an open keep-alive connection delays Triton's shutdown by its
exit timeout.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from dataclasses import dataclass
from typing import Any

from serving.triton.errors import TritonRequestError, TritonUnreachableError


@dataclass(frozen=True)
class HttpResponse:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else {}

    def error_message(self) -> str:
        try:
            return str(self.json().get("error", self.body.decode(errors="replace")))
        except (ValueError, AttributeError):
            return self.body.decode(errors="replace")


def call(
    base_url: str,
    method: str,
    path: str,
    *,
    body: Any = None,
    timeout_s: float,
    setting: str = "triton.http_url",
) -> HttpResponse:
    """Send one request; raise ``TritonUnreachableError`` (naming the URL and setting) if nobody answers."""
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme != "http" or not parts.hostname:
        raise TritonUnreachableError(f"Triton URL {base_url!r} (setting {setting}) is not an http://host:port URL")
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    payload = None if body is None else json.dumps(body).encode()
    headers = {"Connection": "close"}
    if payload is not None:
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, parts.path.rstrip("/") + path, body=payload, headers=headers)
        resp = conn.getresponse()
        return HttpResponse(resp.status, resp.read())
    except TimeoutError as exc:
        raise TimeoutError(
            f"Triton at {base_url} (setting {setting}) did not answer {method} {path} within {timeout_s:g} s"
        ) from exc
    except (ConnectionError, OSError, http.client.HTTPException) as exc:
        raise TritonUnreachableError(
            f"Triton at {base_url} (setting {setting}) is unreachable for {method} {path}: {exc}"
        ) from exc
    finally:
        conn.close()


def call_ok(base_url: str, method: str, path: str, *, body: Any = None, timeout_s: float,
            setting: str = "triton.http_url", error: type[TritonRequestError] = TritonRequestError) -> Any:
    """Like ``call`` but raise ``error`` on a non-2xx status and return the decoded JSON body."""
    resp = call(base_url, method, path, body=body, timeout_s=timeout_s, setting=setting)
    if resp.status // 100 != 2:
        raise error(
            f"Triton at {base_url} (setting {setting}) answered {method} {path} with {resp.status}: "
            f"{resp.error_message()}",
            status=resp.status,
        )
    return resp.json()
