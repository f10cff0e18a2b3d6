"""The canary's text path: text requests beside token ids, and a check that the candidate tokenizes like production.

Triton serves text with the tokenizer files of each version's engine folder. Besides random token ids, the
rollout's test traffic sends a few fixed texts (``CANARY_TEXTS``) twice through the router: as ``text_input``
(tokenized in Triton by the version that answers) and as the token ids the live version's tokenizer gives
(the reference, read from its folder in the model repository). Decoding is greedy, so one version's two
answers to one text are equal when its tokenizer agrees with the reference; another tokenizer of the same
vocabulary size (the fault the gate catches by hashes) answers the text differently, and the analysis fails
the candidate. A text request that errors (no or a broken tokenizer) counts as a failed request.

Without a reference (the first release; a live version without tokenizer files) the texts are still sent
(errors still count) and the comparison is reported as not made, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tasks.traffic import RequestRecord

CANARY_TEXTS = ("The capital of France is", "Once upon a time, there was a", "def add(a, b):\n    return",
                "The quick brown fox jumps over")
TEXT_KEY, IDS_KEY = "text", "ids"  # RequestRecord.prompt: "text:<j>" or "ids:<j>" for CANARY_TEXTS[j]
# where a version's tokenizer lies under <repository>/<name>_v<N>/1/, per engine kind
TOKENIZER_PLACES = ("engine/tokenizer.json", "tokenizer/tokenizer.json", "artifact/checkpoint/tokenizer.json")

Outcome = Literal["Successful", "Failed", "Inconclusive"]


@dataclass(frozen=True)
class TextPlan:
    """What the traffic sends: the texts, and each as the reference tokenizer's ids (None without one)."""

    texts: tuple[str, ...]
    reference_ids: tuple[tuple[int, ...], ...] | None
    reference: str  # the reference tokenizer's file, or why there is none
    send_text: bool = True  # False: the candidate has no tokenizer.json, so no text is sent

    def key_of(self, n: int) -> str:
        """The request of number ``n``: "" (random ids), ``text:<j>`` or ``ids:<j>`` (a cycle of 4 whose
        text slots are odd, so TTFT probes every 2nd request leave them alone)."""
        if not self.send_text or not self.texts:
            return ""
        slot, j = n % 4, (n // 4) % len(self.texts)
        if slot == 1:
            return f"{TEXT_KEY}:{j}"
        if slot == 3 and self.reference_ids is not None:
            return f"{IDS_KEY}:{j}"
        return ""


def version_tokenizer(repository: Path, name: str, version: int) -> Path | None:
    """The tokenizer.json that a version's Triton model serves with, if it has one."""
    from serving.triton.repository import engine_model_name

    inner = Path(repository) / engine_model_name(name, version) / "1"
    return next((inner / p for p in TOKENIZER_PLACES if (inner / p).is_file()), None)


def text_plan(repository: Path, name: str, *, live: int | None, candidate: int, compare: bool = True,
              texts: tuple[str, ...] = CANARY_TEXTS) -> TextPlan:
    """The texts of a rollout and their reference ids, from the live version's tokenizer in ``repository``
    (``compare`` False: texts only, as for a release that changes the tokenizer on purpose)."""
    if version_tokenizer(repository, name, candidate) is None:
        return TextPlan(texts, None, f"the candidate's model {name}_v{candidate} has no tokenizer.json", False)
    if live is None or live == candidate:
        return TextPlan(texts, None, "no live version to take a reference tokenizer from")
    if not compare:
        return TextPlan(texts, None, "no analysis step compares texts (none, or analysis.text_pairs 0)")
    path = version_tokenizer(repository, name, live)
    if path is None:
        return TextPlan(texts, None, f"the live version's model {name}_v{live} has no tokenizer.json")
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path))
        return TextPlan(texts, tuple(tuple(tokenizer.encode(t).ids) for t in texts), str(path))
    except Exception as exc:  # noqa: BLE001 - no reference is a reported fact, not a reason to stop the rollout
        return TextPlan(texts, None, f"the live version's tokenizer {path} cannot be read: {exc}")


@dataclass(frozen=True)
class TextCheck:
    """One version's text answers against its answers to the reference ids of the same texts."""

    version: int
    outcome: Outcome
    judged: bool
    text_requests: int
    pairs: int
    mismatched: int
    reason: str

    def figures(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "judged": self.judged, "text_requests": self.text_requests,
                "pairs": self.pairs, "mismatched": self.mismatched, "reason": self.reason}


def text_pairs(records: list[RequestRecord], version: int | None) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per text index: (the first text answer's ids, the first reference-ids answer's ids) of ``version``."""
    first: dict[str, tuple[int, ...]] = {}
    for r in records:
        if r.ok and r.version == version and r.prompt and r.prompt not in first:
            first[r.prompt] = r.output_ids
    out = {}
    for key, ids in first.items():
        kind, j = key.split(":")
        if kind == TEXT_KEY and f"{IDS_KEY}:{j}" in first:
            out[int(j)] = (ids, first[f"{IDS_KEY}:{j}"])
    return out


def check_text(records: list[RequestRecord], plan: TextPlan, version: int, *, min_pairs: int,
               max_mismatch: float) -> TextCheck:
    """Failed when more than ``max_mismatch`` of the compared texts were answered differently as text."""
    texts = sum(r.version == version and r.prompt.startswith(TEXT_KEY) for r in records)
    if not plan.send_text or plan.reference_ids is None:
        return TextCheck(version, "Successful", False, texts, 0, 0,
                         f"text: {texts} text requests; not compared with token ids ({plan.reference})")
    pairs = text_pairs(records, version)
    bad = sorted(j for j, (as_text, as_ids) in pairs.items() if as_text != as_ids)
    n = len(pairs)
    if n < min_pairs:
        return TextCheck(version, "Inconclusive", False, texts, n, len(bad),
                         f"text: not judged: {n} texts answered both as text and as token ids by version {version}; "
                         f"need {min_pairs} (analysis.text_pairs)")
    failed = len(bad) / n > max_mismatch
    example = (f"; e.g. {plan.texts[bad[0]]!r}: as text -> {list(pairs[bad[0]][0])[:6]}, as the live tokenizer's "
               f"ids -> {list(pairs[bad[0]][1])[:6]}") if bad else ""
    verdict = ("the engine folder's tokenizer does not tokenize like the live version's" if failed
               else "its tokenizer agrees with the live version's")
    return TextCheck(version, "Failed" if failed else "Successful", True, texts, n, len(bad),
                     f"text: {verdict}: {len(bad)} of {n} texts answered differently as text than as the live "
                     f"tokenizer's ids (limit analysis.max_text_mismatch {max_mismatch:.0%}){example}")
