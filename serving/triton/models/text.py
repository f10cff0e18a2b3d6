"""What the ``llm`` model knows about its engine's text, read once at load, and the detokenizing of one
request's tokens with its stop strings.

``read_engine_text(engine_dir)`` -> ``EngineText`` (frozen): the end-of-sequence ids of
``generation_config.json`` (``eos_token_id``, an int or a list; what stops generation by default), the
ids of the tokenizer's special tokens (``tokenizer.json`` ``added_tokens`` marked special), the special
token strings of ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ..., which chat templates
use) and the chat template itself (``chat_template.jinja``, else ``tokenizer_config.json``'s
``chat_template``).

``TextStream`` turns one request's tokens into text incrementally (the prefix/read-offset method of
vLLM's detokenizer, so a character split over tokens comes out whole and a word's leading space is
kept) and matches its stop strings against the text *with* special tokens, so ``stop=["<|im_end|>"]``
works although the text a client sees has special tokens removed (like ``skip_special_tokens``). The
token that stops a generation (EOS or a stop id) is never part of the text. While stop strings are
set, the last ``len(longest stop) - 1`` characters are held back until they cannot start a match.

Imports: stdlib only (the tokenizer object is passed in).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
DECODE_WINDOW = 6  # tokens decoded before the new one, so the tokenizer sees its context (vLLM uses 5)


@dataclass(frozen=True)
class EngineText:
    """The engine folder's stopping ids, special tokens and chat template."""

    eos_token_ids: tuple[int, ...] = ()
    special_ids: frozenset[int] = frozenset()
    special_tokens: tuple[tuple[str, str], ...] = ()  # (name, text) for templates: ("eos_token", "<|im_end|>")
    chat_template: str | None = None
    chat_template_source: str = ""  # the file it came from, for messages


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _eos_ids(generation: dict[str, Any], path: Path) -> tuple[int, ...]:
    value = generation.get("eos_token_id")
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{path}: eos_token_id={value!r} must be a token id or a list of them")
    return tuple(dict.fromkeys(values))


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_template(engine_dir: Path, config: dict[str, Any]) -> tuple[str | None, str]:
    path = engine_dir / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8"), path.name
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return (template, TOKENIZER_CONFIG) if isinstance(template, str) and template else (None, "")


def read_engine_text(engine_dir: Path) -> EngineText:
    """The engine folder's EOS ids, special tokens and chat template (each absent part left empty)."""
    engine_dir = Path(engine_dir)
    eos = _eos_ids(_read_json(engine_dir / GENERATION_CONFIG), engine_dir / GENERATION_CONFIG)
    added = _read_json(engine_dir / TOKENIZER_JSON).get("added_tokens") or []
    special = frozenset(int(t["id"]) for t in added if isinstance(t, dict) and t.get("special") and "id" in t)
    config = _read_json(engine_dir / TOKENIZER_CONFIG)
    tokens = tuple((key, text) for key in SPECIAL_TOKEN_KEYS if (text := _token_text(config.get(key))) is not None)
    template, source = _chat_template(engine_dir, config)
    return EngineText(eos, special, tokens, template, source)


def stop_ids_for(request_ids: tuple[int, ...], eos_ids: tuple[int, ...], *, ignore_eos: bool) -> tuple[int, ...]:
    """The ids that end a request: its own ``stop_token_ids`` plus the engine's EOS ids unless
    ``ignore_eos`` (vLLM's semantics: stop ids add to EOS; ``ignore_eos`` drops EOS only)."""
    return tuple(dict.fromkeys(request_ids + (() if ignore_eos else eos_ids)))


class TextStream:
    """One request's text: feed its tokens in order with ``add``; read what may be sent."""

    def __init__(self, tokenizer: Any, *, special_ids: frozenset[int], stop_ids: tuple[int, ...] = (),
                 stop_strings: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.special_ids = special_ids
        self.stop_ids = frozenset(stop_ids)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.holdback = max((len(s) for s in self.stop_strings), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.full = ""  # every token's text, special tokens included (what stop strings match)
        self.pieces: list[tuple[int, int, int]] = []  # (start in `full`, start in `visible`, length) if visible
        self.visible = ""  # without special tokens
        self.sent = 0  # characters of `visible` already handed out
        self.stopped = False  # a stop string matched: the text is final

    def _piece(self, token: int) -> tuple[str, bool]:
        """The new text of the last token (``""`` while a character is incomplete) and whether it is hidden."""
        if token in self.special_ids or token in self.stop_ids:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            self.prefix_offset = self.read_offset = len(self.ids)  # decode what follows on its own
            return text, True
        before = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=False)
        after = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=False)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return "", False  # wait for the rest of the character
        self.prefix_offset = max(self.read_offset, len(self.ids) - DECODE_WINDOW)
        self.read_offset = len(self.ids)
        return after[len(before):], False

    def add(self, ids: list[int]) -> int | None:
        """Feed new tokens; return how many of them to keep when a stop string matched (the generation
        ends with the token that completed it), else None."""
        for n, token in enumerate(ids, start=1):
            if self.stopped:
                return 0
            self.ids.append(token)
            text, hidden = self._piece(token)
            if not text:
                continue
            start = max(0, len(self.full) - self.holdback)
            if not hidden:
                self.pieces.append((len(self.full), len(self.visible), len(text)))
                self.visible += text
            self.full += text
            if self.stop_strings and self._match(start):
                return n
        return None

    def _match(self, start: int) -> bool:
        found = [i for i in (self.full.find(s, start) for s in self.stop_strings) if i >= 0]
        if not found:
            return False
        cut = min(found)
        keep = 0  # visible characters that come before `cut` in `full`
        for full_start, visible_start, length in self.pieces:
            if full_start >= cut:
                break
            keep = visible_start + min(length, cut - full_start)
        self.visible = self.visible[:keep]
        self.stopped = True
        return True

    def take(self, *, final: bool) -> str:
        """The visible text not handed out yet: all of it when ``final`` (or stopped), otherwise without
        the tail that could still begin a stop string."""
        end = len(self.visible) if final or self.stopped or not self.stop_strings else len(self.visible) - self.holdback
        end = max(end, self.sent)
        text, self.sent = self.visible[self.sent:end], end
        return text
