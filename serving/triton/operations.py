"""Repository change + reload in one call: the steps a gray release applies to each Triton endpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from serving.triton.control import TritonControl
from serving.triton.errors import TritonRequestError
from serving.triton.repository import (
    engine_decoupled,
    engine_model_name,
    remove_folder,
    set_served_versions,
    stream_model_name,
    write_router,
    write_stream_router,
)


def apply_router_weights(control: TritonControl, root: Path, name: str, weights: dict[int, int], *,
                         timeout_s: float = 60.0, **config_kwargs: Any) -> dict[str, Any]:
    """Persist the router's weights and reload it with the complete config as an override; the same for
    the streaming router while the llm is decoupled (written, or removed when it no longer is)."""
    decoupled = engine_decoupled(root, name)
    config = write_router(root, name, weights, target_decoupled=decoupled, **config_kwargs)
    if decoupled:
        load_id = config["parameters"]["load_id"]["string_value"]
        stream = write_stream_router(root, name, weights, load_id=load_id, seed=config_kwargs.get("seed"))
        control.load_model(stream_model_name(name), config=stream, timeout_s=timeout_s)
    else:
        remove_stream_router(control, root, name, timeout_s=timeout_s)
    control.load_model(name, config=config, timeout_s=timeout_s)
    return config


def remove_stream_router(control: TritonControl, root: Path, name: str, *, timeout_s: float = 60.0) -> None:
    """Unload and delete ``<name>_stream`` if it is there (the llm is no longer decoupled)."""
    path = Path(root) / stream_model_name(name)
    if not path.is_dir():
        return
    control.unload_model(stream_model_name(name), timeout_s=timeout_s)
    remove_folder(path)


def serve_versions(control: TritonControl, root: Path, name: str, versions: list[int], *,
                   timeout_s: float = 120.0) -> dict[str, Any]:
    """Serve exactly ``versions`` of ``<name>_engine``: rewrite its config, then reload it, unless Triton
    serves that very config already (a reload re-creates every version: seconds to minutes per engine)."""
    config = set_served_versions(root, name, versions)
    if not already_served(control, engine_model_name(name), config):
        control.load_model(engine_model_name(name), timeout_s=timeout_s)
    return config


def already_served(control: TritonControl, model: str, config: dict[str, Any]) -> bool:
    """Exactly the versions of ``config`` are ready, and every setting ``config`` holds has the same value in
    the config Triton loaded (which adds its defaults)."""
    if control.ready_versions(model) != sorted(config["version_policy"]["specific"]["versions"]):
        return False
    try:
        loaded = control.model_config(model)
    except TritonRequestError:
        return False
    return holds(loaded, config)


def holds(loaded: Any, wanted: Any) -> bool:
    """``wanted`` is contained in ``loaded``: dicts key by key, lists element by element (same length)."""
    if isinstance(wanted, dict):
        return isinstance(loaded, dict) and all(k in loaded and holds(loaded[k], v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(loaded, list) and len(loaded) == len(wanted) and all(map(holds, loaded, wanted))
    return loaded == wanted


def served_models(root: Path) -> list[str]:
    """The models ``root`` serves, in the order they must load: per engine model (``<name>_engine`` serving
    versions) its TensorRT-LLM backend models, the engine, the streaming router, the router."""
    from serving.triton.repository import STATE_FILE, served_versions
    from serving.triton.trtllm_repository import trtllm_model_name

    root = Path(root)
    suffix = engine_model_name("")  # "_engine"
    order = []
    for engine_dir in sorted(root.glob(f"*{suffix}")):
        name = engine_dir.name.removesuffix(suffix)
        if not name or not (engine_dir / STATE_FILE).is_file():
            continue
        served = served_versions(root, name)
        if not served:
            continue
        order += [trtllm_model_name(name, v) for v in served if (root / trtllm_model_name(name, v)).is_dir()]
        order.append(engine_dir.name)
        order += [model for model in (stream_model_name(name), name) if (root / model / "config.pbtxt").is_file()]
    return order


def load_served(control: TritonControl, root: Path, *, timeout_s: float = 120.0) -> list[str]:
    """Load every model ``root`` serves (``served_models``) and return their names: a server started in
    explicit model control (a restart) loads nothing by itself. ``--load-model=*`` is no substitute: a
    folder a crash left at the top of the repository (``.staging-*``) makes Triton 2.51 refuse to start."""
    models = served_models(root)
    for model in models:
        control.load_model(model, timeout_s=timeout_s)
    return models
