"""The candidate's output distribution against production's on the evaluation passages, one value per passage.

- teacher-forced on the same token ids (only where both engines tokenize the passage alike: a KL between two
  vocabularies means nothing): the mean KL(production || candidate) over the passage's positions and the
  share of positions whose most likely next token differs (`tasks.token_stats`, as the validation gate);
- free-running: from each passage's first tokens both engines decode greedily, as they serve; the share of
  the continuation's positions whose token differs from production's (a divergence early in a short
  continuation counts every later position, as a user reading the answer sees it).
Likelihood alone misses a candidate that is as likely on the text but answers differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks.token_stats import sequence_stats


@dataclass
class PassageDistances:
    """Per passage: KL and top-1 disagreement (teacher-forced) and greedy disagreement; `skipped` says which
    passages were tokenized differently (their teacher-forced figures are left out)."""

    kl: list[float] = field(default_factory=list)
    top1_disagreement: list[float] = field(default_factory=list)
    greedy_disagreement: list[float] = field(default_factory=list)
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


def greedy_disagreement(production: Any, candidate: Any, production_prompts: list[list[int]],
                        candidate_prompts: list[list[int]], new_tokens: int) -> list[float]:
    """Per prompt: the share of `new_tokens` greedy positions whose token differs from production's (a side that
    stops early differs at every position it did not produce). Each side decodes its own tokenization."""
    ours = candidate.generate(candidate_prompts, max_new_tokens=new_tokens, logprobs=False)
    theirs = production.generate(production_prompts, max_new_tokens=new_tokens, logprobs=False)
    out = []
    for c, p in zip(ours, theirs):
        a, b = list(c.token_ids) + [None] * new_tokens, list(p.token_ids) + [None] * new_tokens
        out.append(sum(x != y for x, y in zip(a[:new_tokens], b[:new_tokens])) / new_tokens)
    return out
