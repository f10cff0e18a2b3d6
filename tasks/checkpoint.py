"""The source checkpoint and what a conversion makes of it, shared by every engine kind's convert."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.errors import CheckpointError


@dataclass(frozen=True)
class ConvertedCheckpoint:
    path: Path
    source_digest: str
    reused: bool = False  # a finished conversion with the same key was found: nothing was redone


def check_checkpoint(checkpoint: Path, *, kind: str | None = None) -> None:
    """Fail early, naming the setting, when the source folder is not a usable HF checkpoint; for `kind` "torch"
    (the spec's engine.kind) also when it is quantized in a scheme that engine does not load."""
    if not checkpoint.is_dir():
        raise CheckpointError(
            f"source.checkpoint {str(checkpoint)!r} is not a folder; point it at a Hugging Face checkpoint "
            "(config.json and *.safetensors)"
        )
    if not (checkpoint / "config.json").is_file():
        raise CheckpointError(f"source.checkpoint {str(checkpoint)!r} has no config.json")
    if not any(checkpoint.glob("*.safetensors")):
        raise CheckpointError(f"source.checkpoint {str(checkpoint)!r} has no *.safetensors weights")
    if kind == "torch":
        from tasks.hf_reference import fp8_checkpoint_of

        fp8_checkpoint_of(checkpoint)  # a quantization the engine does not load is refused here, naming it
