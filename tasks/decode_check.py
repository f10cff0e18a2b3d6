"""Free-running decode compared position by position with the reference, and wide batches against rows alone.

Teacher-forced figures (KL, NLL, top-1) go through the prompt path only; an engine whose decode step is wrong
(a cache read, a decode-only kernel) passes them. Here the engine's own greedy generation is scored: Hugging
Face float32 runs teacher-forced over the engine's sequence (prompt + the engine's tokens), and at every
generated position:
- *disagreement*: the engine's token is not HF's argmax on that same prefix;
- *gap*: HF's log-prob of its own argmax minus HF's log-prob of the engine's token (0 where they agree):
  how far from a tie the engine's choice was;
- *log-prob delta*: where both pick the same token, the engine's log-prob of it minus HF's (signed; its mean
  is the decode path's NLL difference). Positions where they disagree are left out of it: there the engine's
  token is the one its own error favoured, so its log-prob is biased upwards by selection, and those
  positions are counted and measured by the two figures above.
The budget limits how many disagreements (`max_disagreements`) and how far (`max_gap`), so a divergence is
never simply "tolerated"; the mean delta is judged for float32 engines (where it is ~1e-7 and a decode step
that rescales its logits without changing the argmax shows), reported for the others (in bfloat16 it
reached 1.2x the teacher-forced NLL budget on an unchanged tiny build: an engine's near-tie picks are
where its own rounding favoured its token, a bias the teacher-forced budget does not carry).

`check_wide_batch`: the prompts in one batch of `max_batch_size` rows, each row's output against the same
prompt generated alone; float32 must be token-for-token equal; in reduced precision every row is scored like a
prompt alone and held to the same budget (a batch's row count picks other GEMMs, so near-ties break otherwise
there without any fault; a row that leaks its neighbours' state leaves HF's argmax by far).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

ReferenceLogits = Callable[[int, list[int]], torch.Tensor]  # (prompt index, sequence) -> HF float32 [S, V]


@dataclass(frozen=True)
class DecodePosition:
    prompt: int
    position: int  # index of the generated token
    engine_token: int
    reference_token: int  # HF's argmax on the engine's prefix
    gap: float
    logprob_delta: float | None  # None when the engine gave no log-probs, or picked another token than HF


@dataclass
class DecodeFigures:
    """Decode-position figures over every generated token of every prompt."""

    positions: int = 0
    disagreements: list[DecodePosition] = field(default_factory=list)
    max_gap: float = 0.0
    logprob_delta_sum: float = 0.0
    logprob_positions: int = 0
    worst: DecodePosition | None = None  # the position of the largest gap

    @property
    def mean_logprob_delta(self) -> float:
        return self.logprob_delta_sum / self.logprob_positions if self.logprob_positions else 0.0

    def add(self, p: DecodePosition) -> None:
        self.positions += 1
        if p.engine_token != p.reference_token:
            self.disagreements.append(p)
        if self.worst is None or p.gap > self.max_gap:
            self.max_gap, self.worst = max(self.max_gap, p.gap), p
        if p.logprob_delta is not None:
            self.logprob_delta_sum += p.logprob_delta
            self.logprob_positions += 1


@dataclass(frozen=True)
class DecodeLimits:
    max_disagreements: int
    max_gap: float  # nats
    max_mean_logprob_delta: float | None  # nats per token, either sign; None: reported, not judged

    def to_dict(self) -> dict[str, float]:
        return {"max_decode_disagreements": self.max_disagreements, "max_decode_gap": self.max_gap,
                "max_decode_logprob_delta": self.max_mean_logprob_delta}


def score_generation(figures: DecodeFigures, index: int, prompt: Sequence[int], tokens: Sequence[int],
                     logprobs: Sequence[float], reference_logits: torch.Tensor) -> None:
    """Add prompt `index`'s generated `tokens` to `figures`; `reference_logits`: HF float32 [S, V] of at least
    prompt + tokens[:-1] (teacher-forced over the engine's own sequence)."""
    if not tokens:
        return
    start = len(prompt) - 1
    lp = torch.log_softmax(reference_logits[start:start + len(tokens)].double(), dim=-1)  # [T, V]
    if lp.shape[0] != len(tokens):
        raise ValueError(f"reference logits cover {lp.shape[0]} of {len(tokens)} generated positions")
    best, argmax = lp.max(dim=-1)
    chosen = lp.gather(1, torch.tensor(list(tokens)).unsqueeze(1))[:, 0]
    for t, tok in enumerate(tokens):
        agree = int(tok) == int(argmax[t])
        delta = float(logprobs[t]) - float(chosen[t]) if agree and t < len(logprobs) else None
        figures.add(DecodePosition(index, t, int(tok), int(argmax[t]), float(best[t] - chosen[t]), delta))


def score_generations(prompt_ids: Sequence[Sequence[int]], generations: Sequence,
                      reference_logits: ReferenceLogits) -> DecodeFigures:
    """Every generated token of `generations` (row r the output of prompt r mod the prompts: the prompts alone,
    or cycled through a wide batch) against HF float32 teacher-forced over that row's own sequence."""
    figures = DecodeFigures()
    for r, gen in enumerate(generations):
        p, tokens = r % len(prompt_ids), list(gen.token_ids)
        if tokens:
            logits = reference_logits(p, list(prompt_ids[p]) + tokens[:-1])
            score_generation(figures, p, prompt_ids[p], tokens, list(gen.logprobs), logits)
    return figures


def judge_decode(figures: DecodeFigures, limits: DecodeLimits, labels: Sequence[str]) -> list[str]:
    """Failures naming each figure, its budget and the evidence (prompt, position, both tokens)."""
    failures = []

    def where(p: DecodePosition) -> str:
        return (f"prompt {labels[p.prompt]!r} token {p.position}: engine {p.engine_token} vs HF {p.reference_token}, "
                f"gap {p.gap:.3g} nats")

    n = len(figures.disagreements)
    if n > limits.max_disagreements:
        shown = "; ".join(where(p) for p in figures.disagreements[:3])
        failures.append(f"free-running decode: {n} of {figures.positions} generated tokens are not HF's argmax on the "
                        f"engine's own prefix (budget {limits.max_disagreements}: validation top-1 limit x positions "
                        f"+ the precision's allowance); first: {shown}")
    if figures.max_gap > limits.max_gap and figures.worst is not None:
        failures.append(f"free-running decode: largest gap {figures.max_gap:.3g} nats > budget {limits.max_gap:.3g} "
                        f"(validation.envelope.max_decode_gap, or the precision's) at {where(figures.worst)}")
    delta = figures.mean_logprob_delta
    if limits.max_mean_logprob_delta is not None and abs(delta) > limits.max_mean_logprob_delta:
        failures.append(f"free-running decode: mean log-prob of the engine's tokens {delta:+.3g} nats/token from HF's "
                        f"over {figures.logprob_positions} positions, budget |.| <= {limits.max_mean_logprob_delta:.3g} "
                        "(the validation NLL limit)")
    return failures


class Float32Reference:
    """HF float32 teacher-forced logits of any sequence, the model loaded on first use (validation needs it only
    for a sequence where the engine left the reference's greedy path; the reference run's own model is not
    kept)."""

    def __init__(self, checkpoint, device: torch.device | str) -> None:
        self.checkpoint, self.device, self.model = checkpoint, device, None

    @torch.no_grad()
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """[len(ids), V] float32 on the CPU."""
        if self.model is None:
            from tasks.hf_reference import load_hf_model

            self.model = load_hf_model(self.checkpoint, "float32", self.device)
        return self.model(torch.tensor([list(ids)], device=self.model.device)).logits[0].float().cpu()


@dataclass(frozen=True)
class RowDifference:
    row: int
    prompt: int
    position: int
    batched_token: int
    alone_token: int | None
    gap: float | None  # alone's log-prob of its token minus of the batched one (None: outside alone's top-N)


@dataclass
class BatchCheck:
    rows: int
    prompts: int
    differences: list[RowDifference] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    figures: DecodeFigures | None = None  # reduced precision: every row scored against HF float32

    @property
    def passed(self) -> bool:
        return not self.failures


def check_wide_batch(generate: Callable[[list[list[int]]], list], prompt_ids: Sequence[Sequence[int]],
                     alone: Sequence, *, width: int, exact: bool, labels: Sequence[str],
                     limits: DecodeLimits | None = None, reference_logits: ReferenceLogits | None = None,
                     max_rows: int | None = None) -> BatchCheck:
    """Run the prompts cycled to `width` rows in one batch (`generate(prompts)` -> `Generation`s with
    log-probs) against each prompt's output `alone` (generated in a batch of one).

    `exact` (float32): every row must equal its output alone. Otherwise a row may break a near-tie its own way
    (which rows do depends on the GEMM a batch's row count picks, not on a fault), so each row is held to the
    budget its prompt alone is held to: every row's tokens scored against HF float32 teacher-forced over that
    row's own sequence (`reference_logits`), judged by `limits` with the disagreements allowed per row
    (`limits.max_disagreements` over the prompts, times the rows); `max_rows`, if given, caps the rows that may
    differ from their output alone at all."""
    rows = [list(prompt_ids[r % len(prompt_ids)]) for r in range(width)]
    batched = generate(rows)
    check = BatchCheck(width, len(prompt_ids))
    for r, got in enumerate(batched):
        diff = _first_difference(r, r % len(prompt_ids), got, alone[r % len(prompt_ids)])
        if diff is not None:
            check.differences.append(diff)
    head = (f"wide batch: {len(check.differences)} of {width} rows (one batch of limits.max_batch_size={width}) "
            "differ from the same prompt generated alone")
    if exact:
        if check.differences:
            check.failures.append(f"{head} (float32: every row must equal its output alone); "
                                  f"{_named(check.differences[0], labels)}")
        return check
    if limits is None or reference_logits is None:
        raise ValueError("reduced precision: the wide batch is judged by the decode limits against HF float32")
    check.figures = score_generations(prompt_ids, batched, reference_logits)
    per_rows = DecodeLimits(limits.max_disagreements * width // len(prompt_ids), limits.max_gap, None)
    for failure in judge_decode(check.figures, per_rows, labels):
        check.failures.append(f"{head}, and its rows scored like the prompts alone: "
                              f"{failure.removeprefix('free-running decode: ')}")
    if max_rows is not None and len(check.differences) > max_rows:
        check.failures.append(f"{head} (validation.envelope.max_wide_batch_rows: at most {max_rows}); "
                              f"{_named(check.differences[0], labels)}")
    return check


def _named(d: RowDifference, labels: Sequence[str]) -> str:
    gap = "outside its top-N" if d.gap is None else f"log-prob gap {d.gap:.3g} nats"
    return (f"row {d.row} (prompt {labels[d.prompt]!r}) at token {d.position}: batched {d.batched_token} vs alone "
            f"{d.alone_token}, {gap}")


def _first_difference(row: int, prompt: int, got, want) -> RowDifference | None:
    for t, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
        if a != b:
            top = want.top_logprobs[t] if t < len(want.top_logprobs) else {}
            gap = top[b] - top[a] if a in top and b in top else None
            return RowDifference(row, prompt, t, a, b, gap)
    if len(got.token_ids) != len(want.token_ids):
        t = min(len(got.token_ids), len(want.token_ids))
        return RowDifference(row, prompt, t, got.token_ids[t] if t < len(got.token_ids) else -1,
                             want.token_ids[t] if t < len(want.token_ids) else None, None)
    return None


def check_timed_outputs(checkpoint, prompts: Sequence[Sequence[int]], generations: Sequence,
                        limits: DecodeLimits, *, sample: int = 2, device: torch.device | str = "cpu",
                        labels: Sequence[str] | None = None) -> tuple[DecodeFigures, list[str]]:
    """The perf gate's hook: is what it timed correct? A sample of its rows (the first `sample`, and the row of
    the longest prompt) scored like validation's free-running decode, HF float32 (`checkpoint`) teacher-forced
    over each row's prompt and generated tokens, judged by `limits` (validation's `ValidationResult.decode_limits`:
    the same budget). Generations without log-probs are judged on disagreements and gap only."""
    rows = sorted({*range(min(sample, len(prompts))), max(range(len(prompts)), key=lambda r: len(prompts[r]))})
    hf = Float32Reference(checkpoint, device)
    figures = DecodeFigures()
    for r in rows:
        tokens = list(generations[r].token_ids)
        if tokens:
            logits = hf.logits(list(prompts[r]) + tokens[:-1])
            score_generation(figures, r, prompts[r], tokens, list(generations[r].logprobs), logits)
    names = list(labels) if labels is not None else [f"timed row {r} ({len(p)} tokens)" for r, p in enumerate(prompts)]
    return figures, judge_decode(figures, limits, names)
