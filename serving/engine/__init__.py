"""The `torch` engine kind: convert an HF Llama-family checkpoint, build an engine folder, load, generate.

The engine speaks token ids, not text. Imports: stdlib, torch and numpy only at import time
(this package runs inside Triton's python backend); safetensors is imported lazily by convert.
"""

from serving.engine.build import (
    ENGINE_FORMAT_VERSION,
    EngineInfo,
    EngineLimits,
    build_engine,
    check_toolchain,
    current_toolchain,
    read_engine_info,
    verify_engine,
)
from serving.engine.convert import convert_checkpoint
from serving.engine.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    EngineError,
    EngineExistsError,
    EngineFormatError,
    EngineIntegrityError,
    EngineLimitError,
    ToolchainMismatchError,
    UnsupportedArchitectureError,
)
from serving.engine.model import SUPPORTED_ARCHITECTURES, KVCache, ModelArgs, Transformer
from serving.engine.runner import EngineRunner, Generation, load_engine
from serving.engine.sampling import SamplingParams, sample

__all__ = [
    "ENGINE_FORMAT_VERSION",
    "SUPPORTED_ARCHITECTURES",
    "CheckpointError",
    "CheckpointNotFoundError",
    "EngineError",
    "EngineExistsError",
    "EngineFormatError",
    "EngineInfo",
    "EngineIntegrityError",
    "EngineLimitError",
    "EngineLimits",
    "EngineRunner",
    "Generation",
    "KVCache",
    "ModelArgs",
    "SamplingParams",
    "ToolchainMismatchError",
    "Transformer",
    "UnsupportedArchitectureError",
    "build_engine",
    "check_toolchain",
    "convert_checkpoint",
    "current_toolchain",
    "load_engine",
    "read_engine_info",
    "sample",
    "verify_engine",
]
