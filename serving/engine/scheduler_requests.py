"""A request as the in-flight scheduler (`scheduler.Scheduler`) holds it, and what a step's logits give it.

- `ScheduledRequest`: a `scheduler_loop.GenRequest` with what it has computed and what it still wants (its tokens
  past `computed`), its block table (the KV-cache manager's `RequestBlocks`), its seed, how it samples and drafts.
  There are no prefill and decode phases: a step gives each live request its next chunk of uncomputed tokens.
- `sample_next`: sampling in one place. A step's sampled rows are sampled together (`step_sampling`: every row its
  own temperature, top-k/top-p, penalties, `logit_bias`, `min_tokens`, token mask and seed, in per-row tensors);
  a request's seed (a random one when it has none) and the position sampled choose its draw, so a sampled request
  is repeatable whatever it is batched with. A step of plain greedy rows only is one argmax.
- `step_logprobs`: each sampled token's log-prob and top log-probs, for the requests that ask (`on_logprobs`),
  made on the device with the tokens.
- `report_prompt_logprobs`: a request can ask for its prompt's log-probs (`on_prompt_logprobs`: each prompt
  token's raw log-prob given the tokens before it, from the logits of every position of its prompt chunks,
  computed in the chunks' own forward; such a prompt is computed whole, not taken from the prefix cache).

Imports: stdlib and torch only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from serving.engine.kv_cache_manager import RequestBlocks
from serving.engine.sampling import chosen_logprobs
from serving.engine.scheduler_loop import GenRequest
from serving.engine.speculative import Drafter, SpeculativeOptions
from serving.engine.step_sampling import RowSampling, StepLogprobs, StepSampling, fresh_seed, sample_rows


@dataclass(eq=False)
class ScheduledRequest:
    req: GenRequest
    tokens: list[int]  # prompt + every token delivered
    kv: RequestBlocks = field(default_factory=RequestBlocks)  # its block table (`kv.table`), the manager's
    computed: int = 0  # positions whose K/V are in the cache
    generated: int = 0
    seed: int = 0  # its draws' seed (`step_sampling`)
    prompt_len: int = 0
    prompt_reported: int = 1  # prompt tokens whose log-probs went out (the first has none)
    plain_greedy: bool = True  # greedy with nothing shaping its logits: sampled by the step's one argmax
    needs_host: bool = False  # its sampling reads its tokens on the host (penalties, min_tokens, a token mask)
    stop: frozenset[int] = frozenset()
    live: bool = False  # in `running` (a flag: membership tests of a list of 1,024 cost a step milliseconds)
    drafter: Drafter | None = None  # its n-gram drafting, when the engine speculates and it may (`speculative`)
    draft: list[int] = field(default_factory=list)  # the tokens this step verifies past its last one

    @classmethod
    def of(cls, req: GenRequest, speculative: SpeculativeOptions | None) -> ScheduledRequest:
        """`req` as it waits for admission; `speculative`: the engine's drafting (None: off)."""
        params = req.sampling
        seq = cls(req=req, tokens=list(req.prompt_ids), stop=frozenset(req.stop_token_ids),
                  prompt_len=len(req.prompt_ids),
                  seed=params.seed if params is not None and params.seed is not None else fresh_seed())
        seq.plain_greedy = req.token_mask is None and (params is None
                                                       or (params.is_greedy and not params.shapes_logits))
        seq.needs_host = req.token_mask is not None or (params is not None and (params.has_penalties
                                                                                or params.min_tokens > 0))
        if speculative is not None and req.token_mask is None:  # a grammar's matcher cannot take drafts back
            seq.drafter = Drafter(speculative)
        return seq

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.computed

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.req.on_prompt_logprobs is not None

    def reports_prompt(self, n: int) -> bool:
        """Whether its next chunk of `n` tokens holds positions whose logits give prompt log-probs not yet
        reported."""
        return (self.wants_prompt_logprobs and self.prompt_reported < self.prompt_len
                and self.computed + 1 < self.prompt_len and self.computed + n >= self.prompt_reported)


def sample_next(logits: torch.Tensor, lives: list[ScheduledRequest], positions: list[int],
                before: Sequence[Sequence[int]] = ()) -> torch.Tensor:
    """The next token of each row of `logits` [N, V]: `positions` are the positions the rows sample, `before` (when
    given) the draft tokens that precede each row's position past its request's tokens."""
    if all(seq.plain_greedy or not seq.live for seq in lives):
        return logits.argmax(dim=-1)
    drafts_before = before or [()] * len(lives)
    rows = [RowSampling(seq.req.sampling, seq.seed, position,
                        ([*seq.tokens, *drafted] if drafted else seq.tokens) if seq.needs_host else (),
                        seq.prompt_len, tuple(seq.stop), seq.generated + len(drafted), seq.req.token_mask)
            if seq.live else RowSampling(None, seq.seed, position)  # finished after a step ahead was launched
            for seq, position, drafted in zip(lives, positions, drafts_before)]
    return sample_rows(logits, StepSampling.build(rows, logits.shape[-1], logits.device))


def step_logprobs(logits: torch.Tensor, tokens: torch.Tensor, lives: list[ScheduledRequest]) -> StepLogprobs | None:
    """The raw log-probs of the chosen tokens (and alternatives) of the rows that want them, on the device."""
    rows = [k for k, s in enumerate(lives) if s.req.on_logprobs is not None]
    if not rows:
        return None
    top_ns = [lives[k].req.top_logprobs for k in rows]
    index = torch.tensor(rows, device=logits.device) if len(rows) < len(lives) else None
    picked = (logits, tokens) if index is None else (logits[index], tokens[index])
    chosen, top_v, top_i = chosen_logprobs(*picked, max(top_ns))
    return StepLogprobs(rows, top_ns, chosen, top_v, top_i)


def report_prompt_logprobs(echoing: list[tuple[ScheduledRequest, int]], logits: torch.Tensor,
                           log_error: Callable[[str], None]) -> None:
    """Hand each echoing chunk's prompt tokens' log-probs to its request: `logits` [every chunk's tokens, V]
    hold the logits of each of their positions, in order; position p's give the log-prob of token p + 1. A
    callback that raises is logged through `log_error`; the others still get theirs."""
    at, rows, targets, spans = 0, [], [], []
    for seq, n in echoing:
        first = max(seq.computed + 1, seq.prompt_reported)  # the first prompt token to report
        last = min(seq.computed + n, seq.prompt_len - 1)  # the last
        rows += range(at + first - 1 - seq.computed, at + last - seq.computed)
        targets += seq.tokens[first:last + 1]
        spans.append((seq, first, last + 1 - first))
        at += n
    top_n = max(seq.req.top_logprobs for seq, _ in echoing)
    chosen, top_v, top_i = chosen_logprobs(logits[torch.tensor(rows, device=logits.device)],
                                           torch.tensor(targets, device=logits.device), top_n)
    chosen_l = chosen.tolist()
    top_vl, top_il = (top_v.tolist(), top_i.tolist()) if top_v is not None and top_i is not None else ([], [])
    k = 0
    for seq, first, count in spans:
        n_top = seq.req.top_logprobs
        tops = [dict(zip(top_il[k + j][:n_top], top_vl[k + j][:n_top])) if n_top else {} for j in range(count)]
        seq.prompt_reported = first + count
        try:
            seq.req.on_prompt_logprobs(first, chosen_l[k:k + count], tops)
        except Exception as exc:  # noqa: BLE001 - a broken callback must not stop the others
            log_error(f"request {seq.req.request_id}: prompt logprobs failed: {type(exc).__name__}: {exc}")
        k += count
