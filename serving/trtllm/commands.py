"""Command lines and ``LLM()`` arguments of the TensorRT-LLM steps, built from ``TrtllmOptions``.

Pure functions (no subprocess here): every command is checked against the documented flag table in
``serving/trtllm/flags.py`` before it is returned.

- trtllm-engine, no quantization or weight-only/KV-cache quantization:
  ``python <examples>/models/core/<family>/convert_checkpoint.py --model_dir HF --output_dir CKPT ...``
- trtllm-engine, ModelOpt quantization (fp8, int4_awq, w4a8_awq, nvfp4, int8 SmoothQuant):
  ``python <examples>/quantization/quantize.py --model_dir HF --qformat fp8 --output_dir CKPT ...``
  (convert_checkpoint.py says itself that AWQ is only supported by quantize.py).
- then ``trtllm-build --checkpoint_dir CKPT --output_dir ENGINE --max_batch_size ... --kv_cache_type paged ...``
- trtllm-llmapi: no build; quantized variants come from ModelOpt's ``hf_ptq.py`` (a Hugging Face checkpoint
  with ``hf_quant_config.json``, which the LLM API's PyTorch backend reads), then ``llm_args.json``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from serving.trtllm.errors import TrtllmUnavailableError
from serving.trtllm.flags import (
    CONVERT_CHECKPOINT,
    MODELOPT_HF_PTQ,
    QUANTIZE,
    TRTLLM_BUILD,
    check_command,
    check_llm_args,
)
from serving.trtllm.options import CONVERT_SCRIPTS, QUANT_ROUTE, QUANTIZE_SCRIPT, TrtllmOptions

EXAMPLES_ENV = "TRTLLM_EXAMPLES_DIR"
DEFAULT_EXAMPLES_DIRS = ("/app/tensorrt_llm/examples", "/opt/TensorRT-LLM/examples")
MODELOPT_EXAMPLES_ENV = "MODELOPT_EXAMPLES_DIR"


def _enable(flag: bool) -> str:
    return "enable" if flag else "disable"


def examples_dir(options: TrtllmOptions, *, must_exist: bool = True) -> Path:
    """TensorRT-LLM's ``examples/`` folder: the option, ``$TRTLLM_EXAMPLES_DIR``, or the NGC image's path."""
    candidates = [options.examples_dir, os.environ.get(EXAMPLES_ENV), *DEFAULT_EXAMPLES_DIRS]
    for c in candidates:
        if c and (not must_exist or Path(c).is_dir()):
            return Path(c)
    raise TrtllmUnavailableError(
        "TensorRT-LLM's examples folder (convert_checkpoint.py, quantization/quantize.py) was not found: set "
        f"engine.trtllm.examples_dir or ${EXAMPLES_ENV} (tried {[c for c in candidates if c]})")


def convert_command(options: TrtllmOptions, hf_dir: Path, out_dir: Path, *, python: str = "python3",
                    examples: Path | None = None) -> list[str]:
    """The conversion (or ModelOpt quantization) command: HF checkpoint -> TensorRT-LLM checkpoint."""
    options.check()
    examples = examples or examples_dir(options)
    tool, value = QUANT_ROUTE[options.quantization]
    if tool == "quantize":
        argv = [python, str(examples / QUANTIZE_SCRIPT), "--model_dir", str(hf_dir), "--output_dir", str(out_dir),
                "--dtype", options.dtype, "--qformat", str(value), "--calib_size", str(options.calib_size),
                "--tp_size", str(options.tp_size), "--pp_size", str(options.pp_size)]
        if options.quantization in ("int4_awq", "w4a8_awq"):
            argv += ["--awq_block_size", str(options.awq_block_size)]
        if options.kv_cache_dtype != "auto":
            argv += ["--kv_cache_dtype", options.kv_cache_dtype]
        check_command(argv, QUANTIZE, skip=2)
        return argv
    argv = [python, str(examples / CONVERT_SCRIPTS[options.model_family]), "--model_dir", str(hf_dir),
            "--output_dir", str(out_dir), "--dtype", options.dtype, "--tp_size", str(options.tp_size),
            "--pp_size", str(options.pp_size)]
    if value in ("int8", "int4"):
        argv += ["--use_weight_only", "--weight_only_precision", value]
    if options.kv_cache_dtype == "fp8":
        argv.append("--fp8_kv_cache")
    elif options.kv_cache_dtype == "int8":
        argv.append("--int8_kv_cache")
    check_command(argv, CONVERT_CHECKPOINT, skip=2)
    return argv


def build_command(options: TrtllmOptions, checkpoint_dir: Path, out_dir: Path, *,
                  executable: str = "trtllm-build") -> list[str]:
    """``trtllm-build`` with the spec's limits and plugins mapped to its flags."""
    options.check()
    argv = [executable, "--checkpoint_dir", str(checkpoint_dir), "--output_dir", str(out_dir),
            "--max_batch_size", str(options.max_batch_size), "--max_input_len", str(options.max_input_len),
            "--max_seq_len", str(options.max_seq_len), "--max_beam_width", str(options.max_beam_width)]
    if options.max_num_tokens is not None:
        argv += ["--max_num_tokens", str(options.max_num_tokens)]
    argv += ["--kv_cache_type", "paged" if options.paged_kv_cache else "continuous",
             "--gpt_attention_plugin", options.gpt_attention_plugin, "--gemm_plugin", options.gemm_plugin,
             "--context_fmha", _enable(options.context_fmha),
             "--remove_input_padding", _enable(options.remove_input_padding),
             "--use_paged_context_fmha", _enable(options.use_paged_context_fmha),
             "--multiple_profiles", _enable(options.multiple_profiles)]
    if options.use_fp8_context_fmha:
        argv += ["--use_fp8_context_fmha", "enable"]
    if options.tokens_per_block is not None:
        argv += ["--tokens_per_block", str(options.tokens_per_block)]
    if options.world_size > 1:
        argv += ["--workers", str(options.world_size)]
    check_command(argv, TRTLLM_BUILD)
    return argv


def modelopt_command(options: TrtllmOptions, hf_dir: Path, out_dir: Path, *, python: str = "python3",
                     examples: Path | None = None) -> list[str]:
    """ModelOpt post-training quantization to a Hugging Face checkpoint (the LLM API's input)."""
    options.check()
    if examples is None:
        found = options.modelopt_examples_dir or os.environ.get(MODELOPT_EXAMPLES_ENV)
        if not found:
            raise TrtllmUnavailableError(
                f"engine.trtllm.quantization={options.quantization!r} with engine.kind='trtllm-llmapi' runs "
                f"ModelOpt's examples/llm_ptq/hf_ptq.py: set engine.trtllm.modelopt_examples_dir or "
                f"${MODELOPT_EXAMPLES_ENV}, or use a pre-quantized checkpoint with quantization 'none'")
        examples = Path(found)
    qformat = QUANT_ROUTE[options.quantization][1]
    if qformat is None or QUANT_ROUTE[options.quantization][0] != "quantize":
        raise ValueError(f"quantization {options.quantization!r} is not a ModelOpt format")
    argv = [python, str(Path(examples) / "llm_ptq" / "hf_ptq.py"), "--pyt_ckpt_path", str(hf_dir),
            "--export_path", str(out_dir), "--qformat", qformat, "--calib_size", str(options.calib_size),
            "--kv_cache_qformat", "fp8" if options.kv_cache_dtype == "fp8" else "none",
            "--inference_tensor_parallel", str(options.tp_size),
            "--inference_pipeline_parallel", str(options.pp_size)]
    if options.quantization in ("int4_awq", "w4a8_awq"):
        argv += ["--awq_block_size", str(options.awq_block_size)]
    check_command(argv, MODELOPT_HF_PTQ, skip=2)
    return argv


def llm_args(options: TrtllmOptions, *, model: str = "checkpoint") -> dict[str, Any]:
    """The ``LLM()`` keyword arguments of a ``trtllm-llmapi`` artifact (``model`` relative to the artifact)."""
    options.check()
    args: dict[str, Any] = {
        "model": model,
        "tokenizer": model,
        "backend": "pytorch",
        "dtype": options.dtype,
        "tensor_parallel_size": options.tp_size,
        "pipeline_parallel_size": options.pp_size,
        "max_batch_size": options.max_batch_size,
        "max_input_len": options.max_input_len,
        "max_seq_len": options.max_seq_len,
        "max_beam_width": options.max_beam_width,
        "kv_cache_config": {
            "free_gpu_memory_fraction": options.kv_cache_free_gpu_mem_fraction,
            "enable_block_reuse": options.enable_kv_cache_reuse,
            "dtype": "fp8" if options.kv_cache_dtype == "fp8" else "auto",
        },
        "enable_chunked_prefill": options.enable_chunked_context,
    }
    if options.max_num_tokens is not None:
        args["max_num_tokens"] = options.max_num_tokens
    if options.quant_algo is not None and not options.llmapi_quantizes_with_modelopt:
        args["quant_config"] = {"quant_algo": options.quant_algo}  # e.g. W8A16: LLM() quantizes at load
    check_llm_args(args)
    return args


def make_llm(args: dict[str, Any], base_dir: Path) -> Any:
    """Create ``tensorrt_llm.LLM`` from an argument file's dict (paths relative to ``base_dir``); lazy import."""
    try:
        from tensorrt_llm import LLM
        from tensorrt_llm.llmapi import KvCacheConfig
    except ImportError as exc:
        raise TrtllmUnavailableError(
            f"engine.kind='trtllm-llmapi' needs the tensorrt_llm package to serve, and importing it failed: {exc}"
        ) from exc
    check_llm_args(args)
    kwargs = dict(args)
    for key in ("model", "tokenizer"):
        if key in kwargs and not Path(kwargs[key]).is_absolute():
            kwargs[key] = str(Path(base_dir) / kwargs[key])
    if kwargs.get("kv_cache_config") is not None:
        kwargs["kv_cache_config"] = KvCacheConfig(**kwargs["kv_cache_config"])
    if kwargs.get("quant_config") is not None:
        from tensorrt_llm.llmapi import QuantAlgo, QuantConfig

        kwargs["quant_config"] = QuantConfig(**{k: QuantAlgo[v] for k, v in kwargs["quant_config"].items()})
    return LLM(**kwargs)
