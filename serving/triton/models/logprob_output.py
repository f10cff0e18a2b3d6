"""Log-probs in the ``llm`` model's responses: each token's bytes, and the ``output_logprobs`` output.

``output_logprobs`` (BYTES [1], JSON) accompanies each response of a request that asked for ``logprobs``,
``top_logprobs`` or ``prompt_logprobs``, for the tokens that response carries, in order::

    {"prompt": [ENTRY, ...],   # first response only, with prompt_logprobs: every prompt token, the first
                               # with "logprob": null and no alternatives
     "tokens": [ENTRY, ...]}   # the response's output tokens, one entry each
    ENTRY = {"id": 42, "bytes": [32, 116], "logprob": -1.25, "top": [{"id", "bytes", "logprob"}, ...]}

"bytes" are the token's own bytes (a token may hold part of a UTF-8 character); "top" lists up to
``top_logprobs`` alternatives, most likely first. Log-probs are the model's raw float32 log-softmax (before
penalties, temperature and top-k/top-p).

`LogprobTrail` gathers them as the scheduler reports them (its thread) and hands them out with the tokens each
response carries (the sending thread): the scheduler reports a token's log-probs just before the token itself,
and a stop string may cut tokens off before they are sent (`drop_last`).

Imports: stdlib only.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

LOWEST_LOGPROB = -9999.0  # JSON has no -inf: a log-prob below this is written as this
_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # a byte-fallback token (SentencePiece's)
Entry = dict[str, Any]


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in the vocabulary -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenBytes:
    """Token id -> its bytes, from a `tokenizers.Tokenizer` (byte-level BPE, or SentencePiece-style pieces with
    byte fallback); remembered per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        self.byte_level = "ByteLevel" in json.dumps(decoder)
        self.alphabet = _byte_level_decoder() if self.byte_level else {}
        self.special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
        self.known: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        known = self.known.get(token_id)
        if known is None:
            known = self.known[token_id] = self._bytes(token_id)
        return known

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if piece in self.special:
            return piece.encode("utf-8")
        if self.byte_level:
            return bytes(self.alphabet[c] for c in piece if c in self.alphabet)
        hex_byte = _HEX_BYTE.match(piece)
        if hex_byte:
            return bytes([int(hex_byte.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")


def entry(token_id: int, logprob: float | None, top: dict[int, float], token_bytes: Callable[[int], bytes]) -> Entry:
    return {"id": token_id, "bytes": list(token_bytes(token_id)),
            "logprob": None if logprob is None else max(logprob, LOWEST_LOGPROB),
            "top": [{"id": t, "bytes": list(token_bytes(t)), "logprob": max(lp, LOWEST_LOGPROB)}
                    for t, lp in sorted(top.items(), key=lambda kv: -kv[1])]}


class LogprobTrail:
    """One request's log-probs between the scheduler's thread and the thread that sends its responses."""

    def __init__(self, prompt_ids: Sequence[int], token_bytes: Callable[[int], bytes], *, prompt: bool) -> None:
        self.prompt_ids = list(prompt_ids)
        self.token_bytes = token_bytes
        self.lock = threading.Lock()
        self.reported: list[tuple[float, dict[int, float]]] = []  # log-probs of tokens not emitted yet
        self.ready: list[Entry] = []  # entries of emitted tokens, not sent yet
        self.prompt: list[Entry] | None = ([entry(self.prompt_ids[0], None, {}, token_bytes)]
                                           if prompt and self.prompt_ids else None)
        self.prompt_sent = not prompt

    def on_prompt_logprobs(self, first: int, logprobs: list[float], tops: list[dict[int, float]]) -> None:
        """The scheduler's report of prompt tokens [first, first + len(logprobs))."""
        entries = [entry(self.prompt_ids[first + k], lp, top, self.token_bytes)
                   for k, (lp, top) in enumerate(zip(logprobs, tops))]
        with self.lock:
            if self.prompt is not None:
                self.prompt += entries

    def on_logprobs(self, logprob: float, top: dict[int, float]) -> None:
        """The scheduler's report of the next token's log-probs (the token follows in its emit)."""
        self.reported.append((logprob, top))

    def emitted(self, ids: list[int]) -> None:
        """The scheduler emitted `ids`: pair them with their reported log-probs."""
        reported, self.reported = self.reported[:len(ids)], self.reported[len(ids):]
        entries = [entry(t, lp, top, self.token_bytes) for t, (lp, top) in zip(ids, reported)]
        with self.lock:
            self.ready += entries

    def drop_last(self, count: int) -> None:
        """A stop string cut the last `count` emitted tokens off: they are never sent."""
        if count > 0:
            with self.lock:
                del self.ready[len(self.ready) - count:]

    def take(self, count: int) -> str:
        """The `output_logprobs` JSON of a response carrying the next `count` tokens."""
        with self.lock:
            tokens, self.ready = self.ready[:count], self.ready[count:]
            body: dict[str, list[Entry]] = {"tokens": tokens}
            if not self.prompt_sent:
                body["prompt"] = self.prompt or []
                self.prompt_sent = True
        return json.dumps(body)
