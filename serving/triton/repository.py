"""Generate and change the Triton model repository, never leaving it half-written.

Layout for a release ``<name>``: one Triton model per engine version, so each one loads, warms and unloads
on its own (Triton re-creates every version of a model whose config changes: a model holding all versions
reloaded the live engine at every promotion)::

    <root>/<name>/config.pbtxt               router (python BLS), parameter target_model
    <root>/<name>/enginewright.json          its routing file: weights, load_id (replaced, never reloaded)
    <root>/<name>/1/model.py                 copy of serving/triton/models/router.py
    <root>/<name>_v<N>/config.pbtxt          llm (python) of engine version N, its own settings
    <root>/<name>_v<N>/1/model.py            copy of serving/triton/models/llm.py
    <root>/<name>_v<N>/1/engine/             the engine files (hardlinked, copied across filesystems)
    <root>/<name>_v<N>/1/version.json        release, version, limits, fingerprint, source, settings
    <root>/.engines-<name>.json              the versions the release serves (Triton never reads it)

The router's ``target_model`` is the pattern ``<name>_v{version}``: it calls the model of the version its
weights pick. A version is written in ``<root>/.staging-<name>_v<N>-<random>/`` and renamed into place;
configs are written to a temp file and ``os.replace``d. Any failure removes the temp folder/file. Removal
renames the folder aside first (``.removing-*``), then deletes it.

The layout before it (``<name>_engine`` with numbered version folders, one config serving them all) is
`legacy_engine_dir`; `serving.triton.operations.migrate_legacy` moves a release off it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from serving.files import link_or_copy
from serving.triton.errors import RepositoryError
from serving.triton.model_configs import check_weights, llm_config, router_config, stream_router_config
from serving.triton.models.params import check_parameters, flag
from serving.triton.models.routing_file import ROUTING_FILE, Routing, read_routing
from serving.triton.pbtxt import to_pbtxt

MODELS_DIR = Path(__file__).resolve().parent / "models"
STATE_FILE = "enginewright.json"
VERSION_FILE = "version.json"
STAGING_PREFIX = ".staging-"
REMOVING_PREFIX = ".removing-"
SERVED_PREFIX = ".engines-"
VERSION_SUFFIX = "_v"
TRITON_VERSION = 1  # the one numbered folder of an engine version's model
LEGACY_SUFFIX = "_engine"
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
    "engine_model_pattern",
    "init_repository",
    "legacy_engine_dir",
    "list_versions",
    "llm_model_config",
    "remove_folder",
    "remove_model",
    "remove_version",
    "router_config",
    "router_routing",
    "router_weights",
    "served_versions",
    "set_served_versions",
    "stage_engine_version",
    "stage_version_model",
    "stream_model_name",
    "upgrade_router_files",
    "version_summary",
    "write_atomic",
    "write_router",
    "write_stream_router",
]


def engine_model_name(name: str, version: int) -> str:
    """The Triton model of engine version ``version`` of release ``name``: ``<name>_v<version>``."""
    return f"{name}{VERSION_SUFFIX}{int(version)}"


def engine_model_pattern(name: str) -> str:
    """The routers' ``target_model``: ``<name>_v{version}``, the version filled in per request."""
    return f"{name}{VERSION_SUFFIX}{{version}}"


def stream_model_name(name: str) -> str:
    """The streaming router of release ``name`` (present while its llm is decoupled)."""
    return f"{name}_stream"


def legacy_engine_dir(root: Path, name: str) -> Path | None:
    """``<root>/<name>_engine`` when it holds numbered version folders (the layout before one model per
    version), else None."""
    path = Path(root) / f"{name}{LEGACY_SUFFIX}"
    if path.is_dir() and any(p.is_dir() and p.name.isdigit() for p in path.iterdir()):
        return path
    return None


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


def resolve_device_kind(kind: str) -> str:
    """``auto`` / ``cpu`` / ``gpu`` / ``cuda`` / ``KIND_*`` -> Triton's ``KIND_CPU`` or ``KIND_GPU``."""
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


def _version_dir(root: Path, name: str, version: int) -> Path:
    return Path(root) / engine_model_name(name, version)


def _served_file(root: Path, name: str) -> Path:
    return Path(root) / f"{SERVED_PREFIX}{name}.json"


def version_summary(root: Path, name: str, version: int) -> dict[str, Any]:
    """The sidecar of a staged version (limits, fingerprint, settings); RepositoryError when not staged."""
    path = _version_dir(root, name, version) / str(TRITON_VERSION) / VERSION_FILE
    if not path.is_file():
        raise RepositoryError(f"version {version} of {name} is not staged in {root} ({path} missing)")
    return json.loads(path.read_text())


def list_versions(root: Path, name: str) -> list[int]:
    """Engine versions of release ``name`` staged in ``root`` (complete model folders only), ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    pattern = re.compile(re.escape(name + VERSION_SUFFIX) + r"(\d+)")
    found = []
    for path in root.iterdir():
        match = pattern.fullmatch(path.name)
        if match and (path / str(TRITON_VERSION) / VERSION_FILE).is_file() and \
                json.loads((path / str(TRITON_VERSION) / VERSION_FILE).read_text()).get("release") == name:
            found.append(int(match.group(1)))
    return sorted(found)


def served_versions(root: Path, name: str) -> list[int]:
    """Versions release ``name`` serves (loaded on start, kept on finish/rollback); [] before a first one."""
    path = _served_file(root, name)
    return sorted(int(v) for v in json.loads(path.read_text())["served"]) if path.is_file() else []


def set_served_versions(root: Path, name: str, versions: list[int]) -> dict[int, dict[str, Any]]:
    """Record that ``name`` serves exactly ``versions``; return each one's complete model config.

    Nothing loads here (`serving.triton.operations.serve_versions` does, one model per version); nothing is
    written when a version is not staged."""
    versions = sorted({int(v) for v in versions})
    if not versions:
        raise RepositoryError(f"release {name} in {root} would serve no version (argument versions)")
    configs = {v: llm_model_config(root, name, v) for v in versions}
    write_atomic(_served_file(root, name), json.dumps({"served": versions}))
    return configs


def llm_model_config(root: Path, name: str, version: int) -> dict[str, Any]:
    """The complete config of engine version ``version``'s model (from the settings it was staged with)."""
    summary = version_summary(root, name, version)
    return version_config(engine_model_name(name, version), summary)


def version_config(model: str, summary: dict[str, Any]) -> dict[str, Any]:
    """The llm config of one version's model from its sidecar (``max_batch_size`` + ``settings``)."""
    settings = {**DEFAULT_SETTINGS, **(summary.get("settings") or {})}
    return llm_config(
        model,
        versions=[TRITON_VERSION],
        max_batch_size=int(summary["max_batch_size"]),
        device_kind=resolve_device_kind(settings["device_kind"]),
        max_queue_size=int(settings["max_queue_size"]),
        max_queue_delay_us=int(settings["max_queue_delay_us"]),
        instance_count=int(settings["instance_count"]),
        parameters=dict(settings.get("parameters") or {}),
        dynamic_batching=summary.get("dynamic_batching"),
        tensor_parallel=int(summary.get("tensor_parallel", 1)),
    )


def place_tree(src: Path, dst: Path, *, link: bool) -> None:
    """Recreate ``src`` under ``dst`` (new folder), files hardlinked where ``link`` and possible."""
    dst.mkdir(parents=True)
    for path in sorted(src.iterdir()):
        if path.is_dir():
            place_tree(path, dst / path.name, link=link)
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
            "max_input_len": int(info.limits.max_input_len), "max_seq_len": int(info.limits.max_seq_len),
            **({"tensor_parallel": info.tensor_parallel} if info.tensor_parallel > 1 else {})}


def next_version(root: Path, name: str, version: int | None) -> int:
    """``version`` checked (>= 1, not staged yet), or the next free number."""
    existing = list_versions(root, name)
    if version is None:
        return max(existing, default=0) + 1
    if version < 1 or version in existing or _version_dir(root, name, version).exists():
        raise RepositoryError(
            f"version {version} of {name} in {root} cannot be staged: "
            + ("versions start at 1" if version < 1 else f"{_version_dir(root, name, version)} already exists")
        )
    return version


def stage_version_model(root: Path, name: str, version: int, *, model_source: Path,
                        payload: dict[str, Path], sidecar: dict[str, Any], link: bool = True) -> Path:
    """Write the model ``<name>_v<version>`` aside, then rename it into place; return its folder.

    ``payload`` maps a folder name under ``1/`` to the tree placed there (``engine``, ``artifact``, ...);
    ``sidecar`` becomes ``1/version.json`` (with ``release`` and ``version`` added) and must hold
    ``max_batch_size`` and ``settings``: the config is rendered from it."""
    final = _version_dir(root, name, version)
    sidecar = {**sidecar, "release": name, "version": int(version)}
    config = version_config(final.name, sidecar)
    tmp = Path(root) / f"{STAGING_PREFIX}{final.name}-{secrets.token_hex(4)}"
    try:
        inner = tmp / str(TRITON_VERSION)
        inner.mkdir(parents=True)
        shutil.copy2(model_source, inner / "model.py")
        for folder, src in payload.items():
            place_tree(src, inner / folder, link=link)
        (inner / VERSION_FILE).write_text(json.dumps(sidecar, indent=2, sort_keys=True))
        (tmp / "config.pbtxt").write_text(to_pbtxt(config))
        try:
            os.rename(tmp, final)
        except OSError as exc:
            raise RepositoryError(f"cannot rename {tmp} to {final.name}: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


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
    """Write ``engine_dir`` as the model ``<name>_v<version>`` atomically; return the version number.

    Settings given here (device kind, queue, instances, parameters) go into this version's own config;
    ``None`` takes the newest staged version's value (or the default). The first version staged becomes
    the served one; later ones are served by ``set_served_versions``. ``max_batch_size`` defaults to the
    engine's limit. ``version`` picks the number (the promote flow uses the MLflow version).
    """
    root = init_repository(root)
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise RepositoryError(f"engine folder {engine_dir} (argument engine_dir) does not exist")
    if parameters is not None:
        try:
            check_parameters(parameters)
        except ValueError as exc:
            raise RepositoryError(f"{name}: {exc} (argument parameters); nothing was staged") from exc
    summary = _engine_summary(engine_dir, max_batch_size)
    version = next_version(root, name, version)
    existing = list_versions(root, name)
    settings = dict(DEFAULT_SETTINGS)
    if existing:
        settings.update(version_summary(root, name, existing[-1]).get("settings") or {})
    for key, value in (("device_kind", device_kind), ("max_queue_size", max_queue_size),
                       ("max_queue_delay_us", max_queue_delay_us), ("instance_count", instance_count),
                       ("parameters", parameters)):
        if value is not None:
            settings[key] = value
    sidecar = {**summary, "source": str(engine_dir.resolve()), "staged_at": time.time(),
               "settings": json.loads(json.dumps(settings))}
    stage_version_model(root, name, version, model_source=MODELS_DIR / "llm.py", payload={"engine": engine_dir},
                        sidecar=sidecar, link=link)
    if not served_versions(root, name):
        set_served_versions(root, name, [version])
    return version


def remove_folder(path: Path) -> None:
    """Delete ``path``: renamed aside first (``.removing-<name>-<hex>``, which Triton ignores), then removed."""
    aside = path.parent / f"{REMOVING_PREFIX}{path.name}-{secrets.token_hex(4)}"
    os.rename(path, aside)
    shutil.rmtree(aside)


def remove_version(root: Path, name: str, version: int, *, force: bool = False) -> None:
    """Delete the model folder of a version that is no longer served (renamed aside first, then removed).

    ``force`` also removes a version still listed as served (when the whole release is being removed).
    """
    if not force and version in served_versions(root, name):
        raise RepositoryError(
            f"version {version} of {name} is still served (served versions {served_versions(root, name)}); "
            "call set_served_versions without it and unload it first"
        )
    path = _version_dir(root, name, version)
    if not path.is_dir():
        raise RepositoryError(f"version {version} of {name} does not exist ({path})")
    remove_folder(path)


def write_router(root: Path, name: str, weights: dict[int, int], *, target_decoupled: bool | None = None,
                 **config_kwargs: Any) -> dict[str, Any]:
    """Write the router model ``name``: its config and model file when they differ from what is there, and
    its routing file (``weights``, a fresh ``load_id``: each weight change counts on its own); return the
    complete config. A loaded router follows the routing file from its next request; the config needs a
    load only when Triton does not run it yet (`serving.triton.operations.apply_router_weights`)."""
    from serving.triton.models.routing import new_generation

    root = init_repository(root)
    check_weights(f"router {name!r}", weights)
    config = router_config(name, **config_kwargs)
    target_model = config["parameters"]["target_model"]["string_value"]
    if target_decoupled is None:  # its own llms: call them the way they are staged
        target_decoupled = "target_model" not in config_kwargs and engine_decoupled(root, name)
    model_dir = root / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    routing = Routing(weights=dict(weights), load_id=new_generation(), target_model=target_model,
                      target_decoupled=target_decoupled)
    write_atomic(model_dir / ROUTING_FILE, routing.to_json())  # first: a router loaded next reads it
    _write_if_changed(model_dir / "1" / "model.py", (MODELS_DIR / "router.py").read_bytes())
    _write_if_changed(model_dir / "config.pbtxt", to_pbtxt(config).encode())
    return config


def _write_if_changed(path: Path, data: bytes) -> None:
    if not (path.is_file() and path.read_bytes() == data):
        write_atomic(path, data)


def upgrade_router_files(root: Path, name: str) -> bool:
    """Rewrite the router ``name``'s model file and config (and its streaming router's) when they are an
    older enginewright's (weights in the config, no routing file parameter), keeping what it routes by:
    the weights, ``load_id``, target and ``target_decoupled`` of its routing file. True when it rewrote
    them. For a server about to load them from disk (a restart after an upgrade)."""
    from serving.triton.models.routing_file import ROUTING_PARAMETER

    config_path = Path(root) / name / "config.pbtxt"
    routing = router_routing(root, name)
    if routing is None or not config_path.is_file() or f'"{ROUTING_PARAMETER}"' in config_path.read_text():
        return False
    kwargs = {} if routing.target_model in ("", engine_model_pattern(name)) else {"target_model": routing.target_model}
    config = router_config(name, **kwargs)
    _write_if_changed(Path(root) / name / "1" / "model.py", (MODELS_DIR / "router.py").read_bytes())
    _write_if_changed(config_path, to_pbtxt(config).encode())
    if (Path(root) / stream_model_name(name) / "config.pbtxt").is_file():
        write_stream_router(root, name)
    return True


def engine_decoupled(root: Path, name: str) -> bool:
    """Whether the newest version ``name`` serves is staged with the parameter ``decoupled`` on (False when
    none is): the routers call every version the way the newest one expects."""
    served = served_versions(root, name)
    if not served:
        return False
    return flag(version_summary(root, name, served[-1]).get("settings", {}).get("parameters") or {}, "decoupled")


def write_stream_router(root: Path, name: str, *, seed: int | None = None) -> dict[str, Any]:
    """Write ``<name>_stream`` (config and model file, when they differ); return its complete config. It
    routes by the router ``name``'s routing file and belongs beside decoupled engine models only
    (`engine_decoupled`)."""
    config = stream_router_config(stream_model_name(name), target_model=engine_model_pattern(name),
                                  counters_model=name, seed=seed)
    model_dir = Path(root) / stream_model_name(name)
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    _write_if_changed(model_dir / "1" / "model.py", (MODELS_DIR / "stream_router.py").read_bytes())
    _write_if_changed(model_dir / "config.pbtxt", to_pbtxt(config).encode())
    return config


def router_stats(root: Path, name: str) -> dict[str, Any]:
    """The router ``name``'s per-version counters (requests, errors, latency, tokens) as its instances
    last wrote them beside it (after every request): ``versions`` / ``detail`` of the weights now written,
    ``cumulative`` over every change. Read from the repository, never over Triton's ports, which serve clients."""
    from serving.triton.models.routing import COUNTERS_DIR, counter_files, counters_snapshot

    routing = router_routing(root, name)
    if routing is None:
        raise RepositoryError(f"no router {name!r} in the model repository {str(root)!r}")
    target_model, load_id = routing.target_model or engine_model_pattern(name), routing.load_id
    parts = counter_files(Path(root) / name / COUNTERS_DIR, target_model)
    return counters_snapshot([v for lid, v in parts if load_id and lid == load_id], [v for _, v in parts],
                             load_id=load_id, target_model=target_model, weights=routing.weights)


def router_routing(root: Path, name: str) -> Routing | None:
    """What `write_router` last wrote in the router's routing file; None if there is no router."""
    path = Path(root) / name / ROUTING_FILE
    return read_routing(path) if path.is_file() else None


def router_weights(root: Path, name: str) -> dict[int, int]:
    """The weights the router ``name`` routes by; empty when there is no router yet."""
    routing = router_routing(root, name)
    return dict(routing.weights) if routing else {}


def remove_model(control: Any, root: Path, name: str, *, timeout_s: float = 60.0) -> None:
    """Unload the router ``name``, its streaming router and every engine version's model and delete their
    folders (renamed aside first), then the served record."""
    models = [stream_model_name(name), name, *(engine_model_name(name, v) for v in list_versions(root, name))]
    for model in models:
        path = Path(root) / model
        if model == stream_model_name(name) and not path.is_dir():
            continue
        control.unload_model(model, timeout_s=timeout_s)
        if path.is_dir():
            remove_folder(path)
    _served_file(root, name).unlink(missing_ok=True)
