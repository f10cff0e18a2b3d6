"""Errors of the TensorRT-LLM engine kinds: one base class, narrow subclasses.

Every message names the offending value and the setting (or path) it came from.
"""

from __future__ import annotations


class TrtllmError(Exception):
    """Base class of every error raised by ``serving.trtllm``."""


class TrtllmUnavailableError(TrtllmError):
    """TensorRT-LLM (the ``tensorrt_llm`` package or one of its commands) is not installed here."""


class TrtllmOptionError(TrtllmError, ValueError):
    """A build or serving option is invalid or not a documented TensorRT-LLM 1.2 flag."""


class TrtllmStepError(TrtllmError):
    """A TensorRT-LLM subprocess (convert, quantize, build, bench) failed or timed out.

    ``log_path`` holds the whole log; ``tail`` its last lines (also in the message).
    """

    def __init__(self, message: str, *, log_path: str | None = None, tail: str = "") -> None:
        super().__init__(message + (f"\n--- last lines of {log_path} ---\n{tail}" if tail else ""))
        self.log_path = log_path
        self.tail = tail


class TrtllmArtifactError(TrtllmError):
    """An engine or LLM-API artifact folder is missing files, metadata, or was changed."""


class TrtllmToolchainMismatchError(TrtllmError):
    """An artifact was built with a toolchain the target cannot serve it with (both sides named)."""


class TrtllmBenchError(TrtllmError):
    """A ``trtllm-bench`` report could not be parsed or the dataset is invalid."""
