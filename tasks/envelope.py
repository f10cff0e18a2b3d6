"""The engine's whole envelope in the gates: prompts up to `max_input_len`, batches up to `max_batch_size`.

An engine is built for its limits (`engine.max_input_len`, `max_seq_len`, `max_batch_size`); gates that only
try short prompts in narrow batches pass faults that appear past some position (a RoPE table wrong beyond
N) or in wide batches (rows interfering). This module says which prompt lengths and batch widths the gates
run:
- `envelope_lengths`: the long prompts' lengths, the longest as near `max_input_len` as the sequence limit
  lets a generation of `max_new_tokens` follow it;
- `long_prompt_ids`: a prompt of exactly that many tokens, made of the fixed texts (the evaluation passages)
  continued one after another, so it stays natural text rather than repeated ids;
- `workload_lengths`: the hook the perf gate calls for its workload's prompt lengths (one row at the longest
  length the engine takes, the others at the spec's `input_len`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LongPrompt:
    label: str  # what a report shows instead of the text: "passages 3.. continued to 126 tokens"
    ids: list[int]


def longest_prompt(*, max_input_len: int, max_seq_len: int, max_new_tokens: int) -> int:
    """The longest prompt that leaves room for `max_new_tokens` under `max_seq_len`, at most `max_input_len`."""
    longest = min(max_input_len, max_seq_len - max_new_tokens)
    if longest < 1:
        raise ValueError(f"no prompt fits: limits.max_seq_len={max_seq_len} - max_new_tokens={max_new_tokens} "
                         "leaves no position for a prompt")
    return longest


def envelope_lengths(count: int, *, max_input_len: int, max_seq_len: int, max_new_tokens: int,
                     shortest: int = 1) -> list[int]:
    """`count` prompt lengths spread from the longest the engine takes down towards `shortest` (the longest
    first; distinct, each at least `shortest`)."""
    longest = longest_prompt(max_input_len=max_input_len, max_seq_len=max_seq_len, max_new_tokens=max_new_tokens)
    lengths = [max(shortest, longest - (longest - shortest) * i // (2 * count)) for i in range(count)]
    return list(dict.fromkeys(lengths))


def long_prompt_ids(tokenizer, texts: Sequence[str], length: int, *, start: int = 0) -> list[int]:
    """Exactly `length` token ids of `texts` joined from `texts[start]` on (wrapping around), tokenized as one
    text by `tokenizer` (an HF tokenizer; its special tokens added as for any prompt)."""
    if not texts:
        raise ValueError("long_prompt_ids: no texts to build a prompt from")
    pieces: list[str] = []
    ids: list[int] = []
    i = start
    while len(ids) < length:
        pieces.append(texts[i % len(texts)])
        i += 1
        if len(pieces) % 4 == 0 or i - start >= len(texts):  # tokenize every few pieces, not after each
            ids = list(tokenizer(" ".join(pieces)).input_ids)
        if i - start > 64 * len(texts):
            raise ValueError(f"long_prompt_ids: the texts do not reach {length} tokens")
    return ids[:length]


def long_prompts(tokenizer, texts: Sequence[str], count: int, *, max_input_len: int, max_seq_len: int,
                 max_new_tokens: int, shortest: int = 1) -> list[LongPrompt]:
    """The gates' long prompts: `envelope_lengths` of them, each from another of the fixed texts."""
    lengths = envelope_lengths(count, max_input_len=max_input_len, max_seq_len=max_seq_len,
                               max_new_tokens=max_new_tokens, shortest=shortest)
    out = []
    for n, length in enumerate(lengths):
        start = (n * 5) % len(texts)
        out.append(LongPrompt(f"[fixed texts from #{start}, {length} tokens]",
                              long_prompt_ids(tokenizer, texts, length, start=start)))
    return out


def workload_lengths(*, batch_size: int, input_len: int, max_input_len: int, max_seq_len: int,
                     output_len: int) -> list[int]:
    """The perf gate's hook: each row's prompt length for a workload of `batch_size` rows of `input_len`
    tokens, the last row at the longest prompt the engine takes with `output_len` new tokens after it (so
    the timed run covers the long end of the envelope too). One row only: `input_len` stays the typical row."""
    longest = longest_prompt(max_input_len=max_input_len, max_seq_len=max_seq_len, max_new_tokens=output_len)
    typical = min(input_len, longest)
    return [typical] * (batch_size - 1) + [longest]
