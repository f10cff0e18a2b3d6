"""Repository change + load in one call: the steps a gray release applies to each Triton endpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from serving.triton.control import TritonControl
from serving.triton.errors import TritonRequestError
from serving.triton.repository import (
    LEGACY_SUFFIX,
    STATE_FILE,
    TRITON_VERSION,
    engine_decoupled,
    engine_model_name,
    list_versions,
    remove_folder,
    router_weights,
    set_served_versions,
    stream_model_name,
    write_router,
    write_stream_router,
)


def apply_router_weights(control: TritonControl, root: Path, name: str, weights: dict[int, int], *,
                         timeout_s: float = 60.0, **config_kwargs: Any) -> dict[str, Any]:
    """Route release ``name`` by ``weights`` on one endpoint: write the routing file, which the loaded
    routers follow from their next request, and load the router (and the streaming router, while the llm
    is decoupled; it is removed when it no longer is) only where Triton does not run it with the config
    written: the first time, after a restart, or a router of an older layout. Returns the router's config."""
    decoupled = engine_decoupled(root, name)
    config = write_router(root, name, weights, target_decoupled=decoupled, **config_kwargs)
    if decoupled:
        stream = write_stream_router(root, name, seed=config_kwargs.get("seed"))
        _load_unless_running(control, stream_model_name(name), stream, timeout_s=timeout_s)
    else:
        remove_stream_router(control, root, name, timeout_s=timeout_s)
    _load_unless_running(control, name, config, timeout_s=timeout_s)
    return config


def _running_with(control: TritonControl, model: str, config: dict[str, Any]) -> bool:
    """Triton runs ``model`` with ``config``'s parameters (a router that follows its routing file)."""
    try:
        loaded = control.model_config(model)
    except TritonRequestError:
        return False
    return loaded.get("parameters", {}) == config["parameters"]


def _load_unless_running(control: TritonControl, model: str, config: dict[str, Any], *, timeout_s: float) -> None:
    if not _running_with(control, model, config):
        control.load_model(model, config=config, timeout_s=timeout_s)


def router_loaded_with(control: TritonControl, root: Path, name: str, weights: dict[int, int]) -> bool:
    """The router ``name`` routes by exactly ``weights``: its routing file holds them and Triton runs the
    router (and the streaming router, while the llm is decoupled) as one that follows that file."""
    from serving.triton.models.routing_file import routing_parameters

    if router_weights(root, name) != weights:
        return False
    models = [name] + ([stream_model_name(name)] if engine_decoupled(root, name) else [])
    for model in models:
        try:
            loaded = control.model_config(model)
        except TritonRequestError:
            return False
        if not routing_parameters(loaded.get("parameters", {})):
            return False
    return True


def remove_stream_router(control: TritonControl, root: Path, name: str, *, timeout_s: float = 60.0) -> None:
    """Unload and delete ``<name>_stream`` if it is there (the llm is no longer decoupled)."""
    path = Path(root) / stream_model_name(name)
    if not path.is_dir():
        return
    control.unload_model(stream_model_name(name), timeout_s=timeout_s)
    remove_folder(path)


def serve_versions(control: TritonControl, root: Path, name: str, versions: list[int], *,
                   timeout_s: float = 120.0) -> dict[int, dict[str, Any]]:
    """Serve exactly ``versions`` of release ``name``: record them, load each version's model that is not
    ready (that model only: a version already live is never reloaded), then unload the other versions'
    models. Their folders stay until `remove_version`. Returns each served version's config."""
    configs = set_served_versions(root, name, versions)
    for version in configs:
        model = engine_model_name(name, version)
        if control.ready_versions(model) != [TRITON_VERSION]:
            control.load_model(model, timeout_s=timeout_s)
    for version in list_versions(root, name):
        model = engine_model_name(name, version)
        if version not in configs and control.ready_versions(model):
            control.unload_model(model, timeout_s=timeout_s)
    return configs


def served_models(root: Path) -> list[str]:
    """The models ``root`` serves, in the order they must load: per release (``.engines-<name>.json``
    naming served versions) each version's TensorRT-LLM backend model and its engine model, then the
    streaming router and the router. A release still in the old layout (``<name>_engine`` serving
    versions) loads as it was staged."""
    from serving.triton.repository import SERVED_PREFIX, served_versions
    from serving.triton.trtllm_repository import trtllm_model_name

    root = Path(root)
    order = []
    for record in sorted(root.glob(f"{SERVED_PREFIX}*.json")):
        name = record.name.removeprefix(SERVED_PREFIX).removesuffix(".json")
        for version in served_versions(root, name):
            if (root / trtllm_model_name(name, version)).is_dir():
                order.append(trtllm_model_name(name, version))
            if (root / engine_model_name(name, version) / "config.pbtxt").is_file():
                order.append(engine_model_name(name, version))
        order += [model for model in (stream_model_name(name), name) if (root / model / "config.pbtxt").is_file()]
    return order + legacy_served_models(root)


def legacy_served_models(root: Path) -> list[str]:
    """``served_models`` of releases in the old layout (one ``<name>_engine`` for every version)."""
    from serving.triton.trtllm_repository import trtllm_model_name

    order = []
    for engine_dir in sorted(Path(root).glob(f"*{LEGACY_SUFFIX}")):
        name = engine_dir.name.removesuffix(LEGACY_SUFFIX)
        state = engine_dir / STATE_FILE
        served = json.loads(state.read_text()).get("served", []) if name and state.is_file() else []
        if not served:
            continue
        order += [trtllm_model_name(name, v) for v in served if (Path(root) / trtllm_model_name(name, v)).is_dir()]
        order.append(engine_dir.name)
        order += [model for model in (stream_model_name(name), name) if (Path(root) / model / "config.pbtxt").is_file()]
    return order


def load_served(control: TritonControl, root: Path, *, timeout_s: float = 120.0) -> list[str]:
    """Load every model ``root`` serves (``served_models``) and return their names: a server started in
    explicit model control (a restart) loads nothing by itself. ``--load-model=*`` is no substitute: a
    folder a crash left at the top of the repository (``.staging-*``) makes Triton 2.51 refuse to start.
    Routers an older enginewright wrote are upgraded first (`upgrade_router_files`): their model files
    would not import the routing helpers they were written against."""
    from serving.triton.repository import upgrade_router_files

    models = served_models(root)
    for model in models:
        upgrade_router_files(root, model)  # False for anything but an old router
    for model in models:
        control.load_model(model, timeout_s=timeout_s)
    return models
