"""TensorRT-LLM engine kinds (``trtllm-engine``, ``trtllm-llmapi``): commands, artifacts, toolchain, bench.

Imports only the standard library: ``tensorrt_llm`` is imported lazily, by ``commands.make_llm`` and the
Triton models that serve the LLM API, so every part that builds command lines, argument files or
repositories runs (and is tested) on machines without TensorRT-LLM.
"""

from serving.trtllm.artifacts import (
    METADATA,
    TrtllmArtifact,
    build_trtllm_engine,
    convert_trtllm_checkpoint,
    prepare_llmapi_artifact,
    read_artifact,
    verify_artifact,
)
from serving.trtllm.bench import bench_command, parse_bench_report, run_trtllm_bench, write_bench_dataset
from serving.trtllm.commands import build_command, convert_command, llm_args, make_llm, modelopt_command
from serving.trtllm.errors import (
    TrtllmArtifactError,
    TrtllmBenchError,
    TrtllmError,
    TrtllmOptionError,
    TrtllmStepError,
    TrtllmToolchainMismatchError,
    TrtllmUnavailableError,
)
from serving.trtllm.options import TrtllmOptions
from serving.trtllm.toolchain import (
    check_trtllm_toolchain,
    current_toolchain,
    require_trtllm,
    trtllm_installed,
)

__all__ = [
    "METADATA", "TrtllmArtifact", "TrtllmArtifactError", "TrtllmBenchError", "TrtllmError", "TrtllmOptionError",
    "TrtllmOptions", "TrtllmStepError", "TrtllmToolchainMismatchError", "TrtllmUnavailableError", "bench_command",
    "build_command", "build_trtllm_engine", "check_trtllm_toolchain", "convert_command", "convert_trtllm_checkpoint",
    "current_toolchain", "llm_args", "make_llm", "modelopt_command", "parse_bench_report", "prepare_llmapi_artifact",
    "read_artifact", "require_trtllm", "run_trtllm_bench", "trtllm_installed", "verify_artifact",
    "write_bench_dataset",
]
