"""The fixed evaluation's greedy part, one continuation at a time: a divergence counts from its position to the
end, unless either side was nearly indifferent between its token and the other's there (within the tie gap of
its own log-probs: a tie that its precision's rounding may break either way); the tie gap is
`evaluation.greedy_tie_gap` or production's measured rounding noise, the larger."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.evaluation import greedy_tie_gap
from tasks.gate_specs import EvaluationSpec
from tasks.output_distribution import Continuation, PassageDistances, rounding_noise


def continuation(candidate: list[int], gap_at_divergence: float | None,
                 candidate_gap: float | None = 1.0) -> Continuation:
    """Production greedy-decodes 1..8; at each position it had its token at log-prob -0.5 and, when given, the
    candidate's token `gap_at_divergence` nats below it; the candidate had its own token `candidate_gap` nats
    above production's (None: production's outside its top log-probs)."""
    production = list(range(1, 9))
    top, theirs = [], []
    for i, token in enumerate(production):
        probs, mine = {token: -0.5}, {}
        if i < len(candidate) and candidate[i] != token:
            if gap_at_divergence is not None:
                probs[candidate[i]] = -0.5 - gap_at_divergence
            mine = {candidate[i]: -0.5} | ({} if candidate_gap is None else {token: -0.5 - candidate_gap})
        elif i < len(candidate):
            mine = {token: -0.5}
        top.append(probs)
        theirs.append(mine)
    return Continuation(production, candidate, top, theirs)


def test_the_same_tokens_disagree_nowhere():
    c = continuation(list(range(1, 9)), None)
    assert c.first_divergence(8) is None and c.disagreement(8, 0.1) == 0.0


def test_a_clear_divergence_counts_every_position_after_it():
    c = continuation([1, 2, 99, 98, 97, 96, 95, 94], 1.5)
    assert c.first_divergence(8) == 2 and c.tie_gap(2) == pytest.approx(1.5)
    assert c.disagreement(8, 0.1) == 6 / 8
    assert c.disagreement(8, 2.0) == 0.0  # a looser tie gap calls it a tie


def test_a_tie_in_production_is_no_disagreement():
    c = continuation([1, 2, 3, 99, 98, 97, 96, 95], 0.04)
    assert c.tie_gap(3) == pytest.approx(0.04) and c.disagreement(8, 0.1) == 0.0
    assert c.disagreement(8, 0.0) == 5 / 8  # no tie gap: the old rule, every divergence counts


def test_a_tie_in_the_candidate_is_no_disagreement_either():
    """Production was sure (1.5 nats) but the candidate chose its token by 0.05: its rounding could have gone
    to production's token."""
    c = continuation([1, 2, 3, 99, 98, 97, 96, 95], 1.5, candidate_gap=0.05)
    assert c.candidate_gap(3) == pytest.approx(0.05) and c.disagreement(8, 0.1) == 0.0
    assert c.disagreement(8, 0.01) == 5 / 8
    outside = continuation([1, 2, 3, 99, 98, 97, 96, 95], 1.5, candidate_gap=None)  # production's token not in its top
    assert outside.candidate_gap(3) == math.inf and outside.disagreement(8, 0.1) == 5 / 8


def test_tokens_outside_each_other_s_top_log_probs_or_a_side_that_stopped_are_never_a_tie():
    outside = continuation([1, 77, 3, 4, 5, 6, 7, 8], None, candidate_gap=None)
    assert outside.tie_gap(1) == outside.candidate_gap(1) == math.inf and outside.disagreement(8, 10.0) == 7 / 8
    assert continuation([1, 77, 3, 4, 5, 6, 7, 8], None, candidate_gap=0.05).disagreement(8, 0.1) == 0.0
    stopped = continuation([1, 2, 3, 4], None)
    assert stopped.first_divergence(8) == 4 and stopped.disagreement(8, 10.0) == 4 / 8


class Greedy:
    """A production engine whose decode saw its log-probs rounded to `step` nats where a prefill sees exact ones."""

    def __init__(self, step: float) -> None:
        self.step = step

    def prefill_logits(self, ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(torch.linspace(0, 3, 16).repeat(len(ids), 1), dim=-1)

    def top(self) -> dict[int, float]:
        row = self.prefill_logits([0])[0]
        return {t: round(float(row[t]) / self.step) * self.step if self.step else float(row[t]) for t in (15, 14, 13)}


@pytest.mark.parametrize("step", [0.0, 0.125])
def test_production_s_rounding_noise_is_how_far_its_gaps_move_between_its_paths(step):
    """The noise is what rounding moved production's own gaps by (0 when both paths agree), and it is the tie gap
    when larger than the spec's: 0.1 in float32, a bf16 logit step where that is coarser."""
    engine = Greedy(step)
    c = Continuation([15] * 4, [15] * 4, [engine.top()] * 4, [engine.top()] * 4)
    noise = rounding_noise(engine, [[1, 2]], [c])
    exact = engine.prefill_logits([0])[0]
    moved = max(abs((engine.top()[15] - engine.top()[t]) - float(exact[15] - exact[t])) for t in (14, 13))
    assert noise == pytest.approx(moved) and (noise == 0) == (step == 0)
    assert greedy_tie_gap(EvaluationSpec(), PassageDistances(rounding_noise=noise)) == max(0.1, noise)


def test_the_spec_s_tie_gap_is_a_probability_ratio_a_user_can_read():
    assert EvaluationSpec().greedy_tie_gap == pytest.approx(0.1)  # two tokens within ~10% of each other
    with pytest.raises(ValueError, match="greedy_tie_gap"):
        EvaluationSpec(greedy_tie_gap=-0.1)
