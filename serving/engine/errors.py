"""Errors of the `torch` engine kind: one base class, narrow subclasses.

Every message names the offending value and the setting (or path) it came from, so a failed
release step reads as a report, not a stack trace.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error raised by `serving.engine`."""


class CheckpointError(EngineError):
    """A checkpoint folder is missing, incomplete or holds unexpected tensors."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint or engine folder, or a file it must contain, does not exist."""


class UnsupportedArchitectureError(EngineError):
    """The checkpoint's `architectures` / `model_type` / options are not supported by this engine."""


class EngineLimitError(EngineError, ValueError):
    """A request or a build setting exceeds the engine's limits (batch, input length, sequence length)."""


class EngineFormatError(EngineError):
    """An `engine.json` is missing fields or has an unknown format version."""


class EngineExistsError(EngineError, FileExistsError):
    """The output folder already holds a different engine (or something that is not an engine)."""


class EngineIntegrityError(EngineError):
    """A file of an engine does not match the sha256 recorded in its `engine.json`."""


class ToolchainMismatchError(EngineError):
    """The engine was built with a toolchain the runtime cannot load it with."""


class EngineQuantizationError(EngineLimitError):
    """A quantization the device cannot run, or a quantization record that does not match the weights."""
