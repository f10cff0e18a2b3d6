"""Speculative decoding by n-gram lookup (prompt lookup decoding): drafts from a request's own tokens.

No second model: for a decoding request, the most recent earlier occurrence of its last n tokens (n from
`max_ngram` down to `min_ngram`) in its prompt and output so far is looked up, and the up to `max_draft` tokens
that followed it there are its draft. The scheduler (`scheduler.Scheduler`) then computes the request's last
token and the draft as one chunk of `1 + k` tokens from its position (a later chunk of the mixed step), samples
each of the `1 + k` positions by the request's own sampling rule, and keeps the longest prefix of the draft that
equals what was picked, plus one token: the pick after it (the correction, or the bonus when all `k` were
taken). A pick at a position is what the request would have picked there without speculation (greedy: the
argmax; sampled: the draw of its seed at that position, `step_sampling`), so its tokens are the same with and
without speculation. The K/V written for rejected positions is overwritten later.

- `SpeculativeOptions`: the engine option (`options.EngineOptions.speculative`), `parse_speculative` reads it from
  a mapping or from the `llm` model's `speculative` parameter (a JSON object, "ngram" or "off");
- `NgramIndex`: one request's n-grams and where each last occurred, kept up to date as its tokens grow (a lookup
  costs `max_ngram - min_ngram + 1` dict reads, whatever the sequence's length);
- `Drafter`: one request's drafting: the index, and a back-off that stops it drafting for a while after a
  lookup found nothing or a draft had no token accepted (each verification is an eager mixed step, where a step
  without drafts is one CUDA graph and may run a step ahead);
- `verified_rows`: which rows of a step's logits each pick reads; `accepted_length(draft, picked)`.

Imports: stdlib only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from serving.engine.errors import EngineLimitError

SETTING = "speculative"
METHODS = ("ngram",)
OFF = ("", "off", "none", "false")
MAX_DRAFT = 64  # the most draft tokens a step may verify for one request
MAX_NGRAM = 16
MAX_BACKOFF_STEPS = 16  # the longest a drafter waits after misses: it doubles from 1 per miss in a row


@dataclass(frozen=True)
class SpeculativeOptions:
    """How a request drafts (docs/engine.md#speculative-decoding-n-gram-lookup)."""

    method: str = "ngram"  # the only one: prompt lookup, no draft model
    max_draft: int = 4  # draft tokens a step proposes at most per request
    max_ngram: int = 3  # the longest tail of the request's tokens looked up
    min_ngram: int = 1  # the shortest

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise EngineLimitError(f"{SETTING}.method={self.method!r}: expected one of {list(METHODS)}")
        for name, most in (("max_draft", MAX_DRAFT), ("max_ngram", MAX_NGRAM), ("min_ngram", MAX_NGRAM)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
                raise EngineLimitError(f"{SETTING}.{name}={value!r}: expected a whole number from 1 to {most}")
        if self.min_ngram > self.max_ngram:
            raise EngineLimitError(f"{SETTING}.min_ngram={self.min_ngram} > {SETTING}.max_ngram={self.max_ngram}")

    def describe(self) -> str:
        return f"{self.method}(max_draft={self.max_draft}, max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"


def parse_speculative(value: SpeculativeOptions | Mapping | str | None) -> SpeculativeOptions | None:
    """The option from what a user wrote: None, "", "off": no speculation; "ngram": the defaults; a mapping of
    `SpeculativeOptions` fields, or the same as a JSON object (the `llm` model's parameters are strings). A bad
    name or value raises `EngineLimitError` naming it."""
    if value is None or isinstance(value, SpeculativeOptions):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in OFF:
            return None
        if text.lower() in METHODS:
            return SpeculativeOptions(method=text.lower())
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise EngineLimitError(f"{SETTING}={text!r}: expected 'off', one of {list(METHODS)}, or a JSON object "
                                   'such as {"method": "ngram", "max_draft": 4, "max_ngram": 3}') from None
    if not isinstance(value, Mapping):
        raise EngineLimitError(f"{SETTING}={value!r}: expected a mapping of {[f.name for f in fields(SpeculativeOptions)]}")
    known = {f.name for f in fields(SpeculativeOptions)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise EngineLimitError(f"{SETTING}: {unknown} are not known; known: {sorted(known)}")
    return SpeculativeOptions(**value)


class NgramIndex:
    """Where each n-gram (n in [min_ngram, max_ngram]) of a sequence's tokens last ended, for every n-gram but
    those ending at its last token (the tail being looked up is never its own match)."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> the index just past its latest indexed occurrence
        self.indexed = 0  # n-grams ending before this many tokens are in `ends`

    def _index_to(self, tokens: Sequence[int], end: int) -> None:
        for stop in range(self.indexed + 1, end + 1):  # n-grams ending just before `stop`
            for n in self.sizes:
                if n <= stop:
                    self.ends[tuple(tokens[stop - n:stop])] = stop
        self.indexed = max(self.indexed, end)

    def draft(self, tokens: Sequence[int], most: int) -> list[int]:
        """Up to `most` tokens that followed the latest earlier occurrence of the longest tail of `tokens` found."""
        last = len(tokens)
        self._index_to(tokens, last - 1)
        for n in self.sizes:
            if n < last:
                end = self.ends.get(tuple(tokens[last - n:]))
                if end is not None:
                    return list(tokens[end:end + most])
        return []


class Drafter:
    """One request's drafting (see the module doc): `propose` at each step the scheduler plans for it, `passed` at
    each step run ahead without it, `verified` once its draft's picks are known."""

    def __init__(self, options: SpeculativeOptions) -> None:
        self.options = options
        self.index = NgramIndex(options.min_ngram, options.max_ngram)
        self.wait = 0  # the next steps that do not draft (back-off)
        self.misses = 0  # lookups or drafts in a row that gave no accepted token

    @property
    def due(self) -> bool:
        """Whether the next step drafts (then it needs the request's tokens on the host)."""
        return self.wait == 0

    def propose(self, tokens: Sequence[int], room: int) -> list[int]:
        """The draft of this step, at most `room` tokens ([] while backing off or when nothing matches)."""
        if self.wait:
            self.wait -= 1
            return []
        if room <= 0:
            return []
        draft = self.index.draft(tokens, min(room, self.options.max_draft))
        if not draft:
            self._missed()
        return draft

    def passed(self) -> None:
        """A step ran for the request without a draft, planned before its tokens were read."""
        if self.wait:
            self.wait -= 1

    def verified(self, accepted: int) -> None:
        if accepted:
            self.misses = self.wait = 0
        else:
            self._missed()

    def _missed(self) -> None:
        self.misses += 1
        self.wait = min(1 << (self.misses - 1), MAX_BACKOFF_STEPS)


def accepted_length(draft: Sequence[int], picked: Sequence[int]) -> int:
    """How many leading draft tokens equal the picks at their positions (`picked[j]` chose token j)."""
    for j, token in enumerate(draft):
        if picked[j] != token:
            return j
    return len(draft)


def verified_rows(drafts: Sequence[Sequence[int]], positions: Sequence[int], at: int
                  ) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """The picks of a step with drafts. Its sampled chunks have `drafts` ([] where none) and sample from
    `positions`; its logits hold each sampled chunk's last token in order, then, from row `at`, each draft token's,
    in order. A plain chunk picks once, a drafting one also once after each draft token, each as if the draft
    tokens before it were the request's own -> (the logits row of each pick, the sampled chunk it belongs to, the
    position it samples, the draft tokens before it)."""
    rows: list[int] = []
    owners: list[int] = []
    picked_at: list[int] = []
    before: list[list[int]] = []
    for k, (draft, position) in enumerate(zip(drafts, positions)):
        picks = len(draft) + 1
        rows += (k, *range(at, at + len(draft)))
        at += len(draft)
        owners += [k] * picks
        picked_at += range(position, position + picks)
        before += [list(draft[:j]) for j in range(picks)]
    return rows, owners, picked_at, before
