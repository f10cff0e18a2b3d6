"""The Triton endpoints a promotion acts on, each with the setting it came from (for error messages)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.promote_spec import TritonSpec


@dataclass(frozen=True)
class Target:
    url: str
    model_repository: Path
    setting: str

    def control(self, *, request_timeout_s: float = 10.0):
        from serving.triton.control import TritonControl

        return TritonControl(self.url, setting=self.setting, request_timeout_s=request_timeout_s)


def resolve_targets(triton: TritonSpec, *, embedded_url: str | None = None) -> list[Target]:
    """The spec's endpoints, or the embedded server when the spec names none."""
    if triton.endpoints:
        return [
            Target(e.url, Path(e.model_repository), f"triton.endpoints[{i}].url")
            for i, e in enumerate(triton.endpoints)
        ]
    if embedded_url is None:
        raise ValueError("no Triton endpoints in the spec and no embedded server running")
    return [Target(embedded_url, Path(triton.model_repository), "triton.model_repository (embedded server)")]


def check_reachable(targets: list[Target], *, timeout_s: float = 5.0) -> None:
    """Fail before any change when one endpoint of the fleet does not answer ready."""
    from serving.triton.errors import TritonUnreachableError

    for target in targets:
        control = target.control(request_timeout_s=min(timeout_s, 5.0))
        if not control.server_ready():
            raise TritonUnreachableError(
                f"Triton at {target.url} (setting {target.setting}) is not reachable or not ready; "
                "nothing was staged. Start the server or fix the URL, then run the promotion again."
            )
