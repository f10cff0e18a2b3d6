"""The documented command-line surface of TensorRT-LLM 1.2 that enginewright uses, with its source.

Each table maps a flag to what it takes: ``None`` (a switch, ``store_true``), ``"int"``, ``"float"``,
``"str"`` (any value) or a tuple of allowed values. ``check_command`` refuses any generated command line
that uses a flag outside its table or a value outside its choices, so a typo or a removed flag fails in
unit tests here, not hours into a build on a GPU host. On a TensorRT-LLM host,
``tests/test_trtllm_host.py`` also compares these tables with the real ``--help`` output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serving.trtllm.errors import TrtllmOptionError

PLUGIN_DTYPES = ("auto", "float16", "float32", "bfloat16", "int32", "disable")
ENABLE = ("enable", "disable")


@dataclass(frozen=True)
class FlagTable:
    command: str
    flags: dict[str, Any]
    sources: tuple[str, ...]
    positional: tuple[str, ...] = ()


TRTLLM_BUILD = FlagTable(
    command="trtllm-build",
    sources=(
        "https://nvidia.github.io/TensorRT-LLM/commands/trtllm-build.html",
        "NVIDIA/TensorRT-LLM tensorrt_llm/commands/build.py (parse_arguments)",
        "NVIDIA/TensorRT-LLM tensorrt_llm/plugin/plugin.py (add_plugin_argument, cli_plugin_args)",
    ),
    flags={
        "--checkpoint_dir": "str", "--output_dir": "str", "--max_batch_size": "int", "--max_input_len": "int",
        "--max_seq_len": "int", "--max_beam_width": "int", "--max_num_tokens": "int", "--opt_num_tokens": "int",
        "--kv_cache_type": ("continuous", "paged", "disabled"), "--paged_kv_cache": ENABLE,
        "--workers": "int", "--log_level": ("internal_error", "error", "warning", "info", "verbose", "debug", "trace"),
        "--logits_dtype": ("float16", "float32"), "--gather_context_logits": None,
        "--gather_generation_logits": None, "--strip_plan": None, "--weight_streaming": None, "--fast_build": None,
        "--monitor_memory": None,
        # plugin config arguments
        "--gpt_attention_plugin": PLUGIN_DTYPES, "--gemm_plugin": (*PLUGIN_DTYPES, "fp8", "nvfp4"),
        "--context_fmha": ENABLE, "--remove_input_padding": ENABLE, "--use_paged_context_fmha": ENABLE,
        "--use_fp8_context_fmha": ENABLE, "--multiple_profiles": ENABLE, "--tokens_per_block": "int",
        "--multi_block_mode": ENABLE, "--use_fused_mlp": ENABLE,
    },
)

CONVERT_CHECKPOINT = FlagTable(
    command="convert_checkpoint.py",
    sources=("NVIDIA/TensorRT-LLM examples/models/core/llama/convert_checkpoint.py (parse_arguments)",
             "NVIDIA/TensorRT-LLM examples/models/core/llama/README.md"),
    flags={
        "--model_dir": "str", "--output_dir": "str", "--dtype": ("auto", "float16", "bfloat16", "float32"),
        "--tp_size": "int", "--pp_size": "int", "--use_weight_only": None,
        "--weight_only_precision": ("int8", "int4", "int8_gptq", "int4_gptq", "int4_awq"),
        "--int8_kv_cache": None, "--fp8_kv_cache": None, "--use_fp8": None, "--workers": "int",
        "--load_by_shard": None, "--log_level": "str",
    },
)

QUANTIZE = FlagTable(
    command="quantize.py",
    sources=("NVIDIA/TensorRT-LLM examples/quantization/quantize.py (argparse)",
             "NVIDIA/TensorRT-LLM examples/quantization/README.md"),
    flags={
        "--model_dir": "str", "--output_dir": "str", "--dtype": ("auto", "float16", "bfloat16", "float32"),
        "--qformat": ("nvfp4", "fp8", "int8_sq", "int4_awq", "w4a8_awq", "int8_wo", "int4_wo", "full_prec"),
        "--kv_cache_dtype": ("int8", "fp8", "nvfp4"), "--calib_size": "int", "--calib_max_seq_length": "int",
        "--batch_size": "int", "--awq_block_size": "int", "--tp_size": "int", "--pp_size": "int",
        "--calib_dataset": "str", "--device": ("cuda", "cpu"),
    },
)

MODELOPT_HF_PTQ = FlagTable(
    command="hf_ptq.py",
    sources=("NVIDIA/Model-Optimizer examples/llm_ptq/hf_ptq.py (argparse)",
             ("https://nvidia.github.io/TensorRT-LLM/developer-guide/perf-benchmarking.html "
             "(pre-quantized checkpoints for the PyTorch flow: hf_quant_config.json from ModelOpt)")),
    flags={
        "--pyt_ckpt_path": "str", "--export_path": "str",
        "--qformat": ("fp8", "int4_awq", "w4a8_awq", "nvfp4", "int8_sq"),
        "--kv_cache_qformat": ("fp8", "nvfp4", "none"), "--calib_size": "str", "--awq_block_size": "int",
        "--inference_tensor_parallel": "int", "--inference_pipeline_parallel": "int",
    },
)

TRTLLM_BENCH = FlagTable(
    command="trtllm-bench",
    sources=("https://nvidia.github.io/TensorRT-LLM/commands/trtllm-bench.html",
             "NVIDIA/TensorRT-LLM docs/source/developer-guide/perf-benchmarking.md"),
    flags={
        # global options (before the sub-command)
        "--model": "str", "--model_path": "str", "--workspace": "str",
        "--log_level": ("internal_error", "error", "warning", "info", "verbose", "debug", "trace"),
        # throughput options
        "--engine_dir": "str", "--backend": ("pytorch", "_autodeploy", "tensorrt"), "--dataset": "str",
        "--extra_llm_api_options": "str", "--max_batch_size": "int", "--max_num_tokens": "int",
        "--max_seq_len": "int", "--beam_width": "int", "--kv_cache_free_gpu_mem_fraction": "float",
        "--num_requests": "int", "--warmup": "int", "--concurrency": "int", "--streaming": None,
        "--tp": "int", "--pp": "int", "--report_json": "str",
    },
    positional=("throughput", "latency"),
)

# LLM() keyword arguments we write to llm_args.json (TensorRT-LLM 1.2 LLM API), and the fields of the
# nested configs. Checked by ``check_llm_args``; a recorded fake tensorrt_llm asserts the same in tests.
LLM_ARGS_SOURCES = (
    "https://nvidia.github.io/TensorRT-LLM/llm-api/reference.html (class tensorrt_llm.llmapi.LLM)",
    "https://nvidia.github.io/TensorRT-LLM/examples/kvcacheconfig.html (KvCacheConfig)",
    "https://nvidia.github.io/TensorRT-LLM/1.2.1/examples/llm_inference_async_streaming.html (generate_async)",
)
LLM_KWARGS = frozenset({
    "model", "tokenizer", "backend", "dtype", "tensor_parallel_size", "pipeline_parallel_size", "max_batch_size",
    "max_num_tokens", "max_seq_len", "max_input_len", "max_beam_width", "kv_cache_config", "trust_remote_code",
    "skip_tokenizer_init", "enable_chunked_prefill", "quant_config",
})
QUANT_CONFIG_FIELDS = frozenset({"quant_algo", "kv_cache_quant_algo"})  # QuantConfig (tensorrt_llm.llmapi)
KV_CACHE_CONFIG_FIELDS = frozenset({"free_gpu_memory_fraction", "enable_block_reuse", "dtype", "max_tokens"})
SAMPLING_PARAMS_FIELDS = frozenset({
    "max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "end_id", "pad_id", "detokenize",
})


def check_command(argv: list[str], table: FlagTable, *, skip: int = 1) -> None:
    """Raise ``TrtllmOptionError`` when ``argv[skip:]`` uses an undocumented flag or value for ``table``."""
    i = skip
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            if arg in table.positional:
                i += 1
                continue
            raise TrtllmOptionError(f"{table.command}: unexpected argument {arg!r} in {argv!r}")
        if arg not in table.flags:
            raise TrtllmOptionError(f"{table.command}: flag {arg} is not in the documented TensorRT-LLM 1.2 "
                                    f"flags (sources: {'; '.join(table.sources)})")
        kind = table.flags[arg]
        if kind is None:
            i += 1
            continue
        if i + 1 >= len(argv):
            raise TrtllmOptionError(f"{table.command}: flag {arg} needs a value")
        value = argv[i + 1]
        if isinstance(kind, tuple) and value not in kind:
            raise TrtllmOptionError(f"{table.command}: {arg} {value!r} is not one of {kind}")
        if kind == "int":
            int(value)
        elif kind == "float":
            float(value)
        i += 2


def check_llm_args(args: dict[str, Any]) -> None:
    """Raise ``TrtllmOptionError`` when an ``LLM()`` argument file uses undocumented keys."""
    unknown = sorted(set(args) - LLM_KWARGS)
    if unknown:
        raise TrtllmOptionError(f"LLM() arguments {unknown} are not documented keyword arguments "
                                f"(sources: {'; '.join(LLM_ARGS_SOURCES)})")
    unknown = sorted(set(args.get("quant_config") or {}) - QUANT_CONFIG_FIELDS)
    if unknown:
        raise TrtllmOptionError(f"QuantConfig fields {unknown} are not documented")
    kv = args.get("kv_cache_config") or {}
    unknown = sorted(set(kv) - KV_CACHE_CONFIG_FIELDS)
    if unknown:
        raise TrtllmOptionError(f"KvCacheConfig fields {unknown} are not documented")
