"""Plain build/serve options of the TensorRT-LLM kinds (the spec's ``engine`` + ``engine.trtllm`` mapped here).

A dataclass, not the pydantic spec: ``serving`` never imports ``tasks``. ``tasks/engine_kinds.py`` builds
it with ``TrtllmOptions.from_mapping(spec.engine.model_dump() | spec.engine.trtllm.model_dump())``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from serving.trtllm.errors import TrtllmOptionError

QUANTIZATIONS = ("none", "fp8", "int4_awq", "w4a8_awq", "nvfp4", "int8_weight_only", "int4_weight_only", "w8a8_sq")
# quantization -> (tool, value): ModelOpt through examples/quantization/quantize.py, or convert_checkpoint.py.
QUANT_ROUTE: dict[str, tuple[str, str | None]] = {
    "none": ("convert", None),
    "int8_weight_only": ("convert", "int8"),
    "int4_weight_only": ("convert", "int4"),
    "w8a8_sq": ("quantize", "int8_sq"),
    "fp8": ("quantize", "fp8"),
    "int4_awq": ("quantize", "int4_awq"),
    "w4a8_awq": ("quantize", "w4a8_awq"),
    "nvfp4": ("quantize", "nvfp4"),
}
FP8_QUANTIZATIONS = frozenset({"fp8", "w4a8_awq", "nvfp4"})
# engine.quantization (the field every kind takes) -> engine.trtllm.quantization
FROM_ENGINE_QUANTIZATION = {"none": "none", "fp8": "fp8", "int8-weight-only": "int8_weight_only"}
# engine.trtllm.quantization -> the member of tensorrt_llm.llmapi.QuantAlgo it is (QuantConfig(quant_algo=...);
# https://nvidia.github.io/TensorRT-LLM/llm-api/reference.html, QuantConfig / QuantAlgo)
QUANT_ALGO = {"fp8": "FP8", "int8_weight_only": "W8A16", "int4_weight_only": "W4A16", "int4_awq": "W4A16_AWQ",
              "w4a8_awq": "W4A8_AWQ", "nvfp4": "NVFP4", "w8a8_sq": "W8A8_SQ_PER_CHANNEL"}
TRTLLM_ENGINE_VERSIONS = (
    "engine.kind='trtllm-engine' builds TensorRT engines with convert_checkpoint.py and trtllm-build, which "
    "TensorRT-LLM deprecated in Feb 2026 and removed in Jul 2026 (PyTorch is its only backend since): it is for "
    "fleets on TensorRT-LLM <= 1.2. Use engine.kind='trtllm-llmapi' for later releases")
# Model families and the folder of their convert_checkpoint.py under TensorRT-LLM's examples/.
CONVERT_SCRIPTS = {
    "llama": "models/core/llama/convert_checkpoint.py",
    "mistral": "models/core/llama/convert_checkpoint.py",   # Mistral converts with the Llama script
    "qwen": "models/core/qwen/convert_checkpoint.py",
}
QUANTIZE_SCRIPT = "quantization/quantize.py"


@dataclass(frozen=True)
class TrtllmOptions:
    """Everything the convert/build/serve commands need; field names follow the spec."""

    kind: str = "trtllm-engine"
    dtype: str = "bfloat16"
    max_batch_size: int = 8
    max_input_len: int = 128
    max_seq_len: int = 256
    max_num_tokens: int | None = 8192
    max_beam_width: int = 1
    paged_kv_cache: bool = True
    tokens_per_block: int | None = None
    gpt_attention_plugin: str = "auto"
    gemm_plugin: str = "auto"
    context_fmha: bool = True
    use_paged_context_fmha: bool = True
    use_fp8_context_fmha: bool = False
    remove_input_padding: bool = True
    multiple_profiles: bool = False
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    calib_size: int = 512
    awq_block_size: int = 128
    smoothquant_alpha: float = 0.5
    tp_size: int = 1
    pp_size: int = 1
    model_family: str = "llama"
    kv_cache_free_gpu_mem_fraction: float = 0.9
    enable_kv_cache_reuse: bool = False
    enable_chunked_context: bool = False
    batching_strategy: str = "inflight_fused_batching"
    batch_scheduler_policy: str = "guaranteed_no_evict"
    decoupled_mode: bool = False
    convert_timeout_s: float = 3600.0
    build_timeout_s: float = 7200.0
    examples_dir: str | None = None
    modelopt_examples_dir: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> TrtllmOptions:
        """Take the known fields of ``values`` (spec dumps carry more keys); unknown ones are dropped."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def quant_algo(self) -> str | None:
        """The `QuantAlgo` member name of this quantization (None for "none")."""
        return QUANT_ALGO.get(self.quantization)

    @property
    def llmapi_quantizes_with_modelopt(self) -> bool:
        """trtllm-llmapi: whether the checkpoint is quantized offline by ModelOpt (its export carries
        hf_quant_config.json, which the PyTorch backend reads), else `LLM(quant_config=...)` does it."""
        return self.quantization != "none" and QUANT_ROUTE[self.quantization][0] == "quantize"

    @property
    def uses_fp8(self) -> bool:
        return self.quantization in FP8_QUANTIZATIONS or self.kv_cache_dtype == "fp8"

    def check(self) -> None:
        """Cross-field rules TensorRT-LLM itself enforces late (after hours of calibration)."""
        if self.quantization not in QUANTIZATIONS:
            raise TrtllmOptionError(f"engine.trtllm.quantization={self.quantization!r} is not one of {QUANTIZATIONS}")
        if self.quantization != "none" and self.dtype == "float32":
            raise TrtllmOptionError(f"engine.trtllm.quantization={self.quantization!r} needs engine.dtype float16 "
                                    f"or bfloat16, not {self.dtype!r}")
        if self.gemm_plugin == "fp8" and self.quantization not in FP8_QUANTIZATIONS:
            raise TrtllmOptionError("engine.trtllm.gemm_plugin='fp8' needs an FP8 engine.trtllm.quantization "
                                    f"(got {self.quantization!r})")
        if self.use_fp8_context_fmha and self.quantization not in FP8_QUANTIZATIONS:
            raise TrtllmOptionError("engine.trtllm.use_fp8_context_fmha needs an FP8 engine.trtllm.quantization")
        if self.use_paged_context_fmha and not (self.paged_kv_cache and self.context_fmha):
            raise TrtllmOptionError("engine.trtllm.use_paged_context_fmha needs paged_kv_cache and context_fmha")
        if self.max_num_tokens is not None and self.max_num_tokens < self.max_input_len and not (
                self.enable_chunked_context and self.use_paged_context_fmha):
            raise TrtllmOptionError(
                f"engine.trtllm.max_num_tokens ({self.max_num_tokens}) is below engine.max_input_len "
                f"({self.max_input_len}): a full prompt would not fit one step; raise it or enable "
                "enable_chunked_context with use_paged_context_fmha")
        if self.model_family not in CONVERT_SCRIPTS:
            raise TrtllmOptionError(f"engine.trtllm.model_family={self.model_family!r} is not one of "
                                    f"{sorted(CONVERT_SCRIPTS)}")
        if self.decoupled_mode and self.batching_strategy != "inflight_fused_batching":
            raise TrtllmOptionError("engine.trtllm.decoupled_mode (streaming) needs batching_strategy "
                                    "inflight_fused_batching")
