"""Repository change + reload in one call: the steps a gray release applies to each Triton endpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from serving.triton.control import TritonControl
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
    """Serve exactly ``versions`` of ``<name>_engine``: rewrite its config, then reload it."""
    config = set_served_versions(root, name, versions)
    control.load_model(engine_model_name(name), timeout_s=timeout_s)
    return config
