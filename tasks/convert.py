"""Step 1: Hugging Face checkpoint -> engine checkpoint (fused weights, dtype cast, quantization)."""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import task

from tasks.checkpoint import ConvertedCheckpoint, check_checkpoint
from tasks.engine_kinds import convert_for_kind
from tasks.engine_spec import EngineSpec
from tasks.hashing import tree_digest, value_digest

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
    """Convert once per (checkpoint content, dtype, quantization); a finished conversion is reused."""
    if engine.kind != "torch":  # TensorRT-LLM kinds: tasks/engine_kinds.py
        return convert_for_kind(checkpoint, engine, work_dir)
    from serving.engine import convert_checkpoint

    check_checkpoint(checkpoint)
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


@task(name="convert", retries=0)
def convert_task(checkpoint: Path, engine: EngineSpec, work_dir: Path) -> ConvertedCheckpoint:
    """Convert the HF checkpoint into an engine checkpoint."""
    return convert(checkpoint, engine, work_dir)
