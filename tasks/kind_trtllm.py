"""The TensorRT-LLM engine kinds' steps (``trtllm-engine``, ``trtllm-llmapi``): convert, build, verify, stage.

``tasks.engine_kinds`` puts them in its table beside the ``torch`` kind's (``tasks.kind_torch``). The
work is keyed by content hashes like the torch path, so a re-run finds finished conversions and builds.
TensorRT-LLM is required up front (``require_trtllm``): a machine without it fails before any hashing,
with a message naming ``engine.kind``.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

from tasks.checkpoint import ConvertedCheckpoint, check_checkpoint
from tasks.engine_spec import EngineSpec
from tasks.hashing import tree_digest, value_digest
from tasks.promote_spec import TritonSpec

log = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 32000  # for the analysis traffic's random prompts when an artifact carries no HF config


def trtllm_options(engine: EngineSpec) -> Any:
    """The spec's engine section as ``serving.trtllm.TrtllmOptions`` (cross-field rules checked).

    ``engine.quantization`` (the field every kind takes) sets ``engine.trtllm.quantization`` (fp8 -> fp8,
    int8-weight-only -> int8_weight_only: QuantAlgo FP8 / W8A16); both set and different is an error.
    ``trtllm-engine`` warns which TensorRT-LLM versions it is for."""
    from serving.trtllm import TrtllmOptions
    from serving.trtllm.errors import TrtllmOptionError
    from serving.trtllm.options import FROM_ENGINE_QUANTIZATION, TRTLLM_ENGINE_VERSIONS

    values = {**engine.model_dump(exclude={"trtllm"}), **engine.trtllm.model_dump(exclude={"target_toolchain"})}
    mapped = FROM_ENGINE_QUANTIZATION[engine.quantization]
    if mapped != "none":
        if engine.trtllm.quantization not in ("none", mapped):
            raise TrtllmOptionError(f"engine.quantization={engine.quantization!r} (TensorRT-LLM {mapped!r}) and "
                                    f"engine.trtllm.quantization={engine.trtllm.quantization!r} disagree; set one")
        values["quantization"] = mapped
    if engine.kind == "trtllm-engine":
        warnings.warn(TRTLLM_ENGINE_VERSIONS, FutureWarning, stacklevel=2)
        log.warning("%s", TRTLLM_ENGINE_VERSIONS)
    options = TrtllmOptions.from_mapping(values)
    options.check()
    return options


def convert_engine_checkpoint(checkpoint: Path, engine: EngineSpec, work_dir: Path) -> ConvertedCheckpoint:
    """trtllm-engine: HF -> TensorRT-LLM checkpoint (convert_checkpoint.py / quantize.py), keyed by content."""
    from serving.trtllm import convert_trtllm_checkpoint, require_trtllm

    options = trtllm_options(engine)
    require_trtllm(engine.kind, commands=("trtllm-build",))
    check_checkpoint(checkpoint)
    source_digest = tree_digest(checkpoint)
    key = value_digest({"source": source_digest, "kind": engine.kind,
                        "convert": _convert_relevant(engine)})[:16]
    out = work_dir / "checkpoints" / key
    if (out / "config.json").is_file():
        log.info("TensorRT-LLM conversion already done: %s", out)
        return ConvertedCheckpoint(out, source_digest)
    convert_trtllm_checkpoint(checkpoint, out, options, log_dir=work_dir / "logs" / key,
                              progress=lambda m: log.info("%s", m))
    return ConvertedCheckpoint(out, source_digest)


def keep_hf_checkpoint(checkpoint: Path, engine: EngineSpec, work_dir: Path) -> ConvertedCheckpoint:
    """trtllm-llmapi: nothing to convert (the artifact is built from the HF checkpoint in ``build``)."""
    from serving.trtllm import require_trtllm

    trtllm_options(engine)
    require_trtllm(engine.kind)
    check_checkpoint(checkpoint)
    return ConvertedCheckpoint(Path(checkpoint), tree_digest(checkpoint))


def _convert_relevant(engine: EngineSpec) -> dict[str, Any]:
    t = engine.trtllm
    return {"dtype": engine.dtype, "quantization": t.quantization, "kv_cache_dtype": t.kv_cache_dtype,
            "calib_size": t.calib_size, "awq_block_size": t.awq_block_size, "tp": t.tp_size, "pp": t.pp_size,
            "family": t.model_family}


def _artifact_dir(converted, engine: EngineSpec, work_dir: Path) -> tuple[Path, Path]:
    """Where the artifact of ``converted`` built with ``engine`` lives (keyed by content), and its logs."""
    spec = engine.model_dump(exclude={"trtllm": {"examples_dir", "modelopt_examples_dir", "convert_timeout_s",
                                                 "build_timeout_s", "target_toolchain"}})
    key = value_digest({"checkpoint": converted.path.name, "source": converted.source_digest, "engine": spec})[:16]
    return work_dir / "engines" / key, work_dir / "logs" / key


def build_engine_artifact(converted, engine: EngineSpec, work_dir: Path, *, hf_checkpoint: Path | None = None):
    """trtllm-engine: ``trtllm-build`` of the converted checkpoint; a ``TrtllmArtifact`` (``.path``, ``.fingerprint``)."""
    from serving.trtllm import build_trtllm_engine, read_artifact, require_trtllm

    options = trtllm_options(engine)
    require_trtllm(engine.kind, commands=("trtllm-build",))
    out, logs = _artifact_dir(converted, engine, work_dir)
    if out.is_dir():
        log.info("TensorRT-LLM artifact already built: %s", out)
        return read_artifact(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    hf = Path(hf_checkpoint) if hf_checkpoint else _hf_source_of(converted)
    return build_trtllm_engine(converted.path, hf, out, options, log_dir=logs, progress=lambda m: log.info("%s", m))


def build_llmapi_artifact(converted, engine: EngineSpec, work_dir: Path, *, hf_checkpoint: Path | None = None):
    """trtllm-llmapi: the HF checkpoint beside the ``LLM()`` arguments; a ``TrtllmArtifact``."""
    from serving.trtllm import prepare_llmapi_artifact, read_artifact, require_trtllm

    options = trtllm_options(engine)
    require_trtllm(engine.kind)
    out, logs = _artifact_dir(converted, engine, work_dir)
    if out.is_dir():
        log.info("TensorRT-LLM artifact already built: %s", out)
        return read_artifact(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return prepare_llmapi_artifact(converted.path, out, options, log_dir=logs, progress=lambda m: log.info("%s", m))


def _hf_source_of(converted) -> Path:
    """The source's tokenizer/config files, kept by ``convert_trtllm_checkpoint`` beside the checkpoint."""
    from serving.trtllm.artifacts import HF_FILES_DIR

    hf = Path(converted.path) / HF_FILES_DIR
    if not (hf / "config.json").is_file():
        raise ValueError(f"converted checkpoint {converted.path} has no {HF_FILES_DIR}/config.json; pass "
                         "hf_checkpoint (source.checkpoint) to build engine.kind='trtllm-engine'")
    return hf


def target_toolchain(engine: EngineSpec) -> dict[str, Any] | None:
    """The fleet toolchain from ``engine.trtllm.target_toolchain``; None when no field is set (detect)."""
    values = engine.trtllm.target_toolchain.model_dump()
    return values if any(values.values()) else None


def verify_fetched(artifact_dir: Path, engine: EngineSpec, *, fingerprint: str, device: str) -> None:
    """After the download: every file against the artifact's own hashes, then its toolchain against the fleet's
    (``fingerprint`` was checked by the manifest; ``device`` is the torch kind's concern)."""
    from serving.trtllm import verify_artifact

    verify_artifact(artifact_dir)
    check_stage_toolchain(artifact_dir, engine)


def check_stage_toolchain(artifact_dir: Path, engine: EngineSpec) -> None:
    """Before promotion/staging: refuse an artifact built for another GPU or TensorRT-LLM version."""
    from serving.trtllm import check_trtllm_toolchain, current_toolchain, read_artifact

    art = read_artifact(artifact_dir)
    opts = trtllm_options(engine)
    check_trtllm_toolchain(art.toolchain, target_toolchain(engine) or current_toolchain(), kind=art.kind,
                           uses_fp8=opts.uses_fp8)


def stage_for_kind(root: Path, name: str, artifact_dir: Path, engine: EngineSpec, *, version: int | None = None,
                   max_queue_delay_us: int = 2000, max_queue_size: int = 64,
                   repository_mount: str | None = None) -> int:
    """Stage a TensorRT-LLM artifact into the gray-release layout (toolchain checked first)."""
    from serving.triton.trtllm_repository import stage_trtllm_version

    return stage_trtllm_version(root, name, artifact_dir, target_toolchain=target_toolchain(engine), version=version,
                                max_queue_delay_us=max_queue_delay_us, max_queue_size=max_queue_size,
                                repository_mount=repository_mount)


def vocab_size(artifact_dir: Path) -> int:
    """The vocabulary of the artifact's model, from the HF config that travels with every TensorRT-LLM artifact."""
    config = next(artifact_dir.rglob("config.json"), None)
    return int(json.loads(config.read_text()).get("vocab_size", DEFAULT_VOCAB_SIZE)) if config else DEFAULT_VOCAB_SIZE


def stage_version(root: Path, name: str, artifact_dir: Path, *, version: int, engine: EngineSpec,
                  triton: TritonSpec) -> None:
    """The table's stage step: `stage_for_kind` with the spec's queue settings."""
    stage_for_kind(root, name, artifact_dir, engine, version=version, max_queue_delay_us=triton.max_queue_delay_us,
                   max_queue_size=triton.max_queue_size)
