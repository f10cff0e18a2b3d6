"""Step 2: engine checkpoint -> engine folder for one target, carrying its limits and toolchain."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task

from tasks.checkpoint import ConvertedCheckpoint
from tasks.convert import quant_info, toolchain_key
from tasks.engine_spec import EngineSpec
from tasks.hashing import value_digest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltEngine:
    info: Any  # serving.engine.EngineInfo, or a TrtllmArtifact for the TensorRT-LLM kinds (.path, .fingerprint)
    reused: bool  # the engine folder was already there: nothing was rebuilt


def build(converted: ConvertedCheckpoint, engine: EngineSpec, work_dir: Path) -> BuiltEngine:
    """Build once per (converted checkpoint, limits, toolchain); a finished build is reused."""
    engines = work_dir / "engines"
    before = {p.name for p in engines.iterdir()} if engines.is_dir() else set()
    info = _build(converted, engine, work_dir)
    reused = Path(info.path).name in before
    if reused:
        log.info("build: cache hit, reusing %s (fingerprint %s)", info.path, info.fingerprint[:16])
    return BuiltEngine(info, reused)


def _build(converted: ConvertedCheckpoint, engine: EngineSpec, work_dir: Path):
    if engine.kind != "torch":  # TensorRT-LLM kinds: tasks/engine_kinds.py (returns a TrtllmArtifact)
        from tasks.engine_kinds import build_for_kind

        return build_for_kind(converted, engine, work_dir)
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
    return build_engine(converted.path, out, limits=limits, quantization=quant_info(engine), paged=_paged(engine))


def _paged(engine: EngineSpec) -> Any:
    """The spec's paged KV settings as serving.engine.paged_cache.PagedKVConfig, or None (static cache)."""
    if engine.paged is None:
        return None
    from serving.engine.paged_cache import PagedKVConfig

    p = engine.paged
    return PagedKVConfig(block_size=p.block_size, num_blocks=p.num_blocks, free_mem_fraction=p.free_gpu_mem_fraction,
                         max_num_tokens=p.max_num_tokens)


def _unquantized_keys(engine: EngineSpec) -> set[str]:
    """Fields left out of the build key: the TensorRT-LLM options, and the quantization and paged fields while
    they hold their defaults (so that unquantized, static-cache builds keep the keys they had)."""
    keys = {"trtllm"}
    if engine.paged is None:
        keys.add("paged")
    if engine.quantization == "none":
        keys |= {"quantization", "quantize_lm_head"}
    return keys


@task(name="build", retries=0)
def build_task(converted: ConvertedCheckpoint, engine: EngineSpec, work_dir: Path) -> BuiltEngine:
    """Build the engine folder from the converted checkpoint."""
    return build(converted, engine, work_dir)
