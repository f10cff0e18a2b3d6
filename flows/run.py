"""Run a flow and turn its final state into an outcome a person reads (no stack traces for gate failures)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flows.errors import known_errors
from flows.spec import ReleaseSpec

if TYPE_CHECKING:
    from prefect.states import State


@dataclass
class Outcome:
    ok: bool
    message: str
    result: Any = None
    details: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return "\n".join([self.message, *self.details])


def outcome_of(state: State, *, what: str) -> Outcome:
    """Completed -> ok with the flow's return value; Failed -> the state's message (and data if any)."""
    if state.is_completed():
        return Outcome(True, f"{what} completed", state.result())
    try:
        data = state.result(raise_on_failure=True)
    except known_errors() as exc:  # a step refused: its message already names the setting
        return Outcome(False, f"{what} failed: {exc}")
    except Exception:  # noqa: BLE001 - the flow's own message is what a person needs
        data = None
    return Outcome(False, state.message or f"{what} ended in state {state.name}", data)


def run_release(spec: ReleaseSpec) -> Outcome:
    """Check what can be checked without a flow run (so a bad input costs seconds), then run the flow."""
    from flows.release import release_flow
    from tasks.checkpoint import check_checkpoint

    check_checkpoint(spec.source.checkpoint, kind=spec.engine.kind)
    return outcome_of(release_flow(spec, return_state=True), what="release")


def run_promote(spec: ReleaseSpec, version: str) -> Outcome:
    """Check that every Triton endpoint answers, wait for the approval, then run the flow.

    The wait happens here, before the flow run, so that nothing runs beside it: the ephemeral Prefect
    API (a child server, in the terminal's process group) starts with the flow run, and Triton after the
    approval. Ctrl-C or SIGTERM during the wait therefore stop one process that has changed nothing
    (WaitInterrupted). The flow reads the decision again at once and records it in its own run.
    """
    from flows.interrupt import interruptible
    from tasks.approve import await_decision
    from tasks.errors import ApprovalRejected
    from tasks.targets import check_reachable, resolve_targets

    if spec.triton.endpoints:
        check_reachable(resolve_targets(spec.triton))
    if spec.approval.mode == "mlflow-tag":
        try:
            with interruptible(f"the approval of {spec.model_name} version {version}") as sleep:
                await_decision(spec.approval, tracking_uri=spec.mlflow.tracking_uri, model_name=spec.model_name,
                               version=version, sleep=sleep)
        except ApprovalRejected as exc:
            return Outcome(False, f"promote stopped: {exc}")
    # imported after the wait: a process stopped while waiting never loads the flow (seconds of CPU)
    from flows.promote import promote_flow

    return outcome_of(promote_flow(spec, version, return_state=True), what="promote")
