"""Move a release off the old layout (``<name>_engine``: one Triton model whose numbered folders are all
the engine versions, one config serving them) onto one model per version (``<name>_v<N>``).

Each served version's model is written aside and renamed into place (its engine files hardlinked from the
old folder), loaded, the routers are repointed at ``<name>_v{version}``, and only then is ``<name>_engine``
unloaded and removed. Every step is idempotent, so a crash anywhere is finished by the next call; until the
routers are repointed, clients are served by the old model. The migration initializes each served engine
once more (beside the old model, briefly twice the memory): the one reload this layout change costs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from serving.triton.errors import RepositoryError
from serving.triton.operations import apply_router_weights, serve_versions
from serving.triton.repository import (
    DEFAULT_SETTINGS,
    MODELS_DIR,
    STATE_FILE,
    VERSION_FILE,
    legacy_engine_dir,
    list_versions,
    remove_folder,
    router_weights,
    stage_version_model,
)


def legacy_served(legacy: Path) -> tuple[list[int], dict[str, Any]]:
    """The versions the old model serves (its state file, else every numbered folder) and its settings."""
    numbered = sorted(int(p.name) for p in legacy.iterdir() if p.is_dir() and p.name.isdigit())
    state = json.loads((legacy / STATE_FILE).read_text()) if (legacy / STATE_FILE).is_file() else {}
    served = sorted(int(v) for v in state.get("served") or numbered if int(v) in numbered)
    return served, {**DEFAULT_SETTINGS, **(state.get("settings") or {})}


def migrate_legacy(control: Any, root: Path, name: str, *, timeout_s: float = 120.0) -> list[int]:
    """Migrate release ``name`` in ``root`` if it is in the old layout; return the versions moved ([] when
    there was nothing to do). RepositoryError, before anything changes, for what cannot be moved."""
    legacy = legacy_engine_dir(root, name)
    if legacy is None:
        return []
    served, settings = legacy_served(legacy)
    sidecars = {}
    for version in served:
        sidecar = json.loads((legacy / str(version) / VERSION_FILE).read_text())
        if sidecar.get("kind", "torch") != "torch" or not (legacy / str(version) / "engine").is_dir():
            raise RepositoryError(
                f"{legacy} (the layout with one model for all versions) serves version {version} of kind "
                f"{sidecar.get('kind')!r}, which is not migrated automatically: remove the release from this "
                f"repository (unload {name}, {legacy.name} and delete their folders), then promote again")
        sidecars[version] = {**sidecar, "settings": sidecar.get("settings") or settings}
    for version in served:
        if version not in list_versions(root, name):
            stage_version_model(root, name, version, model_source=MODELS_DIR / "llm.py",
                                payload={"engine": legacy / str(version) / "engine"}, sidecar=sidecars[version])
    if served:
        serve_versions(control, root, name, served, timeout_s=timeout_s)
    weights = router_weights(root, name)
    if weights:
        apply_router_weights(control, root, name, weights, timeout_s=timeout_s)
    control.unload_model(legacy.name, timeout_s=timeout_s)
    remove_folder(legacy)
    return served
