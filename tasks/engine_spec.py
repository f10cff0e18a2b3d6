"""The engine section of a release spec: which engine kind to build and its limits."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Dtype = Literal["float32", "bfloat16", "float16"]
Quantization = Literal["none", "fp8", "int8-weight-only"]  # serving.engine.quantize.QUANTIZATIONS
EngineKind = Literal["torch", "trtllm-engine", "trtllm-llmapi"]
KvCacheDtype = Literal["auto", "fp8"]  # serving.engine.kv_cache.KV_CACHE_DTYPES


class TargetToolchain(BaseModel):
    """The Triton fleet's TensorRT-LLM toolchain; staging checks the artifact against it (None: detect here)."""

    model_config = ConfigDict(extra="forbid")

    tensorrt_llm: str | None = Field(None, description="TensorRT-LLM version in the serving image, e.g. 1.2.0.")
    tensorrt: str | None = Field(None, description="TensorRT version in the serving image.")
    compute_capability: str | None = Field(None, description="GPU compute capability of the fleet, e.g. 9.0.")
    container_image: str | None = Field(None, description="Serving image, e.g. nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3.")


class TrtllmSpec(BaseModel):
    """Build and serving options of the TensorRT-LLM kinds (docs/tensorrt-llm.md maps each to its flag)."""

    model_config = ConfigDict(extra="forbid")

    max_num_tokens: int | None = Field(8192, ge=1, description="trtllm-build --max_num_tokens / LLM(max_num_tokens).")
    paged_kv_cache: bool = Field(True, description="--kv_cache_type paged (else continuous).")
    tokens_per_block: int | None = Field(None, ge=1, description="--tokens_per_block; None keeps the default.")
    gpt_attention_plugin: Literal["auto", "float16", "bfloat16", "float32", "disable"] = Field(
        "auto", description="--gpt_attention_plugin.")
    gemm_plugin: Literal["auto", "float16", "bfloat16", "float32", "fp8", "disable"] = Field(
        "auto", description="--gemm_plugin (fp8 only with an FP8 quantization).")
    context_fmha: bool = Field(True, description="--context_fmha enable/disable.")
    use_paged_context_fmha: bool = Field(True, description="--use_paged_context_fmha (needed for chunked context).")
    use_fp8_context_fmha: bool = Field(False, description="--use_fp8_context_fmha (FP8 quantizations only).")
    remove_input_padding: bool = Field(True, description="--remove_input_padding.")
    multiple_profiles: bool = Field(False, description="--multiple_profiles.")
    quantization: Literal["none", "fp8", "int4_awq", "w4a8_awq", "nvfp4", "int8_weight_only", "int4_weight_only",
                          "w8a8_sq"] = Field("none", description="Weight/activation quantization (ModelOpt or convert_checkpoint).")
    kv_cache_dtype: Literal["auto", "fp8", "int8"] = Field("auto", description="KV cache quantization.")
    calib_size: int = Field(512, ge=1, description="Calibration samples for ModelOpt quantization.")
    awq_block_size: int = Field(128, ge=1, description="AWQ group size.")
    tp_size: int = Field(1, ge=1, description="Tensor parallel size.")
    pp_size: int = Field(1, ge=1, description="Pipeline parallel size.")
    model_family: Literal["llama", "mistral", "qwen"] = Field("llama", description="Which convert_checkpoint.py to use.")
    kv_cache_free_gpu_mem_fraction: float = Field(0.9, gt=0, le=1, description="Share of free GPU memory for the KV cache.")
    enable_kv_cache_reuse: bool = Field(False, description="KV cache block reuse across requests.")
    enable_chunked_context: bool = Field(False, description="Chunked prefill.")
    batching_strategy: Literal["inflight_fused_batching", "v1"] = Field(
        "inflight_fused_batching", description="tensorrt_llm backend gpt_model_type.")
    batch_scheduler_policy: Literal["guaranteed_no_evict", "max_utilization"] = Field(
        "guaranteed_no_evict", description="tensorrt_llm backend batch_scheduler_policy.")
    decoupled_mode: bool = Field(False, description="Decoupled (streaming) tensorrt_llm model.")
    convert_timeout_s: float = Field(3600, gt=0, description="Timeout of conversion / quantization.")
    build_timeout_s: float = Field(7200, gt=0, description="Timeout of trtllm-build.")
    examples_dir: str | None = Field(None, description="TensorRT-LLM examples/ folder ($TRTLLM_EXAMPLES_DIR).")
    modelopt_examples_dir: str | None = Field(None, description="ModelOpt examples/ folder for trtllm-llmapi quantization.")
    target_toolchain: TargetToolchain = Field(default_factory=TargetToolchain,
                                              description="Toolchain of the serving fleet, checked at stage time.")


class KvCacheSpec(BaseModel):
    """The KV cache of the `torch` kind (serving.engine.kv_cache): blocks shared by every request, admitted by
    free blocks; prefill in chunks mixed with decodes under a token budget per step."""

    model_config = ConfigDict(extra="forbid")

    block_size: int = Field(32, ge=1, description="Token positions per KV block (TensorRT-LLM's tokens_per_block).")
    num_blocks: int | None = Field(None, ge=1, description="Blocks in the pool; None: sized at load from "
                                   "free_gpu_mem_fraction when set, else room for max_batch_size sequences of "
                                   "max_seq_len (so admission never waits for blocks).")
    free_gpu_mem_fraction: float | None = Field(None, gt=0, le=1, description="Share of the GPU memory free after "
                                                "the weights that the pool takes when num_blocks is None "
                                                "(kv_cache_free_gpu_mem_fraction; CUDA only). None: see num_blocks.")
    max_num_tokens: int = Field(8192, ge=1, description="Tokens one step computes at most: prefill chunks and "
                                "one decode token per live request (TensorRT-LLM's max_num_tokens).")
    max_waiting: int | None = Field(None, ge=1, description="Served requests waiting for admission (blocks or "
                                    "live slots full) at most; one more is refused as overloaded (HTTP 429 at the "
                                    "OpenAI front, UNAVAILABLE from Triton) instead of queueing. None: no limit.")
    kv_cache_dtype: KvCacheDtype = Field("auto", description="How K/V are stored: `auto` in the engine's dtype, `fp8` "
                                         "as float8_e4m3fn (scale 1.0, clamped to +-448): half the bytes of bf16, so "
                                         "twice the blocks and half the KV reads of a decode step; judged by the "
                                         "`+fp8-kv` quality budget. GPUs of compute capability >= 8.9, or the CPU.")
    prefix_caching: bool = Field(False, description="Share the computed K/V of full blocks between requests whose "
                                 "tokens start alike (a system prompt, a chat's earlier turns), as vLLM's automatic "
                                 "prefix caching: a prompt's leading cached blocks are not computed again; released "
                                 "ones stay cached until their blocks are needed (least recently used first). The TensorRT-LLM kinds' "
                                 "equivalent is `trtllm.enable_kv_cache_reuse`.")


class EngineSpec(BaseModel):
    """Engine kind and build limits; the engine refuses requests beyond them."""

    model_config = ConfigDict(extra="forbid")

    kind: EngineKind = Field("torch", description="Engine kind. `torch` runs everywhere (CPU and CUDA); "
                             "`trtllm-engine` / `trtllm-llmapi` need TensorRT-LLM (docs/tensorrt-llm.md).")
    dtype: Dtype = Field("float32", description="Weight and activation dtype of the engine.")
    quantization: Quantization = Field(
        "none", description="Weight quantization (docs/quantization.md): `fp8` (e4m3 weights, per-output-channel "
        "scales, activations scaled per token at run time; GPUs of compute capability >= 8.9, or the CPU's "
        "dequantizing path), `int8-weight-only` (per-output-channel symmetric int8; any GPU, the CPU). "
        "Embeddings, norms and the LM head keep `dtype`. A checkpoint already in FP8 (compressed-tensors, "
        "ModelOpt, block-wise fp8) needs `fp8`: it loads with its own weights and scales.")
    quantize_lm_head: bool = Field(False, description="Quantize the LM head too (untied models only).")
    max_batch_size: int = Field(8, ge=1, le=1024, description="Most sequences the engine decodes at once.")
    max_input_len: int = Field(128, ge=1, description="Longest prompt, in tokens.")
    max_seq_len: int = Field(256, ge=2, description="Longest prompt + generated tokens, in tokens.")
    kv_cache: KvCacheSpec = Field(default_factory=KvCacheSpec, description="`torch` kind: its paged KV cache "
                                  "(docs/engine.md); max_batch_size is the most live requests.")
    trtllm: TrtllmSpec = Field(default_factory=TrtllmSpec, description="Options of the TensorRT-LLM kinds.")

    @model_validator(mode="after")
    def _lm_head_needs_quantization(self) -> EngineSpec:
        if self.quantize_lm_head and self.quantization == "none":
            raise ValueError("quantize_lm_head=true needs quantization 'fp8' or 'int8-weight-only', not 'none'")
        return self

    @model_validator(mode="before")
    @classmethod
    def _paged_is_kv_cache(cls, data: Any) -> Any:
        if isinstance(data, dict) and "paged" in data:
            raise ValueError("`paged` was renamed `kv_cache` (every `torch` engine has a paged KV cache now): move "
                             "its settings under engine.kv_cache (block_size, num_blocks, free_gpu_mem_fraction, "
                             "max_num_tokens, max_waiting, kv_cache_dtype, prefix_caching) and delete engine.paged")
        return data

    @model_validator(mode="after")
    def _kv_cache_fits_limits(self) -> EngineSpec:
        p = self.kv_cache
        if self.kind != "torch" and p != KvCacheSpec():
            raise ValueError(f"kv_cache is an option of kind 'torch'; kind {self.kind!r} sets its KV cache in trtllm")
        if p.max_num_tokens < p.block_size:
            raise ValueError(f"kv_cache.max_num_tokens ({p.max_num_tokens}) is smaller than one block "
                             f"(kv_cache.block_size {p.block_size})")
        if self.kind == "torch" and p.max_num_tokens < self.max_batch_size:
            raise ValueError(f"kv_cache.max_num_tokens ({p.max_num_tokens}) < max_batch_size ({self.max_batch_size}): "
                             "a step could not give every live request its decode token")
        need = -(-self.max_seq_len // p.block_size)
        if p.num_blocks is not None and p.num_blocks < need:
            raise ValueError(f"kv_cache.num_blocks ({p.num_blocks}) x block_size ({p.block_size}) = "
                             f"{p.num_blocks * p.block_size} positions cannot hold one sequence of max_seq_len "
                             f"({self.max_seq_len}, {need} blocks)")
        return self

    @model_validator(mode="after")
    def _input_fits_sequence(self) -> EngineSpec:
        if self.max_input_len >= self.max_seq_len:
            raise ValueError(
                f"max_input_len ({self.max_input_len}) must be smaller than max_seq_len ({self.max_seq_len}) "
                "so that at least one token can be generated"
            )
        return self
