"""The `torch` engine kind: convert an HF Llama-family checkpoint, build an engine folder, load, generate.

The engine speaks token ids, not text. Imports: stdlib, torch and numpy only at import time
(this package runs inside Triton's python backend); safetensors is imported lazily by convert.

The names below are imported when first used (PEP 562), so that importing a light module of this package
(`serving.engine.heap`, `serving.engine.launch_lock`) does not import torch: the `llm` model imports torch
while it loads the engine, at the load's CPU priority (`serving.triton.models.load_priority`).
"""

from __future__ import annotations

from serving.lazy_exports import lazy_exports

_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("ENGINE_FORMAT_VERSION", "EngineInfo", "EngineLimits", "build_engine", "check_toolchain",
                     "current_toolchain", "read_engine_info", "verify_engine"), "build"),
    "convert_checkpoint": "convert",
    **dict.fromkeys(("CheckpointError", "CheckpointNotFoundError", "EngineError", "EngineExistsError",
                     "EngineFormatError", "EngineIntegrityError", "EngineLimitError", "ToolchainMismatchError",
                     "UnsupportedArchitectureError"), "errors"),
    "ModelArgs": "model",
    "SUPPORTED_ARCHITECTURES": "models.registry",
    "Transformer": "models.llama",
    "KVCacheConfig": "kv_cache",
    **dict.fromkeys(("AttentionKernelOptions", "EngineOptions", "resolve_options"), "options"),
    **dict.fromkeys(("EngineRunner", "Generation", "load_engine"), "runner"),
    **dict.fromkeys(("SamplingParams", "sample"), "sampling"),
}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
