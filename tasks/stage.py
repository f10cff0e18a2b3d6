"""Step 7: fetch the approved artifacts, verify them, and stage them as a new version in every repository.

Either every endpoint of the fleet ends up serving the live version plus the candidate, or none does:
a failure on one endpoint unstages the candidate everywhere it was staged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from prefect import task

from tasks.promote_spec import TritonSpec
from tasks.targets import Target

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagedVersion:
    model_name: str
    version: int
    live_version: int | None
    engine_dir: Path


def fetch_engine(*, artifacts_uri: str, model_name: str, fingerprint: str, cache_dir: Path, device: str) -> Path:
    """Download the engine (every file checked against the manifest) and check its toolchain here."""
    from registry.stores import artifact_key, open_store
    from serving.engine import check_toolchain, read_engine_info
    from serving.engine.runner import resolve_device

    local = cache_dir / model_name / fingerprint
    store = open_store(artifacts_uri)
    store.get_tree(artifact_key(model_name, fingerprint), local)
    info = read_engine_info(local)
    if info.fingerprint != fingerprint:
        raise ValueError(
            f"artifact {model_name}/{fingerprint} holds an engine with fingerprint {info.fingerprint}"
        )
    check_toolchain(info, device=resolve_device(device))
    return local


def live_version(target: Target, model_name: str) -> int | None:
    """The version the router sends all traffic to, or None before the first release."""
    from serving.triton.repository import router_weights

    weights = router_weights(target.model_repository, model_name)
    full = [v for v, w in weights.items() if w == 100]
    return full[0] if full else None


def stage(targets: list[Target], *, model_name: str, engine_dir: Path, version: int, triton: TritonSpec) -> StagedVersion:
    """Stage `engine_dir` as `version` beside the live version on every target and load both."""
    from serving.triton.operations import apply_router_weights, serve_versions
    from serving.triton.repository import remove_version, served_versions, stage_engine_version

    lives = {live_version(t, model_name) for t in targets}
    if len(lives) > 1:
        raise ValueError(f"the fleet is inconsistent: live versions of {model_name} differ across endpoints: {lives}")
    live = lives.pop()
    done: list[tuple[Target, list[int]]] = []
    try:
        for target in targets:
            before = served_versions(target.model_repository, model_name) if live is not None else []
            stage_engine_version(
                target.model_repository,
                model_name,
                engine_dir,
                version=version,
                device_kind=triton.device,
                max_queue_size=triton.max_queue_size,
                max_queue_delay_us=triton.max_queue_delay_us,
            )
            done.append((target, before))
            serving = sorted({*before, version})
            serve_versions(target.control(), target.model_repository, model_name, serving, timeout_s=triton.load_timeout_s)
            if live is None:  # first release: the router appears, pointing at the only version there is
                apply_router_weights(target.control(), target.model_repository, model_name, {version: 100},
                                     timeout_s=triton.load_timeout_s)
            log.info("staged %s version %d on %s (serving %s)", model_name, version, target.url, serving)
    except BaseException:
        for target, before in reversed(done):
            _unstage(target, model_name, version, before, triton.load_timeout_s, remove_version)
        raise
    return StagedVersion(model_name, version, live, engine_dir)


def _unstage(target: Target, model_name: str, version: int, before: list[int], timeout_s: float, remove_version) -> None:
    from serving.triton.operations import serve_versions
    from serving.triton.repository import remove_model

    try:
        if before:
            serve_versions(target.control(), target.model_repository, model_name, before, timeout_s=timeout_s)
            remove_version(target.model_repository, model_name, version)
        else:
            remove_model(target.control(), target.model_repository, model_name, timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - keep unstaging the other endpoints
        log.error("could not unstage %s version %d on %s: %s", model_name, version, target.url, exc)


@task(name="stage", retries=0)
def stage_task(targets: list[Target], *, model_name: str, engine_dir: Path, version: int, triton: TritonSpec) -> StagedVersion:
    """Stage the candidate version on every Triton endpoint."""
    return stage(targets, model_name=model_name, engine_dir=engine_dir, version=version, triton=triton)
