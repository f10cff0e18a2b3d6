"""The engine kinds, one table: each kind's convert / build / verify / stage (and what a promotion reads from
its artifact), so the steps never ask which kind they hold and a new kind is one new entry.

| kind | convert | build | artifact |
| --- | --- | --- | --- |
| ``torch`` | fused wqkv / w13, dtype, quantization (``tasks.kind_torch``) | ``serving.engine`` folder | ``engine.json`` + weights |
| ``trtllm-engine`` | ``convert_checkpoint.py`` / ``quantize.py`` (``tasks.kind_trtllm``) | ``trtllm-build`` | TensorRT engines |
| ``trtllm-llmapi`` | nothing (the HF checkpoint is the input) | ``LLM()`` arguments beside the checkpoint | checkpoint + ``model.yaml`` |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tasks import kind_torch, kind_trtllm
from tasks.checkpoint import ConvertedCheckpoint
from tasks.engine_spec import EngineSpec
from tasks.promote_spec import TritonSpec


class StageFn(Protocol):
    def __call__(self, root: Path, name: str, engine_dir: Path, *, version: int, engine: EngineSpec | None,
                 triton: TritonSpec) -> None: ...


class VerifyFn(Protocol):
    def __call__(self, engine_dir: Path, engine: EngineSpec | None, *, fingerprint: str, device: str) -> None: ...


@dataclass(frozen=True)
class Kind:
    """One engine kind's steps. ``build`` returns the artifact's record (``.path``, ``.fingerprint``)."""

    name: str
    convert: Callable[[Path, EngineSpec, Path], ConvertedCheckpoint]  # (checkpoint, engine, work_dir)
    build: Callable[[ConvertedCheckpoint, EngineSpec, Path], Any]  # (converted, engine, work_dir)
    verify: VerifyFn  # a fetched artifact, before anything is staged
    stage: StageFn  # the artifact as the Triton model of one version
    vocab_size: Callable[[Path], int]  # for the analysis traffic's random prompts
    memory_estimate: Callable[[Path], Any] | None  # serving.engine.memory.MemoryEstimate; None: not known


TORCH = Kind("torch", kind_torch.convert, kind_torch.build, kind_torch.verify_fetched, kind_torch.stage_version,
             kind_torch.vocab_size, kind_torch.memory_estimate)
TRTLLM_ENGINE = Kind("trtllm-engine", kind_trtllm.convert_engine_checkpoint, kind_trtllm.build_engine_artifact,
                     kind_trtllm.verify_fetched, kind_trtllm.stage_version, kind_trtllm.vocab_size, None)
TRTLLM_LLMAPI = Kind("trtllm-llmapi", kind_trtllm.keep_hf_checkpoint, kind_trtllm.build_llmapi_artifact,
                     kind_trtllm.verify_fetched, kind_trtllm.stage_version, kind_trtllm.vocab_size, None)
KINDS: dict[str, Kind] = {k.name: k for k in (TORCH, TRTLLM_ENGINE, TRTLLM_LLMAPI)}


def kind_of(engine: EngineSpec | str | None) -> Kind:
    """The steps of ``engine.kind`` (a spec, a kind's name, or None for the default ``torch``)."""
    name = "torch" if engine is None else engine if isinstance(engine, str) else engine.kind
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"engine.kind={name!r} is not a known engine kind: expected one of "
                         f"{', '.join(sorted(KINDS))}") from None
