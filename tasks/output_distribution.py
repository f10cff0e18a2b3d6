"""The candidate's output distribution against production's on the evaluation passages, one value per passage.

- teacher-forced on the same token ids (only where both engines tokenize the passage alike: a KL between two
  vocabularies means nothing): the mean KL(production || candidate) over the passage's positions and the
  share of positions whose most likely next token differs (`tasks.token_stats`, as the validation gate);
- free-running: from each passage's first tokens both engines decode greedily, as they serve; the share of
  the continuation's positions from the first divergence on (a divergence early in a short continuation counts
  every later position, as a user reading the answer sees it), unless either side was nearly indifferent
  there: its own log-probs put its token and the other's within the tie gap, a tie its precision's rounding
  may break either way. The tie gap is the spec's, or production's own rounding noise where that is larger
  (`rounding_noise`: how far production's log-prob gaps move between its two serving paths, decode and a
  teacher-forced prefill of the same tokens; about 0 in float32, one or two steps of the logits in bf16).
Likelihood alone misses a candidate that is as likely on the text but answers differently.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks.token_stats import sequence_stats

TIE_CANDIDATES = 5  # top log-probs kept at each greedy position: a token outside the other side's is no tie
NOISE_QUANTILE = 0.95  # production's rounding noise: this quantile of its log-prob gaps' moves between paths


@dataclass(frozen=True)
class Continuation:
    """One greedy continuation on each side from the same text: the tokens each produced and, per position,
    each side's top log-probs (to tell a tie that side's rounding could have broken either way)."""

    production: list[int]
    candidate: list[int]
    production_top: list[dict[int, float]]
    candidate_top: list[dict[int, float]] = field(default_factory=list)

    def first_divergence(self, new_tokens: int) -> int | None:
        """The first position (< new_tokens) whose tokens differ (a side that stopped differs), or None."""
        a = self.production + [None] * new_tokens
        b = self.candidate + [None] * new_tokens
        return next((i for i in range(new_tokens) if a[i] != b[i]), None)

    def tie_gap(self, position: int) -> float:
        """How much less likely production found the candidate's token than its own at `position`, in nats
        (inf when the candidate's token is outside production's top log-probs, or a side stopped)."""
        return _gap(self.production_top, self.production, self.candidate, position)

    def candidate_gap(self, position: int) -> float:
        """How much less likely the candidate found production's token than its own at `position`, in nats
        (inf when production's token is outside the candidate's top log-probs, or a side stopped)."""
        return _gap(self.candidate_top, self.candidate, self.production, position)

    def disagreement(self, new_tokens: int, tie_gap: float = 0.0) -> float:
        """The share of `new_tokens` positions from the first divergence on, when that divergence is no tie: each
        side preferred its own token by more than `tie_gap` nats of its own log-probs. Where either side was
        within `tie_gap` of indifferent (its precision's rounding can break such a tie either way) it scores 0:
        the texts part at a point that side was undecided about, and what follows answers another text."""
        first = self.first_divergence(new_tokens)
        if first is None or min(self.tie_gap(first), self.candidate_gap(first)) <= tie_gap:
            return 0.0
        return (new_tokens - first) / new_tokens


def _gap(top_of: list[dict[int, float]], own: list[int], other: list[int], position: int) -> float:
    """own's log-prob minus other's token's at `position` in `top_of` (inf when either is missing)."""
    if position >= min(len(own), len(other), len(top_of)):
        return math.inf
    top = top_of[position]
    mine, theirs = top.get(own[position]), top.get(other[position])
    return math.inf if mine is None or theirs is None else mine - theirs


@dataclass
class PassageDistances:
    """Per passage: KL and top-1 disagreement (teacher-forced); per greedy prompt, both continuations; `skipped`
    says which passages were tokenized differently (their teacher-forced figures are left out)."""

    kl: list[float] = field(default_factory=list)
    top1_disagreement: list[float] = field(default_factory=list)
    greedy: list[Continuation] = field(default_factory=list)
    tokenized_differently: int = 0
    rounding_noise: float = 0.0  # production's (`rounding_noise`), nats: the least tie gap the greedy part uses

    @property
    def skipped(self) -> str:
        if not self.tokenized_differently:
            return ""
        return (f"{self.tokenized_differently} passage(s) tokenized differently by the candidate and production: "
                "KL and top-1 are compared only on passages with the same token ids"
                + ("; none had" if not self.kl else ""))

    def add_teacher_forced(self, production_logits: Any, candidate_logits: Any, production_ids: Sequence[int],
                           candidate_ids: Sequence[int]) -> None:
        """One passage's KL and top-1 disagreement, when both sides scored the same ids over the same vocabulary."""
        if list(production_ids) != list(candidate_ids) or production_logits.shape != candidate_logits.shape:
            self.tokenized_differently += 1
            return
        stats = sequence_stats(production_logits, candidate_logits, list(production_ids))
        self.kl.append(stats.kl_sum / stats.positions)
        self.top1_disagreement.append(1.0 - stats.top1_agree / stats.positions)


def greedy_continuations(production: Any, candidate: Any, production_prompts: list[list[int]],
                         candidate_prompts: list[list[int]], new_tokens: int) -> list[Continuation]:
    """Each prompt decoded greedily by both engines (each side from its own tokenization), each with its top
    log-probs at every position."""
    ours = candidate.generate(candidate_prompts, max_new_tokens=new_tokens, top_logprobs=TIE_CANDIDATES)
    theirs = production.generate(production_prompts, max_new_tokens=new_tokens, top_logprobs=TIE_CANDIDATES)
    return [Continuation(list(p.token_ids), list(c.token_ids), list(p.top_logprobs), list(c.top_logprobs))
            for c, p in zip(ours, theirs)]


def rounding_noise(production: Any, prompts: list[list[int]], continuations: list[Continuation]) -> float:
    """Production's own rounding noise on log-prob gaps, nats: at each position of its greedy continuations, the
    gap between its token and each other of its top log-probs as decode saw it, against the same gap in one
    teacher-forced prefill of the prompt and continuation (the same weights and tokens through the other path,
    whose GEMMs and attention round differently); the NOISE_QUANTILE of how far the gaps moved. A greedy step
    decided by less than this could go either way under the precision's rounding alone. Of production, so a
    candidate cannot widen its own tie gap."""
    moves: list[float] = []
    for prompt, c in zip(prompts, continuations):
        if not c.production:
            continue
        logits = production.prefill_logits(list(prompt) + c.production)  # [S, V] float32
        log_probs = logits[len(prompt) - 1:].log_softmax(dim=-1)
        for row, own, top in zip(log_probs, c.production, c.production_top):
            mine = float(row[own])
            moves += [abs((top[own] - lp) - (mine - float(row[token]))) for token, lp in top.items() if token != own]
    if not moves:
        return 0.0
    moves.sort()
    return moves[min(len(moves) - 1, int(NOISE_QUANTILE * len(moves)))]
