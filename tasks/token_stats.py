"""Two-sided statistics of one model's teacher-forced logits against a reference's, on the same token ids.

Per scored position (every position but the last of a sequence, predicting the next id):
- KL(reference || other) of the next-token distributions: 0 only when they are equal, whichever way
  they differ (a perplexity ratio can go *down* for a broken model);
- the log-likelihood of the true next token on both sides (their difference, signed);
- whether both sides' argmax agree;
- the largest absolute logit difference (reported, not judged: it grows with the logit scale).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceStats:
    """Sums over the scored positions of one sequence (so sequences combine by adding)."""

    positions: int
    kl_sum: float
    nll_reference_sum: float
    nll_other_sum: float
    top1_agree: int
    max_logit_error: float


@dataclass(frozen=True)
class DistanceFigures:
    """One side's distance from the reference over all scored positions."""

    positions: int
    mean_kl: float
    nll_reference: float  # mean NLL per token, nats
    nll_other: float
    top1_agreement: float
    max_logit_error: float

    @property
    def nll_delta(self) -> float:
        """Signed: positive when the other side finds the text less likely than the reference does."""
        return self.nll_other - self.nll_reference

    @property
    def top1_disagreement(self) -> float:
        return 1.0 - self.top1_agreement


def sequence_stats(reference_logits: torch.Tensor, other_logits: torch.Tensor, ids: list[int]) -> SequenceStats:
    """Statistics of [S, V] logits of both sides for the token ids `ids` (length S)."""
    if reference_logits.shape != other_logits.shape or reference_logits.shape[0] != len(ids):
        raise ValueError(f"logits {tuple(reference_logits.shape)} and {tuple(other_logits.shape)} do not match "
                         f"{len(ids)} token ids")
    ref = torch.log_softmax(reference_logits[:-1].double(), dim=-1)
    oth = torch.log_softmax(other_logits[:-1].double(), dim=-1)
    target = torch.tensor(ids[1:], dtype=torch.long).unsqueeze(1)
    kl = (ref.exp() * (ref - oth)).sum(-1).clamp_min(0.0)
    return SequenceStats(
        positions=len(ids) - 1,
        kl_sum=float(kl.sum()),
        nll_reference_sum=float(-ref.gather(1, target).sum()),
        nll_other_sum=float(-oth.gather(1, target).sum()),
        top1_agree=int((ref.argmax(-1) == oth.argmax(-1)).sum()),
        max_logit_error=float((reference_logits.float() - other_logits.float()).abs().max()),
    )


def combine(stats: Iterable[SequenceStats]) -> DistanceFigures:
    """Mean figures over every scored position of all sequences."""
    items = list(stats)
    n = sum(s.positions for s in items)
    if n == 0:
        raise ValueError("no scored positions: every sequence has a single token")
    return DistanceFigures(
        positions=n,
        mean_kl=sum(s.kl_sum for s in items) / n,
        nll_reference=sum(s.nll_reference_sum for s in items) / n,
        nll_other=sum(s.nll_other_sum for s in items) / n,
        top1_agreement=sum(s.top1_agree for s in items) / n,
        max_logit_error=max(s.max_logit_error for s in items),
    )
