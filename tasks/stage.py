"""Step 7: fetch the approved artifacts, verify them, and stage them as a new version in every repository.

Either every endpoint of the fleet ends up serving the live version plus the candidate, or none does:
a failure on one endpoint unstages the candidate everywhere it was staged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.engine_kinds import kind_of
from tasks.engine_spec import EngineSpec
from tasks.promote_spec import TritonSpec
from tasks.rollback import remove_leftovers
from tasks.targets import Target

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagedVersion:
    model_name: str
    version: int
    live_version: int | None
    engine_dir: Path


def fetch_engine(*, artifacts_uri: str, model_name: str, fingerprint: str, cache_dir: Path, device: str,
                 engine: EngineSpec | None = None) -> Path:
    """Download the engine (every file checked against the manifest) and check its toolchain here.

    TensorRT-LLM artifacts are checked against the spec's target toolchain (GPU compute capability,
    TensorRT-LLM version) instead: a mismatch is refused before anything is staged.
    """
    from registry.stores import artifact_key, open_store

    local = cache_dir / model_name / fingerprint
    store = open_store(artifacts_uri)
    store.get_tree(artifact_key(model_name, fingerprint), local)
    kind_of(engine).verify(local, engine, fingerprint=fingerprint, device=device)
    return local


def migrate_layout(targets: list[Target], model_name: str, timeout_s: float) -> None:
    """Move every endpoint still in the old layout (``<name>_engine`` holding all versions) to one Triton
    model per version (`serving.triton.migrate`); idempotent, so a run killed midway is finished by the next."""
    from serving.triton.migrate import migrate_legacy

    for target in targets:
        moved = migrate_legacy(target.control(), target.model_repository, model_name, timeout_s=timeout_s)
        if moved:
            log.warning("%s on %s: migrated versions %s from %s_engine to one Triton model per version",
                        model_name, target.url, moved, model_name)
            print(f"{model_name} on {target.url}: migrated versions {moved} from the old layout ({model_name}_engine) "
                  "to one Triton model per version")


def stage(targets: list[Target], *, model_name: str, engine_dir: Path, version: int, triton: TritonSpec,
          live: int | None = None, engine: EngineSpec | None = None) -> StagedVersion:
    """Stage `engine_dir` as the model of `version` beside the live version's on every target and load
    that model only (the live one keeps running untouched).

    A failure on any endpoint is raised as it is: the promotion rolls every endpoint back
    (`tasks.rollback.roll_back`, the one place a rollout is undone).
    """
    from serving.triton.operations import apply_router_weights, serve_versions
    from serving.triton.repository import list_versions, served_versions
    from tasks.rollout_state import checkpoint

    kind = kind_of(engine)
    for target in targets:
        remove_leftovers(target.model_repository, model_name)
        before = served_versions(target.model_repository, model_name) if live is not None else []
        if version in list_versions(target.model_repository, model_name):
            raise ValueError(f"version {version} of {model_name} is already staged on {target.url} but not "
                             "live; the rollout journal should have rolled it back")
        kind.stage(target.model_repository, model_name, engine_dir, version=version, engine=engine, triton=triton)
        checkpoint(f"stage {target.url}: version {version} folder in place")
        serving = sorted({*before, version})
        serve_versions(target.control(), target.model_repository, model_name, serving, timeout_s=triton.load_timeout_s)
        checkpoint(f"stage {target.url}: serving {serving}")
        warm_up(target, model_name, version, triton)
        if live is None:  # first release: the router appears, pointing at the only version there is
            apply_router_weights(target.control(), target.model_repository, model_name, {version: 100},
                                 timeout_s=triton.load_timeout_s)
        log.info("staged %s version %d on %s (serving %s)", model_name, version, target.url, serving)
    return StagedVersion(model_name, version, live, engine_dir)


def warm_up(target: Target, model_name: str, version: int, triton: TritonSpec) -> None:
    """A few requests straight to the new version (first calls are slow; a version that cannot answer fails here)."""
    from serving.triton.client import generate_ids, generate_text, infer_ids, infer_text
    from serving.triton.models.params import flag
    from serving.triton.repository import engine_model_name
    from tasks.canary_text import CANARY_TEXTS, version_tokenizer

    decoupled = flag(triton.engine_parameters, "decoupled")
    send = generate_ids if decoupled else infer_ids  # /infer refuses decoupled
    send_text = generate_text if decoupled else infer_text
    has_tokenizer = version_tokenizer(target.model_repository, model_name, version) is not None
    for i in range(triton.warmup_requests):
        send(target.url, engine_model_name(model_name, version), [1 + i, 2, 3], max_tokens=4,
             timeout_s=triton.request_timeout_s, setting=target.setting)
        if has_tokenizer and i == 0:  # the text path too: the engine folder's tokenizer, in Triton
            send_text(target.url, engine_model_name(model_name, version), CANARY_TEXTS[0], max_tokens=4,
                      timeout_s=triton.request_timeout_s, setting=target.setting)


@task(name="stage", retries=0, cache_policy=NO_CACHE)
def stage_task(targets: list[Target], *, model_name: str, engine_dir: Path, version: int, triton: TritonSpec,
               live: int | None = None, engine: EngineSpec | None = None) -> StagedVersion:
    """Stage the candidate version on every Triton endpoint."""
    return stage(targets, model_name=model_name, engine_dir=engine_dir, version=version, triton=triton, live=live,
                 engine=engine)
