"""Errors raised by the release steps; each names the offending value and the setting it came from."""

from __future__ import annotations


class StepError(Exception):
    """Base of every error a release step raises on purpose."""


class GateFailed(StepError):
    """A quality or performance gate said no; `report` is what a person reads."""

    def __init__(self, gate: str, summary: str, report: str) -> None:
        super().__init__(f"{gate} gate failed: {summary}")
        self.gate = gate
        self.summary = summary
        self.report = report


class CheckpointError(StepError):
    """The model source cannot be used."""


class RolloutAborted(StepError):
    """The gray release was rolled back; `reason` says why."""

    def __init__(self, reason: str, report: object | None = None) -> None:
        super().__init__(f"rollout aborted and rolled back: {reason}")
        self.reason = reason
        self.report = report


class ApprovalRejected(StepError):
    """A person rejected the version in the MLflow UI."""
