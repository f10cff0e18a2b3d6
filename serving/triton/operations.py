"""Repository change + reload in one call: the steps a gray release applies to each Triton endpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from serving.triton.control import TritonControl
from serving.triton.repository import engine_model_name, set_served_versions, write_router


def apply_router_weights(control: TritonControl, root: Path, name: str, weights: dict[int, int], *,
                         timeout_s: float = 60.0, **config_kwargs: Any) -> dict[str, Any]:
    """Persist the router's weights and reload it with the complete config as an override."""
    config = write_router(root, name, weights, **config_kwargs)
    control.load_model(name, config=config, timeout_s=timeout_s)
    return config


def serve_versions(control: TritonControl, root: Path, name: str, versions: list[int], *,
                   timeout_s: float = 120.0) -> dict[str, Any]:
    """Serve exactly ``versions`` of ``<name>_engine``: rewrite its config, then reload it."""
    config = set_served_versions(root, name, versions)
    control.load_model(engine_model_name(name), timeout_s=timeout_s)
    return config
