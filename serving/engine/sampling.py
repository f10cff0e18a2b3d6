"""Sampling of the next token: pure functions of the logits, computed in float32 (the decode step's
logits are bf16 where the LM head's kernel writes them, `lm_head`).

`sample` turns logits `[B, V]` into token ids `[B]` under one `SamplingParams` (the static runner's
batches): greedy when `temperature == 0`, otherwise temperature, then top-k, then top-p (nucleus), then a
draw through the exponential-race trick (`argmax(p / E)` with `E ~ Exp(1)`), which equals a multinomial
draw, needs no host sync and compiles.

`sample_rows` is the in-flight step's: every row its own parameters, held in per-row tensors built once a
step (`StepSampling.build`), applied to the whole batch at once, in this order (vLLM's):

1. repetition penalty (over the prompt and the output), then frequency and presence penalties (over the
   output's token counts, `[R, V]` for the R rows that use them, from a scatter of their tokens);
2. `logit_bias`, a sparse add of (row, token, bias) triples;
3. `min_tokens`: the request's stop ids masked to -inf while its output is shorter;
4. a token mask (`apply_token_mask`: a grammar's allowed tokens, as a bitmask or a boolean mask);
5. greedy rows: argmax; sampled rows: temperature, top-k, top-p, then the exponential race whose
   exponentials come from a counter-based hash of (the request's seed, the sampled position, the token id)
   (`race_exponentials`): a row's draw depends on its own seed and position only, never on its neighbours
   or the step it ran in, so a request (or one of `n` choices, each with its own seed) is repeatable and one
   generator per request costs no per-row launch.

A step whose rows are all plain greedy (no penalty, bias, min_tokens or mask) is one argmax.

Reported log-probabilities are the model's raw `log_softmax(logits)` (before penalties, temperature,
top-k/top-p), like vLLM's default, so validation can compare them with HF's (`chosen_logprobs`).

Imports: stdlib and torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from serving.engine.errors import EngineLimitError

PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range of presence_penalty and frequency_penalty
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range of a logit_bias value
BITMASK_BITS = 32  # tokens a word of a packed token mask covers (xgrammar's layout: bit j of word i = token 32 i + j)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. `temperature == 0` is greedy; `top_k == 0` and `top_p == 1` are off;
    penalties at 0 (repetition at 1), no `logit_bias` and `min_tokens == 0` are off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # the request's stop ids cannot end it before this many tokens

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise EngineLimitError(f"SamplingParams.temperature={self.temperature} must be >= 0")
        if self.top_k < 0:
            raise EngineLimitError(f"SamplingParams.top_k={self.top_k} must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise EngineLimitError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise EngineLimitError(f"SamplingParams.{name}={value} must be in [{PENALTY_RANGE[0]:g}, "
                                       f"{PENALTY_RANGE[1]:g}]")
        if not 0 < self.repetition_penalty <= 2**16:
            raise EngineLimitError(f"SamplingParams.repetition_penalty={self.repetition_penalty} must be > 0 "
                                   "(1 = off)")
        for token, bias in self.logit_bias:
            if token < 0 or not LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]:
                raise EngineLimitError(f"SamplingParams.logit_bias has ({token}, {bias}): token ids are >= 0 and "
                                       f"biases in [{LOGIT_BIAS_RANGE[0]:g}, {LOGIT_BIAS_RANGE[1]:g}]")
        if self.min_tokens < 0:
            raise EngineLimitError(f"SamplingParams.min_tokens={self.min_tokens} must be >= 0")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def shapes_logits(self) -> bool:
        """Whether anything but temperature/top-k/top-p changes the logits (penalties, bias, min_tokens)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0

    def check_vocab(self, vocab_size: int) -> None:
        """Raise EngineLimitError naming a `logit_bias` token id outside [0, vocab_size)."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise EngineLimitError(f"logit_bias names token id {bad[0]}, outside the vocabulary [0, {vocab_size})")


def sample(logits: torch.Tensor, params: SamplingParams | None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: [B, V] -> next token ids [B] (int64), every row under `params` (temperature/top-k/top-p only:
    the static runner's batches; `step_sampling.sample_rows` serves the rest, and is refused here)."""
    if params is not None and params.shapes_logits:
        raise EngineLimitError("penalties, logit_bias and min_tokens are served by the paged engine's per-row "
                               f"sampling (step_sampling.sample_rows), not by the static runner: {params}")
    if params is None or params.is_greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / max(params.temperature, 1e-6)
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = top_p_filter(logits, torch.full((logits.shape[0], 1), params.top_p, device=logits.device))
    probs = logits.softmax(dim=-1)  # [B, V]
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(dim=-1)


def top_p_filter(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Drop a token when the mass strictly before it already reaches its row's top_p [B, 1] (keeps one)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
    sorted_probs = sorted_logits.softmax(dim=-1)
    drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Raw log-probs of the chosen tokens [B] and, if top_n > 0, the top_n (values, ids) [B, top_n]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if top_n <= 0:
        return chosen, None, None
    top = torch.topk(logprobs, min(top_n, logprobs.shape[-1]), dim=-1)
    return chosen, top.values, top.indices


# -- a token mask (a grammar's allowed tokens) ---------------------------------------------------------------
class TokenMaskSource(Protocol):
    """What constrains one request's tokens (a grammar matcher): the in-flight scheduler asks it for the allowed
    tokens of the next position before each sampling step and tells it the token chosen. xgrammar's
    `GrammarMatcher` has exactly these methods."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> object:
        """Write the allowed tokens of the next position into row `index` of `bitmask` (int32 [R, W] on the
        CPU, `BITMASK_BITS` tokens a word, a set bit = allowed)."""

    def accept_token(self, token_id: int) -> bool:
        """Advance past `token_id`; False when the grammar cannot take it."""

    def is_terminated(self) -> bool:
        """Whether the grammar is complete (the request then ends with finish_reason "stop")."""


def bitmask_words(vocab_size: int) -> int:
    """The int32 words a packed token mask of `vocab_size` tokens takes per row."""
    return -(-vocab_size // BITMASK_BITS)


def apply_token_mask(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Set the logits of disallowed tokens to -inf, in place, and return `logits` [B, V]. `mask` is a packed
    int32 bitmask [R, bitmask_words(V)] (xgrammar's layout) or a bool mask [R, V] (True = allowed); its rows
    are `logits`' rows `rows` [R] (all rows, in order, when None)."""
    vocab = logits.shape[-1]
    mask = mask.to(logits.device, non_blocking=True)
    if mask.dtype == torch.bool:
        allowed = mask[:, :vocab]
    else:
        shifts = torch.arange(BITMASK_BITS, device=logits.device, dtype=torch.int32)
        allowed = ((mask.to(torch.int32).unsqueeze(-1) >> shifts) & 1).bool().reshape(mask.shape[0], -1)[:, :vocab]
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        rows = rows.to(logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits
