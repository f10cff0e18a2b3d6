"""The bodies the front answers with: OpenAI's completion and chat completion objects, their stream chunks, and
their ``logprobs`` in OpenAI's shapes, built from the engine's pieces (`backend.Piece`).

Log-probs come from the llm's ``output_logprobs`` (`serving.triton.models.logprob_output`: each token's id,
bytes, log-prob and alternatives):

- chat: ``choices[].logprobs.content[]`` of ``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}`` (``top_logprobs`` alternatives, most likely first);
- completions: ``logprobs`` of ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict token -> log-prob per token:
  the ``logprobs`` likeliest and the chosen one, as vLLM answers) and ``text_offset`` (each token's offset in the
  choice's text, counted from the prompt's start); with ``echo`` the prompt's tokens come first, the first with
  ``token_logprobs`` and ``top_logprobs`` null.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

Entry = dict[str, Any]  # one token of `output_logprobs`


def token_text(entry: Entry) -> str:
    return bytes(entry["bytes"]).decode("utf-8", "replace")


@dataclass
class Choice:
    """What one choice of one prompt has gathered from its pieces."""

    index: int
    prompt_text: str = ""  # the prompt as echoed (``echo``), else ""
    text: str = ""
    tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    prompt_entries: list[Entry] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)


def chat_logprobs(entries: list[Entry], top_n: int) -> dict[str, Any]:
    def one(e: Entry) -> dict[str, Any]:
        return {"token": token_text(e), "logprob": e["logprob"], "bytes": e["bytes"]}

    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e["top"][:top_n]]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[Entry], top_n: int, offset: int) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` of `entries` (prompt ones first, with echo); `offset`: the first's text
    offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for e in entries:
        text = token_text(e)
        tokens.append(text)
        token_logprobs.append(e["logprob"])
        if e["logprob"] is None:
            tops.append(None)
        else:
            top = {token_text(t): t["logprob"] for t in reversed(e["top"][:top_n])}
            top.setdefault(text, e["logprob"])
            tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass(frozen=True)
class Shape:
    """How a request wants its answer shaped."""

    rid: str
    model: str
    chat: bool
    logprobs: bool  # chat: logprobs true; completions: logprobs given
    top_n: int  # chat: top_logprobs; completions: logprobs

    def envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": int(time.time()), "model": self.model, "choices": choices}

    def choice_logprobs(self, prompt_entries: list[Entry], entries: list[Entry], offset: int) -> Any:
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(entries, self.top_n)
        return completion_logprobs(prompt_entries + entries, self.top_n, offset)

    def body(self, choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
        """The whole answer of a request that did not stream."""
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            item: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason or "length",
                                    "logprobs": self.choice_logprobs(c.prompt_entries, c.entries,
                                                                     0 if c.prompt_entries else len(c.prompt_text))}
            if self.chat:
                item["message"] = {"role": "assistant", "content": c.text}
            else:
                item["text"] = c.prompt_text + c.text
            out.append(item)
        completion_tokens = sum(c.tokens for c in choices)
        return {**self.envelope(out, chunk=False), "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, index: int, text: str | None, reason: str | None, *, role: bool = False,
              prompt_entries: list[Entry] | None = None, entries: list[Entry] | None = None,
              offset: int = 0) -> dict[str, Any]:
        """One choice's stream chunk: its new text (and log-probs), its role (chat's first), or its finish."""
        logprobs = (self.choice_logprobs(prompt_entries or [], entries or [], offset)
                    if prompt_entries or entries else None)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
            if reason is not None:
                delta = {}
            choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        return self.envelope([choice], chunk=True)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The last chunk of a stream asked for ``stream_options.include_usage``: no choices, the usage."""
        return {**self.envelope([], chunk=True), "usage": usage(prompt_tokens, completion_tokens)}
