"""The fixed evaluation's greedy part, one continuation at a time: a divergence counts from its position to the
end, unless production itself was nearly indifferent between its token and the candidate's there (within
`evaluation.greedy_tie_gap` nats of its own log-probs: a tie that any rounding may break either way)."""

from __future__ import annotations

import math

import pytest

from tasks.gate_specs import EvaluationSpec
from tasks.output_distribution import Continuation


def continuation(candidate: list[int], gap_at_divergence: float | None) -> Continuation:
    """Production greedy-decodes 1..8; at each position it had its token at log-prob -0.5 and, when given, the
    candidate's token `gap_at_divergence` nats below it."""
    production = list(range(1, 9))
    top = []
    for i, token in enumerate(production):
        probs = {token: -0.5}
        if gap_at_divergence is not None and i < len(candidate) and candidate[i] != token:
            probs[candidate[i]] = -0.5 - gap_at_divergence
        top.append(probs)
    return Continuation(production, candidate, top)


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


def test_a_token_outside_production_s_top_log_probs_or_a_side_that_stopped_is_never_a_tie():
    outside = continuation([1, 77, 3, 4, 5, 6, 7, 8], None)
    assert outside.tie_gap(1) == math.inf and outside.disagreement(8, 10.0) == 7 / 8
    stopped = continuation([1, 2, 3, 4], None)
    assert stopped.first_divergence(8) == 4 and stopped.disagreement(8, 10.0) == 4 / 8


def test_the_spec_s_tie_gap_is_a_probability_ratio_a_user_can_read():
    assert EvaluationSpec().greedy_tie_gap == pytest.approx(0.1)  # two tokens within ~10% of each other
    with pytest.raises(ValueError, match="greedy_tie_gap"):
        EvaluationSpec(greedy_tie_gap=-0.1)
