"""One part of the fixed evaluation judged against its budget: per-unit values -> bounds -> verdict -> message.

Each part (perplexity, cloze accuracy, KL, top-1 and greedy disagreement against production) hands in one
value per unit (passage or item) on the scale its test runs on, its budget on that scale, and how to show a
value in the unit a user reads. `tasks.gate_power` gives the bounds, the verdict and the sample size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tasks.gate_power import POWER, detectable, paired_bounds, units_for_power


@dataclass(frozen=True)
class PartComparison:
    """One part's verdict with its figure, interval and budget in the user's unit, and its power."""

    name: str  # perplexity | cloze | kl | top1 | greedy
    label: str  # what the figure is, in words
    setting: str  # the spec field of the budget, e.g. "evaluation.max_perplexity_increase"
    figure: float
    low: float  # one-sided (1 - alpha) bounds, each side
    high: float
    budget: float
    alpha: float
    verdict: str  # within | beyond | undecided
    units: int  # passages or items judged
    needed: int  # the units the power calculation asks for
    detectable: float  # the regression these units detect with POWER at the measured spread (user's unit)
    spread_assumed: float  # on the test's scale
    spread_measured: float
    held: bool  # undecided, and the spec holds such a release for a person rather than refusing it
    text: str  # the figure, interval, budget and evidence in one line

    @property
    def failed(self) -> bool:
        return self.verdict == "beyond" or (self.verdict == "undecided" and not self.held)


@dataclass(frozen=True)
class PartSpec:
    """How one part is judged and shown."""

    name: str
    label: str
    setting: str
    budget: float  # on the test's scale
    spread: float  # assumed, on the test's scale
    show: Callable[[float], float]  # test scale -> the user's unit
    fmt: str  # format of a value in the user's unit, e.g. "{:+.1%}"
    unit_word: str  # "passages" or "items"


def judge_part(part: PartSpec, values: list[float], *, alpha: float, hold: bool, against: str) -> PartComparison:
    """Bounds on the mean of `values` (one per unit), the verdict against the budget, and the line saying so."""
    bounds = paired_bounds(values, alpha)
    verdict = bounds.verdict(part.budget)
    needed = units_for_power(part.budget, part.spread, alpha)
    measured = detectable(bounds.n, max(bounds.sd, part.spread), alpha)
    f = part.fmt.format
    consequence = {"within": "within the budget", "beyond": "beyond the budget: refused",
                   "undecided": "undecided, the interval holds the budget: "
                   + ("held for review (evaluation.on_inconclusive: hold)" if hold
                      else "refused (evaluation.on_inconclusive: refuse)")}[verdict]
    text = (f"fixed evaluation: {part.label} {f(part.show(bounds.mean))} against production version {against} "
            f"(interval [{f(part.show(bounds.low))}, {f(part.show(bounds.high))}], one-sided t bounds at alpha "
            f"{alpha:g} each, over {bounds.n} {part.unit_word}, spread {bounds.sd:.3g} measured / {part.spread:.3g} "
            f"assumed; {needed} {part.unit_word} give {POWER:.0%} power); {part.setting} {f(part.show(part.budget))}: "
            f"{consequence}")
    return PartComparison(
        part.name, part.label, part.setting, part.show(bounds.mean), part.show(bounds.low), part.show(bounds.high),
        part.show(part.budget), alpha, verdict, bounds.n, needed, part.show(measured), part.spread, bounds.sd,
        hold and verdict == "undecided", text)


def log_ratio_percent(x: float) -> float:
    """A mean log ratio as the relative change it stands for (0.0488 -> 0.05)."""
    return math.expm1(x) if x < 700 else math.inf


def points(x: float) -> float:
    """A mean difference of 0/1 outcomes in percentage points."""
    return 100.0 * x


def same(x: float) -> float:
    return x
