"""Generate and change the Triton model repository, never leaving it half-written.

Layout for a model ``<name>``::

    <root>/<name>/config.pbtxt            router (python BLS), parameters target_model + weights
    <root>/<name>/1/model.py              copy of serving/triton/models/router.py
    <root>/<name>_engine/config.pbtxt     llm (python), version_policy specific: the served versions
    <root>/<name>_engine/enginewright.json  settings + next version number (Triton ignores the file)
    <root>/<name>_engine/<N>/model.py     copy of serving/triton/models/llm.py
    <root>/<name>_engine/<N>/engine/      the engine files (hardlinked, copied across filesystems)
    <root>/<name>_engine/<N>/version.json limits + fingerprint + source of this version

A version is written in ``<name>_engine/.staging-<N>-<random>/`` (Triton 2.51 ignores non-numeric
folders with a warning) and renamed into place; configs are written to a temp file and ``os.replace``d.
Any failure removes the temp folder/file. Removal renames the version aside first, then deletes it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from serving.files import link_or_copy
from serving.triton.errors import RepositoryError
from serving.triton.model_configs import llm_config, router_config, stream_router_config
from serving.triton.models.params import check_parameters, flag
from serving.triton.pbtxt import to_pbtxt

MODELS_DIR = Path(__file__).resolve().parent / "models"
STATE_FILE = "enginewright.json"
VERSION_FILE = "version.json"
STAGING_PREFIX = ".staging-"
REMOVING_PREFIX = ".removing-"
DEFAULT_SETTINGS: dict[str, Any] = {
    "device_kind": "auto",
    "max_queue_size": 64,
    "max_queue_delay_us": 2000,
    "instance_count": 1,
    "parameters": {},
}

__all__ = [
    "engine_decoupled",
    "engine_model_name",
    "init_repository",
    "list_versions",
    "llm_model_config",
    "remove_folder",
    "remove_model",
    "remove_version",
    "router_config",
    "router_weights",
    "served_versions",
    "set_served_versions",
    "stage_engine_version",
    "stream_model_name",
    "write_atomic",
    "write_router",
    "write_stream_router",
]


def engine_model_name(name: str) -> str:
    """The llm model that holds the engine versions behind router ``name``."""
    return f"{name}_engine"


def stream_model_name(name: str) -> str:
    """The streaming router of release ``name`` (present while its llm is decoupled)."""
    return f"{name}_stream"


def init_repository(root: Path) -> Path:
    """Create the repository folder (idempotent) and return its absolute path."""
    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``path`` through a dot-prefixed temp file in the same folder and ``os.replace``."""
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _resolve_device_kind(kind: str) -> str:
    if kind in ("KIND_CPU", "KIND_GPU"):
        return kind
    if kind == "cpu":
        return "KIND_CPU"
    if kind in ("gpu", "cuda"):
        return "KIND_GPU"
    if kind == "auto":
        try:
            import torch
        except ImportError:
            return "KIND_CPU"
        return "KIND_GPU" if torch.cuda.is_available() else "KIND_CPU"
    raise RepositoryError(f"device_kind={kind!r} must be auto, cpu, gpu, KIND_CPU or KIND_GPU")


def _model_dir(root: Path, name: str) -> Path:
    return Path(root) / engine_model_name(name)


def _read_state(model_dir: Path) -> dict[str, Any]:
    path = model_dir / STATE_FILE
    if not path.is_file():
        return {"settings": dict(DEFAULT_SETTINGS), "next_version": 1, "served": []}
    return json.loads(path.read_text())


def _write_state(model_dir: Path, state: dict[str, Any]) -> None:
    write_atomic(model_dir / STATE_FILE, json.dumps(state, indent=2, sort_keys=True))


def list_versions(root: Path, name: str) -> list[int]:
    """Numbered version folders of ``<name>_engine`` (complete ones only), ascending."""
    model_dir = _model_dir(root, name)
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def served_versions(root: Path, name: str) -> list[int]:
    """Versions the ``<name>_engine`` config currently serves."""
    return list(_read_state(_model_dir(root, name)).get("served", []))


def _place_tree(src: Path, dst: Path, *, link: bool) -> None:
    dst.mkdir()
    for path in sorted(src.iterdir()):
        if path.is_dir():
            _place_tree(path, dst / path.name, link=link)
        elif path.is_file():
            link_or_copy(path, dst / path.name, link=link)


def _engine_summary(engine_dir: Path, max_batch_size: int | None) -> dict[str, Any]:
    if max_batch_size is not None:
        return {"max_batch_size": int(max_batch_size), "fingerprint": None}
    try:
        from serving.engine import read_engine_info  # lazy: the engine package imports torch
    except ImportError as exc:
        raise RepositoryError(f"cannot read engine limits of {engine_dir}: serving.engine unavailable ({exc}); "
                              "pass max_batch_size") from exc
    info = read_engine_info(engine_dir)
    return {"max_batch_size": int(info.limits.max_batch_size), "fingerprint": getattr(info, "fingerprint", None),
            "max_input_len": int(info.limits.max_input_len), "max_seq_len": int(info.limits.max_seq_len)}


def stage_engine_version(
    root: Path,
    name: str,
    engine_dir: Path,
    *,
    device_kind: str | None = None,
    max_queue_size: int | None = None,
    max_queue_delay_us: int | None = None,
    instance_count: int | None = None,
    parameters: dict[str, str] | None = None,
    max_batch_size: int | None = None,
    link: bool = True,
    version: int | None = None,
) -> int:
    """Write ``engine_dir`` as the next version of ``<name>_engine`` atomically; return its number.

    Settings given here (device kind, queue, instances, parameters) are kept for the model's config;
    ``None`` keeps the previous value. The first version staged becomes the served one; later
    versions are served by ``set_served_versions``. ``max_batch_size`` defaults to the engine's limit.
    ``version`` picks the number (the promote flow uses the MLflow version); it must not exist yet.
    """
    root = init_repository(root)
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise RepositoryError(f"engine folder {engine_dir} (argument engine_dir) does not exist")
    if parameters is not None:
        try:
            check_parameters(parameters)
        except ValueError as exc:
            raise RepositoryError(f"{engine_model_name(name)}: {exc} (argument parameters); nothing was staged") from exc
    summary = _engine_summary(engine_dir, max_batch_size)
    model_dir = _model_dir(root, name)
    model_dir.mkdir(exist_ok=True)
    state = _read_state(model_dir)
    settings = state["settings"]
    for key, value in (("device_kind", device_kind), ("max_queue_size", max_queue_size),
                       ("max_queue_delay_us", max_queue_delay_us), ("instance_count", instance_count),
                       ("parameters", parameters)):
        if value is not None:
            settings[key] = value
    existing = list_versions(root, name)
    if version is None:
        version = max([int(state.get("next_version", 1)), *(v + 1 for v in existing)])
    elif version < 1 or version in existing:
        raise RepositoryError(
            f"version {version} of {engine_model_name(name)} in {root} cannot be staged: "
            + ("it already exists" if version in existing else "versions start at 1")
        )
    tmp = model_dir / f"{STAGING_PREFIX}{version}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir()
        shutil.copy2(MODELS_DIR / "llm.py", tmp / "model.py")
        _place_tree(engine_dir, tmp / "engine", link=link)
        # the settings this version was staged with: served alone again (a rollback to it), it gets them back
        sidecar = {**summary, "source": str(engine_dir.resolve()), "staged_at": time.time(),
                   "settings": json.loads(json.dumps(settings))}
        (tmp / VERSION_FILE).write_text(json.dumps(sidecar, indent=2, sort_keys=True))
        try:
            os.rename(tmp, model_dir / str(version))
        except OSError as exc:
            raise RepositoryError(f"cannot rename {tmp} to version {version} of {model_dir.name}: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    state["next_version"] = max(int(state.get("next_version", 1)), version + 1)
    _write_state(model_dir, state)
    if not state.get("served"):
        set_served_versions(root, name, [version])
    return version


def _version_summary(model_dir: Path, version: int) -> dict[str, Any]:
    path = model_dir / str(version) / VERSION_FILE
    if not path.is_file():
        raise RepositoryError(f"version {version} of {model_dir.name} is not staged ({path} missing)")
    return json.loads(path.read_text())


def llm_model_config(root: Path, name: str, versions: list[int] | None = None) -> dict[str, Any]:
    """The complete config of ``<name>_engine`` for ``versions`` (default: the served ones)."""
    model_dir = _model_dir(root, name)
    state = _read_state(model_dir)
    return _config_of(model_dir, name, state["settings"], versions if versions is not None else state.get("served", []))


def _config_of(model_dir: Path, name: str, settings: dict[str, Any], versions: list[int]) -> dict[str, Any]:
    versions = sorted(versions)
    if not versions:
        raise RepositoryError(f"model {model_dir.name} in {model_dir.parent} serves no version (argument versions)")
    summaries = [_version_summary(model_dir, v) for v in versions]
    return llm_config(
        engine_model_name(name),
        versions=versions,
        max_batch_size=min(int(x["max_batch_size"]) for x in summaries),
        device_kind=_resolve_device_kind(settings["device_kind"]),
        max_queue_size=int(settings["max_queue_size"]),
        max_queue_delay_us=int(settings["max_queue_delay_us"]),
        instance_count=int(settings["instance_count"]),
        parameters=dict(settings.get("parameters") or {}),
    )


def set_served_versions(root: Path, name: str, versions: list[int]) -> dict[str, Any]:
    """Rewrite ``<name>_engine/config.pbtxt`` to serve exactly ``versions``; return the config dict.

    Triton picks it up on the next ``load_model("<name>_engine")``. Settings (parameters, queue, device
    kind) are the model's, not a version's, in Triton: while two versions are served they run with the
    latest staged ones; one version served alone runs with those it was staged with, so a rollback also
    takes back the candidate's parameters (a bad one could otherwise fail the live version's reload).
    Nothing is written when a version is not staged.
    """
    model_dir = _model_dir(root, name)
    state = _read_state(model_dir)
    if len(versions) == 1:
        own = _version_summary(model_dir, int(versions[0])).get("settings")  # absent: staged before they were kept
        if own is not None:
            state["settings"] = own
    state["served"] = sorted(int(v) for v in versions)
    config = _config_of(model_dir, name, state["settings"], state["served"])
    write_atomic(model_dir / "config.pbtxt", to_pbtxt(config))
    _write_state(model_dir, state)
    return config


def remove_folder(path: Path) -> None:
    """Delete ``path``: renamed aside first (``.removing-<name>-<hex>``, which Triton ignores), then removed."""
    aside = path.parent / f"{REMOVING_PREFIX}{path.name}-{secrets.token_hex(4)}"
    os.rename(path, aside)
    shutil.rmtree(aside)


def remove_version(root: Path, name: str, version: int, *, force: bool = False) -> None:
    """Delete a version folder that is no longer served (renamed aside first, then removed).

    ``force`` also removes a version still listed as served (when the whole model is being removed).
    """
    model_dir = _model_dir(root, name)
    if not force and version in served_versions(root, name):
        raise RepositoryError(
            f"version {version} of {model_dir.name} is still served (config versions {served_versions(root, name)}); "
            "call set_served_versions without it and reload first"
        )
    path = model_dir / str(version)
    if not path.is_dir():
        raise RepositoryError(f"version {version} of {model_dir.name} does not exist ({path})")
    remove_folder(path)


def write_router(root: Path, name: str, weights: dict[int, int], **config_kwargs: Any) -> dict[str, Any]:
    """Write (or rewrite) the router model ``name`` with ``weights``; return its complete config.

    The file change alone does not reach a loaded router: apply it with
    ``TritonControl.load_model(name, config=<returned dict>)``.
    """
    from serving.triton.models.routing import new_generation

    root = init_repository(root)
    config_kwargs.setdefault("load_id", new_generation())  # fresh per write: each load counts on its own
    if "target_model" not in config_kwargs:  # its own llm: call it the way it is staged
        config_kwargs.setdefault("target_decoupled", engine_decoupled(root, name))
    config = router_config(name, weights, **config_kwargs)
    model_dir = root / name
    version_dir = model_dir / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(version_dir / "model.py", (MODELS_DIR / "router.py").read_bytes())
    write_atomic(model_dir / "config.pbtxt", to_pbtxt(config))
    write_atomic(model_dir / STATE_FILE, json.dumps({"weights": {str(v): w for v, w in sorted(weights.items())}}))
    return config


def engine_decoupled(root: Path, name: str) -> bool:
    """Whether ``<name>_engine`` is staged with the parameter ``decoupled`` on (False when not staged)."""
    model_dir = _model_dir(root, name)
    if not model_dir.is_dir():
        return False
    return flag(_read_state(model_dir)["settings"].get("parameters") or {}, "decoupled")


def write_stream_router(root: Path, name: str, weights: dict[int, int], *, load_id: str,
                        seed: int | None = None) -> dict[str, Any]:
    """Write (or rewrite) ``<name>_stream`` with ``weights``; return its complete config. It belongs
    beside a decoupled ``<name>_engine`` only (`engine_decoupled`)."""
    config = stream_router_config(stream_model_name(name), weights, target_model=engine_model_name(name),
                                  counters_model=name, seed=seed, load_id=load_id)
    model_dir = Path(root) / stream_model_name(name)
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    write_atomic(model_dir / "1" / "model.py", (MODELS_DIR / "stream_router.py").read_bytes())
    write_atomic(model_dir / "config.pbtxt", to_pbtxt(config))
    return config


def router_weights(root: Path, name: str) -> dict[int, int]:
    """The weights the router ``name`` was last written with; empty when there is no router yet."""
    path = Path(root) / name / STATE_FILE
    if not path.is_file():
        return {}
    return {int(v): int(w) for v, w in json.loads(path.read_text())["weights"].items()}


def remove_model(control: Any, root: Path, name: str, *, timeout_s: float = 60.0) -> None:
    """Unload the router ``name``, its streaming router and ``<name>_engine`` and delete their folders
    (renamed aside first)."""
    for model in (stream_model_name(name), name, engine_model_name(name)):
        path = Path(root) / model
        if model == stream_model_name(name) and not path.is_dir():
            continue
        control.unload_model(model, timeout_s=timeout_s)
        if path.is_dir():
            remove_folder(path)
