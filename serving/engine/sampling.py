"""Sampling of the next token: a pure function of the logits, computed in float32 (the decode step's
logits are bf16 where the LM head's kernel writes them, `lm_head`).

`sample` turns logits `[B, V]` into token ids `[B]`: greedy when `temperature == 0`, otherwise
temperature, then top-k, then top-p (nucleus), then a draw through the exponential-race trick
(`argmax(p / E)` with `E ~ Exp(1)`), which equals a multinomial draw, needs no host sync and
compiles. Reported log-probabilities are the model's raw `log_softmax(logits)` (before
temperature/top-k/top-p), like vLLM's default, so validation can compare them with HF's.

Imports: stdlib and torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.engine.errors import EngineLimitError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. `temperature == 0` is greedy; `top_k == 0` and `top_p == 1` are off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise EngineLimitError(f"SamplingParams.temperature={self.temperature} must be >= 0")
        if self.top_k < 0:
            raise EngineLimitError(f"SamplingParams.top_k={self.top_k} must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise EngineLimitError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def sample(logits: torch.Tensor, params: SamplingParams | None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: [B, V] -> next token ids [B] (int64)."""
    if params is None or params.is_greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / max(params.temperature, 1e-6)
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps at least one)
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)  # [B, V]
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(dim=-1)


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Raw log-probs of the chosen tokens [B] and, if top_n > 0, the top_n (values, ids) [B, top_n]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if top_n <= 0:
        return chosen, None, None
    top = torch.topk(logprobs, min(top_n, logprobs.shape[-1]), dim=-1)
    return chosen, top.values, top.indices
