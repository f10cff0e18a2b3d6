"""Pure request helpers of the Triton models in front of TensorRT-LLM (no numpy, no Triton).

The router contract (``docs/triton.md``), the same as the torch ``llm`` model's: exactly one of
``input_ids`` INT32 [n], ``text_input`` BYTES or ``messages`` BYTES (a JSON chat, rendered with the
checkpoint's chat template), ``max_tokens``, optional ``temperature`` / ``top_k`` / ``top_p`` / ``seed`` /
``stop_token_ids`` (added to the model's EOS), ``stop`` BYTES [k] (stop strings; the text returned ends
before the match), ``ignore_eos`` BOOL (do not stop at EOS; stop ids and strings still apply); outputs
``output_ids`` (new tokens only), ``text_output``, ``finish_reason`` ("stop" | "length"), ``prompt_tokens``.
The penalties (``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``) and ``min_tokens`` map onto
TensorRT-LLM's own (`TENSORRT_LLM_INPUTS`; the LLM API's ``SamplingParams`` fields of the same names); the inputs
these kinds do not serve yet (`UNSERVED_INPUTS`: log-probs, logit bias, a grammar) are refused naming the input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# router input -> tensorrt_llm backend input (docs/tensorrt-llm.md, "Name mapping")
TENSORRT_LLM_INPUTS = {
    "input_ids": "input_ids", "max_tokens": "request_output_len", "temperature": "temperature",
    "top_k": "runtime_top_k", "top_p": "runtime_top_p", "seed": "seed", "stop_token_ids": "stop_words_list",
    "stop": "stop_words_list", "ignore_eos": "end_id", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens",
}
UNSERVED_INPUTS = ("logprobs", "top_logprobs", "prompt_logprobs", "logit_bias_ids", "logit_bias_values",
                   "guided_decoding")
IGNORED_END_ID = -1  # what TensorRT-LLM's own executor sends as end_id for SamplingParams(ignore_eos=True)


@dataclass
class GenRequest:
    prompt_ids: list[int] | None
    text: str | None
    max_tokens: int
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    messages: str | None = None  # the JSON chat, rendered by the model with the chat template
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None


def _flat(value: Any) -> list[Any]:
    out: list[Any] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (list, tuple)):
            stack.extend(reversed(v))
        elif hasattr(v, "tolist"):
            stack.append(v.tolist())
        else:
            out.append(v)
    return out


def _string(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def parse_request(get: Callable[[str], Any]) -> GenRequest:
    """Read one request; ``get(name)`` returns the input (nested lists / numpy) or None. Raises ValueError."""
    ids, text, messages = get("input_ids"), get("text_input"), get("messages")
    if sum(x is not None for x in (ids, text, messages)) != 1:
        raise ValueError("exactly one of inputs 'input_ids', 'text_input' and 'messages' must be given")
    prompt_ids = [int(t) for t in _flat(ids)] if ids is not None else None
    text_value = _string(_flat(text)[0]) if text is not None else None
    chat = _string(_flat(messages)[0]) if messages is not None else None
    if not prompt_ids and not text_value and not chat:
        raise ValueError("the request needs a non-empty input_ids, text_input or messages")
    max_tokens = get("max_tokens")
    if max_tokens is None or int(_flat(max_tokens)[0]) < 1:
        raise ValueError("max_tokens must be given and >= 1")

    def opt(name: str, cast: Callable[[Any], Any]) -> Any:
        value = get(name)
        return None if value is None else cast(_flat(value)[0])

    unserved = next((name for name in UNSERVED_INPUTS if get(name) is not None), None)
    if unserved is not None:
        raise ValueError(f"input {unserved!r} is not served by the TensorRT-LLM engine kinds yet")
    stops, stop_strings = get("stop_token_ids"), get("stop")
    words = [_string(w) for w in _flat(stop_strings)] if stop_strings is not None else []
    if any(not w for w in words):
        raise ValueError("input 'stop' holds an empty string")
    return GenRequest(prompt_ids, text_value, int(_flat(max_tokens)[0]), opt("temperature", float),
                      opt("top_k", int), opt("top_p", float), opt("seed", int),
                      [int(t) for t in _flat(stops)] if stops is not None else [], chat, words,
                      bool(opt("ignore_eos", bool) or False), opt("presence_penalty", float),
                      opt("frequency_penalty", float), opt("repetition_penalty", float), opt("min_tokens", int))


def check_limits(prompt_len: int, max_tokens: int, *, max_input_len: int, max_seq_len: int) -> None:
    if prompt_len > max_input_len:
        raise ValueError(f"prompt of {prompt_len} tokens is over max_input_len {max_input_len}")
    if prompt_len + max_tokens > max_seq_len:
        raise ValueError(f"prompt ({prompt_len}) + max_tokens ({max_tokens}) is over max_seq_len {max_seq_len}")


def stop_words_list(words: list[list[int]]) -> list[list[int]]:
    """TensorRT-LLM's ``stop_words_list`` [2, n]: every word's token ids concatenated, then the cumulative end
    offset of each word padded with -1 (the layout the backend's preprocessing model writes)."""
    flat = [int(t) for w in words for t in w]
    ends, total = [], 0
    for w in words:
        total += len(w)
        ends.append(total)
    width = max(1, len(flat))
    return [flat + [0] * (width - len(flat)), ends + [-1] * (width - len(ends))]


def stop_words(stop_ids: list[int], stop_strings: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Stop words as token-id sequences: each stop id alone, each stop string as the tokenizer encodes it
    without special tokens (the engine then matches tokens: a string that the model spells with other
    tokens is still cut from the text by ``cut_at_stop``)."""
    out = [[int(t)] for t in stop_ids]
    for text in stop_strings:
        ids = [int(t) for t in encode(text)]
        if ids:
            out.append(ids)
    return out


def cut_at_stop(text: str, stop_strings: list[str]) -> tuple[str, bool]:
    """The text before the first stop string, and whether one was found (the torch model's semantics)."""
    hits = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def generated_tokens(output_ids: list[int], sequence_length: int, *, prompt_len: int,
                     input_in_output: bool) -> list[int]:
    """New tokens of beam 0 from the backend's ``output_ids`` / ``sequence_length``."""
    start = prompt_len if input_in_output else 0
    return [int(t) for t in output_ids[start:int(sequence_length)]]


def finish_reason(tokens: list[int], max_tokens: int, stop_ids: set[int]) -> str:
    if tokens and tokens[-1] in stop_ids:
        return "stop"
    return "length" if len(tokens) >= max_tokens else "stop"
