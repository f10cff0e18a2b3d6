"""How far an engine of each precision may be from the float32 reference: one table keyed by precision name.

An engine's error is judged against Hugging Face's own error at the same precision (the *peer*: HF run
in that dtype beside the float32 reference). Each limit is ``floor + peer_factor * peer's figure``, so a
bfloat16 engine is allowed what HF bfloat16 does plus a margin, and a float32 engine (peer = the reference
itself, figure 0) only the floor. A new precision is one new entry.

A quantized engine's precision is its dtype and its scheme, ``<dtype>+<method>[+lm_head]`` (``bfloat16+fp8``):
its peer is HF at that dtype with the same weights quantized and dequantized (per output channel, by the
engine's own `quantize_weight`), so the quantization's own cost is in the peer's figure and only what the
engine adds beyond it counts against the floors. Measured on SmolLM2-135M, fp8's own cost (KL 0.05-0.1
nats) is the size of a swapped head: no fixed floor tells the two apart, a quantized peer does.

A paged engine with an fp8 KV cache (``engine.kv_cache.kv_cache_dtype: fp8``) adds ``+fp8-kv`` to its precision
(``bfloat16+fp8-kv``, ``bfloat16+fp8+fp8-kv``), the same way: its budget is the quantized one (the dtype's
floors, bf16-like for float32; the quantized peer factor and allowance of diverged prompts), and its peer's
attention reads K/V rounded to e4m3 as the cache stores them (``peer_kv_cache``), so the rounding's cost is
the peer's too. The peer rounds every position, the engine only those it reads back from the cache (a
prompt's first chunk attends over its own unrounded K/V): the peer is at least as far from the reference.

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
    extra_diverged_prompts: int = 0  # prompts the engine may diverge on beyond those the peer diverges on
    peer_quantization: str | None = None  # the peer's weights go through this scheme (a quantized engine's)
    peer_lm_head: bool = False  # ... the LM head's too
    peer_kv_cache: str | None = None  # the peer's attention reads K/V stored so ("fp8": an fp8 KV cache's engine)


PRECISION_BUDGETS: dict[str, PrecisionBudget] = {
    "float32": PrecisionBudget(peer_dtype=None, max_mean_kl=1e-5, max_nll_delta=1e-3,
                               max_top1_disagreement=0.005, peer_factor=0.0),
    # one greedy prompt more than the peer: a good bf16 build diverged beyond the top-N on one of six prompts in 4
    # of 80 builds of the sweep (bench/gate_sweep.py), each time where HF bf16 did too; KL refuses the faults
    "bfloat16": PrecisionBudget(peer_dtype="bfloat16", max_mean_kl=5e-4, max_nll_delta=5e-3,
                                max_top1_disagreement=0.01, peer_factor=2.0, extra_diverged_prompts=1),
    "float16": PrecisionBudget(peer_dtype="float16", max_mean_kl=2e-4, max_nll_delta=2e-3,
                               max_top1_disagreement=0.01, peer_factor=2.0, extra_diverged_prompts=1),
}


QUANTIZED_PEER_FACTOR = 2.0  # as for bfloat16: the engine may add up to twice the quantized peer's own error
LM_HEAD = "lm_head"
FP8_KV = "fp8-kv"  # the precision suffix of an engine with an fp8 KV cache
FP8_KV_CACHE = "fp8"  # kv_cache.kv_cache_dtype of such an engine, and its budget's peer_kv_cache


def quantized_precision(dtype: str, method: str, *, lm_head: bool) -> str:
    """The precision name of an engine of `dtype` quantized with `method`: ``bfloat16+fp8[+lm_head]``."""
    return "+".join([dtype, method, *([LM_HEAD] if lm_head else [])])


def with_kv_cache(precision: str, kv_cache_dtype: str) -> str:
    """`precision` of an engine whose KV cache stores `kv_cache_dtype`: ``+fp8-kv`` added for "fp8"."""
    return f"{precision}+{FP8_KV}" if kv_cache_dtype == FP8_KV_CACHE else precision


def budget_for(precision: str, *, setting: str = "engine.dtype") -> PrecisionBudget:
    """The budget of `precision` (a dtype, or ``<dtype>[+<method>[+lm_head]][+fp8-kv]``); a clear error naming
    the setting when there is none."""
    dtype, *scheme = precision.split("+")
    try:
        base = PRECISION_BUDGETS[dtype]
    except KeyError:
        raise ValueError(f"{setting}={dtype!r} has no quality budget; known precisions: "
                         f"{sorted(PRECISION_BUDGETS)} (tasks/quality_budgets.py)") from None
    kv = scheme[-1:] == [FP8_KV]
    if kv:
        scheme = scheme[:-1]
    if not scheme and not kv:
        return base
    method, lm_head = (scheme[0], scheme[1:] == [LM_HEAD]) if scheme else (None, False)
    if len(scheme) > 2 or (len(scheme) == 2 and not lm_head) or FP8_KV in scheme:
        raise ValueError(f"precision {precision!r} is not <dtype>[+<method>[+{LM_HEAD}]][+{FP8_KV}]")
    floors = PRECISION_BUDGETS["bfloat16"] if dtype == "float32" else base  # fp32 + quantization: bf16-like floors
    return PrecisionBudget(peer_dtype=dtype, peer_quantization=method, peer_lm_head=lm_head,
                           peer_kv_cache=FP8_KV_CACHE if kv else None,
                           max_mean_kl=floors.max_mean_kl, max_nll_delta=floors.max_nll_delta,
                           max_top1_disagreement=floors.max_top1_disagreement, peer_factor=QUANTIZED_PEER_FACTOR,
                           extra_diverged_prompts=PRECISION_BUDGETS["bfloat16"].extra_diverged_prompts)
