"""Converge every endpoint of a fleet to ONE served version: the live one (``roll_back``) or the candidate
(``finish``). Both are idempotent and safe to run from any intermediate state a crash can leave, which is
what makes reconciliation after a killed promote possible. They are the only two ways a rollout ends: a
failed staging, a failed or aborted gray release and the reconciliation of a killed run all call
``roll_back``; a finished gray release and the reconciliation of a run killed while finishing call ``finish``.
Each writes the rollout journal before it changes anything and records the outcome in MLflow.

Order matters for zero dropped requests: the router stops choosing a version (its routing file, which
every router instance follows from its next request; no reload) BEFORE that version is unloaded, and only
then is its folder renamed aside and deleted.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Literal

from registry.rollout_record import record_failure, record_interrupted, record_success
from tasks.rollout_state import Journal, checkpoint, write_journal
from tasks.targets import Target, live_version

log = logging.getLogger(__name__)


class FleetError(RuntimeError):
    """One or more endpoints could not be converged; every endpoint was still attempted."""


def remove_leftovers(root: Path, name: str) -> list[str]:
    """Delete ``.staging-<name>_v*`` / ``.removing-*`` folders a crash left in the repository (Triton
    ignores them)."""
    from serving.triton.repository import REMOVING_PREFIX, STAGING_PREFIX, engine_model_name

    gone = []
    for pattern in (f"{STAGING_PREFIX}{engine_model_name(name, 0)[:-1]}*", f"{REMOVING_PREFIX}*"):
        for path in Path(root).glob(pattern):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
                gone.append(path.name)
    return gone


def converge(target: Target, name: str, version: int, timeout_s: float) -> None:
    """On one endpoint: router 100% to ``version``, ``version`` the only one served, other folders removed.

    When the router already gives every other version weight 0 (a release's last step, or a rollback
    before any traffic moved), those versions are unloaded first and the routing file is written once,
    after: it drops their entries and follows the served version's decoupled setting together (not at all
    when the router already routes by ``version`` alone). Otherwise the router stops choosing them before
    they are unloaded, and its routing file is written again only if that setting changed.
    """
    from serving.triton.operations import apply_router_weights, router_loaded_with, serve_versions
    from serving.triton.repository import engine_decoupled, list_versions, remove_version

    control = target.control()
    decoupled = engine_decoupled(target.model_repository, name)
    routed = live_version(target, name) == version  # weights are percents: the others are at 0
    if not routed:
        apply_router_weights(control, target.model_repository, name, {version: 100}, timeout_s=timeout_s)
        checkpoint(f"converge {target.url}: router -> {version}")
    serve_versions(control, target.model_repository, name, [version], timeout_s=timeout_s)
    checkpoint(f"converge {target.url}: served [{version}]")
    alone = {version: 100}
    if (routed and not router_loaded_with(control, target.model_repository, name, alone)) \
            or engine_decoupled(target.model_repository, name) != decoupled:  # served alone, own settings back
        apply_router_weights(control, target.model_repository, name, {version: 100}, timeout_s=timeout_s)
        checkpoint(f"converge {target.url}: router -> {version} alone")
    for other in list_versions(target.model_repository, name):
        if other != version:
            remove_version(target.model_repository, name, other)
    remove_leftovers(target.model_repository, name)


def remove_everywhere(target: Target, name: str, timeout_s: float) -> None:
    """Before any live version: unload and delete the router, the streaming router and every engine
    version's model (absent is fine)."""
    from serving.triton.repository import (
        SERVED_PREFIX,
        engine_model_name,
        list_versions,
        remove_folder,
        stream_model_name,
    )

    control = target.control()
    for model in (stream_model_name(name), name, *(engine_model_name(name, v)
                                                   for v in list_versions(target.model_repository, name))):
        try:
            control.unload_model(model, timeout_s=timeout_s)
        except Exception as exc:  # noqa: BLE001 - a model Triton never loaded cannot be unloaded
            log.info("unload %s on %s: %s", model, target.url, exc)
        path = Path(target.model_repository) / model
        if path.is_dir():
            remove_folder(path)
    (Path(target.model_repository) / f"{SERVED_PREFIX}{name}.json").unlink(missing_ok=True)
    remove_leftovers(target.model_repository, name)


def restore_live(targets: list[Target], name: str, live: int | None, timeout_s: float) -> None:
    """Roll back every endpoint to ``live`` (or remove the model when there was none). Tries all; raises after."""
    errors = []
    for target in targets:
        try:
            if live is None:
                remove_everywhere(target, name, timeout_s)
            else:
                converge(target, name, live, timeout_s)
            log.info("%s on %s rolled back to version %s", name, target.url, live)
        except Exception as exc:  # noqa: BLE001 - keep going: every endpoint must be attempted
            log.error("rollback of %s on %s failed: %s", name, target.url, exc)
            errors.append(f"{target.url} ({target.setting}): {type(exc).__name__}: {exc}")
    if errors:
        raise FleetError(f"rollback of {name} to version {live} failed on {len(errors)} endpoint(s): "
                         + "; ".join(errors) + ". Run the promotion (or `enginewright rollback`) again to retry.")


def make_live(targets: list[Target], name: str, candidate: int, timeout_s: float) -> None:
    """Finish on every endpoint: the candidate takes all traffic and is the only version served."""
    errors = []
    for target in targets:
        try:
            converge(target, name, candidate, timeout_s)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{target.url} ({target.setting}): {type(exc).__name__}: {exc}")
    if errors:
        raise FleetError(f"finishing {name} version {candidate} failed on: " + "; ".join(errors)
                         + ". Run the promotion again: it resumes the finish.")


Verdict = Literal["rejected", "failed", "interrupted"]


def roll_back(tracking_uri: str, targets: list[Target], journal: Journal, *, reason: str, verdict: Verdict,
              figures: dict[str, Any] | None = None, timeout_s: float) -> Journal:
    """End a rollout on the live version: journal ``aborting`` (write-ahead), every endpoint back to
    ``journal.live``, MLflow told why, journal ``aborted`` (``interrupted`` for a run that died).

    ``verdict``: ``rejected`` when the analysis judged the engine (the version is also rejected), ``failed``
    when a step failed (the infrastructure may be at fault: the approval stays), ``interrupted`` when a killed
    run is reconciled. Raises ``FleetError`` when an endpoint cannot be rolled back (the journal stays
    ``aborting``, so the next run retries)."""
    repos = [t.model_repository for t in targets]
    name, candidate = journal.model_name, journal.candidate
    if verdict != "interrupted" and journal.phase != "aborting":
        journal = write_journal(repos, journal, phase="aborting", reason=reason, figures=figures or {})
    restore_live(targets, name, journal.live, timeout_s)
    if verdict == "interrupted":
        record_interrupted(tracking_uri, name, candidate, reason)
        return write_journal(repos, journal, phase="interrupted", reason=reason)
    record_failure(tracking_uri, name, candidate, reason, figures or {}, reject=verdict == "rejected")
    return write_journal(repos, journal, phase="aborted")


def finish(tracking_uri: str, targets: list[Target], journal: Journal, *, figures: dict[str, Any] | None = None,
           timeout_s: float) -> Journal:
    """End a rollout on the candidate: journal ``finishing`` (write-ahead), the candidate the only version
    served with all traffic on every endpoint, MLflow ``production``, journal ``done``."""
    repos = [t.model_repository for t in targets]
    name, candidate = journal.model_name, journal.candidate
    if journal.phase != "finishing":
        journal = write_journal(repos, journal, phase="finishing", weights={candidate: 100}, figures=figures or {})
    make_live(targets, name, candidate, timeout_s)
    record_success(tracking_uri, name, candidate, journal.live, journal.kind)
    print(f"{name} version {candidate} is production: router sends it 100% of traffic")
    return write_journal(repos, journal, phase="done")
