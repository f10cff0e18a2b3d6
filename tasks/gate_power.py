"""How much evidence a statistical gate needs, and what the evidence it got shows: stdlib only.

Every statistical gate judges a *regression* against production on paired units (passages, cloze items,
ABBA rounds) with a *budget*, and ends in one of three verdicts:
- *within*: the one-sided (1 - alpha) upper bound of the regression is at or below the budget: passes;
- *beyond*: the one-sided (1 - alpha) lower bound is above the budget: refused;
- *undecided*: the budget lies inside the interval: refused by default (the spec's ``on_inconclusive:
  hold`` publishes it marked for a person's review instead).
So a candidate whose true regression is the budget (or worse) passes with probability <= alpha, and the
sample size is what makes a good candidate pass: n is the fewest units with which a candidate *equal to
production* is shown within budget with >= 90% power, given the spread of a unit assumed in the spec (the
same n detects a regression of the budget against "no change" with 90% power at alpha: the two statements
are one calculation). The bounds are Student t bounds on the mean of the paired differences (the units are
independent texts; their mean is close to normal at these n); the perf gate's rounds keep their sign test
(a load burst moves it by one round at most) and its own power calculation (``sign_test_rounds``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from functools import cache
from statistics import NormalDist

POWER = 0.90  # each gate's chance of passing a candidate equal to production, at its assumed spread


def _t_cdf(x: float, df: int) -> float:
    """Student t CDF for an integer `df`: the finite series of Abramowitz and Stegun 26.7.3-4 for P(|T| <= x)."""
    theta = math.atan(abs(x) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:
        term, series = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            series += term
        inside = 2 / math.pi * (theta + (s * math.cos(theta) * series if df > 1 else 0.0))
    else:
        term = series = 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            series += term
        inside = s * series
    return 0.5 + inside / 2 if x >= 0 else 0.5 - inside / 2


@cache
def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (bisection on the CDF)."""
    if not 0 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = -1e4, 1e4
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def units_for_power(budget: float, spread: float, alpha: float, power: float = POWER) -> int:
    """The fewest paired units whose one-sided t bound at `alpha` shows a true regression of 0 within
    `budget` with probability >= `power`, when a unit's difference has standard deviation `spread`:
    the smallest n with (t_{1-alpha, n-1} + t_{power, n-1}) * spread / sqrt(n) <= budget."""
    if budget <= 0 or spread < 0:
        raise ValueError(f"power needs a budget > 0 and a spread >= 0, got budget={budget}, spread={spread}")
    for n in range(2, 100_000):
        if detectable(n, spread, alpha, power) <= budget:
            return n
    raise ValueError(f"no sample size up to 100000 detects {budget} at spread {spread}")


def detectable(n: int, spread: float, alpha: float, power: float = POWER) -> float:
    """The regression that n units of `spread` tell from 0 with `power` at `alpha` (one-sided t)."""
    if n < 2:
        return math.inf
    return (t_quantile(1 - alpha, n - 1) + t_quantile(power, n - 1)) * spread / math.sqrt(n)


@dataclass(frozen=True)
class PairedBounds:
    """The mean of n paired differences with its one-sided (1 - alpha) lower and upper bounds."""

    n: int
    mean: float
    sd: float
    low: float
    high: float
    alpha: float

    def verdict(self, budget: float) -> str:
        """'within' (high <= budget), 'beyond' (low > budget) or 'undecided'."""
        if self.high <= budget:
            return "within"
        if self.low > budget:
            return "beyond"
        return "undecided"


def paired_bounds(differences: list[float], alpha: float) -> PairedBounds:
    """One-sided t bounds at `alpha` on the mean of `differences` (equal differences: a zero-width interval)."""
    n = len(differences)
    if n < 2:
        raise ValueError(f"paired bounds need at least 2 units, got {n}")
    mean = statistics.fmean(differences)
    sd = statistics.stdev(differences)
    half = t_quantile(1 - alpha, n - 1) * sd / math.sqrt(n)
    return PairedBounds(n, mean, sd, mean - half, mean + half, alpha)


def sign_test_critical(n: int, alpha: float) -> int | None:
    """The fewest 'hits' of n rounds whose one-sided exact sign test p is below `alpha` (None: none can)."""
    tail = 0.0
    for k in range(n, -1, -1):
        tail += math.comb(n, k) / 2 ** n
        if tail >= alpha:
            return k + 1 if k < n else None
    return 0


def sign_test_power(n: int, alpha: float, hit_probability: float) -> float:
    """P(a one-sided sign test over n rounds decides at `alpha`) when each round is a hit with that probability."""
    k = sign_test_critical(n, alpha)
    if k is None:
        return 0.0
    q = hit_probability
    return sum(math.comb(n, j) * q ** j * (1 - q) ** (n - j) for j in range(k, n + 1))


def round_hit_probability(ratio: float, budget: float, spread: float) -> float:
    """P(one round's throughput ratio lands above `budget`) for an engine at median `ratio`, its log ratio
    normal with standard deviation `spread`."""
    if spread <= 0:
        return 1.0 if ratio > budget else 0.0
    return NormalDist().cdf((math.log(ratio) - math.log(budget)) / spread)


def sign_test_rounds(budget: float, spread: float, alpha: float, power: float = POWER) -> int:
    """The fewest rounds whose sign test at `alpha` shows an engine as fast as production above `budget`
    with probability >= `power`, a round's log ratio having standard deviation `spread`."""
    q = round_hit_probability(1.0, budget, spread)
    for n in range(1, 10_000):
        if sign_test_power(n, alpha, q) >= power:
            return n
    raise ValueError(f"no number of rounds up to 10000 decides budget {budget} at spread {spread}")


def slowest_within(rounds: int, budget: float, spread: float, alpha: float, power: float = POWER) -> float:
    """The slowest speed ratio that `rounds` rounds still show above `budget` with `power` (bisection)."""
    lo, hi = budget, 10.0
    if sign_test_power(rounds, alpha, round_hit_probability(hi, budget, spread)) < power:
        return math.inf
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sign_test_power(rounds, alpha, round_hit_probability(mid, budget, spread)) < power \
            else (lo, mid)
    return hi
