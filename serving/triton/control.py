"""Triton repository API client (explicit model-control mode) over HTTP, loads over gRPC when given its address.

Pitfalls handled here (measured on the bundled 2.51): a python stub that cannot start makes
``load`` hang forever, so every call has its own timeout; ``unload`` returns before the unload has
finished, so ``unload_model(wait=True)`` polls the repository index; ``load_model(config=...)``
replaces the WHOLE config, and after such an override a plain load is a no-op until unload + load.
An HTTP load holds the HTTP thread that took it until the model is loaded, and every HTTP client whose
connection that thread serves waits with it (Triton issue #8958; seen: both clients of a rollout's load
test stalled 7-11 s while a candidate loaded); a gRPC load runs on a thread of its own, so with
``grpc_url`` loads go over gRPC (``tritonclient.grpc``, imported when first used).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from serving.triton.errors import ModelLoadError, ModelLoadTimeout, TritonRequestError, TritonUnreachableError
from serving.triton.rest import call, call_ok

POLL_S = 0.05


@dataclass(frozen=True)
class ModelState:
    """One row of the repository index."""

    name: str
    version: int | None
    state: str
    reason: str = ""


class TritonControl:
    """Repository and health API of one Triton endpoint."""

    def __init__(self, http_url: str, *, grpc_url: str | None = None, setting: str = "triton.http_url",
                 request_timeout_s: float = 10.0) -> None:
        self.http_url = http_url.rstrip("/")
        self.grpc_url = grpc_url
        self.setting = setting
        self.request_timeout_s = request_timeout_s

    def _call_ok(self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None,
                 error: type[TritonRequestError] = TritonRequestError) -> Any:
        try:
            return call_ok(self.http_url, method, path, body=body, setting=self.setting, error=error,
                           timeout_s=self.request_timeout_s if timeout_s is None else timeout_s)
        except TimeoutError as exc:
            raise TritonUnreachableError(str(exc)) from exc

    def server_live(self) -> bool:
        """True when ``/v2/health/live`` answers 200; False if unreachable."""
        try:
            return call(self.http_url, "GET", "/v2/health/live", timeout_s=self.request_timeout_s,
                        setting=self.setting).status == 200
        except (TritonUnreachableError, TimeoutError):
            return False

    def server_ready(self) -> bool:
        """True when ``/v2/health/ready`` answers 200; False if unreachable or not ready."""
        try:
            return call(self.http_url, "GET", "/v2/health/ready", timeout_s=self.request_timeout_s,
                        setting=self.setting).status == 200
        except (TritonUnreachableError, TimeoutError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        """Poll readiness until ``timeout_s``; raise ``TritonUnreachableError`` naming the URL and setting."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.server_ready():
                return
            time.sleep(POLL_S)
        raise TritonUnreachableError(
            f"Triton at {self.http_url} (setting {self.setting}) did not answer ready within {timeout_s:g} s"
        )

    def repository_index(self) -> list[ModelState]:
        """All models in the repository with their per-version state."""
        rows = self._call_ok("POST", "/v2/repository/index", {})
        return [
            ModelState(r["name"], int(r["version"]) if r.get("version") else None, r.get("state", ""),
                       r.get("reason", ""))
            for r in rows
        ]

    def load_model(self, name: str, *, config: dict[str, Any] | None = None, timeout_s: float = 60.0) -> None:
        """Load (or reload) ``name``; ``config`` must be the COMPLETE model config (it replaces the file's)."""
        if self.grpc_url:
            self._load_over_grpc(name, config, timeout_s)
            return
        body: dict[str, Any] = {}
        if config is not None:
            body = {"parameters": {"config": json.dumps(config)}}
        try:
            call_ok(self.http_url, "POST", f"/v2/repository/models/{name}/load", body=body, timeout_s=timeout_s,
                    setting=self.setting, error=ModelLoadError)
        except TimeoutError as exc:
            raise ModelLoadTimeout(
                f"model {name!r} did not load on Triton at {self.http_url} (setting {self.setting}) within "
                f"{timeout_s:g} s (argument timeout_s); a python stub that cannot start hangs the load: "
                "stop the server by PID"
            ) from exc

    def _load_over_grpc(self, name: str, config: dict[str, Any] | None, timeout_s: float) -> None:
        from tritonclient.grpc import InferenceServerClient
        from tritonclient.utils import InferenceServerException

        where = f"Triton at {self.grpc_url} (gRPC of {self.http_url}, setting {self.setting})"
        client = InferenceServerClient(self.grpc_url)
        try:
            client.load_model(name, config=None if config is None else json.dumps(config), client_timeout=timeout_s)
        except InferenceServerException as exc:
            status = str(exc.status() or "")
            if status.endswith("DEADLINE_EXCEEDED"):
                raise ModelLoadTimeout(
                    f"model {name!r} did not load on {where} within {timeout_s:g} s (argument timeout_s); a python "
                    "stub that cannot start hangs the load: stop the server by PID") from exc
            if status.endswith("UNAVAILABLE"):
                raise TritonUnreachableError(f"{where} is unreachable for the load of {name!r}: {exc.message()}") \
                    from exc
            raise ModelLoadError(f"{where} refused to load {name!r}: {exc.message()}") from exc
        finally:
            client.close()

    def unload_model(self, name: str, *, timeout_s: float = 30.0, wait: bool = True,
                     unload_dependents: bool = False) -> None:
        """Unload ``name``; with ``wait`` poll the index until no version of it is READY or UNLOADING."""
        body = {"parameters": {"unload_dependents": unload_dependents}}
        self._call_ok("POST", f"/v2/repository/models/{name}/unload", body, error=ModelLoadError)
        if not wait:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = [m for m in self.repository_index() if m.name == name and m.state in ("READY", "UNLOADING",
                                                                                          "LOADING")]
            if not live:
                return
            time.sleep(POLL_S)
        raise ModelLoadTimeout(
            f"model {name!r} did not finish unloading on Triton at {self.http_url} (setting {self.setting}) "
            f"within {timeout_s:g} s (argument timeout_s)"
        )

    def model_ready(self, name: str, version: int | None = None) -> bool:
        """True when the model (or the given version) answers ready."""
        path = f"/v2/models/{name}" + (f"/versions/{version}" if version is not None else "") + "/ready"
        try:
            return call(self.http_url, "GET", path, timeout_s=self.request_timeout_s,
                        setting=self.setting).status == 200
        except (TritonUnreachableError, TimeoutError):
            return False

    def ready_versions(self, name: str) -> list[int]:
        """Versions of ``name`` that are READY, ascending."""
        return sorted(m.version for m in self.repository_index()
                      if m.name == name and m.state == "READY" and m.version is not None)

    def model_config(self, name: str, version: int | None = None) -> dict[str, Any]:
        """The config Triton is serving for ``name`` (JSON form)."""
        path = f"/v2/models/{name}" + (f"/versions/{version}" if version is not None else "") + "/config"
        return self._call_ok("GET", path)
