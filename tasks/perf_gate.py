"""Gate 2: the candidate against the production engine, timed interleaved in one run, plus absolute SLOs.

Each round times the fixed workload (``serving.engine.timing.time_generate``, the timer of ``bench offline``)
twice on each engine in the order ABBA (BAAB the next round), so a drift within the round hits both alike; the
round's ratio is candidate/production of the two iterations' geometric means. The verdict is a sign test on
those ratios against the budget ``1 - max_slowdown`` (H0: the median round ratio is the budget), which a load
burst can move by one round at most, however large it is:
- *slower*: so many rounds below the budget that p < alpha at a look: refused;
- *within*: so many above it that p < alpha: passed, the rounds stop;
- neither by the last look: *slower* when the median's interval at ``confidence`` lies wholly below the budget
  (whatever the looks said: it is a sign test at (1 - confidence) / 2 on all the rounds), else *undecided*:
  refused with the interval in the message, or with ``on_inconclusive: hold`` published held for a person's
  review (the version page shows the interval).
The rounds come from a power calculation (`tasks.gate_power.sign_test_rounds`): with rounds whose log ratio
has the spec's ``round_spread``, an engine as fast as production is shown *within* at the last look with
90% power; one at the budget or slower is passed with probability <= alpha. The result records the rounds
needed, and a spec whose ``max_iterations`` can never decide is refused with the number needed.
Looks are planned, not taken every round: at ``n0``, 2 ``n0``, 4 ``n0``... and ``max_iterations``, ``n0`` the
fewest rounds (at least ``iterations``) at which a look can decide, and alpha = ``1 - confidence`` is split
evenly over them (Bonferroni), so the chance of refusing an engine whose median round ratio is within budget
is at most alpha over the whole run, whatever the stopping. The estimate is the median round ratio, with the
order-statistic interval of the median at ``confidence``.
The workload is ``batch_size`` random prompts of ``input_len`` tokens, the last at the longest prompt both engines
take (``long_row``: ``tasks.envelope.workload_lengths``), so the timed run reaches the long end of the envelope the
engine is built for; and what was timed must be right: the candidate's generations of the last timed iteration
(a sample of rows and the longest) are scored against HF float32 by validation's decode budget
(``tasks.decode_check.check_timed_outputs``), when the release hands in its checkpoint and that budget.
An iteration that raises counts as an error; ``slo.max_error_rate`` bounds the candidate's share.
Without a production engine the candidate alone is timed and only the absolute SLOs apply; an SLO
missed is measured once more (``slo_retries``) before it fails, since one noisy sample on a loaded
machine failed a good engine (3.9 tok/s, then 30 on the rerun). Figures in the release report come from
this same run.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import NONE

from tasks.errors import GateFailed
from tasks.gate_power import sign_test_critical, sign_test_rounds, slowest_within
from tasks.gate_specs import PerfSlo, PerfSpec

if TYPE_CHECKING:
    from tasks.decode_check import DecodeLimits


@dataclass
class EngineFigures:
    """One engine's figures over the rounds of one run."""

    output_tokens_per_s: float  # median of the rounds
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    iterations: int
    errors: int
    round_tokens_per_s: list[float] = field(default_factory=list)
    ttft_samples_ms: list[float] = field(default_factory=list)
    tpot_samples_ms: list[float] = field(default_factory=list)
    first_error: str = ""

    @property
    def error_rate(self) -> float:
        return self.errors / self.iterations if self.iterations else 0.0


@dataclass
class PerfResult:
    passed: bool
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    workload: dict
    failures: list[str]
    ttft_samples_ms: list[float] = field(default_factory=list)
    tpot_samples_ms: list[float] = field(default_factory=list)
    errors: int = 0
    iterations: int = 0
    production_version: str | None = None
    production: EngineFigures | None = None
    throughput_ratio: float | None = None  # candidate / production, median of the rounds' ratios
    ratio_interval: tuple[float, float] | None = None
    stopped: str = ""  # why the rounds ended
    inconclusive: bool = False  # neither slower nor within the budget with confidence when the rounds ran out
    held: bool = False  # inconclusive, and the spec holds such a release for a person's review
    rounds: int = 0  # ABBA rounds timed
    rounds_needed: int | None = None  # the power calculation's rounds (an equal engine shown within, 90%)
    slowest_detected_within: float | None = None  # the slowest ratio max_iterations show within with 90% power
    skipped: str = ""  # why production was not timed
    outputs_checked: bool = False  # the timed generations were scored against HF float32

    @property
    def metrics(self) -> dict[str, float]:
        out = {
            "perf_output_tokens_per_s": self.output_tokens_per_s,
            "perf_ttft_p50_ms": self.ttft_p50_ms,
            "perf_ttft_p99_ms": self.ttft_p99_ms,
            "perf_tpot_p50_ms": self.tpot_p50_ms,
            "perf_tpot_p99_ms": self.tpot_p99_ms,
            "perf_error_rate": self.errors / self.iterations if self.iterations else 0.0,
        }
        if self.throughput_ratio is not None:
            out["perf_throughput_ratio_vs_production"] = self.throughput_ratio
        return out

    def production_metrics(self) -> dict[str, float]:
        """Production's figures from this same run, under the candidate's metric names (for the report)."""
        p = self.production
        if p is None:
            return {}
        return {"perf_output_tokens_per_s": p.output_tokens_per_s, "perf_ttft_p50_ms": p.ttft_p50_ms,
                "perf_ttft_p99_ms": p.ttft_p99_ms, "perf_tpot_p50_ms": p.tpot_p50_ms, "perf_tpot_p99_ms": p.tpot_p99_ms}

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "metrics": self.metrics}, indent=2)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


class _Timer:
    """Times single iterations of the workload on one runner and keeps the samples (and the last generations)."""

    def __init__(self, runner: Any, spec: PerfSpec, prompts: list[list[int]]) -> None:
        self.runner, self.spec, self.prompts = runner, spec, prompts
        self.outputs: list = []
        self.round_tok_s: list[float] = []
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.iterations = self.errors = 0
        self.first_error = ""

    def warm_up(self) -> None:
        for _ in range(self.spec.warmup):
            self.once(record=False)

    def once(self, *, record: bool = True) -> float | None:
        from serving.engine.timing import time_generate

        s = self.spec
        try:
            cell = time_generate(self.runner, batch=len(self.prompts), prompt_len=s.input_len, gen_len=s.output_len,
                                 repeats=1, warmup=0, impl="perf-gate", prompts=self.prompts, outputs=self.outputs)
        except Exception as exc:  # noqa: BLE001 - an engine that errors is measured as erroring
            if record:
                self.iterations += 1
                self.errors += 1
                self.first_error = self.first_error or f"{type(exc).__name__}: {exc}"
            return None
        if record:
            self.iterations += 1
            self.round_tok_s.append(cell.e2e_tok_s)
            self.ttft += cell.ttft_samples_ms
            self.tpot += cell.tpot_samples_ms
        return cell.e2e_tok_s

    def figures(self) -> EngineFigures:
        def pct(xs: list[float], q: float) -> float:
            return percentile(xs, q) if xs else float("nan")

        return EngineFigures(
            output_tokens_per_s=statistics.median(self.round_tok_s) if self.round_tok_s else 0.0,
            ttft_p50_ms=pct(self.ttft, 50), ttft_p99_ms=pct(self.ttft, 99),
            tpot_p50_ms=pct(self.tpot, 50), tpot_p99_ms=pct(self.tpot, 99),
            iterations=self.iterations, errors=self.errors, round_tokens_per_s=list(self.round_tok_s),
            ttft_samples_ms=list(self.ttft), tpot_samples_ms=list(self.tpot), first_error=self.first_error)


def sign_test_p(hits: int, misses: int) -> float:
    """One-sided exact sign test: P(at least `hits` of `hits + misses` fair coin flips come up 'hit')."""
    n = hits + misses
    return 1.0 if n == 0 else sum(math.comb(n, k) for k in range(hits, n + 1)) / 2 ** n


def planned_looks(spec: PerfSpec) -> tuple[list[int], float]:
    """The rounds after which the verdict is looked at, and the alpha each look spends (Bonferroni split of
    1 - confidence): n0, 2 n0, 4 n0, ... and max_iterations, n0 >= iterations the fewest rounds whose
    unanimous sign test reaches the per-look alpha."""
    alpha = 1.0 - spec.confidence
    looks: list[int] = [spec.max_iterations]
    for _ in range(8):  # the number of looks and n0 settle in a few passes
        per_look = alpha / len(looks)
        n0 = max(spec.iterations, math.ceil(math.log2(1.0 / per_look)))
        new = [n for n in (n0 * 2 ** k for k in range(32)) if n < spec.max_iterations] + [spec.max_iterations]
        if new == looks:
            break
        looks = new
    return looks, alpha / len(looks)


def check_rounds_can_decide(spec: PerfSpec, looks: list[int], alpha: float) -> None:
    """A ValueError naming perf.max_iterations when no look can decide at its alpha (every run would end
    undecided, which refuses)."""
    if sign_test_critical(looks[-1], alpha) is None:
        needed = sign_test_rounds(1.0 - spec.max_slowdown, spec.round_spread, alpha)
        raise ValueError(f"perf.max_iterations {spec.max_iterations} can never decide: a sign test over "
                         f"{looks[-1]} rounds cannot reach alpha {alpha:.3g} per look; the power calculation asks "
                         f"for {needed} rounds (perf.round_spread {spec.round_spread})")


def settle(verdict: str, interval_high: float, budget: float) -> str:
    """The verdict when the rounds end: an undecided run whose median interval lies wholly below the budget is
    'slower' (whatever the looks said), else the verdict as it stood."""
    return "slower" if verdict == "undecided" and interval_high < budget else verdict


def ab_verdict(log_ratios: list[float], budget: float, alpha: float) -> str:
    """'slower' (rounds below the budget significantly more often than not), 'within' (above it), or
    'undecided': one-sided sign tests at `alpha` on the per-round log ratios against log(budget)."""
    line = math.log(budget)
    below = sum(r < line for r in log_ratios)
    above = sum(r > line for r in log_ratios)
    if sign_test_p(below, above) < alpha:
        return "slower"
    if sign_test_p(above, below) < alpha:
        return "within"
    return "undecided"


def median_interval(log_ratios: list[float], confidence: float) -> tuple[float, float, float]:
    """(median ratio, low, high): the order-statistic interval of the median at `confidence` (distribution-free;
    (0, inf) when there are too few rounds for that confidence)."""
    ordered = sorted(log_ratios)
    n = len(ordered)
    median = math.exp(statistics.median(ordered))
    k = 0  # the interval is [x_(k), x_(n-1-k)] (0-based) while P(Bin(n, 1/2) <= k) <= (1 - confidence) / 2
    while k < n // 2 and sum(math.comb(n, j) for j in range(k + 1)) / 2 ** n <= (1 - confidence) / 2:
        k += 1
    if k == 0:
        return median, 0.0, math.inf
    return median, math.exp(ordered[k - 1]), math.exp(ordered[n - k])


def workload_prompts(spec: PerfSpec, runners: list[Any]) -> list[list[int]]:
    """The timed prompts (seeded random ids): `batch_size` rows of `input_len`, the last at the longest prompt
    every runner takes with `output_len` tokens after it (`long_row`)."""
    from serving.engine.timing import random_prompts_of
    from tasks.envelope import workload_lengths

    limits = [r.info.limits for r in runners]
    vocab = min(r.info.model.vocab_size for r in runners)
    if not spec.long_row:
        return random_prompts_of([spec.input_len] * spec.batch_size, vocab, spec.seed)
    lengths = workload_lengths(batch_size=spec.batch_size, input_len=spec.input_len,
                               max_input_len=min(lim.max_input_len for lim in limits),
                               max_seq_len=min(lim.max_seq_len for lim in limits), output_len=spec.output_len)
    return random_prompts_of(lengths, vocab, spec.seed)


TimedCheck = Callable[[list[list[int]], list[Any]], list[str]]  # (prompts, generations) -> failures


def compare_runners(candidate: Any, production: Any | None, spec: PerfSpec, *,
                    production_version: str | None = None, skipped: str = "",
                    check_timed: TimedCheck | None = None) -> PerfResult:
    """Time the candidate (and production, interleaved) and judge: budget against production, SLOs, errors, and
    (`check_timed`) the candidate's last timed generations."""
    prompts = workload_prompts(spec, [candidate] + ([production] if production is not None else []))
    cand = _Timer(candidate, spec, prompts)
    prod = _Timer(production, spec, prompts) if production is not None else None
    for timer in (cand, prod):
        if timer:
            timer.warm_up()
    budget = 1.0 - spec.max_slowdown
    looks, alpha = planned_looks(spec)
    if prod is not None:
        check_rounds_can_decide(spec, looks, alpha)
    log_ratios: list[float] = []
    verdict = "undecided"
    stopped = f"{spec.iterations} iterations (no production engine to compare with)"
    if prod is None:
        for _ in range(spec.iterations):
            cand.once()
    for i in range(spec.max_iterations if prod else 0):
        order = (cand, prod, prod, cand) if i % 2 == 0 else (prod, cand, cand, prod)  # ABBA, BAAB, ...
        got: dict[int, list[float | None]] = {id(cand): [], id(prod): []}
        for timer in order:
            got[id(timer)].append(timer.once())
        c, p = got[id(cand)], got[id(prod)]
        if all(c) and all(p):
            log_ratios.append((math.log(c[0]) + math.log(c[1]) - math.log(p[0]) - math.log(p[1])) / 2)
        if cand.errors == cand.iterations or prod.errors == prod.iterations:
            stopped = f"{i + 1} rounds: an engine failed every iteration"
            break
        if i + 1 in looks:
            verdict = ab_verdict(log_ratios, budget, alpha)
            if verdict != "undecided":
                stopped = (f"{i + 1} rounds: {verdict} ({_count(log_ratios, budget)}; sign test at alpha "
                           f"{alpha:.3g} per look, looks at rounds {looks})")
                break
        stopped = (f"{i + 1} rounds (perf.max_iterations), undecided: {_count(log_ratios, budget)}; sign test at "
                   f"alpha {alpha:.3g} per look, looks at rounds {looks}")
    result = _result(cand.figures(), spec)
    result.workload["prompt_lens"] = [len(p) for p in prompts]
    result.stopped = stopped
    result.skipped = skipped
    if prod is not None:
        result.production_version = production_version
        result.production = prod.figures()
        if log_ratios:
            ratio, low, high = median_interval(log_ratios, spec.confidence)
            result.throughput_ratio, result.ratio_interval = ratio, (low, min(high, 1e9))
            if settle(verdict, high, budget) != verdict:
                verdict = "slower"
                result.stopped += f"; the {spec.confidence:.0%} interval of the median lies wholly below the budget"
            result.inconclusive = verdict == "undecided"
            result.held = result.inconclusive and spec.on_inconclusive == "hold"
            result.rounds = len(log_ratios)
            result.rounds_needed = sign_test_rounds(budget, spec.round_spread, alpha)
            result.slowest_detected_within = slowest_within(spec.max_iterations, budget, spec.round_spread, alpha)
            if result.inconclusive and not result.held:
                result.failures.append(
                    f"throughput {ratio:.3f}x production version {production_version}'s in the same run, undecided "
                    f"after {len(log_ratios)} ABBA rounds: {spec.confidence:.0%} interval [{low:.3f}, "
                    f"{min(high, 1e9):.3g}] holds the budget 1 - perf.max_slowdown = {budget:.2f} "
                    f"({_count(log_ratios, budget)}; {result.rounds_needed} rounds give 90% power at "
                    f"perf.round_spread {spec.round_spread}); refused (perf.on_inconclusive: refuse)")
            if verdict == "slower":
                result.failures.append(
                    f"throughput {ratio:.3f}x production version {production_version}'s in the same run (median of "
                    f"{len(log_ratios)} ABBA rounds; {result.output_tokens_per_s:.1f} vs "
                    f"{result.production.output_tokens_per_s:.1f} tok/s; {_count(log_ratios, budget)}, sign test "
                    f"p < {alpha:.3g}; {spec.confidence:.0%} interval [{low:.3f}, {min(high, 1e9):.3g}]) < "
                    f"1 - perf.max_slowdown = {budget:.2f}")
    result.failures += check_errors(cand.figures(), spec.slo)
    if check_timed is not None and cand.outputs:
        result.failures += check_timed(prompts, cand.outputs)
        result.outputs_checked = True
    if not result.failures:
        result.failures = check_slos(result, spec.slo)
        for _ in range(spec.slo_retries if result.failures else 0):
            retry = _Timer(candidate, spec, prompts)
            for _ in range(spec.iterations):
                retry.once()
            again = _result(retry.figures(), spec)
            result.failures = [f"{f} (and again on a retry of {spec.iterations} iterations)"
                               for f in check_slos(again, spec.slo)]
            if not result.failures:
                result.stopped += "; an SLO missed on the first measurement was met on the retry"
                break
    result.passed = not result.failures
    return result


def _count(log_ratios: list[float], budget: float) -> str:
    below = sum(r < math.log(budget) for r in log_ratios)
    return f"{below} of {len(log_ratios)} rounds below the budget {budget:.2f}"


def _result(fig: EngineFigures, spec: PerfSpec) -> PerfResult:
    return PerfResult(
        passed=True, output_tokens_per_s=fig.output_tokens_per_s, ttft_p50_ms=fig.ttft_p50_ms,
        ttft_p99_ms=fig.ttft_p99_ms, tpot_p50_ms=fig.tpot_p50_ms, tpot_p99_ms=fig.tpot_p99_ms,
        workload=spec.model_dump(exclude={"slo"}), failures=[], ttft_samples_ms=fig.ttft_samples_ms,
        tpot_samples_ms=fig.tpot_samples_ms, errors=fig.errors, iterations=fig.iterations)


def check_errors(fig: EngineFigures, slo: PerfSlo) -> list[str]:
    if fig.iterations and fig.error_rate > slo.max_error_rate:
        return [(f"error rate {fig.error_rate:.2f} ({fig.errors} of {fig.iterations} iterations raised; first: "
                f"{fig.first_error}) > perf.slo.max_error_rate {slo.max_error_rate}")]
    return []


def check_slos(result: PerfResult, slo: PerfSlo) -> list[str]:
    """One line per SLO the figures miss, naming the figure and the setting."""
    checks = [
        ("output tokens/s", result.output_tokens_per_s, slo.min_output_tokens_per_s, "min_output_tokens_per_s", True),
        ("TTFT p50 ms", result.ttft_p50_ms, slo.max_ttft_p50_ms, "max_ttft_p50_ms", False),
        ("TTFT p99 ms", result.ttft_p99_ms, slo.max_ttft_p99_ms, "max_ttft_p99_ms", False),
        ("TPOT p50 ms", result.tpot_p50_ms, slo.max_tpot_p50_ms, "max_tpot_p50_ms", False),
    ]
    failures = []
    for label, value, bound, setting, is_floor in checks:
        if bound is None:
            continue
        if (value < bound) if is_floor else (value > bound):
            relation = "<" if is_floor else ">"
            failures.append(f"{label} {value:.2f} {relation} perf.slo.{setting} {bound}")
    return failures


def timed_outputs_check(checkpoint: Path, limits: DecodeLimits, spec: PerfSpec, device: Any) -> TimedCheck:
    """The check of the timed generations: validation's decode budget on a sample of the rows, each failure
    prefixed with where it was measured."""
    def check(prompts: list[list[int]], generations: list[Any]) -> list[str]:
        from tasks.decode_check import check_timed_outputs

        labels = [f"timed row {r} ({len(p)} random tokens)" for r, p in enumerate(prompts)]
        _, failures = check_timed_outputs(checkpoint, prompts, generations, limits, sample=spec.check_outputs,
                                          device=device, labels=labels)
        return [f"timed outputs (perf.check_outputs): {f}" for f in failures]
    return check


def measure_engine(engine_dir: Path, spec: PerfSpec, production_dir: Path | None = None, *,
                   production_version: str | None = None, skipped: str = "", runner=None,
                   production_runner=None, checkpoint: Path | None = None,
                   decode_limits: DecodeLimits | None = None) -> PerfResult:
    """Run `compare_runners` on the candidate and the production engine (when given), each loaded from its
    folder unless its runner is given (the release's gates share them). With `checkpoint` and validation's
    `decode_limits`, the candidate's timed generations are checked too (`perf.check_outputs` rows)."""
    from serving.engine.runner import load_engine

    candidate = runner or load_engine(engine_dir)
    production = None
    if production_dir is not None:
        production = production_runner or load_engine(production_dir)
    check = (timed_outputs_check(checkpoint, decode_limits, spec, candidate.device)
             if checkpoint is not None and decode_limits is not None and spec.check_outputs else None)
    return compare_runners(candidate, production, spec, production_version=production_version, skipped=skipped,
                           check_timed=check)


def render_report(result: PerfResult) -> str:
    """Markdown: verdict, candidate and production side by side from this run, the ratio and why rounds ended."""
    p = result.production
    head = f"production v{result.production_version} (same run)" if p else "production"

    def both(label: str, cand: str, prod: str) -> str:
        return f"| {label} | {cand} | {prod if p else '-'} |\n"

    return (
        f"# Performance gate: {'FAILED' if not result.passed else 'HELD FOR REVIEW' if result.held else 'PASSED'}\n\n"
        + "".join(f"- {f}\n" for f in result.failures)
        + (f"\nProduction not timed: {result.skipped}.\n" if result.skipped else "")
        + f"\n| figure | candidate | {head} |\n| --- | --- | --- |\n"
        + both("output tokens/s (median of rounds)", f"{result.output_tokens_per_s:.1f}",
               f"{p.output_tokens_per_s:.1f}" if p else "")
        + both("TTFT p50 / p99 ms", f"{result.ttft_p50_ms:.2f} / {result.ttft_p99_ms:.2f}",
               f"{p.ttft_p50_ms:.2f} / {p.ttft_p99_ms:.2f}" if p else "")
        + both("TPOT p50 / p99 ms", f"{result.tpot_p50_ms:.2f} / {result.tpot_p99_ms:.2f}",
               f"{p.tpot_p50_ms:.2f} / {p.tpot_p99_ms:.2f}" if p else "")
        + both("iterations (errors)", f"{result.iterations} ({result.errors})",
               f"{p.iterations} ({p.errors})" if p else "")
        + (f"\nThroughput ratio candidate/production: {result.throughput_ratio:.3f} "
           f"(interval {result.ratio_interval[0]:.3f}-{result.ratio_interval[1]:.3f})"
           f"{'; inconclusive: neither slower nor within the budget with confidence' if result.inconclusive else ''}"
           f"{' (held for review: perf.on_inconclusive is hold)' if result.held else ''}.\n"
           if result.throughput_ratio is not None and result.ratio_interval else "")
        + (f"\nPower: {result.rounds_needed} rounds show an engine as fast as production within the budget with 90% "
           f"power at perf.round_spread {result.workload.get('round_spread')}; perf.max_iterations "
           f"{result.workload.get('max_iterations')} show one at {result.slowest_detected_within:.3f}x or faster.\n"
           if result.rounds_needed is not None and result.slowest_detected_within is not None else "")
        + f"\nRounds: {result.stopped}.\n\nWorkload: `{json.dumps(result.workload)}`\n"
        + ("\nTimed outputs: the candidate's generations of the last timed iteration scored against HF float32 by "
           "validation's decode budget (perf.check_outputs rows and the longest).\n" if result.outputs_checked else "")
    )


def require_passed(result: PerfResult) -> None:
    """Raise GateFailed with the report when an SLO or the budget is missed."""
    if not result.passed:
        raise GateFailed("performance", "; ".join(result.failures), render_report(result))


@task(name="perf-gate", retries=0, cache_policy=NONE)  # NONE: a runner would be hashed by pickling its model
def perf_gate_task(engine_dir: Path, spec: PerfSpec, production_dir: Path | None = None,
                   production_version: str | None = None, skipped: str = "", runner=None,
                   production_runner=None, checkpoint: Path | None = None,
                   decode_limits: DecodeLimits | None = None) -> PerfResult:
    """Time the candidate against the production engine on the fixed workload, check the SLOs and what it timed."""
    return measure_engine(engine_dir, spec, production_dir, production_version=production_version, skipped=skipped,
                          runner=runner, production_runner=production_runner, checkpoint=checkpoint,
                          decode_limits=decode_limits)
