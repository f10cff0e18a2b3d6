"""The fixed evaluation: one data file in the repository, scored on the candidate and on production's engine.

``tasks/evaluation_data.json`` holds text passages and multiple-choice cloze items written for this
project. Each engine tokenizes with its own folder's tokenizer (as Triton does) and is scored by its
teacher-forced log-likelihoods:
- a passage: its NLL in nats (and nats per byte of text, tokenizer-independent, for the record);
- an item: the option whose tokens are most likely after the context (summed log-probability) is the
  engine's answer; right or wrong against the item's answer.
Beside likelihood, the candidate's output distribution is compared with production's on the same passages
(`tasks.output_distribution`): mean KL(production || candidate) and top-1 disagreement teacher-forced on the
same tokens (when both tokenize a passage alike), and greedy disagreement on short continuations.

Every part is paired (one difference per passage or item) and judged by `tasks.paired_parts` with one-sided t
bounds at ``alpha`` against a budget in the unit a user reads (tasks/gate_power.py says why and how n is
sized):
- perplexity: a passage's log perplexity ratio, (NLL_candidate - NLL_production) / production's tokens
  (exactly log(ppl_c / ppl_p) when the tokenizers match); shown as a perplexity increase in %;
- cloze: an item's production-correct minus candidate-correct (1 lost, 0 kept, -1 won); shown in points;
- KL and top-1 disagreement: a passage's mean, against 0 (production itself); greedy disagreement: one
  continuation's share from its first divergence on, ``greedy_windows`` continuations per passage (from its
  first 8, 16, 24 tokens); a divergence where either side's own log-probs put the two tokens within the tie
  gap is a tie, not a disagreement (`tasks.output_distribution.Continuation`); the tie gap is
  ``greedy_tie_gap`` nats, or production's measured rounding noise where larger (bf16's logit steps).
A part passes when its upper bound is within the budget, is refused when its lower bound is beyond it, and an
undecided part refuses (or, with ``on_inconclusive: hold``, publishes held for a person's review).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NONE

from tasks.gate_power import POWER
from tasks.gate_specs import EvaluationSpec
from tasks.output_distribution import PassageDistances, greedy_continuations, rounding_noise
from tasks.paired_parts import PartComparison, PartSpec, judge_part, log_ratio_percent, points, same

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
    nll: list[float] = field(default_factory=list)  # nats per passage (every token after the first)
    tokens: list[int] = field(default_factory=list)  # tokens predicted per passage

    @property
    def mean_nats_per_byte(self) -> float:
        return sum(self.nats_per_byte) / len(self.nats_per_byte)

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct)


LogitsFn = Callable[[list[int]], "object"]  # token ids -> [S, V] float logits (EngineRunner.prefill_logits)


def passage_ids(encode: Callable[[str], list[int]], text: str, max_len: int) -> list[int]:
    return encode(text)[:max_len]


def passage_nll(logits, ids: list[int]) -> float:
    """NLL in nats of every token of `ids` after the first, from its [S, V] teacher-forced logits."""
    import torch

    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return float(-logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).sum())


def score(logits_of: LogitsFn, encode: Callable[[str], list[int]], data: EvaluationData, *,
          max_len: int) -> EvaluationScores:
    """Score one model: teacher-forced logits of each passage and of each (context, option) pair."""
    nll, tokens = [], []
    for text in data.passages:
        ids = passage_ids(encode, text, max_len)
        nll.append(passage_nll(logits_of(ids), ids))
        tokens.append(len(ids) - 1)
    return scores_of(data, nll, tokens, score_choices(logits_of, encode, data, max_len=max_len))


def scores_of(data: EvaluationData, nll: list[float], tokens: list[int], correct: list[bool]) -> EvaluationScores:
    return EvaluationScores([n / len(t.encode()) for n, t in zip(nll, data.passages)], correct, nll, tokens)


def score_choices(logits_of: LogitsFn, encode: Callable[[str], list[int]], data: EvaluationData, *,
                  max_len: int) -> list[bool]:
    """Whether the model's most likely option of each cloze item is the item's answer."""
    import torch

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
    return correct


def _option_start(context: Sequence[int], ids: Sequence[int]) -> int:
    """Index of the first token of `ids` that is not the context's (at least 1, at most the last token)."""
    n = 0
    while n < min(len(context), len(ids)) and context[n] == ids[n]:
        n += 1
    return max(1, min(n, len(ids) - 1))


@dataclass
class EvaluationComparison:
    """The candidate against production on the fixed evaluation; `skipped` says why nothing was compared,
    `distribution_skipped` why the output distributions were not (the likelihood parts still were)."""

    production_version: str | None
    candidate: EvaluationScores | None
    production: EvaluationScores | None = None
    parts: list[PartComparison] = field(default_factory=list)
    skipped: str = ""
    distribution_skipped: str = ""
    greedy_ties: str = ""  # the tie gap the greedy part judged with, and why (`greedy_ties_line`)

    @property
    def passed(self) -> bool:
        return not any(p.failed for p in self.parts)

    @property
    def held(self) -> list[PartComparison]:
        """Undecided parts the spec holds for a person's review (the release publishes them marked so)."""
        return [p for p in self.parts if p.held]

    @property
    def failures(self) -> list[str]:
        return [p.text for p in self.parts if p.failed]

    @property
    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.candidate is not None:
            out["eval_nats_per_byte"] = self.candidate.mean_nats_per_byte
            out["eval_choice_accuracy"] = self.candidate.accuracy
        for p in self.parts:
            out |= {f"eval_{p.name}": p.figure, f"eval_{p.name}_low": p.low, f"eval_{p.name}_high": p.high}
        return out


def part_specs(spec: EvaluationSpec) -> dict[str, PartSpec]:
    """How each part is judged: its budget and assumed spread on the test's scale, and its display unit."""
    return {
        "perplexity": PartSpec("perplexity", "perplexity change", "evaluation.max_perplexity_increase",
                               math.log1p(spec.max_perplexity_increase), spec.perplexity_spread, log_ratio_percent,
                               "{:+.2%}", "passages"),
        "cloze": PartSpec("cloze", "cloze accuracy drop (points)", "evaluation.max_accuracy_drop_points",
                          spec.max_accuracy_drop_points / 100, spec.accuracy_spread, points, "{:+.1f}", "items"),
        "kl": PartSpec("kl", "mean KL from production to candidate, nats/token", "evaluation.max_mean_kl",
                       spec.max_mean_kl, spec.kl_spread, same, "{:.3g}", "passages"),
        "top1": PartSpec("top1", "top-1 disagreement with production (teacher-forced)",
                         "evaluation.max_top1_disagreement", spec.max_top1_disagreement, spec.top1_spread, same,
                         "{:.3f}", "passages"),
        "greedy": PartSpec("greedy", f"greedy disagreement with production ({spec.greedy_new_tokens} tokens, "
                           f"{spec.greedy_windows} prompts a passage)", "evaluation.max_greedy_disagreement",
                           spec.max_greedy_disagreement, spec.greedy_spread, same, "{:.3f}", "continuations"),
    }


def units_needed(spec: EvaluationSpec) -> dict[str, int]:
    """The passages or items each part's power calculation asks for."""
    from tasks.gate_power import units_for_power

    return {name: units_for_power(p.budget, p.spread, spec.alpha) for name, p in part_specs(spec).items()}


def check_enough_units(spec: EvaluationSpec, data: EvaluationData) -> None:
    """A ValueError naming the part, its setting and the number needed when the data is too small for its power."""
    have = {"passages": len(data.passages), "items": len(data.choices), "continuations": greedy_units(data, spec)}
    for name, needed in units_needed(spec).items():
        part = part_specs(spec)[name]
        if have[part.unit_word] < needed:
            raise ValueError(
                f"the fixed evaluation's {name} part needs {needed} {part.unit_word} for {POWER:.0%} power at "
                f"{part.setting} and alpha {spec.alpha} (assumed spread {part.spread}), got {have[part.unit_word]} "
                f"(evaluation.max_passages / max_choices, or {DATA_FILE.name}): score more, or widen the budget")


def compare_scores(candidate: EvaluationScores, production: EvaluationScores, spec: EvaluationSpec,
                   *, production_version: str, distances: PassageDistances | None = None,
                   distribution_skipped: str = "") -> EvaluationComparison:
    """Paired one-sided bounds of the candidate against production, part by part (see the module docstring)."""
    if len(candidate.nll) != len(production.nll) or len(candidate.correct) != len(production.correct):
        raise ValueError("candidate and production were scored on different evaluation data")
    parts = part_specs(spec)
    hold = spec.on_inconclusive == "hold"
    ppl = [(c - p) / t for c, p, t in zip(candidate.nll, production.nll, production.tokens)]
    lost = [float(p) - float(c) for c, p in zip(candidate.correct, production.correct)]
    judged = [judge_part(parts["perplexity"], ppl, alpha=spec.alpha, hold=hold, against=production_version),
              judge_part(parts["cloze"], lost, alpha=spec.alpha, hold=hold, against=production_version)]
    if distances is not None:
        if distances.kl:
            judged += [judge_part(parts[name], values, alpha=spec.alpha, hold=hold, against=production_version)
                       for name, values in (("kl", distances.kl), ("top1", distances.top1_disagreement))]
        tie = greedy_tie_gap(spec, distances)
        greedy = [c.disagreement(spec.greedy_new_tokens, tie) for c in distances.greedy]
        judged.append(judge_part(parts["greedy"], greedy, alpha=spec.alpha, hold=hold,
                                 against=production_version))
    return EvaluationComparison(production_version, candidate, production, judged,
                                distribution_skipped=distribution_skipped or (distances.skipped if distances else ""),
                                greedy_ties=greedy_ties_line(spec, distances) if distances is not None else "")


def greedy_tie_gap(spec: EvaluationSpec, distances: PassageDistances) -> float:
    """The tie gap the greedy part judges with: the spec's, or production's measured rounding noise if larger."""
    return max(spec.greedy_tie_gap, distances.rounding_noise)


def greedy_ties_line(spec: EvaluationSpec, distances: PassageDistances) -> str:
    return (f"Greedy ties: a divergence where either side chose its token by at most {greedy_tie_gap(spec, distances):.3g} "
            f"nats of its own log-probs is a tie (evaluation.greedy_tie_gap {spec.greedy_tie_gap:g}; production's "
            f"rounding noise {distances.rounding_noise:.3g} nats).")


def render_report(result: EvaluationComparison) -> str:
    """Markdown: the verdict, then one row per part with its figure, interval, budget, verdict and power."""
    verdict = "SKIPPED" if result.skipped else "PASSED" if result.passed else "FAILED"
    if verdict == "PASSED" and result.held:
        verdict = "HELD FOR REVIEW"
    lines = [f"# Fixed evaluation against production: {verdict}", ""]
    if result.skipped:
        lines += [f"Not compared: {result.skipped}.", ""]
        if result.candidate is not None:
            lines += [(f"Candidate: {result.candidate.mean_nats_per_byte:.4f} nats/byte over "
                      f"{len(result.candidate.nats_per_byte)} passages, cloze accuracy {result.candidate.accuracy:.3f} "
                      f"over {len(result.candidate.correct)} items."), ""]
        return "\n".join(lines)
    lines += [*(f"- {p.text}" for p in result.parts if p.failed or p.held), "",
              f"Production version {result.production_version}, same data, same run.", ""]
    if result.distribution_skipped:
        lines += [f"Output distributions teacher-forced: not compared ({result.distribution_skipped}).", ""]
    lines += [part_table_head(), *(part_row(p) for p in result.parts), ""]
    if result.greedy_ties:
        lines += [result.greedy_ties, ""]
    if result.candidate is not None and result.production is not None:
        lines += [(f"Recorded: candidate {result.candidate.mean_nats_per_byte:.4f} nats/byte, cloze accuracy "
                  f"{result.candidate.accuracy:.3f}; production {result.production.mean_nats_per_byte:.4f}, "
                  f"{result.production.accuracy:.3f}."), ""]
    return "\n".join(lines)


def part_table_head() -> str:
    return ("| part | figure | interval (one-sided bounds) | budget | verdict | n (needed for 90% power) | "
            "detects |\n| --- | --- | --- | --- | --- | --- | --- |")


def part_row(p: PartComparison) -> str:
    """One part as a table row: figure, interval, budget and verdict, and its power (n and what it detects)."""
    fmt = part_format(p.name)
    return (f"| {p.label} | {fmt(p.figure)} | [{fmt(p.low)}, {fmt(p.high)}] | {fmt(p.budget)} | "
            f"{'held for review' if p.held else p.verdict} | {p.units} ({p.needed}) | {fmt(p.detectable)} |")


def part_format(name: str) -> Callable[[float], str]:
    return {"perplexity": "{:+.2%}", "cloze": "{:+.1f} pt"}.get(name, "{:.3g}").format


def evaluation_verdict(result: EvaluationComparison | None) -> str:
    """'not run', 'skipped (why)', 'passed', 'held for review' or 'FAILED'."""
    if result is None:
        return "not run"
    if result.skipped:
        return f"skipped ({result.skipped})"
    if not result.passed:
        return "FAILED"
    return "held for review" if result.held else "passed"


@dataclass(frozen=True)
class Scored:
    """One engine ready to score: its runner and its folder's tokenizer (as Triton tokenizes)."""

    runner: Any
    encode: Callable[[str], list[int]]

    @property
    def max_len(self) -> int:
        return self.runner.info.limits.max_seq_len


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

    def scored(folder: Path, loaded) -> Scored:
        return Scored(loaded or load_engine(folder), server_encode(folder)[0])

    candidate = scored(engine_dir, runner)
    if not spec.enabled or production_dir is None:
        why = "evaluation.enabled is false" if not spec.enabled else skipped or "no production engine"
        c = candidate
        return EvaluationComparison(production_version, score(c.runner.prefill_logits, c.encode, data,
                                                              max_len=c.max_len), skipped=why)
    check_enough_units(spec, data)
    production = scored(production_dir, production_runner)
    c_scores, p_scores, distances = score_pair(candidate, production, data, spec)
    return compare_scores(c_scores, p_scores, spec, production_version=production_version or "?",
                          distances=distances)


def score_pair(candidate: Scored, production: Scored, data: EvaluationData, spec: EvaluationSpec
               ) -> tuple[EvaluationScores, EvaluationScores, PassageDistances]:
    """Both engines on the same passages, passage by passage (one prefill of each side per passage gives its
    likelihood and, when the token ids are the same, the distribution distances), then the items."""
    nll: dict[str, list[float]] = {"c": [], "p": []}
    tokens: dict[str, list[int]] = {"c": [], "p": []}
    distances = PassageDistances()
    for text in data.passages:
        ids_c = passage_ids(candidate.encode, text, candidate.max_len)
        ids_p = passage_ids(production.encode, text, production.max_len)
        logits_c, logits_p = candidate.runner.prefill_logits(ids_c), production.runner.prefill_logits(ids_p)
        for side, ids, logits in (("c", ids_c, logits_c), ("p", ids_p, logits_p)):
            nll[side].append(passage_nll(logits, ids))
            tokens[side].append(len(ids) - 1)
        distances.add_teacher_forced(logits_p, logits_c, ids_p, ids_c)
    prompts = greedy_prompts(production.encode, data, spec)
    distances.greedy = greedy_continuations(production.runner, candidate.runner, prompts,
                                            greedy_prompts(candidate.encode, data, spec), spec.greedy_new_tokens)
    longest = slice(spec.greedy_windows - 1, None, spec.greedy_windows)  # one prefill a passage measures enough
    distances.rounding_noise = rounding_noise(production.runner, prompts[longest], distances.greedy[longest])
    return (scores_of(data, nll["c"], tokens["c"], score_choices(candidate.runner.prefill_logits, candidate.encode,
                                                                 data, max_len=candidate.max_len)),
            scores_of(data, nll["p"], tokens["p"], score_choices(production.runner.prefill_logits, production.encode,
                                                                 data, max_len=production.max_len)),
            distances)


def greedy_prompts(encode: Callable[[str], list[int]], data: EvaluationData, spec: EvaluationSpec) -> list[list[int]]:
    """Each passage's first k x greedy_prompt_tokens tokens, k = 1..greedy_windows (a passage shorter than a window
    gives all its tokens: every passage gives the same number of prompts on both sides)."""
    step = spec.greedy_prompt_tokens
    return [ids[:step * k] for ids in map(encode, data.passages) for k in range(1, spec.greedy_windows + 1)]


def greedy_units(data: EvaluationData, spec: EvaluationSpec) -> int:
    return len(data.passages) * spec.greedy_windows


@task(name="evaluate", retries=0, cache_policy=NONE)  # NONE: a runner would be hashed by pickling its model
def evaluation_task(engine_dir: Path, spec: EvaluationSpec, production_dir: Path | None = None,
                    production_version: str | None = None, skipped: str = "", runner=None,
                    production_runner=None) -> EvaluationComparison:
    """The fixed evaluation on the candidate and the production version's engine, compared passage by passage
    and item by item."""
    return evaluate_engines(engine_dir, spec, production_dir=production_dir, production_version=production_version,
                            skipped=skipped, runner=runner, production_runner=production_runner)
