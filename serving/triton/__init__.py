"""Serving through NVIDIA Triton: the bundled server, the model repository, the llm/router models.

Client-side modules here use the standard library only (tritonclient is optional and never imported at
module level); ``models/`` holds the python-backend model sources copied into the repository.
"""

from serving.triton.client import InferResult, infer_ids, infer_text
from serving.triton.control import ModelState, TritonControl
from serving.triton.errors import (
    ConfigError,
    InferenceError,
    ModelLoadError,
    ModelLoadTimeout,
    RepositoryError,
    ServingError,
    TritonNotInstalledError,
    TritonRequestError,
    TritonStartError,
    TritonUnreachableError,
)
from serving.triton.install import TritonInstall, locate_triton
from serving.triton.operations import apply_router_weights, serve_versions
from serving.triton.process import TritonProcess, start_triton
from serving.triton.repository import (
    engine_model_name,
    init_repository,
    list_versions,
    remove_version,
    router_config,
    router_stats,
    served_versions,
    set_served_versions,
    stage_engine_version,
    write_router,
)

__all__ = [
    "ConfigError", "InferResult", "InferenceError", "ModelLoadError", "ModelLoadTimeout", "ModelState",
    "RepositoryError", "ServingError", "TritonControl", "TritonInstall", "TritonNotInstalledError",
    "TritonProcess", "TritonRequestError", "TritonStartError", "TritonUnreachableError", "apply_router_weights",
    "engine_model_name", "infer_ids", "infer_text", "init_repository", "list_versions", "locate_triton",
    "remove_version", "router_config", "router_stats", "serve_versions", "served_versions",
    "set_served_versions", "stage_engine_version", "start_triton", "write_router",
]
