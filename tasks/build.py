"""Step 2: engine checkpoint -> engine folder for one target, carrying its limits and toolchain."""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import task

from tasks.convert import ConvertedCheckpoint
from tasks.engine_spec import EngineSpec
from tasks.hashing import value_digest

log = logging.getLogger(__name__)


def build(converted: ConvertedCheckpoint, engine: EngineSpec, work_dir: Path):
    """Build once per (converted checkpoint, limits); returns the engine's EngineInfo."""
    if engine.kind != "torch":  # TensorRT-LLM kinds: tasks/engine_kinds.py (returns a TrtllmArtifact)
        from tasks.engine_kinds import build_for_kind

        return build_for_kind(converted, engine, work_dir)
    from serving.engine import EngineLimits, build_engine, read_engine_info

    limits = EngineLimits(
        dtype=engine.dtype,
        max_batch_size=engine.max_batch_size,
        max_input_len=engine.max_input_len,
        max_seq_len=engine.max_seq_len,
    )
    key = value_digest({"checkpoint": converted.path.name, "engine": engine.model_dump(exclude={"trtllm"})})[:16]
    out = work_dir / "engines" / key
    if (out / "engine.json").is_file():
        log.info("engine already built: %s", out)
        return read_engine_info(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return build_engine(converted.path, out, limits=limits)


@task(name="build", retries=0)
def build_task(converted: ConvertedCheckpoint, engine: EngineSpec, work_dir: Path):
    """Build the engine folder from the converted checkpoint."""
    return build(converted, engine, work_dir)
