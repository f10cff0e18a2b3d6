"""Parsing and batching of ``llm`` model requests, independent of ``triton_python_backend_utils``.

A request is read through a getter ``name -> numpy array | None`` so the same code runs inside Triton
and in unit tests. Inputs (the batch dim of 1 added by Triton's dynamic batcher is dropped here):
``input_ids`` INT32 [-1], ``text_input`` BYTES [1] or ``messages`` BYTES [1] (a JSON chat, rendered with
the engine's chat template; exactly one of the three), ``max_tokens`` INT32 [1], optional ``temperature``
FP32, ``top_k`` INT32, ``top_p`` FP32, ``seed`` INT64, ``stop_token_ids`` INT32 [-1] (added to the engine's
EOS ids), ``ignore_eos`` BOOL [1] (do not stop at EOS), ``stop`` BYTES [-1] (stop strings, matched on the
text with special tokens; the text returned ends before the match), and (decoupled models only)
``stream`` BOOL [1]: one response per token instead of one at the end.

Served by in-flight paged engines only (others refuse them, naming the input): ``logprobs`` BOOL [1] (each
output token's raw log-prob), ``top_logprobs`` INT32 [1] (0 to MAX_TOP_LOGPROBS alternatives per token),
``prompt_logprobs`` BOOL [1] (each prompt token's log-prob given the tokens before it, and as many alternatives),
all returned in the ``output_logprobs`` output (JSON, `serving.triton.models.logprob_output`); ``presence_penalty`` and
``frequency_penalty`` FP32 [1] (-2 to 2), ``repetition_penalty`` FP32 [1] (> 0, 1 = off), ``logit_bias_ids``
INT32 [-1] with ``logit_bias_values`` FP32 [-1] (-100 to 100, added to those tokens' logits), ``min_tokens``
INT32 [1] (no stop token before that many), ``guided_decoding`` BYTES [1] (a grammar: `guided.token_mask_for`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

GetInput = Callable[[str], "np.ndarray | None"]

# the inputs only the in-flight paged engine serves, in the order a refusal names them
EXTRA_INPUT_NAMES = ("logprobs", "top_logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "logit_bias_ids", "logit_bias_values", "min_tokens", "guided_decoding")
INPUT_NAMES = ("input_ids", "text_input", "messages", "max_tokens", "temperature", "top_k", "top_p", "seed",
               "stop_token_ids", "ignore_eos", "stop", "stream", *EXTRA_INPUT_NAMES)
OUTPUT_NAMES = ("output_ids", "text_output", "finish_reason", "prompt_tokens", "output_logprobs")
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # OpenAI's limit of chat top_logprobs (completions allow 5)
MAX_LOGIT_BIAS = 300  # entries of logit_bias at most (OpenAI's limit)
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)


# Begins the message of every request the llm refuses (INVALID_ARG): Triton 2.51's BLS turns the code of a
# target's error into INTERNAL, so the routers recognise a client's mistake by these words.
INVALID_REQUEST = "invalid request"


class RequestError(ValueError):
    """A request the model rejects; its message goes back to the client as the response error."""


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling; ``temperature == 0`` (the default) is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def shapes_logits(self) -> bool:
        """Whether penalties, a logit bias or min_tokens change the logits (the engine's sampler then runs)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or self.min_tokens > 0)


@dataclass(frozen=True)
class LlmRequest:
    """One parsed request. Exactly one of ``prompt_ids`` / ``text`` / ``messages`` (JSON) is set."""

    prompt_ids: tuple[int, ...] | None
    text: str | None
    max_tokens: int
    sampling: Sampling
    stop_token_ids: tuple[int, ...]
    want_text: bool
    stream: bool = False
    messages: str | None = None
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    guided_decoding: str | None = None

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0 or self.prompt_logprobs

    def extra_input(self) -> str | None:
        """The first input it uses that only the in-flight paged engine serves, or None."""
        s = self.sampling
        used = {"logprobs": self.logprobs, "top_logprobs": self.top_logprobs > 0,
                "prompt_logprobs": self.prompt_logprobs, "presence_penalty": s.presence_penalty != 0.0,
                "frequency_penalty": s.frequency_penalty != 0.0, "repetition_penalty": s.repetition_penalty != 1.0,
                "logit_bias_ids": bool(s.logit_bias), "min_tokens": s.min_tokens > 0,
                "guided_decoding": self.guided_decoding is not None}
        return next((name for name in EXTRA_INPUT_NAMES if used.get(name)), None)

    def group_key(self) -> tuple:
        """Requests with equal keys can share one ``generate`` call."""
        return (self.sampling if not self.sampling.is_greedy else None, self.stop_token_ids)


def _scalar(arr: np.ndarray | None, name: str) -> np.generic | None:
    if arr is None:
        return None
    flat = np.asarray(arr).reshape(-1)
    if flat.size != 1:
        raise RequestError(f"input {name!r} must hold exactly one value, got shape {list(np.shape(arr))}")
    return flat[0]


def _ids(arr: np.ndarray | None, name: str) -> tuple[int, ...] | None:
    if arr is None:
        return None
    a = np.asarray(arr)
    if a.ndim == 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 1:
        raise RequestError(f"input {name!r} must be [1, n] token ids, got shape {list(np.shape(arr))}")
    if a.size and (a.min() < 0):
        raise RequestError(f"input {name!r} holds a negative token id {int(a.min())}")
    return tuple(a.tolist())  # Python ints, copied out of the request's tensor


def _text(arr: np.ndarray | None, name: str) -> str | None:
    value = _scalar(arr, name)
    if value is None:
        return None
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"input {name!r} is not valid UTF-8: {exc}") from exc
    return str(value)


def _strings(arr: np.ndarray | None, name: str) -> tuple[str, ...]:
    if arr is None:
        return ()
    values = np.asarray(arr).reshape(-1)
    if values.size > MAX_STOP_STRINGS:
        raise RequestError(f"input {name!r} holds {values.size} strings; at most {MAX_STOP_STRINGS} are allowed")
    out = tuple(_text(np.asarray([v]), name) or "" for v in values)
    if any(not s for s in out):
        raise RequestError(f"input {name!r} holds an empty string")
    return out


def parse_request(get_input: GetInput, requested_outputs: tuple[str, ...] = ()) -> LlmRequest:
    """Read and check one request's inputs (not yet against the engine's limits)."""
    prompt_ids = _ids(get_input("input_ids"), "input_ids")
    text = _text(get_input("text_input"), "text_input")
    messages = _text(get_input("messages"), "messages")
    if sum(x is not None for x in (prompt_ids, text, messages)) != 1:
        raise RequestError("exactly one of inputs 'input_ids', 'text_input' and 'messages' must be given")
    if prompt_ids is not None and not prompt_ids:
        raise RequestError("input 'input_ids' is empty")
    max_tokens = _scalar(get_input("max_tokens"), "max_tokens")
    if max_tokens is None:
        raise RequestError("input 'max_tokens' is required")
    if int(max_tokens) < 1:
        raise RequestError(f"input 'max_tokens'={int(max_tokens)} must be >= 1")
    temperature = _scalar(get_input("temperature"), "temperature")
    top_k = _scalar(get_input("top_k"), "top_k")
    top_p = _scalar(get_input("top_p"), "top_p")
    seed = _scalar(get_input("seed"), "seed")
    sampling = Sampling(
        temperature=0.0 if temperature is None else float(temperature),
        top_k=0 if top_k is None else int(top_k),
        top_p=1.0 if top_p is None else float(top_p),
        seed=None if seed is None else int(seed),
    )
    if sampling.temperature < 0 or not np.isfinite(sampling.temperature):
        raise RequestError(f"input 'temperature'={sampling.temperature} must be a finite number >= 0")
    if sampling.top_k < 0:
        raise RequestError(f"input 'top_k'={sampling.top_k} must be >= 0 (0 = off)")
    if not 0.0 < sampling.top_p <= 1.0:
        raise RequestError(f"input 'top_p'={sampling.top_p} must be in (0, 1]")
    sampling = _shaping(get_input, sampling)
    stop = _ids(get_input("stop_token_ids"), "stop_token_ids") or ()
    want_text = text is not None or messages is not None or "text_output" in requested_outputs
    stream = _scalar(get_input("stream"), "stream")
    ignore_eos = _scalar(get_input("ignore_eos"), "ignore_eos")
    top_logprobs = _scalar(get_input("top_logprobs"), "top_logprobs")
    top_n = 0 if top_logprobs is None else int(top_logprobs)
    if not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise RequestError(f"input 'top_logprobs'={top_n} must be from 0 to {MAX_TOP_LOGPROBS}")
    return LlmRequest(prompt_ids, text, int(max_tokens), sampling, stop, want_text,
                      stream=bool(stream) if stream is not None else False, messages=messages,
                      ignore_eos=bool(ignore_eos) if ignore_eos is not None else False,
                      stop_strings=_strings(get_input("stop"), "stop"),
                      logprobs=_flag(get_input, "logprobs"), top_logprobs=top_n,
                      prompt_logprobs=_flag(get_input, "prompt_logprobs"),
                      guided_decoding=_text(get_input("guided_decoding"), "guided_decoding"))


def _flag(get_input: GetInput, name: str) -> bool:
    value = _scalar(get_input(name), name)
    return bool(value) if value is not None else False


def _number(get_input: GetInput, name: str, default: float, least: float, most: float, *,
            above: bool = False) -> float:
    value = _scalar(get_input(name), name)
    if value is None:
        return default
    number = float(value)
    if not np.isfinite(number) or not (least < number if above else least <= number) or number > most:
        raise RequestError(f"input {name!r}={number:g} must be a number {'above' if above else 'from'} {least:g} "
                           f"{'and at most' if above else 'to'} {most:g}")
    return number


def _shaping(get_input: GetInput, sampling: Sampling) -> Sampling:
    """`sampling` with the request's penalties, logit bias and min_tokens."""
    ids = _ids(get_input("logit_bias_ids"), "logit_bias_ids") or ()
    values = get_input("logit_bias_values")
    biases = tuple(float(v) for v in np.asarray(values).reshape(-1)) if values is not None else ()
    if len(ids) != len(biases):
        raise RequestError(f"inputs 'logit_bias_ids' ({len(ids)} values) and 'logit_bias_values' ({len(biases)} "
                           "values) must be as long as each other")
    if len(ids) > MAX_LOGIT_BIAS:
        raise RequestError(f"input 'logit_bias_ids' holds {len(ids)} tokens; at most {MAX_LOGIT_BIAS} are allowed")
    bad = next((b for b in biases if not LOGIT_BIAS_RANGE[0] <= b <= LOGIT_BIAS_RANGE[1]), None)
    if bad is not None:
        raise RequestError(f"input 'logit_bias_values' holds {bad:g}; a bias must be from {LOGIT_BIAS_RANGE[0]:g} "
                           f"to {LOGIT_BIAS_RANGE[1]:g}")
    min_tokens = _scalar(get_input("min_tokens"), "min_tokens")
    if min_tokens is not None and int(min_tokens) < 0:
        raise RequestError(f"input 'min_tokens'={int(min_tokens)} must be >= 0")
    return dataclasses.replace(
        sampling,
        presence_penalty=_number(get_input, "presence_penalty", 0.0, *PENALTY_RANGE),
        frequency_penalty=_number(get_input, "frequency_penalty", 0.0, *PENALTY_RANGE),
        repetition_penalty=_number(get_input, "repetition_penalty", 1.0, 0.0, 2.0**16, above=True),
        logit_bias=tuple(zip(ids, biases)), min_tokens=0 if min_tokens is None else int(min_tokens))


MAX_BYTES_PER_TOKEN = 32  # a prompt longer than max_input_len x this cannot fit: refused before tokenizing


def check_text_size(text: str, *, max_input_len: int) -> None:
    """Refuse a text prompt too long to tokenize within ``max_input_len`` tokens, without tokenizing it."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_input_len * MAX_BYTES_PER_TOKEN:
        raise RequestError(f"input 'text_input' of {size} bytes exceeds the engine limit max_input_len="
                           f"{max_input_len} tokens (at most {max_input_len * MAX_BYTES_PER_TOKEN} bytes, "
                           f"{MAX_BYTES_PER_TOKEN} per token, are tokenized)")


def check_limits(prompt_ids: tuple[int, ...], max_tokens: int, *, max_input_len: int, max_seq_len: int,
                 vocab_size: int | None = None) -> None:
    """Reject a prompt the engine cannot serve, naming the value and the engine limit."""
    if len(prompt_ids) > max_input_len:
        raise RequestError(
            f"prompt of {len(prompt_ids)} tokens exceeds the engine limit max_input_len={max_input_len}"
        )
    if len(prompt_ids) + max_tokens > max_seq_len:
        raise RequestError(
            f"prompt of {len(prompt_ids)} tokens + max_tokens={max_tokens} exceeds the engine limit "
            f"max_seq_len={max_seq_len}"
        )
    if vocab_size is not None and prompt_ids and max(prompt_ids) >= vocab_size:
        raise RequestError(f"token id {max(prompt_ids)} in 'input_ids' is outside the vocabulary ({vocab_size})")


def check_vocab(req: LlmRequest, vocab_size: int) -> None:
    """Reject a logit bias or stop token id outside the vocabulary."""
    bad = next((t for t, _ in req.sampling.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise RequestError(f"input 'logit_bias_ids' names token id {bad}, outside the vocabulary [0, {vocab_size})")


@dataclass(frozen=True)
class BatchItem:
    """A request ready to run: its index in the Triton batch, prompt and settings."""

    index: int
    prompt_ids: tuple[int, ...]
    max_tokens: int
    key: tuple


def plan_batches(items: list[BatchItem], *, max_batch_size: int, max_seq_len: int) -> list[list[BatchItem]]:
    """Group items into ``generate`` calls: same key, at most ``max_batch_size``, and the longest prompt
    plus the largest ``max_tokens`` of a group within ``max_seq_len`` (each item fits alone)."""
    groups: dict[tuple, list[list[BatchItem]]] = {}
    for item in items:
        chunks = groups.setdefault(item.key, [])
        for chunk in chunks:
            longest = max(len(i.prompt_ids) for i in chunk + [item])
            most = max(i.max_tokens for i in chunk + [item])
            if len(chunk) < max_batch_size and longest + most <= max_seq_len:
                chunk.append(item)
                break
        else:
            chunks.append([item])
    return [chunk for chunks in groups.values() for chunk in chunks]
