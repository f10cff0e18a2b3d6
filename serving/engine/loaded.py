"""What a loaded engine actually runs with, read from its tensors and modules (not from `engine.json`).

`loaded_configuration(runner)` -> `LoadedConfiguration`: the dtype the weights were loaded in, the
quantization method of the linears that were installed, the dtype the KV cache's block pools store, and
the decode GEMMs the runner picked, and its speculative decoding. The release gates compare it with the engine
record (`tasks.loaded_check`): an engine that loads something its record does not show (an fp8 KV cache
behind `kv_cache.kv_cache_dtype: auto`, say) must not be judged by the record's budget.

Read-only: it looks at the runner, allocates nothing. It takes an `EngineRunner` or a wrapper that forwards
`model`, `device`, `cache` and `decode`.

Imports: stdlib and torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from serving.engine.linear_quantized import QuantLinear, model_quantization


@dataclass(frozen=True)
class LoadedConfiguration:
    """One loaded engine as it runs."""

    device: str  # "cpu", "cuda:0"
    weight_dtype: str  # torch dtype name of the unquantized weights (embeddings, norms): "bfloat16"
    quantization: str  # method of the installed quantized linears, "none" when there are none
    quantized_lm_head: bool  # the LM head is a quantized linear
    kv_cache_dtype: str  # torch dtype name the KV cache's block pools store: "bfloat16", "float8_e4m3fn"
    decode_gemm: str  # the decode step's GEMMs ("torch" | "triton")
    speculative: str  # "off", or the drafting it runs: "ngram(max_draft=4, max_ngram=3, min_ngram=1)"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def loaded_configuration(runner: Any) -> LoadedConfiguration:
    """What `runner` holds in memory now."""
    model = runner.model
    return LoadedConfiguration(
        device=str(runner.device),
        weight_dtype=dtype_name(model.tok_embeddings.weight.dtype),
        quantization=model_quantization(model),
        quantized_lm_head=isinstance(model.output, QuantLinear),
        kv_cache_dtype=dtype_name(runner.cache.k[0].dtype),
        decode_gemm=model.options.decode_gemm,
        speculative=model.options.speculative.describe() if model.options.speculative is not None else "off",
    )
