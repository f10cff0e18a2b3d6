"""The production version a candidate is compared with: found by the MLflow alias, its engine fetched verified.

The alias ``production`` names the version; its ``fingerprint`` tag names the artifact in the spec's store,
which ``tasks.stage.fetch_engine`` downloads with every file checked against the manifest (and the toolchain
against this machine). When there is no production version, or its engine cannot be used here, the
comparison is skipped and `ProductionEngine.skipped` says why (the release report shows it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProductionEngine:
    version: str | None
    fingerprint: str | None
    engine_dir: Path | None
    skipped: str = ""  # why there is nothing to compare with ("" when engine_dir is set)


def production_engine(*, tracking_uri: str, model_name: str, artifacts_uri: str, cache_dir: Path,
                      device: str = "auto") -> ProductionEngine:
    """The production version's engine, downloaded into `cache_dir` and verified; or why there is none."""
    from registry import model_registry as mr
    from registry.errors import RegistryError
    from tasks.stage import fetch_engine

    try:
        version = mr.get_version_by_alias(tracking_uri, model_name, mr.ALIAS_PRODUCTION)
    except RegistryError as exc:
        return ProductionEngine(None, None, None, f"the registry could not be read ({exc})")
    if version is None:
        return ProductionEngine(None, None, None, f"no version of {model_name} has the alias "
                                f"'{mr.ALIAS_PRODUCTION}' yet (first release)")
    fingerprint = mr.get_version(tracking_uri, model_name, version).fingerprint
    if not fingerprint:
        return ProductionEngine(version, None, None, f"production version {version} has no fingerprint tag")
    try:
        engine_dir = fetch_engine(artifacts_uri=artifacts_uri, model_name=model_name, fingerprint=fingerprint,
                                  cache_dir=cache_dir, device=device)
    except Exception as exc:  # noqa: BLE001 - production's artifact is not the candidate's fault: skip, say why
        log.warning("production version %s: engine not usable here: %s", version, exc)
        return ProductionEngine(version, fingerprint, None, f"production version {version}'s engine could not be "
                                f"fetched and verified from {artifacts_uri}: {type(exc).__name__}: {exc}")
    return ProductionEngine(version, fingerprint, engine_dir)
