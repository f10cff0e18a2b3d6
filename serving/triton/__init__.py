"""Serving through NVIDIA Triton: the bundled server, the model repository, the llm/router models.

Client-side modules here use the standard library only (tritonclient is optional and never imported at
module level); ``models/`` holds the python-backend model sources copied into the repository.

The names below are imported when first used (PEP 562): a model's stub imports ``serving.triton.models.*``,
and with it this package, at the model's CPU priority while a live version serves beside it, so it should
not also import the client, the repository and the process helpers it never calls.
"""

from __future__ import annotations

from serving.lazy_exports import lazy_exports

_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("InferResult", "infer_ids", "infer_text"), "client"),
    **dict.fromkeys(("ModelState", "TritonControl"), "control"),
    **dict.fromkeys(("ConfigError", "InferenceError", "ModelLoadError", "ModelLoadTimeout", "RepositoryError",
                     "ServingError", "TritonNotInstalledError", "TritonRequestError", "TritonStartError",
                     "TritonUnreachableError"), "errors"),
    **dict.fromkeys(("TritonInstall", "locate_triton"), "install"),
    **dict.fromkeys(("apply_router_weights", "serve_versions"), "operations"),
    **dict.fromkeys(("TritonProcess", "start_triton"), "process"),
    **dict.fromkeys(("engine_model_name", "init_repository", "list_versions", "remove_version", "router_config",
                     "router_stats", "served_versions", "set_served_versions", "stage_engine_version",
                     "write_router"), "repository"),
}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
