"""Structured outputs: a request's grammar (a JSON schema, any JSON object, a regex, a choice of strings, a
Lark grammar) turned into a token matcher the in-flight scheduler masks each sampling step with.

The grammar engine is llguidance (docs/structured-outputs.md says why, with the figures). `Guide` is what a
request asks for, as it travels (JSON) from the OpenAI front through Triton's ``guided_decoding`` input to
the engine model; `check_guide` refuses, before anything is generated, a guide the engine would not enforce
in full: llguidance's own errors, and any JSON Schema keyword outside `ENFORCED_KEYWORDS` and
`ANNOTATION_KEYWORDS` (llguidance enforces the former; the latter do not constrain an instance), each
`GuideError` naming the keyword and where it is in the schema.

`GrammarMatcher` is one request's matcher, the scheduler's `TokenMaskSource`: ``fill_next_token_bitmask``
writes the allowed tokens of the next position, ``accept_token`` advances past the chosen token,
``is_terminated`` says the grammar is complete. The mask of the next position is computed off the step's
critical path: when a token is accepted (and when the matcher is made), a `MaskWorker` thread starts
computing the next mask (llguidance releases the GIL while it does), so it is ready, or nearly, when the
next step's logits are; ``fill_next_token_bitmask`` only waits for it and copies one row.

Imports: stdlib and torch at module import; llguidance lazily.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import torch

GuideKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]
GUIDE_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "lark")

# JSON Schema keywords llguidance enforces (its parser/src/json/README.md); `format` only with FORMATS
ENFORCED_KEYWORDS = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})
# keywords that describe and never constrain an instance
ANNOTATION_KEYWORDS = frozenset({
    "$schema", "$id", "$comment", "$anchor", "title", "description", "default", "examples", "deprecated",
    "readOnly", "writeOnly", "x-guidance",
})
FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"})
# keywords whose value is a map of name -> subschema, or a list of subschemas, or one subschema
SCHEMA_MAPS = ("properties", "$defs", "definitions")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_ONE = ("items", "additionalProperties")
MAX_CHOICES = 256
# JSON written as json.dumps writes it (", " and ": ", no other whitespace): a model cannot run away in blank
# space, and keywords the engine does not implement stay errors whatever a schema's "x-guidance" says
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
JSON_STRICT = {"lenient": False}


class GuideError(ValueError):
    """A guide the engine cannot enforce in full; `param` is the request parameter it came from."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Guide:
    """What a request's output must match. `value`: the schema (json_schema), the pattern (regex), the
    strings (choice), the Lark text (lark), None (json_object: any JSON object)."""

    kind: GuideKind
    value: Any = None
    param: str = "response_format"  # the OpenAI parameter it came from, for errors

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "value": self.value, "param": self.param}, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> Guide:
        """The guide of Triton's ``guided_decoding`` input; GuideError naming what is wrong."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise GuideError(f"guided_decoding is not JSON: {exc}", param="guided_decoding") from exc
        if not isinstance(data, dict) or data.get("kind") not in GUIDE_KINDS:
            raise GuideError(f"guided_decoding must be {{\"kind\": one of {list(GUIDE_KINDS)}, \"value\": ...}}, "
                             f"got {text[:120]!r}", param="guided_decoding")
        return Guide(data["kind"], data.get("value"), str(data.get("param") or "guided_decoding"))


def schema_problems(schema: Any, where: str = "") -> Iterator[str]:
    """The keywords of `schema` (at JSON pointer `where`) that the engine would not enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        yield f"{where or '/'} is {type(schema).__name__}, not a JSON Schema object"
        return
    for key, value in schema.items():
        path = f"{where}/{key}"
        if key in ANNOTATION_KEYWORDS:
            continue
        if key not in ENFORCED_KEYWORDS:
            yield f"keyword {key!r} at {path} is not enforced by the grammar engine"
        elif key == "format" and value not in FORMATS:
            yield f"format {value!r} at {path} is not enforced by the grammar engine (enforced: {sorted(FORMATS)})"
        elif key in SCHEMA_MAPS:
            if not isinstance(value, dict):
                yield f"{path} must be an object of schemas"
                continue
            for name, sub in value.items():
                yield from schema_problems(sub, f"{path}/{name}")
        elif key in SCHEMA_LISTS:
            if not isinstance(value, list):
                yield f"{path} must be a list of schemas"
                continue
            for i, sub in enumerate(value):
                yield from schema_problems(sub, f"{path}/{i}")
        elif key in SCHEMA_ONE:
            yield from schema_problems(value, path)


def grammar_text(guide: Guide) -> str:
    """The llguidance grammar of `guide` (not yet checked)."""
    import llguidance

    if guide.kind in ("json_schema", "json_object"):
        schema = guide.value if guide.kind == "json_schema" else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT, overrides=JSON_STRICT)
    if guide.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(guide.value)
    if guide.kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in guide.value))
    return llguidance.LLMatcher.grammar_from_lark(guide.value)


def check_guide(guide: Guide) -> str:
    """The guide's grammar, checked: GuideError (naming the parameter and the feature) for one the engine would
    not enforce in full. Needs no tokenizer, so the front refuses before the request travels."""
    import llguidance

    if guide.kind == "json_schema":
        if not isinstance(guide.value, dict):
            raise GuideError(f"{guide.param}: the schema must be a JSON Schema object, got "
                             f"{type(guide.value).__name__} {json.dumps(guide.value)[:80]}", param=guide.param)
        problems = list(schema_problems(guide.value))
        if problems:
            raise GuideError(f"{guide.param}: {problems[0]}" + (f" (and {len(problems) - 1} more)"
                                                                 if len(problems) > 1 else ""), param=guide.param)
    elif guide.kind in ("regex", "lark") and (not isinstance(guide.value, str) or not guide.value):
        raise GuideError(f"{guide.param} must be a non-empty string", param=guide.param)
    elif guide.kind == "choice" and (not isinstance(guide.value, list) or not guide.value
                                     or len(guide.value) > MAX_CHOICES
                                     or not all(isinstance(c, str) and c for c in guide.value)):
        raise GuideError(f"{guide.param} must be a list of 1 to {MAX_CHOICES} non-empty strings", param=guide.param)
    try:
        grammar = grammar_text(guide)
    except (ValueError, TypeError) as exc:
        raise GuideError(f"{guide.param}: {exc}", param=guide.param) from exc
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GuideError(f"{guide.param}: the grammar engine refuses it: {messages[0]}", param=guide.param)
    return grammar


@lru_cache(maxsize=4)
def grammar_tokenizer(tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]) -> Any:
    """llguidance's view of an engine's tokenizer (`tokenizer_json`: the path of its tokenizer.json), over the
    model's `vocab_size` logits (ids past the tokenizer's are never allowed); built once per engine."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids))


class MaskWorker:
    """The threads that compute next-token masks while the step runs (one pool per engine)."""

    def __init__(self, threads: int = 2) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar-mask")

    def submit(self, matcher: Any, words: int) -> Future[torch.Tensor]:
        return self._pool.submit(_compute_mask, matcher, words)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _compute_mask(matcher: Any, words: int) -> torch.Tensor:
    mask = torch.empty(words, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
    return mask


class GrammarMatcher:
    """One request's grammar state (`sampling.TokenMaskSource`). The scheduler's thread calls it, one call at a
    time; the llguidance matcher is touched by one thread at a time (a worker computing the next mask, or the
    scheduler's thread once that mask is done), so what the scheduler asks meanwhile is kept here."""

    def __init__(self, tokenizer: Any, grammar: str, worker: MaskWorker, *, vocab_size: int) -> None:
        import llguidance

        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise GuideError(f"the grammar engine refuses the guide: {self._matcher.get_error()}",
                             param="guided_decoding")
        self._words = (vocab_size + 31) // 32
        self._worker = worker
        self._stopped = False
        self._error = ""
        self._next: Future[torch.Tensor] = worker.submit(self._matcher, self._words)

    def _wait(self) -> torch.Tensor | None:
        """The next mask, once the worker is done with the matcher (None: it failed, `error` says why)."""
        try:
            return self._next.result()
        except Exception as exc:  # noqa: BLE001 - the request fails at its next token, the engine goes on
            self._error = self._error or f"the grammar engine failed computing a mask: {exc}"
            return None

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Row `index` of `bitmask` (int32 [R, W] on the CPU) := the tokens allowed next (only the EOS ids once
        the grammar is complete). A failed mask leaves the row as it is; `accept_token` then refuses."""
        mask = self._wait()
        if mask is not None:
            bitmask[index] = mask

    def accept_token(self, token_id: int) -> bool:
        """Advance past `token_id`; False when the grammar refuses it (the matcher then stays in error)."""
        if self._wait() is None:
            return False
        ok = bool(self._matcher.consume_token(int(token_id)))
        self._stopped = bool(self._matcher.is_stopped())
        if not ok:
            self._error = self._matcher.get_error() or f"token {token_id} is outside the grammar"
        self._next = self._worker.submit(self._matcher, self._words)
        return ok and not self._error

    def is_terminated(self) -> bool:
        return self._stopped

    @property
    def error(self) -> str:
        return self._error


def make_matchers(guide: Guide, *, tokenizer: Any, worker: MaskWorker, vocab_size: int,
                  count: int = 1) -> Sequence[GrammarMatcher]:
    """`count` fresh matchers of one checked guide (one per choice of the request)."""
    grammar = check_guide(guide)
    return [GrammarMatcher(tokenizer, grammar, worker, vocab_size=vocab_size) for _ in range(count)]
