"""The fixed evaluation: one data file in the repository, scored on the candidate and on production's engine.

``tasks/evaluation_data.json`` holds text passages and multiple-choice cloze items written for this
project. Each engine tokenizes with its own folder's tokenizer (as Triton does) and is scored by its
teacher-forced log-likelihoods:
- a passage: nats per byte of text (tokenizer-independent), from the NLL of every token after the first;
- an item: the option whose tokens are most likely after the context (summed log-probability) is the
  engine's answer; right or wrong against the item's answer.

Candidate and production are compared item by item (paired), one-sided:
- passages: the candidate's per-passage nats/byte minus production's; sign test over the passages
  (H0: a passage is as likely to get worse as better); a regression is the mean relative increase;
- items: exact McNemar (a sign test over the items exactly one of the two gets right).
A part fails only when the regression exceeds its budget AND p < alpha, so neither a significant but
negligible change nor a large change on a few items by chance refuses a release. Odds: with a budget of
0 the sign test alone refuses a candidate no better or worse than production with probability <= alpha
per part; the budget makes it smaller still.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from prefect import task
from prefect.cache_policies import NONE

from tasks.gate_specs import EvaluationSpec

DATA_FILE = Path(__file__).with_name("evaluation_data.json")


@dataclass(frozen=True)
class ChoiceItem:
    context: str
    options: tuple[str, ...]
    answer: int


@dataclass(frozen=True)
class EvaluationData:
    passages: tuple[str, ...]
    choices: tuple[ChoiceItem, ...]


@cache
def load_evaluation(path: Path = DATA_FILE) -> EvaluationData:
    """The committed evaluation data (passages and cloze items), checked for shape."""
    raw = json.loads(Path(path).read_text())
    items = []
    for i, item in enumerate(raw["choices"]):
        if not 0 <= item["answer"] < len(item["options"]) or len(item["options"]) < 2:
            raise ValueError(f"{path}: choices[{i}] needs >= 2 options and an answer index among them, got {item}")
        items.append(ChoiceItem(item["context"], tuple(item["options"]), int(item["answer"])))
    return EvaluationData(tuple(raw["passages"]), tuple(items))


@dataclass(frozen=True)
class EvaluationScores:
    """One engine's scores on the fixed evaluation, per passage and per item (for the paired tests)."""

    nats_per_byte: list[float]
    correct: list[bool]

    @property
    def mean_nats_per_byte(self) -> float:
        return sum(self.nats_per_byte) / len(self.nats_per_byte)

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct)


LogitsFn = Callable[[list[int]], "object"]  # token ids -> [S, V] float logits (EngineRunner.prefill_logits)


def score(logits_of: LogitsFn, encode: Callable[[str], list[int]], data: EvaluationData, *,
          max_len: int) -> EvaluationScores:
    """Score one model: teacher-forced logits of each passage and of each (context, option) pair."""
    import torch

    nats = []
    for text in data.passages:
        ids = encode(text)[:max_len]
        logp = torch.log_softmax(logits_of(ids)[:-1].double(), dim=-1)
        nll = -logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).sum()
        nats.append(float(nll) / len(text.encode()))
    correct = []
    for item in data.choices:
        context = encode(item.context)
        scores = []
        for option in item.options:
            ids = encode(item.context + option)[:max_len]
            start = _option_start(context, ids)  # the option's tokens (a merge across the seam counts)
            logp = torch.log_softmax(logits_of(ids)[:-1].double(), dim=-1)
            picked = logp[start - 1:].gather(1, torch.tensor(ids[start:]).unsqueeze(1))
            scores.append(float(picked.sum()))
        correct.append(max(range(len(scores)), key=scores.__getitem__) == item.answer)
    return EvaluationScores(nats, correct)


def _option_start(context: Sequence[int], ids: Sequence[int]) -> int:
    """Index of the first token of `ids` that is not the context's (at least 1, at most the last token)."""
    n = 0
    while n < min(len(context), len(ids)) and context[n] == ids[n]:
        n += 1
    return max(1, min(n, len(ids) - 1))


def sign_test_greater(worse: int, better: int) -> float:
    """One-sided exact sign test: P(at least `worse` of `worse + better` fair coin flips come up 'worse')."""
    n = worse + better
    if n == 0:
        return 1.0
    return sum(math.comb(n, k) for k in range(worse, n + 1)) / 2 ** n


@dataclass(frozen=True)
class PartComparison:
    name: str  # passages | choices
    candidate: float
    production: float
    regression: float  # passages: relative nats/byte increase; choices: accuracy drop
    budget: float
    alpha: float  # the part fails when regression > budget and p_value < alpha
    worse: int  # items where the candidate is worse
    better: int
    p_value: float
    failed: bool
    reason: str


@dataclass
class EvaluationComparison:
    """The candidate against production on the fixed evaluation; `skipped` says why nothing was compared."""

    production_version: str | None
    candidate: EvaluationScores | None
    production: EvaluationScores | None = None
    parts: list[PartComparison] = field(default_factory=list)
    skipped: str = ""

    @property
    def passed(self) -> bool:
        return not any(p.failed for p in self.parts)

    @property
    def failures(self) -> list[str]:
        return [p.reason for p in self.parts if p.failed]

    @property
    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.candidate is not None:
            out["eval_nats_per_byte"] = self.candidate.mean_nats_per_byte
            out["eval_choice_accuracy"] = self.candidate.accuracy
        for p in self.parts:
            out[f"eval_{p.name}_regression"] = p.regression
            out[f"eval_{p.name}_p_value"] = p.p_value
        return out


def compare_scores(candidate: EvaluationScores, production: EvaluationScores, spec: EvaluationSpec,
                   *, production_version: str) -> EvaluationComparison:
    """Paired one-sided tests of the candidate against production (see the module docstring)."""
    if len(candidate.nats_per_byte) != len(production.nats_per_byte) or len(candidate.correct) != len(production.correct):
        raise ValueError("candidate and production were scored on different evaluation data")
    pairs = list(zip(candidate.nats_per_byte, production.nats_per_byte))
    worse = sum(c > p for c, p in pairs)
    better = sum(c < p for c, p in pairs)
    rel = sum(c / p - 1.0 for c, p in pairs) / len(pairs)
    p_nll = sign_test_greater(worse, better)
    nll_failed = rel > spec.max_nll_regression and p_nll < spec.alpha
    passages = PartComparison(
        "passages", candidate.mean_nats_per_byte, production.mean_nats_per_byte, rel, spec.max_nll_regression,
        spec.alpha, worse, better, p_nll, nll_failed,
        f"fixed evaluation: the passages are {rel:+.2%} nats/byte against production version {production_version} "
        f"({candidate.mean_nats_per_byte:.4f} vs {production.mean_nats_per_byte:.4f}; worse on {worse} of "
        f"{len(pairs)} passages, sign test p={p_nll:.2g}); evaluation.max_nll_regression {spec.max_nll_regression:.0%}"
        f", alpha {spec.alpha}")
    lost = sum(p and not c for c, p in zip(candidate.correct, production.correct))
    won = sum(c and not p for c, p in zip(candidate.correct, production.correct))
    drop = production.accuracy - candidate.accuracy
    p_mc = sign_test_greater(lost, won)
    mc_failed = drop > spec.max_accuracy_drop and p_mc < spec.alpha
    choices = PartComparison(
        "choices", candidate.accuracy, production.accuracy, drop, spec.max_accuracy_drop, spec.alpha, lost, won, p_mc, mc_failed,
        f"fixed evaluation: cloze accuracy {candidate.accuracy:.3f} vs production version {production_version}'s "
        f"{production.accuracy:.3f} (lost {lost}, won {won} of {len(candidate.correct)} items, exact McNemar "
        f"p={p_mc:.2g}); evaluation.max_accuracy_drop {spec.max_accuracy_drop}, alpha {spec.alpha}")
    return EvaluationComparison(production_version, candidate, production, [passages, choices])


def render_report(result: EvaluationComparison) -> str:
    """Markdown: the verdict, then one row per part with both sides, the regression, its budget and p."""
    verdict = "SKIPPED" if result.skipped else "PASSED" if result.passed else "FAILED"
    lines = [f"# Fixed evaluation against production: {verdict}", ""]
    if result.skipped:
        lines += [f"Not compared: {result.skipped}.", ""]
        if result.candidate is not None:
            lines += [(f"Candidate: {result.candidate.mean_nats_per_byte:.4f} nats/byte over "
                      f"{len(result.candidate.nats_per_byte)} passages, cloze accuracy {result.candidate.accuracy:.3f} "
                      f"over {len(result.candidate.correct)} items."), ""]
        return "\n".join(lines)
    lines += [*(f"- {f}" for f in result.failures), "",
              f"Production version {result.production_version}, same data, same run.", "",
              "| part | candidate | production | regression | budget | worse / better | p (one-sided) |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for p in result.parts:
        lines.append(f"| {p.name} | {p.candidate:.4f} | {p.production:.4f} | {p.regression:+.4f} | {p.budget:g} "
                     f"| {p.worse} / {p.better} | {p.p_value:.2g} |")
    return "\n".join(lines) + "\n"


def evaluation_verdict(result: EvaluationComparison | None) -> str:
    """'not run', 'skipped (why)', 'passed' or 'FAILED'."""
    if result is None:
        return "not run"
    if result.skipped:
        return f"skipped ({result.skipped})"
    return "passed" if result.passed else "FAILED"


def evaluate_engines(engine_dir: Path, spec: EvaluationSpec, *, production_dir: Path | None = None,
                     production_version: str | None = None, skipped: str = "",
                     data: EvaluationData | None = None, runner=None, production_runner=None) -> EvaluationComparison:
    """Score the candidate (and production's engine, when given) on the fixed evaluation and compare them.

    `runner` / `production_runner`: the engines already loaded (the release's gates share them); each engine
    still tokenizes with its own folder's tokenizer."""
    from serving.engine.runner import load_engine
    from tasks.text_path import server_encode

    data = data or load_evaluation()
    data = EvaluationData(data.passages[:spec.max_passages], data.choices[:spec.max_choices])

    def scores_of(folder: Path, loaded) -> EvaluationScores:
        loaded = loaded or load_engine(folder)
        encode, _ = server_encode(folder)
        return score(loaded.prefill_logits, encode, data, max_len=loaded.info.limits.max_seq_len)

    candidate = scores_of(engine_dir, runner)
    if not spec.enabled:
        return EvaluationComparison(None, candidate, skipped="evaluation.enabled is false")
    if production_dir is None:
        return EvaluationComparison(production_version, candidate, skipped=skipped or "no production engine")
    return compare_scores(candidate, scores_of(production_dir, production_runner), spec,
                          production_version=production_version or "?")


@task(name="evaluate", retries=0, cache_policy=NONE)  # NONE: a runner would be hashed by pickling its model
def evaluation_task(engine_dir: Path, spec: EvaluationSpec, production_dir: Path | None = None,
                    production_version: str | None = None, skipped: str = "", runner=None,
                    production_runner=None) -> EvaluationComparison:
    """The fixed evaluation on the candidate and the production version's engine, compared item by item."""
    return evaluate_engines(engine_dir, spec, production_dir=production_dir, production_version=production_version,
                            skipped=skipped, runner=runner, production_runner=production_runner)
