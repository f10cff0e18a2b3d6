"""A recorded fake of the ``tensorrt_llm`` 1.2 API surface enginewright uses (tests only).

Signatures recorded from the TensorRT-LLM 1.2 docs (LLM API reference, KvCacheConfig example,
llm_inference_async_streaming example; SamplingParams' stop / stop_token_ids / include_stop_str_in_output /
ignore_eos / add_special_tokens / skip_special_tokens and RequestOutput.prompt_token_ids from the API reference). Every call is appended to ``CALLS`` and checked: an argument
outside the recorded signature raises TypeError, as the real classes would.
Put ``tests/golden/trtllm/fake_tensorrt_llm`` first on ``sys.path`` to import it as ``tensorrt_llm``.
"""

from __future__ import annotations

from typing import Any

__version__ = "1.2.0"
FAKE = True
CALLS: list[tuple[str, dict[str, Any]]] = []

LLM_SIGNATURE = frozenset({
    "model", "tokenizer", "tokenizer_mode", "skip_tokenizer_init", "trust_remote_code", "tensor_parallel_size",
    "dtype", "revision", "tokenizer_revision", "backend", "pipeline_parallel_size", "max_batch_size",
    "max_num_tokens", "max_seq_len", "max_input_len", "max_beam_width", "kv_cache_config",
    "enable_chunked_prefill",
})
SAMPLING_SIGNATURE = frozenset({"max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "end_id",
                                "pad_id", "n", "stop", "detokenize", "return_log_probs", "include_stop_str_in_output",
                                "ignore_eos", "add_special_tokens", "skip_special_tokens"})


def _check(name: str, kwargs: dict[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise TypeError(f"{name}() got unexpected keyword arguments {unknown}")
    CALLS.append((name, dict(kwargs)))


class SamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        _check("SamplingParams", kwargs, SAMPLING_SIGNATURE)
        self.__dict__.update(kwargs)


class CompletionOutput:
    def __init__(self, token_ids: list[int], text: str, finish_reason: str | None) -> None:
        self.token_ids, self.text, self.finish_reason = token_ids, text, finish_reason


class RequestOutput:
    def __init__(self, outputs: list[CompletionOutput], prompt_token_ids: list[int]) -> None:
        self.outputs = outputs
        self.prompt_token_ids = prompt_token_ids


class _Generation:
    """What ``generate_async`` returns: awaitable via ``aresult()``, async-iterable when streaming."""

    def __init__(self, prompt: Any, params: SamplingParams, streaming: bool) -> None:
        # a text prompt "tokenizes" to one id per character, so its prompt_token_ids have a checkable length
        self.prompt_ids = list(prompt) if isinstance(prompt, list) else [ord(c) for c in prompt]
        start = prompt[-1] if isinstance(prompt, list) else len(prompt)
        n = int(params.max_tokens)
        self.tokens = [int(start) + i + 1 for i in range(n)]
        self.streaming = streaming

    def _out(self, k: int) -> RequestOutput:
        toks = self.tokens[:k]
        return RequestOutput([CompletionOutput(toks, " ".join(map(str, toks)), "length" if k == len(self.tokens) else None)],
                             self.prompt_ids)

    async def aresult(self) -> RequestOutput:
        return self._out(len(self.tokens))

    def __aiter__(self):
        async def gen():
            for k in range(1, len(self.tokens) + 1):
                yield self._out(k)
        return gen()


class LLM:
    def __init__(self, **kwargs: Any) -> None:
        _check("LLM", kwargs, LLM_SIGNATURE)
        if "model" not in kwargs:
            raise TypeError("LLM() missing required argument 'model'")
        self.kwargs = kwargs
        self.closed = False

    def generate_async(self, inputs: Any, sampling_params: SamplingParams | None = None,
                       streaming: bool = False) -> _Generation:
        CALLS.append(("generate_async", {"inputs": inputs, "streaming": streaming}))
        return _Generation(inputs, sampling_params or SamplingParams(max_tokens=8), streaming)

    def shutdown(self) -> None:
        self.closed = True
