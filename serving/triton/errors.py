"""Errors raised by the Triton serving layer.

One base error with narrow subclasses (like MLflow's exceptions); every message names the offending
value and the setting or argument it came from. Named ``ServingError`` so it never clashes with
``triton_python_backend_utils.TritonError`` inside the python backend.
"""

from __future__ import annotations


class ServingError(Exception):
    """Base class of every error raised by ``serving.triton``."""


class TritonNotInstalledError(ServingError):
    """The bundled tritonserver (nvidia-pytriton wheel) or one of its parts is missing."""


class TritonStartError(ServingError):
    """tritonserver exited or never became ready while starting."""


class TritonStopError(ServingError):
    """A tritonserver or one of its python stubs still ran after its stop's timeout (and a SIGKILL)."""


class TritonUnreachableError(ServingError):
    """The Triton HTTP endpoint did not answer (connection refused, timeout)."""


class TritonRequestError(ServingError):
    """Triton answered a request with an error status."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ModelLoadError(TritonRequestError):
    """Triton refused to load a model (bad config, initialize raised)."""


class ModelLoadTimeout(ServingError):
    """A model load or unload did not finish within its timeout."""


class InferenceError(TritonRequestError):
    """An inference request came back with an error."""


class RepositoryError(ServingError):
    """The model repository is missing, inconsistent, or a staging step failed."""


class ConfigError(ServingError):
    """A generated or requested model configuration is invalid."""
