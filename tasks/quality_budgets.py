"""How far an engine of each precision may be from the float32 reference: one table keyed by precision name.

An engine's error is judged against Hugging Face's own error at the same precision (the *peer*: HF run
in that dtype beside the float32 reference). Each limit is ``floor + peer_factor * peer's figure``, so a
bfloat16 engine is allowed what HF bfloat16 does plus a margin, and a float32 engine (peer = the reference
itself, figure 0) only the floor. A precision HF cannot run (a quantized engine) has no peer
(``peer_dtype=None``): its floors are its whole budget. A new precision is one new entry.

The figures behind each entry are in docs/gates.md (measured spread on SmolLM2-135M and tiny models).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrecisionBudget:
    """Limits of the teacher-forced comparison with the float32 reference, over all scored positions."""

    peer_dtype: str | None  # HF runs in this torch dtype as the peer; None: no peer, the floors are absolute
    max_mean_kl: float  # floor of the mean per-token KL(reference || engine), nats
    max_nll_delta: float  # floor of |mean NLL(engine) - mean NLL(reference)|, nats per token
    max_top1_disagreement: float  # floor of the share of positions whose argmax differs from the reference
    peer_factor: float  # the engine may be this many times as far from the reference as the peer is


PRECISION_BUDGETS: dict[str, PrecisionBudget] = {
    "float32": PrecisionBudget(peer_dtype=None, max_mean_kl=1e-5, max_nll_delta=1e-3,
                               max_top1_disagreement=0.005, peer_factor=0.0),
    "bfloat16": PrecisionBudget(peer_dtype="bfloat16", max_mean_kl=5e-4, max_nll_delta=5e-3,
                                max_top1_disagreement=0.01, peer_factor=2.0),
    "float16": PrecisionBudget(peer_dtype="float16", max_mean_kl=2e-4, max_nll_delta=2e-3,
                               max_top1_disagreement=0.01, peer_factor=2.0),
}


def budget_for(precision: str, *, setting: str = "engine.dtype") -> PrecisionBudget:
    """The budget of `precision`; a clear error naming the setting when there is none."""
    try:
        return PRECISION_BUDGETS[precision]
    except KeyError:
        raise ValueError(f"{setting}={precision!r} has no quality budget; known precisions: "
                         f"{sorted(PRECISION_BUDGETS)} (tasks/quality_budgets.py)") from None
