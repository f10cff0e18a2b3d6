"""The candidate's output distribution against production's on the evaluation passages, one value per passage.

- teacher-forced on the same token ids (only where both engines tokenize the passage alike: a KL between two
  vocabularies means nothing): the mean KL(production || candidate) over the passage's positions and the
  share of positions whose most likely next token differs (`tasks.token_stats`, as the validation gate);
- free-running: from each passage's first tokens both engines decode greedily, as they serve; the share of
  the continuation's positions from the first divergence on (a divergence early in a short continuation counts
  every later position, as a user reading the answer sees it), unless production itself was nearly indifferent
  there: its log-probs put its token and the candidate's within the spec's tie gap, a tie any rounding may
  break either way (on a random tiny model most greedy steps are such ties).
Likelihood alone misses a candidate that is as likely on the text but answers differently.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks.token_stats import sequence_stats

TIE_CANDIDATES = 5  # production's top log-probs kept at each greedy position: a candidate token outside them is no tie


@dataclass(frozen=True)
class Continuation:
    """One greedy continuation on each side from the same text: the tokens each produced and, per position,
    production's top log-probs (to tell a tie production itself could have broken either way)."""

    production: list[int]
    candidate: list[int]
    production_top: list[dict[int, float]]

    def first_divergence(self, new_tokens: int) -> int | None:
        """The first position (< new_tokens) whose tokens differ (a side that stopped differs), or None."""
        a = self.production + [None] * new_tokens
        b = self.candidate + [None] * new_tokens
        return next((i for i in range(new_tokens) if a[i] != b[i]), None)

    def tie_gap(self, position: int) -> float:
        """How much less likely production found the candidate's token than its own at `position`, in nats
        (inf when the candidate's token is outside production's top log-probs, or a side stopped)."""
        if position >= min(len(self.production), len(self.candidate), len(self.production_top)):
            return math.inf
        top = self.production_top[position]
        theirs, ours = top.get(self.production[position]), top.get(self.candidate[position])
        return math.inf if theirs is None or ours is None else theirs - ours

    def disagreement(self, new_tokens: int, tie_gap: float = 0.0) -> float:
        """The share of `new_tokens` positions from the first divergence on, when that divergence is no tie:
        production's own log-prob of the candidate's token more than `tie_gap` nats below its choice. A
        divergence within `tie_gap` (the precision's rounding can break such a tie either way) scores 0: the
        texts part at a point production itself was undecided about, and what follows answers another text."""
        first = self.first_divergence(new_tokens)
        if first is None or self.tie_gap(first) <= tie_gap:
            return 0.0
        return (new_tokens - first) / new_tokens


@dataclass
class PassageDistances:
    """Per passage: KL and top-1 disagreement (teacher-forced); per greedy prompt, both continuations; `skipped`
    says which passages were tokenized differently (their teacher-forced figures are left out)."""

    kl: list[float] = field(default_factory=list)
    top1_disagreement: list[float] = field(default_factory=list)
    greedy: list[Continuation] = field(default_factory=list)
    tokenized_differently: int = 0

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
    """Each prompt decoded greedily by both engines (each side from its own tokenization), production with its
    top log-probs at every position."""
    ours = candidate.generate(candidate_prompts, max_new_tokens=new_tokens, logprobs=False)
    theirs = production.generate(production_prompts, max_new_tokens=new_tokens, top_logprobs=TIE_CANDIDATES)
    return [Continuation(list(p.token_ids), list(c.token_ids), list(p.top_logprobs)) for c, p in zip(ours, theirs)]
