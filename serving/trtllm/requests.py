"""Pure request helpers of the Triton models in front of TensorRT-LLM (no numpy, no Triton).

The router contract (``docs/triton.md``): inputs ``input_ids`` INT32 [n] or ``text_input`` BYTES,
``max_tokens``, optional ``temperature`` / ``top_k`` / ``top_p`` / ``seed`` / ``stop_token_ids``; outputs
``output_ids`` (new tokens only), ``text_output``, ``finish_reason`` ("stop" | "length").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# router input -> tensorrt_llm backend input (docs/tensorrt-llm.md, "Name mapping")
TENSORRT_LLM_INPUTS = {
    "input_ids": "input_ids", "max_tokens": "request_output_len", "temperature": "temperature",
    "top_k": "runtime_top_k", "top_p": "runtime_top_p", "seed": "seed", "stop_token_ids": "stop_words_list",
}


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


def parse_request(get: Callable[[str], Any]) -> GenRequest:
    """Read one request; ``get(name)`` returns the input (nested lists / numpy) or None. Raises ValueError."""
    ids, text = get("input_ids"), get("text_input")
    prompt_ids = [int(t) for t in _flat(ids)] if ids is not None else None
    text_value = None
    if prompt_ids is None and text is not None:
        raw = _flat(text)[0]
        text_value = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    if not prompt_ids and not text_value:
        raise ValueError("the request needs a non-empty input_ids or text_input")
    max_tokens = get("max_tokens")
    if max_tokens is None or int(_flat(max_tokens)[0]) < 1:
        raise ValueError("max_tokens must be given and >= 1")

    def opt(name: str, cast: Callable[[Any], Any]) -> Any:
        value = get(name)
        return None if value is None else cast(_flat(value)[0])

    stops = get("stop_token_ids")
    return GenRequest(prompt_ids, text_value, int(_flat(max_tokens)[0]), opt("temperature", float),
                      opt("top_k", int), opt("top_p", float), opt("seed", int),
                      [int(t) for t in _flat(stops)] if stops is not None else [])


def check_limits(prompt_len: int, max_tokens: int, *, max_input_len: int, max_seq_len: int) -> None:
    if prompt_len > max_input_len:
        raise ValueError(f"prompt of {prompt_len} tokens is over max_input_len {max_input_len}")
    if prompt_len + max_tokens > max_seq_len:
        raise ValueError(f"prompt ({prompt_len}) + max_tokens ({max_tokens}) is over max_seq_len {max_seq_len}")


def stop_words_list(stop_ids: list[int]) -> list[list[int]]:
    """TensorRT-LLM's ``stop_words_list`` [2, n] for single-token stop words: ids, then cumulative offsets."""
    return [list(stop_ids), list(range(1, len(stop_ids) + 1))]


def generated_tokens(output_ids: list[int], sequence_length: int, *, prompt_len: int,
                     input_in_output: bool) -> list[int]:
    """New tokens of beam 0 from the backend's ``output_ids`` / ``sequence_length``."""
    start = prompt_len if input_in_output else 0
    return [int(t) for t in output_ids[start:int(sequence_length)]]


def finish_reason(tokens: list[int], max_tokens: int, stop_ids: set[int]) -> str:
    if tokens and tokens[-1] in stop_ids:
        return "stop"
    return "length" if len(tokens) >= max_tokens else "stop"
