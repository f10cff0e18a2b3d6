"""Analysis of one rollout step: Argo-style metrics over the router's counters and Triton's Prometheus
endpoint, plus a baseline-vs-canary latency comparison (the candidate/live ratio with confidence bounds
against a relative budget).

Outcomes follow Argo Rollouts: ``Successful`` (continue), ``Failed`` (abort), ``Inconclusive`` (hold for a
person). The pieces here are plain functions over numbers; ``gray_release`` supplies the readers.
"""

from __future__ import annotations

import math
import operator
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Literal

import numpy as np

from tasks.canary_text import TextCheck
from tasks.promote_spec import AnalysisSpec, ComparisonSpec, MetricSpec, parse_condition
from tasks.traffic import RequestRecord

Outcome = Literal["Successful", "Failed", "Inconclusive"]
_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
        "!=": operator.ne}


@dataclass(frozen=True)
class Measurement:
    metric: str
    value: float | None  # None: no data (inconclusive)
    outcome: Outcome
    detail: str = ""


@dataclass(frozen=True)
class MetricResult:
    name: str
    outcome: Outcome
    measurements: list[Measurement]
    reason: str = ""


@dataclass(frozen=True)
class Comparison:
    metric: str  # ttft | tpot
    outcome: Outcome
    judged: bool  # False: no verdict on the latency (not compared, too few samples, or undecided)
    n_baseline: int
    n_canary: int
    median_baseline_s: float | None
    median_canary_s: float | None
    ratio: float | None  # candidate / live, Hodges-Lehmann estimate on log latencies
    interval: tuple[float, float] | None  # one-sided bounds of the ratio, each at confidence 1 - alpha
    limit: float | None  # the largest ratio within budget (``slowdown_limit``)
    reason: str
    needed: int | None = None  # candidate samples that detect the limit with the spec's power (``samples_needed``)
    spread: float | None = None  # the observed spread that sized ``needed`` (``interval_spread``)

    def figures(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "judged": self.judged, "n": [self.n_baseline, self.n_canary],
                "median_live_ms": _ms(self.median_baseline_s), "median_candidate_ms": _ms(self.median_canary_s),
                "ratio": _round(self.ratio), "interval": None if self.interval is None else
                [_round(x) for x in self.interval], "limit": _round(self.limit), "needed_samples": self.needed,
                "spread": _round(self.spread), "reason": self.reason}


@dataclass(frozen=True)
class AnalysisResult:
    t_s: float
    requests: int
    success_rate: float
    per_version: dict[int, dict[str, float]]
    outcome: Outcome
    reason: str
    metrics: list[MetricResult] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    text: TextCheck | None = None  # the candidate's text answers against the live tokenizer's ids
    window_s: float = 0.0  # how long the window stayed open
    expected_window_s: float | None = None  # the least length the traffic rate and weight allowed, when known
    ceiling_s: float | None = None  # analysis.timeout_s

    @property
    def unjudged(self) -> list[str]:
        """Why parts of this window gave no latency verdict (not compared, too few samples, undecided)."""
        return [c.reason for c in self.comparisons if not c.judged] + (
            [self.text.reason] if self.text is not None and not self.text.judged else [])

    def figures(self) -> dict[str, Any]:
        """Numbers a person reads (MLflow tags, reports)."""
        return {
            "outcome": self.outcome, "requests": self.requests, "success_rate": round(self.success_rate, 4),
            "window": {"seconds": round(self.window_s, 2), "expected_s": _round(self.expected_window_s),
                       "ceiling_s": self.ceiling_s},
            "metrics": {m.name: [x.value for x in m.measurements] for m in self.metrics},
            "comparisons": {c.metric: c.figures() for c in self.comparisons},
            "text": None if self.text is None else self.text.figures(),
            "not_judged": self.unjudged,
        }


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def _round(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 4)


# ---------------------------------------------------------------- metric values from counters


def router_value(query: str, delta: dict[str, dict[str, Any]], version: str) -> tuple[float | None, int]:
    """Value of a router query over a counters delta (``routing.diff_counters``); (None, n) without data."""
    from serving.triton.models.routing import hist_quantile

    rows = list(delta.values()) if version == "all" else [delta.get(version) or {}]
    req = sum(int(r.get("requests", 0)) for r in rows)
    err = sum(int(r.get("errors", 0)) for r in rows)
    lat = sum(float(r.get("latency_sum_s", 0.0)) for r in rows)
    tokens = sum(int(r.get("output_tokens", 0)) for r in rows)
    hist: list[int] = []
    for r in rows:
        h = r.get("latency_hist") or []
        hist = [a + b for a, b in zip(hist, h)] if hist else list(h)
    if query == "requests":
        return float(req), req
    if query == "errors":
        return float(err), req
    if req == 0:
        return None, 0
    values = {
        "success_rate": lambda: (req - err) / req,
        "error_rate": lambda: err / req,
        "latency_mean_s": lambda: lat / req,
        "latency_p50_s": lambda: hist_quantile(hist, 0.5),
        "latency_p99_s": lambda: hist_quantile(hist, 0.99),
        "latency_per_token_s": lambda: lat / tokens if tokens else None,
    }
    return values[query](), req


def prometheus_value(query: str, before: dict[str, float], after: dict[str, float]) -> tuple[float | None, int]:
    """Value of a Prometheus query from two scrapes of ``{metric name: summed value}`` for one model version."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    ok, failed = d.get("nv_inference_request_success", 0.0), d.get("nv_inference_request_failure", 0.0)
    n = int(ok + failed)
    if query == "requests":
        return float(n), n
    if query == "failures":
        return failed, n
    if n == 0:
        return None, 0
    if query == "success_rate":
        return ok / n, n
    if query == "request_mean_s":
        return d.get("nv_inference_request_duration_us", 0.0) / 1e6 / n, n
    if query == "queue_mean_s":
        return d.get("nv_inference_queue_duration_us", 0.0) / 1e6 / n, n
    raise ValueError(f"unknown prometheus query {query!r}")


def judge(metric: MetricSpec, value: float | None, n: int) -> Measurement:
    """One measurement against the metric's success_condition."""
    if value is None or (metric.query not in ("requests",) and n < metric.min_requests):
        return Measurement(metric.name, value, "Inconclusive", f"{n} requests < min_requests {metric.min_requests}")
    op, bound = parse_condition(metric.success_condition)
    ok = _OPS[op](value, bound)
    return Measurement(metric.name, value, "Successful" if ok else "Failed",
                       f"{metric.query}={value:.6g} over {n} requests; {metric.success_condition}")


def summarize_metric(metric: MetricSpec, measurements: list[Measurement]) -> MetricResult:
    """Argo's rule: more failures than failure_limit -> Failed; more no-data than inconclusive_limit -> Inconclusive."""
    failed = [m for m in measurements if m.outcome == "Failed"]
    unknown = [m for m in measurements if m.outcome == "Inconclusive"]
    if len(failed) > metric.failure_limit:
        return MetricResult(metric.name, "Failed", measurements,
                            f"metric {metric.name}: {len(failed)} of {len(measurements)} measurements failed "
                            f"(failure_limit {metric.failure_limit}); last: {failed[-1].detail}")
    if len(unknown) > metric.inconclusive_limit:
        return MetricResult(metric.name, "Inconclusive", measurements,
                            f"metric {metric.name}: {len(unknown)} measurements without data "
                            f"(inconclusive_limit {metric.inconclusive_limit}); {unknown[-1].detail}")
    return MetricResult(metric.name, "Successful", measurements)


def take_readings(metrics: list[MetricSpec], read: Callable[[MetricSpec], Any],
                  clock: Callable[[], float] = time.monotonic) -> dict[str, tuple[Any, float]]:
    """The first reading of every metric (taken when the analysis window opens)."""
    return {m.name: (read(m), clock()) for m in metrics}


def run_metrics(metrics: list[MetricSpec], read: Callable[[MetricSpec], Any],
                value_of: Callable[[MetricSpec, Any, Any], tuple[float | None, int]],
                *, initial: dict[str, tuple[Any, float]] | None = None,
                sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic
                ) -> list[MetricResult]:
    """Measure every metric ``count`` times, each ``interval`` after its previous reading (in lock-step).

    ``read(metric)`` takes a reading (counters); ``value_of(metric, before, after)`` turns two readings into
    (value, requests). ``initial`` (from ``take_readings``) opens the first interval earlier, e.g. when the
    analysis window opened, so the first measurement covers the whole window of traffic.
    """
    if not metrics:
        return []
    initial = initial or take_readings(metrics, read, clock)
    state = {m.name: {"last": initial[m.name][0], "at": initial[m.name][1], "done": []} for m in metrics}
    while True:
        pending = [m for m in metrics if len(state[m.name]["done"]) < m.count]
        if not pending:
            break
        due = min(state[m.name]["at"] + m.interval for m in pending)
        wait = due - clock()
        if wait > 0:
            sleep(wait)
        now = clock()
        for m in pending:
            s = state[m.name]
            if now + 1e-6 >= s["at"] + m.interval:
                reading = read(m)
                s["done"].append(judge(m, *value_of(m, s["last"], reading)))
                s["last"], s["at"] = reading, now
    return [summarize_metric(m, state[m.name]["done"]) for m in metrics]


# ---------------------------------------------------------------- baseline vs canary


def latency_samples(records: list[RequestRecord], version: int | None, kind: str) -> list[float]:
    """ttft: latency of successful one-token probes; tpot: latency per output token of the others."""
    mine = [r for r in records if r.ok and r.version == version]
    if kind == "ttft":
        return [r.latency_s for r in mine if r.tokens == 1]
    return [r.latency_s / r.tokens for r in mine if r.tokens > 1]


def comparable(spec: ComparisonSpec, candidate_weight: int | None) -> bool:
    """Whether the candidate's current weight is in ``spec.weight_range`` (None: unknown -> compare)."""
    low, high = spec.weight_range
    return candidate_weight is None or low <= candidate_weight <= high


def ratio_interval(candidate: list[float], baseline: list[float], alpha: float) -> tuple[float, float, float]:
    """Candidate/baseline latency ratio: (estimate, lower, upper), each bound one-sided at confidence 1 - alpha.

    The Hodges-Lehmann shift of log latencies (the median of every pairwise difference) with its
    distribution-free interval from the Mann-Whitney statistic's normal approximation (order statistics of
    the m*n differences). Too few samples for a bound at that confidence: (estimate, 0, inf).
    """
    c = np.log(np.asarray(candidate, dtype=np.float64))
    b = np.log(np.asarray(baseline, dtype=np.float64))
    diffs = np.sort(np.subtract.outer(c, b).ravel())
    m, n = len(c), len(b)
    z = NormalDist().inv_cdf(1.0 - alpha)
    k = math.floor(m * n / 2 - z * math.sqrt(m * n * (m + n + 1) / 12.0))
    estimate = math.exp(float(np.median(diffs)))
    if k < 0:
        return estimate, 0.0, math.inf
    return estimate, math.exp(float(diffs[k])), math.exp(float(diffs[len(diffs) - 1 - k]))


def samples_needed(limit: float, spread: float, alpha: float, power: float) -> int:
    """Candidate samples for which a ratio of ``limit`` is told from 1 with one-sided confidence 1 - ``alpha`` and
    probability ``power``: log(limit) must be (z_alpha + z_power) standard errors, and the standard error of the
    log ratio is ``spread`` / sqrt(n) (``interval_spread``; the live side keeps its share of the traffic)."""
    if limit <= 1.0 or not math.isfinite(spread):
        return sys.maxsize  # no slowdown to detect, or no spread known yet: no number of samples is known to do
    z = NormalDist().inv_cdf(1 - alpha) + NormalDist().inv_cdf(power)
    return max(1, math.ceil((z * spread / math.log(limit)) ** 2))


def interval_spread(low: float, high: float, n_candidate: int, alpha: float) -> float:
    """The observed spread, read off the ratio's own interval: its log half-width is z_alpha standard errors, and
    the standard error times sqrt(candidate samples) stays about constant as the window grows (both sides grow
    in proportion). Distribution-free, as the interval is."""
    return (math.log(high) - math.log(low)) / (2 * NormalDist().inv_cdf(1 - alpha)) * math.sqrt(n_candidate)


@dataclass(frozen=True)
class SlowdownLimit:
    """The largest candidate/live ratio within budget, how many candidate samples detect it, and why."""

    ratio: float
    needed: int  # capped at compare.max_samples
    basis: str
    uncapped: int  # what the power calculation asked for

    def sizing(self, power: float, spread: float) -> str:
        """How many candidate samples detect the limit, for a reason."""
        how = f"with {power:.0%} power at the observed spread {spread:.3f} (log-ratio SE x sqrt(n))"
        if self.needed >= self.uncapped:
            return f"{self.needed} candidate samples detect it {how}"
        return (f"detecting it {how} needs {self.uncapped} candidate samples; the window plans for "
                f"compare.max_samples {self.needed}")


def slowdown_limit(spec: ComparisonSpec, kind: str, spread: float, median_live: float | None) -> SlowdownLimit:
    """Relative first: 1 + ``max_slowdown``, when ``max_samples`` candidate samples can detect it at the observed
    ``spread``. Only where they cannot does the absolute floor (``min_abs_effect_ms`` over the live median)
    decide, and the basis says so."""
    relative = 1.0 + spec.max_slowdown
    need = samples_needed(relative, spread, spec.alpha, spec.power)
    floor_ms = spec.min_abs_effect_ms.get(kind, 0.0)
    if need > spec.max_samples and floor_ms and median_live and 1.0 + floor_ms / 1e3 / median_live > relative:
        floored = 1.0 + floor_ms / 1e3 / median_live
        basis = (f"compare.min_abs_effect_ms {floor_ms:g} ms over the live median {median_live * 1e3:.2f} ms, "
                 f"because compare.max_slowdown {spec.max_slowdown:.0%} would need {need} candidate samples "
                 f"(more than compare.max_samples {spec.max_samples})")
        need_floor = samples_needed(floored, spread, spec.alpha, spec.power)
        return SlowdownLimit(floored, max(spec.min_samples, min(need_floor, spec.max_samples)), basis, need_floor)
    return SlowdownLimit(relative, max(spec.min_samples, min(need, spec.max_samples)),
                         f"compare.max_slowdown {spec.max_slowdown:.0%}", need)


def compare(records: list[RequestRecord], *, live: int | None, candidate: int, spec: ComparisonSpec,
            candidate_weight: int | None = None) -> list[Comparison]:
    """Per metric, is the candidate slower than live beyond the limit (``slowdown_limit``)? A verdict needs
    confidence 1 - alpha.

    Failed: the ratio's lower bound is above the limit (surely slower than the budget), whenever that is seen.
    Successful: its upper bound is at or below the limit once the candidate has the samples that detect the
    limit with the spec's power (``samples_needed``). Otherwise, and with fewer than ``min_samples`` on a side,
    Inconclusive and not judged: the window stays open for more samples, up to its ceiling.
    """
    out = []
    for kind in spec.metrics:
        base = latency_samples(records, live, kind)
        cand = latency_samples(records, candidate, kind)
        mb, mc, n = _median(base), _median(cand), (len(base), len(cand))
        if live is None or live == candidate:
            out.append(Comparison(kind, "Successful", False, *n, mb, mc, None, None, None,
                                  f"{kind}: not compared (no baseline version)"))
            continue
        if candidate_weight is not None and candidate_weight in (0, 100):
            out.append(Comparison(kind, "Successful", False, *n, mb, mc, None, None, None,
                                  f"{kind}: not compared at candidate weight {candidate_weight}% (one version "
                                  "carries all traffic)"))
            continue
        if not comparable(spec, candidate_weight):
            out.append(Comparison(kind, "Successful", False, *n, mb, mc, None, None, None,
                                  f"{kind}: not compared at candidate weight {candidate_weight}% (compare."
                                  f"weight_range {list(spec.weight_range)})"))
            continue
        if len(base) < spec.min_samples or len(cand) < spec.min_samples:
            out.append(Comparison(kind, "Inconclusive", False, *n, mb, mc, None, None, None,
                                  f"{kind}: not judged: {len(base)} live and {len(cand)} candidate samples; need "
                                  f"{spec.min_samples} each (compare.min_samples)"))
            continue
        ratio, low, high = ratio_interval(cand, base, spec.alpha)
        if low <= 0 or not math.isfinite(high):
            out.append(Comparison(kind, "Inconclusive", False, *n, mb, mc, ratio, None, None,
                                  f"{kind}: not judged: {len(base)} live and {len(cand)} candidate samples bound the "
                                  f"ratio at no side at confidence {1 - spec.alpha:.0%}"))
            continue
        spread = interval_spread(low, high, len(cand), spec.alpha)
        limit = slowdown_limit(spec, kind, spread, mb)
        enough = len(cand) >= limit.needed
        outcome: Outcome = "Failed" if low > limit.ratio else \
            "Successful" if high <= limit.ratio and enough else "Inconclusive"
        verdict = {"Failed": "slower than the budget", "Successful": "within the budget",
                   "Inconclusive": "not judged: the interval holds the limit" if enough else
                   f"not judged: {len(cand)} of the {limit.needed} candidate samples that detect the limit"}[outcome]
        out.append(Comparison(
            kind, outcome, outcome != "Inconclusive", *n, mb, mc, ratio, (low, high), limit.ratio,
            f"{kind}: {verdict}: candidate/live {ratio:.3f}x, bounds [{low:.3f}, {high:.3f}] at confidence "
            f"{1 - spec.alpha:.0%} each (n={len(cand)}/{len(base)}; medians {mc * 1e3:.2f} vs {mb * 1e3:.2f} ms); "
            f"limit {limit.ratio:.3f}x = {limit.basis}; {limit.sizing(spec.power, spread)}",
            needed=limit.needed, spread=spread))
    return out


def decided(comparisons: list[Comparison]) -> bool:
    """No comparison is still waiting for samples or confidence."""
    return all(c.outcome != "Inconclusive" for c in comparisons)


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def per_version(records: list[RequestRecord]) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for version in sorted({r.version for r in records if r.version is not None}):
        mine = [r for r in records if r.version == version]
        lat = sorted(r.latency_s for r in mine)
        out[version] = {
            "requests": len(mine),
            "success_rate": sum(r.ok for r in mine) / len(mine),
            "latency_p50_ms": lat[len(lat) // 2] * 1e3,
            "latency_p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3,
        }
    return out


def combine(t_s: float, records: list[RequestRecord], spec: AnalysisSpec, metrics: list[MetricResult],
            comparisons: list[Comparison], text: TextCheck | None = None) -> AnalysisResult:
    """Failed if anything failed (traffic success rate, a metric, a comparison, the text check); else
    Inconclusive if anything was; else Successful. The reason lists every failing (or inconclusive) part."""
    n = len(records)
    rate = sum(r.ok for r in records) / n if n else 0.0
    failed, unsure = [], []
    if not records:
        unsure.append("no request finished in the analysis window")
    elif rate < spec.min_success_rate:
        errors = sorted({r.error for r in records if not r.ok})[:3]
        failed.append(f"success rate {rate:.3f} < analysis.min_success_rate {spec.min_success_rate} over {n} "
                      f"requests; errors: {errors}")
    for m in metrics:
        (failed if m.outcome == "Failed" else unsure if m.outcome == "Inconclusive" else []).append(m.reason)
    parts = [*comparisons, *([text] if text is not None else [])]
    for c in parts:
        (failed if c.outcome == "Failed" else unsure if c.outcome == "Inconclusive" else []).append(c.reason)
    outcome: Outcome = "Failed" if failed else "Inconclusive" if unsure else "Successful"
    notes = [c.reason for c in parts if not c.judged and c.outcome == "Successful"]
    reason = "; ".join(failed or unsure or notes)  # a pass says what it did not compare
    return AnalysisResult(t_s, n, rate, per_version(records), outcome, reason, metrics, comparisons, text)
