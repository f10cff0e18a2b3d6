"""Step 8: gray release. Shift traffic from the live version to the candidate in the spec's steps while
requests flow and analyse each window; the promotion then finishes or rolls back (``tasks.rollback``).

Triton has no traffic splitting: the stable model name is a BLS router whose weights live in a routing
file its instances follow (no reload). Every step is applied to every endpoint of the fleet; a failure on
one endpoint (a write or load that fails, a router that does not answer) aborts the rollout: ``RolloutAborted``
carries the report, and the promotion rolls ALL back.
Each step is written to the rollout journal before it is applied (``tasks.rollout_state``).

Analysis (per ``analysis`` step): the test traffic of the window (``requests``, ``candidate_requests``; token
ids and fixed texts, ``tasks.canary_text``), the spec's metrics over the router's counters and Triton's
Prometheus endpoint, a baseline-vs-canary comparison of TTFT and time per output token
(``tasks.analysis.compare``), and the candidate's text answers against the live tokenizer's ids. Outcomes: Successful -> next step, Failed -> abort,
Inconclusive -> hold for a person (MLflow tag ``rollout.decision``) or decide per ``rollout.hold``.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.analysis import (
    AnalysisResult,
    combine,
    comparable,
    compare,
    decided,
    prometheus_value,
    router_value,
    run_metrics,
    take_readings,
)
from tasks.canary_text import IDS_KEY, TEXT_KEY, TextCheck, TextPlan, check_text, text_plan
from tasks.errors import RolloutAborted
from tasks.promote_spec import Analysis, AnalysisSpec, MetricSpec, Pause, RolloutSpec, SetWeight, TritonSpec
from tasks.rollout_state import Journal, write_journal
from tasks.stage import StagedVersion
from tasks.targets import Target
from tasks.traffic import RequestRecord, TrafficGenerator

log = logging.getLogger(__name__)

DecideFn = Callable[[str], Literal["continue", "abort"]]  # reason -> a person's (or a timeout's) decision


@dataclass(frozen=True)
class WeightChange:
    t_s: float
    weights: dict[int, int]


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
    holds: list[str] = field(default_factory=list)
    text_plan: TextPlan | None = None
    t0: float = field(default_factory=time.monotonic)  # the traffic's clock: weight changes are seconds after it

    @property
    def metrics(self) -> dict[str, float]:
        ok = [r for r in self.records if r.ok]
        return {
            "rollout_requests": len(self.records),
            "rollout_failed_requests": len(self.records) - len(ok),
            "rollout_candidate_requests": sum(r.version == self.candidate for r in self.records),
        }

    def figures(self) -> dict:
        return {"outcome": self.outcome, "reason": self.reason, **self.metrics,
                "analyses": [a.figures() for a in self.analyses]}


def step_weights(live: int | None, candidate: int, percent: int) -> dict[int, int]:
    """Router weights for `percent` on the candidate; before any live version the candidate takes all."""
    if live is None or live == candidate:
        return {candidate: 100}
    if percent == 100:
        return {live: 0, candidate: 100}
    if percent == 0:
        return {live: 100, candidate: 0}
    return {live: 100 - percent, candidate: percent}


def apply_weights(targets: list[Target], model_name: str, weights: dict[int, int], timeout_s: float) -> None:
    """Write the routing file on every endpoint (its routers follow it; nothing reloads); the first failure
    raises (the caller rolls all back)."""
    from serving.triton.operations import apply_router_weights

    for target in targets:
        apply_router_weights(target.control(), target.model_repository, model_name, weights, timeout_s=timeout_s)


# ---------------------------------------------------------------- readers for the metrics


def _router_reading(targets: list[Target], name: str) -> dict:
    from serving.triton.models.routing import merge_counters
    from serving.triton.repository import router_stats

    return merge_counters([router_stats(t.model_repository, name)["cumulative"] for t in targets])


PROM_FAMILIES = ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_request_duration_us",
                 "nv_inference_queue_duration_us")


def _prometheus_reading(targets: list[Target], name: str, versions: list[int]) -> dict[str, float]:
    """Triton's counters of the engine models of ``versions`` (one model per version), summed."""
    from serving.triton.metrics import model_counter, scrape
    from serving.triton.repository import engine_model_name

    out = dict.fromkeys(PROM_FAMILIES, 0.0)
    for t in targets:
        samples = scrape(t.metrics_url, setting=f"{t.setting} (metrics_url)")
        for fam in PROM_FAMILIES:
            out[fam] += sum(model_counter(samples, fam, engine_model_name(name, v)) for v in versions)
    return out


def gray_release(
    targets: list[Target],
    staged: StagedVersion,
    *,
    rollout: RolloutSpec,
    triton: TritonSpec,
    vocab_size: int,
    journal: Journal | None = None,
    decide: DecideFn | None = None,
) -> RolloutReport:
    """Run the rollout steps while test traffic flows; return the report once the last step passed (the
    candidate then has all traffic, beside the live version still loaded).

    A failed step raises ``RolloutAborted`` carrying the report; the weights are left as they were, for the
    caller's ``tasks.rollback.roll_back``.
    """
    from serving.triton.client import infer_ids, infer_text

    name, cand, live = staged.model_name, staged.version, staged.live_version
    repos = [t.model_repository for t in targets]
    journal = journal or Journal(name, cand, live, "shifting", endpoints=[t.url for t in targets])
    report = RolloutReport(name, cand, live)
    _check_metric_sources(rollout, targets)
    max_new = max([s.analysis.max_new_tokens for s in rollout.steps if isinstance(s, Analysis)] or [8])
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(4, 12))] for _ in range(16)]
    probe = rollout.ttft_probe_every
    compare_text = any(s.analysis.text_pairs for s in rollout.steps if isinstance(s, Analysis))
    report.text_plan = plan = text_plan(repos[0], name, live=live, candidate=cand, compare=compare_text)
    print(f"canary text: {len(plan.texts) if plan.send_text else 0} fixed texts sent as text"
          + (f" and as the live tokenizer's ids ({plan.reference})" if plan.reference_ids else f" ({plan.reference})"))

    def send(url: str, n: int) -> tuple:
        tokens = 1 if probe and n % probe == 0 else max_new
        key = "" if tokens == 1 else plan.key_of(n)
        kind, j = key.split(":") if key else ("", "0")
        timeout = triton.request_timeout_s
        if kind == TEXT_KEY:
            result = infer_text(url, name, plan.texts[int(j)], max_tokens=tokens, routed=True, timeout_s=timeout)
        else:
            ids = list(plan.reference_ids[int(j)]) if kind == IDS_KEY and plan.reference_ids else \
                prompts[n % len(prompts)]
            result = infer_ids(url, name, ids, max_tokens=tokens, timeout_s=timeout)
        return result.routed_version, "", len(result.output_ids), key, result.output_ids

    traffic = TrafficGenerator([t.url for t in targets], send, concurrency=rollout.concurrency, max_seconds=3600,
                               rate_per_s=rollout.rate_per_s)
    report.t0 = traffic.t0
    try:
        with traffic:
            for index, step in enumerate(rollout.steps):
                try:
                    _run_step(index, step, targets, report, traffic, triton, rollout, journal, decide)
                except RolloutAborted:
                    raise
                except Exception as exc:  # noqa: BLE001 - any failure on any endpoint aborts the whole fleet
                    report.outcome = "Failed"
                    report.reason = f"step {index} ({_describe(step)}) failed: {type(exc).__name__}: {exc}"
                if report.outcome == "Failed":
                    break
    finally:
        report.records = traffic.log.since(0)
    if report.outcome == "Failed":
        raise RolloutAborted(report.reason, report)
    return report


def _describe(step) -> str:
    if isinstance(step, SetWeight):
        return f"set_weight {step.set_weight}"
    if isinstance(step, Pause):
        return f"pause {step.pause.duration_s:g} s"
    return "analysis"


def _check_metric_sources(rollout: RolloutSpec, targets: list[Target]) -> None:
    uses_prom = any(m.provider == "prometheus" for s in rollout.steps if isinstance(s, Analysis)
                    for m in s.analysis.metrics)
    missing = [t.setting for t in targets if not t.metrics_url]
    if uses_prom and missing:
        raise ValueError(f"analysis metrics with provider prometheus need a metrics_url; missing for {missing}")


def _run_step(index: int, step, targets: list[Target], report: RolloutReport, traffic: TrafficGenerator,
              triton: TritonSpec, rollout: RolloutSpec, journal: Journal, decide: DecideFn | None) -> None:
    name, cand, live = report.model_name, report.candidate, report.live
    if isinstance(step, SetWeight):
        weights = step_weights(live, cand, step.set_weight)
        write_journal([t.model_repository for t in targets], journal, phase="shifting", step=index, weights=weights)
        apply_weights(targets, name, weights, triton.load_timeout_s)
        report.weight_changes.append(WeightChange(time.monotonic() - traffic.t0, weights))
        log.info("set_weight %d%% -> router weights %s on %d endpoint(s)", step.set_weight, weights, len(targets))
    elif isinstance(step, Pause):
        time.sleep(step.pause.duration_s)
    elif isinstance(step, Analysis):
        result = analyse_step(step, targets, report, traffic, rollout.ttft_probe_every)
        report.analyses.append(result)
        print(f"analysis at step {index}: {result.outcome} ({result.requests} requests in {result.window_s:.1f} s, "
              f"success {result.success_rate:.3f}) {json.dumps(result.figures(), default=str)}")
        for why in result.unjudged:
            print(f"analysis at step {index}: {why}")
        if result.outcome == "Failed":
            report.outcome, report.reason = "Failed", f"analysis at step {index} Failed: {result.reason}"
        elif result.outcome == "Inconclusive":
            choice = _on_inconclusive(rollout, result.reason, decide)
            report.holds.append(f"step {index}: {result.reason} -> {choice}")
            if choice == "abort":
                report.outcome = "Failed"
                report.reason = f"analysis at step {index} Inconclusive ({result.reason}); decision: abort"


def _on_inconclusive(rollout: RolloutSpec, reason: str, decide: DecideFn | None) -> str:
    policy = rollout.hold.on_inconclusive
    if policy != "hold":
        return policy
    if decide is None:
        log.warning("analysis inconclusive and nobody to ask (no decide function): aborting")
        return "abort"
    return decide(reason)


def analyse_step(step: Analysis, targets: list[Target], report: RolloutReport, traffic: TrafficGenerator,
                 probe_every: int) -> AnalysisResult:
    """Metrics (measured while traffic flows) + the window's traffic + the baseline-vs-canary comparison.

    The window stays open until it can be judged (``_window_complete``), at most ``timeout_s``; its expected
    length follows from the traffic rate and the candidate's weight (``expected_window_s``) and is logged."""
    spec = step.analysis
    name, cand, live = report.model_name, report.candidate, report.live
    start = traffic.log.count()

    def version_key(metric: MetricSpec) -> str:
        return {"candidate": str(cand), "live": str(live), "all": "all"}[metric.version]

    def read(metric: MetricSpec):
        if metric.provider == "router":
            return _router_reading(targets, name)
        versions = {"candidate": [cand], "live": [live], "all": [cand, live]}[metric.version]
        return _prometheus_reading(targets, name, [v for v in versions if v is not None])

    def value_of(metric: MetricSpec, before, after):
        if metric.provider == "router":
            from serving.triton.models.routing import diff_counters

            return router_value(metric.query, diff_counters(after, before), version_key(metric))
        return prometheus_value(metric.query, before, after)

    initial = take_readings(spec.metrics, read)
    weights = report.weight_changes[-1].weights if report.weight_changes else {}
    opened = time.monotonic()
    deadline = opened + spec.timeout_s
    expected: float | None = None
    window = traffic.log.since(start)
    while time.monotonic() < deadline:
        window = traffic.log.since(start)
        elapsed = time.monotonic() - opened
        if expected is None and len(window) >= WINDOW_RATE_REQUESTS and elapsed > 0:
            expected = expected_window_s(len(window) / elapsed, weights.get(cand), spec, probe_every)
            _say_expected(expected, len(window) / elapsed, weights.get(cand), spec)
        if _window_complete(window, spec, report, weights):
            break
        time.sleep(WINDOW_POLL_S)
    window_s = time.monotonic() - opened
    closed = window  # the comparisons judge the window as it closed, not what came after
    comparisons = (compare(closed, live=live, candidate=cand, spec=spec.compare, candidate_weight=weights.get(cand))
                   if spec.compare else [])
    text = _text_check(closed, spec, report, weights)
    metrics = run_metrics(spec.metrics, read, value_of, initial=initial)
    window = traffic.log.since(start)  # success rate over everything, the metrics' intervals included
    result = combine(time.monotonic() - traffic.t0, window, spec, metrics, comparisons, text)
    return replace(result, window_s=window_s, expected_window_s=expected, ceiling_s=spec.timeout_s)


WINDOW_RATE_REQUESTS = 5  # requests seen before the traffic rate (and so the window's length) is estimated
WINDOW_POLL_S = 0.25  # between two checks of the window (each re-runs the comparison over all its samples)


def expected_window_s(rate: float, candidate_weight: int | None, spec: AnalysisSpec, probe_every: int) -> float:
    """The least time the window needs at ``rate`` requests/s: the candidate's share must bring
    ``candidate_requests``, and with ``compare`` both sides ``min_samples`` of each kind (a TTFT sample is every
    ``probe_every``-th request, a TPOT sample the others). inf when a needed share is 0."""
    share = (candidate_weight if candidate_weight is not None else 100) / 100.0
    needs = [spec.requests / rate, spec.candidate_requests / (rate * share) if share else math.inf]
    if spec.compare is not None and 0 < share < 1 and comparable(spec.compare, candidate_weight):
        ttft = 1.0 / probe_every if probe_every else 0.0
        fractions = {"ttft": ttft, "tpot": 1.0 - ttft}
        smaller_side = min(share, 1.0 - share)
        for kind in spec.compare.metrics:
            f = fractions[kind] * smaller_side
            needs.append(spec.compare.min_samples / (rate * f) if f else math.inf)
    return max(needs)


def _say_expected(expected: float, rate: float, weight: int | None, spec: AnalysisSpec) -> None:
    line = (f"analysis window at candidate weight {weight}%: {rate:.1f} requests/s, so at least {expected:.0f} s "
            f"for its samples (ceiling analysis.timeout_s {spec.timeout_s:g} s)")
    if expected > spec.timeout_s:
        log.warning("%s: it will likely end not judged (Inconclusive); raise timeout_s, rollout.concurrency "
                    "or the weight", line)
    else:
        log.info("%s", line)


def _window_complete(window: list[RequestRecord], spec: AnalysisSpec, report: RolloutReport,
                     weights: dict[int, int]) -> bool:
    """``requests`` finished, ``candidate_requests`` of them by the candidate (while it carries traffic), and,
    when versions are compared, every comparison judged (``min_samples`` per side, then a verdict)."""
    live, cand = report.live, report.candidate
    if len(window) < spec.requests:
        return False
    if weights.get(cand, 100) and sum(r.version == cand for r in window) < spec.candidate_requests:
        return False
    text = _text_check(window, spec, report, weights)
    if text is not None and text.outcome == "Inconclusive":
        return False
    if spec.compare is None or live is None:
        return True
    return decided(compare(window, live=live, candidate=cand, spec=spec.compare, candidate_weight=weights.get(cand)))


def _text_check(window: list[RequestRecord], spec: AnalysisSpec, report: RolloutReport,
                weights: dict[int, int]) -> TextCheck | None:
    """The candidate's text answers against the live tokenizer's ids, while it carries traffic."""
    plan = report.text_plan
    if plan is None or spec.text_pairs == 0 or not weights.get(report.candidate, 100):
        return None
    return check_text(window, plan, report.candidate, min_pairs=spec.text_pairs, max_mismatch=spec.max_text_mismatch)


@task(name="gray-release", retries=0, cache_policy=NO_CACHE)
def gray_release_task(targets: list[Target], staged: StagedVersion, *, rollout: RolloutSpec, triton: TritonSpec,
                      vocab_size: int, journal: Journal | None = None, decide: DecideFn | None = None) -> RolloutReport:
    """Shift traffic to the candidate step by step, analysing each window."""
    return gray_release(targets, staged, rollout=rollout, triton=triton, vocab_size=vocab_size, journal=journal,
                        decide=decide)
