"""Step 8: gray release. Shift traffic from the live version to the candidate in the spec's steps while
requests flow, analyse each window, and finish (candidate takes all traffic) or roll back.

Triton has no traffic splitting: the stable model name is a BLS router whose weights change by a reload
with a complete config override. Every step is applied to every endpoint of the fleet.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Literal

from prefect import task

from tasks.errors import RolloutAborted
from tasks.promote_spec import Analysis, AnalysisSpec, Pause, RolloutSpec, SetWeight, TritonSpec
from tasks.stage import StagedVersion
from tasks.targets import Target
from tasks.traffic import RequestRecord, TrafficGenerator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightChange:
    t_s: float
    weights: dict[int, int]


@dataclass(frozen=True)
class AnalysisResult:
    t_s: float
    requests: int
    success_rate: float
    per_version: dict[int, dict[str, float]]
    outcome: Literal["Successful", "Failed", "Inconclusive"]
    reason: str


@dataclass
class RolloutReport:
    model_name: str
    candidate: int
    live: int | None
    outcome: Literal["Successful", "Failed"] = "Successful"
    reason: str = ""
    weight_changes: list[WeightChange] = field(default_factory=list)
    analyses: list[AnalysisResult] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)

    @property
    def metrics(self) -> dict[str, float]:
        ok = [r for r in self.records if r.ok]
        return {
            "rollout_requests": len(self.records),
            "rollout_failed_requests": len(self.records) - len(ok),
            "rollout_candidate_requests": sum(r.version == self.candidate for r in self.records),
        }


def analyse(records: list[RequestRecord], spec: AnalysisSpec, t_s: float) -> AnalysisResult:
    """Judge one window of requests: overall success rate against the threshold, per-version figures."""
    if not records:
        return AnalysisResult(t_s, 0, 0.0, {}, "Inconclusive", "no request finished in the analysis window")
    per_version: dict[int, dict[str, float]] = {}
    for version in sorted({r.version for r in records if r.version is not None}):
        mine = [r for r in records if r.version == version]
        per_version[version] = {
            "requests": len(mine),
            "success_rate": sum(r.ok for r in mine) / len(mine),
            "latency_p50_ms": sorted(r.latency_s for r in mine)[len(mine) // 2] * 1e3,
        }
    rate = sum(r.ok for r in records) / len(records)
    if rate < spec.min_success_rate:
        errors = sorted({r.error for r in records if not r.ok})[:3]
        return AnalysisResult(
            t_s, len(records), rate, per_version, "Failed",
            f"success rate {rate:.3f} < analysis.min_success_rate {spec.min_success_rate} "
            f"over {len(records)} requests; errors: {errors}",
        )
    return AnalysisResult(t_s, len(records), rate, per_version, "Successful", "")


def step_weights(live: int | None, candidate: int, percent: int) -> dict[int, int]:
    """Router weights for `percent` on the candidate; before any live version the candidate takes all."""
    if live is None or live == candidate:
        return {candidate: 100}
    return {live: 100 - percent, candidate: percent}


def apply_weights(targets: list[Target], model_name: str, weights: dict[int, int], timeout_s: float) -> None:
    from serving.triton.operations import apply_router_weights

    for target in targets:
        apply_router_weights(target.control(), target.model_repository, model_name, weights, timeout_s=timeout_s)


def gray_release(
    targets: list[Target],
    staged: StagedVersion,
    *,
    rollout: RolloutSpec,
    triton: TritonSpec,
    vocab_size: int,
) -> RolloutReport:
    """Run the rollout steps; on success the candidate serves alone, on failure the live version does."""
    from serving.triton.client import infer_ids

    name, cand, live = staged.model_name, staged.version, staged.live_version
    report = RolloutReport(name, cand, live)
    max_new = max([s.analysis.max_new_tokens for s in rollout.steps if isinstance(s, Analysis)] or [8])
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(4, 12))] for _ in range(16)]

    def send(url: str, n: int) -> tuple[int | None, str]:
        result = infer_ids(url, name, prompts[n % len(prompts)], max_tokens=max_new, timeout_s=triton.request_timeout_s)
        return result.routed_version, ""

    traffic = TrafficGenerator([t.url for t in targets], send, concurrency=rollout.concurrency, max_seconds=3600)
    try:
        with traffic:
            for step in rollout.steps:
                _run_step(step, targets, report, traffic, triton, live, cand)
                if report.outcome == "Failed":
                    break
    finally:
        report.records = traffic.log.since(0)
    if report.outcome == "Failed":
        roll_back(targets, staged, triton)
        raise RolloutAborted(report.reason, report)
    finish(targets, staged, triton)
    return report


def _run_step(step, targets, report: RolloutReport, traffic: TrafficGenerator, triton: TritonSpec,
              live: int | None, cand: int) -> None:
    now = time.monotonic() - traffic.t0
    if isinstance(step, SetWeight):
        weights = step_weights(live, cand, step.set_weight)
        apply_weights(targets, report.model_name, weights, triton.load_timeout_s)
        report.weight_changes.append(WeightChange(now, weights))
        log.info("set_weight %d%% -> router weights %s", step.set_weight, weights)
    elif isinstance(step, Pause):
        time.sleep(step.pause.duration_s)
    elif isinstance(step, Analysis):
        window = traffic.wait_for(step.analysis.requests, timeout_s=triton.request_timeout_s * 2)
        result = analyse(window, step.analysis, time.monotonic() - traffic.t0)
        report.analyses.append(result)
        log.info("analysis: %s (%d requests, success %.3f) %s", result.outcome, result.requests,
                 result.success_rate, result.per_version)
        if result.outcome != "Successful":
            report.outcome = "Failed"
            report.reason = result.reason


def finish(targets: list[Target], staged: StagedVersion, triton: TritonSpec) -> None:
    """The candidate takes all traffic and is the only version served; the old version's folder goes."""
    from serving.triton.operations import serve_versions
    from serving.triton.repository import remove_version

    name, cand, live = staged.model_name, staged.version, staged.live_version
    apply_weights(targets, name, {cand: 100}, triton.load_timeout_s)
    for target in targets:
        serve_versions(target.control(), target.model_repository, name, [cand], timeout_s=triton.load_timeout_s)
        if live is not None and live != cand:
            remove_version(target.model_repository, name, live)


def roll_back(targets: list[Target], staged: StagedVersion, triton: TritonSpec) -> None:
    """Weight back to the live version, candidate unloaded and removed; before any live version, remove all."""
    from serving.triton.operations import serve_versions
    from serving.triton.repository import remove_model, remove_version

    name, cand, live = staged.model_name, staged.version, staged.live_version
    for target in targets:
        if live is None:
            remove_model(target.control(), target.model_repository, name, timeout_s=triton.load_timeout_s)
            continue
        apply_weights([target], name, {live: 100}, triton.load_timeout_s)
        serve_versions(target.control(), target.model_repository, name, [live], timeout_s=triton.load_timeout_s)
        remove_version(target.model_repository, name, cand)


@task(name="gray-release", retries=0)
def gray_release_task(targets: list[Target], staged: StagedVersion, *, rollout: RolloutSpec, triton: TritonSpec,
                      vocab_size: int) -> RolloutReport:
    """Shift traffic to the candidate step by step, analysing each window."""
    return gray_release(targets, staged, rollout=rollout, triton=triton, vocab_size=vocab_size)
