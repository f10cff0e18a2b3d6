"""The in-flight step's sampling: every row its own parameters, applied to the whole batch at once.

`StepSampling.build(rows, vocab_size, device)` turns the step's `RowSampling`s (one per sampled sequence:
its `SamplingParams`, seed, position, tokens so far, stop ids, token mask) into per-row tensors once a step;
`sample_rows(logits, step)` then picks every row's token with batched tensor operations only (the order is
`sampling`'s module doc). A row that asks for nothing costs its neighbours nothing: a step of plain greedy
rows builds nothing (`build` returns None) and samples with one argmax.

Randomness (`race_exponentials`): the exponentials of the race `argmax(p / E)` come from a counter-based hash
of (the request's 64-bit seed, the position of the token being sampled, the token id), computed on the device
in 32-bit integer arithmetic held in int64 (no overflow). A row's draw is a function of its own seed and
position: reproducible under any batching, any preemption and recompute, and `n` choices with distinct seeds
are independent streams. A request without a seed gets a random one when it is queued (`fresh_seed`).

Imports: stdlib and torch only.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serving.engine.sampling import (
    SamplingParams,
    TokenMaskSource,
    apply_token_mask,
    bitmask_words,
    top_p_filter,
)

MASK32 = 0xFFFFFFFF
UNIFORM_BITS = 24  # bits of each uniform draw: exact in float32


def fresh_seed() -> int:
    """A random 64-bit seed for a request that did not give one."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class RowSampling:
    """One sampled row of a step, as its scheduler knows it."""

    params: SamplingParams | None  # None: greedy, nothing else
    seed: int  # the request's seed (or `fresh_seed()`), 64 bits
    position: int  # the position in its sequence of the token this row samples: the draw's counter
    tokens: Sequence[int] = ()  # prompt + output so far (read only when penalties are on)
    prompt_len: int = 0  # where the output starts in `tokens`
    stop_ids: Sequence[int] = ()  # masked while the output is shorter than params.min_tokens
    generated: int = 0  # output tokens so far
    token_mask: TokenMaskSource | None = None

    @property
    def plain_greedy(self) -> bool:
        p = self.params
        return self.token_mask is None and (p is None or (p.is_greedy and not p.shapes_logits))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x of uint32 values in int64, without overflowing int64."""
    low, high = c & 0xFFFF, c >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (Chris Wellons' lowbias32) of uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def race_exponentials(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) draws [R, V] (float32) for rows of `seeds` [R] (int64, any 64-bit value) at `positions` [R]:
    a function of (seed, position, token id) alone."""
    device = seeds.device
    low, high = seeds & MASK32, (seeds >> 32) & MASK32
    key = _mix32(_mix32(_mix32(low) ^ high) ^ (positions & MASK32))  # [R]
    tokens = _mix32(torch.arange(vocab_size, device=device, dtype=torch.int64) * 0x9E3779B9 & MASK32)  # [V]
    bits = _mix32(key.unsqueeze(-1) ^ tokens) >> (32 - UNIFORM_BITS)  # [R, V]
    uniform = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))
    return -torch.log(uniform)


@dataclass(frozen=True)
class _Penalties:
    rows: torch.Tensor  # [R] long: the step's rows that use penalties
    counts: torch.Tensor  # [R, V] float32: each token's count in the row's output
    seen: torch.Tensor  # [R, V] bool: in the prompt or the output (repetition penalty)
    presence: torch.Tensor  # [R, 1]
    frequency: torch.Tensor  # [R, 1]
    repetition: torch.Tensor  # [R, 1]


@dataclass(frozen=True)
class StepSampling:
    """A step's sampling parameters as tensors on the logits' device (`build`)."""

    vocab_size: int
    sampled: torch.Tensor | None  # [S] long: the rows that draw (the others are greedy); None when none does
    temperature: torch.Tensor | None  # [S, 1]
    top_k: torch.Tensor | None  # [S] long, vocab_size where off; None when no sampled row has one
    top_p: torch.Tensor | None  # [S, 1]; None when no sampled row has one
    seeds: torch.Tensor | None  # [S] int64
    positions: torch.Tensor | None  # [S] int64
    penalties: _Penalties | None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, biases)
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) set to -inf (min_tokens)
    mask: tuple[torch.Tensor, torch.Tensor] | None  # (int32 bitmask [M, W] on the CPU, rows [M])

    @property
    def shapes_logits(self) -> bool:
        return self.penalties is not None or self.bias is not None or self.banned is not None or self.mask is not None

    @staticmethod
    def build(rows: Sequence[RowSampling], vocab_size: int, device: torch.device) -> StepSampling | None:
        """The step's tensors, or None when every row is plain greedy (one argmax samples them all)."""
        if all(row.plain_greedy for row in rows):
            return None

        def dev(values: list, dtype: torch.dtype) -> torch.Tensor:
            host = torch.tensor(values, dtype=dtype)
            return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host

        sampled = [i for i, r in enumerate(rows) if r.params is not None and not r.params.is_greedy]
        temperature = top_k = top_p = seeds = positions = None
        if sampled:
            params = [rows[i].params for i in sampled]
            temperature = dev([[max(p.temperature, 1e-6)] for p in params], torch.float32)
            if any(0 < p.top_k < vocab_size for p in params):
                top_k = dev([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], torch.long)
            if any(p.top_p < 1.0 for p in params):
                top_p = dev([[p.top_p] for p in params], torch.float32)
            seeds = dev([_signed64(rows[i].seed) for i in sampled], torch.long)
            positions = dev([rows[i].position for i in sampled], torch.long)
        mask_rows = [i for i, r in enumerate(rows) if r.token_mask is not None]
        mask = None
        if mask_rows:
            bitmask = torch.full((len(mask_rows), bitmask_words(vocab_size)), -1, dtype=torch.int32)
            for k, i in enumerate(mask_rows):
                rows[i].token_mask.fill_next_token_bitmask(bitmask, k)  # type: ignore[union-attr]
            mask = (bitmask, dev(mask_rows, torch.long))
        return StepSampling(
            vocab_size=vocab_size, sampled=dev(sampled, torch.long) if sampled else None, temperature=temperature,
            top_k=top_k, top_p=top_p, seeds=seeds, positions=positions,
            penalties=_penalties(rows, vocab_size, dev), bias=_bias(rows, dev), banned=_banned(rows, dev), mask=mask)


def _signed64(seed: int) -> int:
    """A seed as an int64 value (the same 64 bits)."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _penalties(rows: Sequence[RowSampling], vocab_size: int, dev) -> _Penalties | None:
    which = [i for i, r in enumerate(rows) if r.params is not None and r.params.has_penalties]
    if not which:
        return None
    out_rows, out_ids, all_rows, all_ids = [], [], [], []
    for k, i in enumerate(which):
        row = rows[i]
        output = list(row.tokens[row.prompt_len:])
        out_rows += [k] * len(output)
        out_ids += output
        all_rows += [k] * len(row.tokens)
        all_ids += list(row.tokens)
    counts = torch.zeros(len(which), vocab_size, dtype=torch.float32, device=dev([0], torch.long).device)
    if out_ids:
        counts.index_put_((dev(out_rows, torch.long), dev(out_ids, torch.long)),
                          torch.ones(len(out_ids), dtype=torch.float32, device=counts.device), accumulate=True)
    seen = torch.zeros(len(which), vocab_size, dtype=torch.bool, device=counts.device)
    if all_ids:
        seen[dev(all_rows, torch.long), dev(all_ids, torch.long)] = True
    params = [rows[i].params for i in which]
    return _Penalties(rows=dev(which, torch.long), counts=counts, seen=seen,
                      presence=dev([[p.presence_penalty] for p in params], torch.float32),
                      frequency=dev([[p.frequency_penalty] for p in params], torch.float32),
                      repetition=dev([[p.repetition_penalty] for p in params], torch.float32))


def _bias(rows: Sequence[RowSampling], dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    triples = [(i, t, b) for i, r in enumerate(rows) if r.params is not None for t, b in r.params.logit_bias]
    if not triples:
        return None
    which, ids, biases = zip(*triples)
    return dev(list(which), torch.long), dev(list(ids), torch.long), dev(list(biases), torch.float32)


def _banned(rows: Sequence[RowSampling], dev) -> tuple[torch.Tensor, torch.Tensor] | None:
    pairs = [(i, t) for i, r in enumerate(rows)
             if r.params is not None and r.generated < r.params.min_tokens for t in r.stop_ids]
    if not pairs:
        return None
    which, ids = zip(*pairs)
    return dev(list(which), torch.long), dev(list(ids), torch.long)


def shape_logits(logits: torch.Tensor, step: StepSampling) -> torch.Tensor:
    """Float32 logits [B, V] after penalties, bias, min_tokens and the token mask (a new tensor: the step's raw
    logits stay as they were, for the reported log-probs)."""
    x = logits.float().clone()
    if step.penalties is not None:
        p = step.penalties
        rows = x[p.rows]
        rows = torch.where(p.seen, torch.where(rows > 0, rows / p.repetition, rows * p.repetition), rows)
        rows = rows - p.frequency * p.counts - p.presence * (p.counts > 0).float()
        x[p.rows] = rows
    if step.bias is not None:
        x.index_put_(step.bias[:2], step.bias[2], accumulate=True)
    if step.banned is not None:
        x[step.banned] = float("-inf")
    if step.mask is not None:
        apply_token_mask(x, step.mask[0], step.mask[1])
    return x


def sample_rows(logits: torch.Tensor, step: StepSampling | None) -> torch.Tensor:
    """Next token ids [B] (int64) of a step's logits [B, V] under each row's parameters (see the module doc)."""
    if step is None:
        return logits.argmax(dim=-1)
    x = shape_logits(logits, step) if step.shapes_logits else logits.float()
    out = x.argmax(dim=-1)
    if step.sampled is None:
        return out
    s = x[step.sampled] / step.temperature  # [S, V]
    if step.top_k is not None:
        kth = torch.sort(s, dim=-1, descending=True).values.gather(-1, (step.top_k - 1).unsqueeze(-1))
        s = s.masked_fill(s < kth, float("-inf"))
    if step.top_p is not None:
        s = top_p_filter(s, step.top_p)
    probs = s.softmax(dim=-1)
    race = race_exponentials(step.seeds, step.positions, s.shape[-1])  # type: ignore[arg-type]
    out[step.sampled] = (probs / race).argmax(dim=-1)
    return out


@dataclass
class StepLogprobs:
    """The raw log-probs a step's rows asked for (`chosen_logprobs`): `rows` of the step, each with its `top_ns`
    alternatives; made on the device, read on the host (`to_host` first where the tokens are read later)."""

    rows: list[int]
    top_ns: list[int]
    chosen: torch.Tensor  # [R]
    top_values: torch.Tensor | None  # [R, max top_n]
    top_ids: torch.Tensor | None

    def to_host(self) -> StepLogprobs:
        """A copy on the host started without waiting (pinned, non-blocking on CUDA): read after the step's event."""
        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or not t.is_cuda:
                return t
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)

        return StepLogprobs(self.rows, self.top_ns, copy(self.chosen), copy(self.top_values), copy(self.top_ids))

    def per_row(self, n_rows: int) -> list[tuple[float, dict[int, float]] | None]:
        out: list[tuple[float, dict[int, float]] | None] = [None] * n_rows
        chosen = self.chosen.tolist()
        values = self.top_values.tolist() if self.top_values is not None else None
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        for k, (row, n) in enumerate(zip(self.rows, self.top_ns)):
            top = dict(zip(ids[k][:n], values[k][:n])) if n and ids is not None and values is not None else {}
            out[row] = (chosen[k], top)
        return out
