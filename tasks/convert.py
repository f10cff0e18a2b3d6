"""Step 1: Hugging Face checkpoint -> engine checkpoint (fused weights, dtype cast, quantization)."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from tasks.checkpoint import ConvertedCheckpoint
from tasks.engine_kinds import kind_of
from tasks.engine_spec import EngineSpec


def convert(checkpoint: Path, engine: EngineSpec, work_dir: Path) -> ConvertedCheckpoint:
    """Convert once per (checkpoint content, kind, dtype, quantization); a finished conversion is reused."""
    return kind_of(engine).convert(checkpoint, engine, work_dir)


@task(name="convert", retries=0)
def convert_task(checkpoint: Path, engine: EngineSpec, work_dir: Path) -> ConvertedCheckpoint:
    """Convert the HF checkpoint into an engine checkpoint."""
    return convert(checkpoint, engine, work_dir)
