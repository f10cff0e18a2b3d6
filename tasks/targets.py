"""The Triton endpoints a promotion acts on, each with the setting it came from (for error messages)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.promote_spec import TritonSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    url: str
    model_repository: Path
    setting: str
    metrics_url: str | None = None
    grpc_url: str | None = None  # model loads go over gRPC when set (serving.triton.control: HTTP loads stall clients)

    def control(self, *, request_timeout_s: float = 10.0):
        from serving.triton.control import TritonControl

        return TritonControl(self.url, grpc_url=self.grpc_url, setting=self.setting,
                             request_timeout_s=request_timeout_s)


def resolve_targets(triton: TritonSpec, *, embedded_url: str | None = None,
                    embedded_metrics_url: str | None = None, embedded_grpc_url: str | None = None) -> list[Target]:
    """The spec's endpoints, or the embedded server when the spec names none."""
    if triton.endpoints:
        return [
            Target(e.url, Path(e.model_repository), f"triton.endpoints[{i}].url", e.metrics_url, e.grpc_url)
            for i, e in enumerate(triton.endpoints)
        ]
    if embedded_url is None:
        raise ValueError("no Triton endpoints in the spec and no embedded server running")
    return [Target(embedded_url, Path(triton.model_repository), "triton.model_repository (embedded server)",
                   embedded_metrics_url, embedded_grpc_url)]


def live_version(target: Target, model_name: str) -> int | None:
    """The version the router sends all traffic to, or None before the first release."""
    from serving.triton.repository import router_weights

    weights = router_weights(target.model_repository, model_name)
    full = [v for v, w in weights.items() if w == 100]
    return full[0] if full else None


def fleet_live_version(targets: list[Target], model_name: str) -> int | None:
    """The live version, the same on every endpoint (else the fleet is inconsistent: ValueError)."""
    lives = {live_version(t, model_name) for t in targets}
    if len(lives) > 1:
        raise ValueError(f"the fleet is inconsistent: live versions of {model_name} differ across endpoints: {lives}")
    return lives.pop()


def _settling(control: Any) -> bool:
    """Whether a model of the server is still loading or unloading (readiness may yet change)."""
    try:
        return any(m.state in ("LOADING", "UNLOADING") for m in control.repository_index())
    except Exception:  # noqa: BLE001 - cannot tell: keep waiting until the deadline
        return True


def check_reachable(targets: list[Target], *, timeout_s: float = 10.0) -> None:
    """Fail before any change when one endpoint of the fleet does not answer.

    Triton runs with ``--strict-readiness``: while a version unloads (the tail of a previous rollout) the
    server answers not-ready for a moment, and after a FAILED load it stays not-ready (the version remains
    UNAVAILABLE in the index) although it serves everything else. So readiness is polled up to
    ``timeout_s`` while a model is still LOADING or UNLOADING; a server that is live and answers its
    repository index is then accepted with a warning. A server that does not answer at all fails at once.
    """
    from serving.triton.errors import TritonUnreachableError

    for target in targets:
        control = target.control(request_timeout_s=5.0)
        deadline = time.monotonic() + timeout_s
        while (control.server_live() and not control.server_ready() and time.monotonic() < deadline
               and _settling(control)):
            time.sleep(0.2)
        if control.server_ready():
            continue
        if control.server_live():
            try:
                bad = [f"{m.name} v{m.version}: {m.state}" for m in control.repository_index() if m.state != "READY"]
            except Exception:  # noqa: BLE001 - falls through to the error below
                bad = None
            if bad is not None:
                log.warning("Triton at %s is live but not ready (strict readiness): %s", target.url, bad)
                continue
        raise TritonUnreachableError(
            f"Triton at {target.url} (setting {target.setting}) is not reachable or not ready; "
            "nothing was staged. Start the server or fix the URL, then run the promotion again."
        )
