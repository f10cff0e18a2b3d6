"""The ``torch`` engine kind's steps (the PyTorch-native engine of ``serving.engine``): convert, build,
verify, stage, and what a promotion reads from an engine folder (vocabulary, memory estimate).

``tasks.engine_kinds`` puts them in its table. Conversions and builds are keyed by content (checkpoint
digest, dtype, quantization, limits, toolchain), so a re-run finds what is finished and reuses it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tasks.checkpoint import ConvertedCheckpoint, check_checkpoint
from tasks.engine_spec import EngineSpec
from tasks.hashing import tree_digest, value_digest
from tasks.promote_spec import TritonSpec

log = logging.getLogger(__name__)


def toolchain_key() -> dict[str, str]:
    """What a conversion or build depends on besides its inputs: a new torch or engine format rebuilds."""
    import torch

    from serving.engine import ENGINE_FORMAT_VERSION

    return {"torch": torch.__version__.split("+")[0], "engine_format": str(ENGINE_FORMAT_VERSION)}


def quant_info(engine: EngineSpec):
    """The spec's quantization as `serving.engine.quantize.QuantInfo`."""
    from serving.engine.quantize import QuantInfo

    return QuantInfo(method=engine.quantization, lm_head=engine.quantize_lm_head)


def convert(checkpoint: Path, engine: EngineSpec, work_dir: Path) -> ConvertedCheckpoint:
    """HF checkpoint -> engine checkpoint (fused wqkv / w13, dtype cast, quantization), once per content."""
    from serving.engine import convert_checkpoint

    check_checkpoint(checkpoint, kind="torch")
    source_digest = tree_digest(checkpoint)
    identity = {"source": source_digest, "dtype": engine.dtype, "kind": engine.kind, "toolchain": toolchain_key()}
    if engine.quantization != "none":  # (absent otherwise: unquantized conversions keep their keys)
        identity["quantization"] = {"method": engine.quantization, "lm_head": engine.quantize_lm_head}
    key = value_digest(identity)[:16]
    out = work_dir / "checkpoints" / key
    if (out / "checkpoint.json").is_file():  # written last by convert_checkpoint: the conversion finished
        log.info("convert: cache hit, reusing %s for %s (%s)", out, checkpoint, engine.dtype)
        return ConvertedCheckpoint(out, source_digest, reused=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    convert_checkpoint(checkpoint, out, dtype=engine.dtype, progress=lambda msg: log.info("convert: %s", msg),
                       quantization=quant_info(engine))
    return ConvertedCheckpoint(out, source_digest)


def build(converted: ConvertedCheckpoint, engine: EngineSpec, work_dir: Path):
    """Engine checkpoint -> engine folder (``serving.engine.EngineInfo``) for the spec's limits and this toolchain."""
    from serving.engine import EngineLimits, build_engine, current_toolchain, read_engine_info

    limits = EngineLimits(
        dtype=engine.dtype,
        max_batch_size=engine.max_batch_size,
        max_input_len=engine.max_input_len,
        max_seq_len=engine.max_seq_len,
    )
    key = value_digest({
        "checkpoint": converted.path.name,
        "engine": engine.model_dump(exclude=_unquantized_keys(engine)),
        "toolchain": {**toolchain_key(), **{k: str(v) for k, v in current_toolchain().items()}},
    })[:16]
    out = work_dir / "engines" / key
    if (out / "engine.json").is_file():  # build_engine renames a complete folder into place
        return read_engine_info(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return build_engine(converted.path, out, limits=limits, quantization=quant_info(engine),
                        kv_cache=_kv_cache(engine))


def _kv_cache(engine: EngineSpec) -> Any:
    """The spec's KV-cache settings as serving.engine.kv_cache.KVCacheConfig."""
    from serving.engine.kv_cache import KVCacheConfig

    p = engine.kv_cache
    return KVCacheConfig(block_size=p.block_size, num_blocks=p.num_blocks, free_mem_fraction=p.free_gpu_mem_fraction,
                         max_num_tokens=p.max_num_tokens, max_waiting=p.max_waiting, kv_cache_dtype=p.kv_cache_dtype,
                         prefix_caching=p.prefix_caching)


def _unquantized_keys(engine: EngineSpec) -> dict[str, Any]:
    """Fields left out of the build key (a pydantic `exclude`): the TensorRT-LLM options, and the quantization
    fields while they hold their defaults (so that unquantized builds keep the keys they had)."""
    keys: dict[str, Any] = {"trtllm": True}
    if engine.quantization == "none":
        keys |= {"quantization": True, "quantize_lm_head": True}
    return keys


def verify_fetched(engine_dir: Path, engine: EngineSpec | None, *, fingerprint: str, device: str) -> None:
    """After the download: the folder holds the engine of ``fingerprint``, built on a toolchain this device runs."""
    from serving.engine import check_toolchain, read_engine_info
    from serving.engine.runner import resolve_device

    info = read_engine_info(engine_dir)
    if info.fingerprint != fingerprint:
        raise ValueError(f"artifact {engine_dir.parent.name}/{fingerprint} holds an engine with fingerprint "
                         f"{info.fingerprint}")
    check_toolchain(info, device=resolve_device(device))


def stage_version(root: Path, name: str, engine_dir: Path, *, version: int, engine: EngineSpec | None,
                  triton: TritonSpec) -> None:
    """Write the engine as the Triton model of ``version`` (the ``llm`` python model) into ``root``."""
    from serving.triton.repository import stage_engine_version

    stage_engine_version(
        root,
        name,
        engine_dir,
        version=version,
        device_kind=triton.device,
        max_queue_size=triton.max_queue_size,
        max_queue_delay_us=triton.max_queue_delay_us,
        parameters=dict(triton.engine_parameters) if triton.engine_parameters else None,
    )


def vocab_size(engine_dir: Path) -> int:
    """The engine's vocabulary, for the analysis traffic's random prompts."""
    from serving.engine import read_engine_info

    return read_engine_info(engine_dir).model.vocab_size


def memory_estimate(engine_dir: Path):
    """Weights + KV cache at the engine's limits (``serving.engine.memory.MemoryEstimate``)."""
    from serving.engine.memory import estimate_engine_memory

    return estimate_engine_memory(engine_dir)
