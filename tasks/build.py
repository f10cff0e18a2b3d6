"""Step 2: engine checkpoint -> engine folder for one target, carrying its limits and toolchain."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task

from tasks.checkpoint import ConvertedCheckpoint
from tasks.engine_kinds import kind_of
from tasks.engine_spec import EngineSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltEngine:
    info: Any  # the kind's record: serving.engine.EngineInfo, or a TrtllmArtifact (.path, .fingerprint)
    reused: bool  # the engine folder was already there: nothing was rebuilt


def build(converted: ConvertedCheckpoint, engine: EngineSpec, work_dir: Path) -> BuiltEngine:
    """Build once per (converted checkpoint, limits, toolchain); a finished build is reused."""
    engines = work_dir / "engines"
    before = {p.name for p in engines.iterdir()} if engines.is_dir() else set()
    info = kind_of(engine).build(converted, engine, work_dir)
    reused = Path(info.path).name in before
    if reused:
        log.info("build: cache hit, reusing %s (fingerprint %s)", info.path, info.fingerprint[:16])
    return BuiltEngine(info, reused)


@task(name="build", retries=0)
def build_task(converted: ConvertedCheckpoint, engine: EngineSpec, work_dir: Path) -> BuiltEngine:
    """Build the engine folder from the converted checkpoint."""
    return build(converted, engine, work_dir)
