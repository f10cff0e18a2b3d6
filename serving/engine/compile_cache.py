"""The decode step's compile artifacts, kept per engine and toolchain, so a second load skips the compile.

A compiled decode step (`DecodeGraphs` under torch.compile) costs tens of seconds at every load; what it
produces is torch's own compile caches (inductor's FX graph cache with the generated Triton kernels bundled
in, AOTAutograd's, the autotuning results), which `torch.compiler.save_cache_artifacts()` serializes into one
blob and `load_cache_artifacts()` puts back into this process's cache folders ("mega-cache"). Dynamo still
traces the step at the next load; inductor then finds each graph in its cache instead of compiling it.
The engine's own Triton kernels (the skinny GEMMs and the attention, launched by opaque custom ops for
programmatic dependent launch) are compiled by Triton's JIT outside inductor, into Triton's cache folder:
the files a compile adds there are kept too, and put back before the next compile (Triton names each
kernel's folder by a hash of its source, options, target and versions, so a folder put back is used only
where it matches; its group record, which names the files by absolute path, is pointed at their new place).

One entry per engine and toolchain:

    <root>/<fingerprint[:16]>/<key digest[:16]>/
        artifacts.bin    torch's serialized cache artifacts
        triton.tar.gz    the Triton cache folders the compile wrote (when it wrote any)
        cache.json       the key (below), each file's sha256 and size, what torch said it holds

The key is everything the compiled code depends on that the engine folder does not pin: the torch,
Triton and CUDA versions, the GPU's name and compute capability, the engine's fingerprint, a digest of
`serving/engine`'s source (the step and its kernels) and the compile settings the caller names. An entry
is used only when its record's key equals this process's key field by field and every file's sha256
matches the record; anything else (another toolchain, a truncated or edited file, an unreadable record)
is logged and ignored, and the load compiles as if there were no cache. The sha256 catches corruption,
not malice: the blob is a pickle, so the root must be writable only by whoever runs the engine.
Entries are written aside and renamed: a reader sees a whole entry or none.

Imports: stdlib and torch only (Triton's version is read lazily).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CACHE_FORMAT_VERSION = 1
ARTIFACTS_FILE = "artifacts.bin"
RECORD_FILE = "cache.json"
TRITON_FILE = "triton.tar.gz"
TRITON_GROUP_PREFIX = "__grp__"  # Triton's record of the files of one compiled kernel
DEFAULT_DIR_NAME = ".compile-cache"  # in a Triton model repository's root, beside the engines' models
ENGINE_SOURCE = Path(__file__).resolve().parent

Log = Callable[[str], None]
SaveFn = Callable[[], "tuple[bytes, Any] | None"]
LoadFn = Callable[[bytes], Any]


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


def triton_cache_dir(device: torch.device | None = None) -> Path:
    """The folder Triton's JIT caches kernels in: TRITON_CACHE_DIR when set, else the one inductor sets for
    the device before its first kernel (set here now, so that restoring and compiling agree), else Triton's."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    if device is not None and device.type == "cuda":
        try:
            from torch._inductor.runtime.cache_dir_utils import triton_cache_dir as inductors

            os.environ["TRITON_CACHE_DIR"] = inductors(device.index or 0)
            return Path(os.environ["TRITON_CACHE_DIR"])
        except Exception:  # noqa: BLE001, S110 - another torch: Triton's own default below
            pass
    return Path.home() / ".triton" / "cache"


def pin_ptxas() -> None:
    """Have Triton assemble with the ptxas torch ships (torch/bin/ptxas) from the first kernel on, as inductor sets
    it (TRITON_PTXAS_PATH, unless already set) only once it compiles a kernel in this process: until then the
    engine's own kernels were assembled by Triton's bundled ptxas, whose version is part of Triton's cache key.
    A first load (inductor compiling in its workers) then cached the engine's kernels under one ptxas and a second
    load (inductor in this process from the start) looked them up under the other and compiled all of them again
    (1B engine on the H200: 19 kernels, their TTIR identical; CUDA 12.8's ptxas against 13.0's). A no-op where
    torch has no ptxas (CPU builds)."""
    try:
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:  # another torch: Triton keeps its own choice
        return
    _set_triton_ptxas_path.__wrapped__()  # functools.cache'd: run it even where it ran before the variable was unset


def pack_new_folders(folder: Path, since: float, out: Path) -> int:
    """Tar (gzip) every folder directly under `folder` holding a file modified at or after `since` (time.time())
    into `out`; returns how many folders (0: nothing written)."""
    if not folder.is_dir():
        return 0
    fresh = sorted(d for d in folder.iterdir() if d.is_dir() and any(
        f.is_file() and f.stat().st_mtime >= since for f in d.iterdir()))
    if not fresh:
        return 0
    with tarfile.open(out, "w:gz", compresslevel=1) as tar:
        for d in fresh:
            tar.add(d, arcname=d.name)
    return len(fresh)


def unpack_folders(archive: Path, folder: Path) -> int:
    """Extract a `pack_new_folders` archive into `folder` (plain files and folders inside it only), with each
    kernel's group record pointed at its files' new place (`relink_groups`); returns the number of files."""
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:gz") as tar:
        members = tar.getmembers()
        for m in members:
            if not (m.isfile() or m.isdir()) or m.name.startswith(("/", "..")) or ".." in Path(m.name).parts:
                raise ValueError(f"{archive.name}: member {m.name!r} is not a plain file or folder inside it")
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python 3.11.4+: refuse links, modes
        tar.extractall(folder, members=members, **safe)
    for name in sorted({Path(m.name).parts[0] for m in members}):
        relink_groups(folder / name)
    return sum(m.isfile() for m in members)


def relink_groups(kernel_folder: Path) -> int:
    """Point the file paths in a Triton kernel folder's group records (`__grp__<kernel>.json`, {"child_paths":
    {file name: absolute path}}) at the files in `kernel_folder`; returns how many records changed.

    Triton finds a cached kernel through that record and counts a path that does not exist as a miss, so a
    folder put back under another cache root (another machine's, user's, or a fresh temporary folder) was
    compiled again: 24 kernels at every second load of the 1B engine on the H200 (docs/performance.md).
    Records that list only the file names (other Triton versions) are left as they are."""
    changed = 0
    for record in sorted(kernel_folder.glob(f"{TRITON_GROUP_PREFIX}*.json")):
        try:
            data = json.loads(record.read_text())
        except (OSError, ValueError):
            continue  # Triton reads it as no entry: a miss, as before
        paths = data.get("child_paths") if isinstance(data, dict) else None
        if not isinstance(paths, dict):
            continue
        here = {name: str(kernel_folder / Path(str(path)).name) for name, path in paths.items()}
        if here != paths:
            data["child_paths"] = here
            tmp = record.with_name(record.name + f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, record)
            changed += 1
    return changed


def source_digest(folder: Path = ENGINE_SOURCE) -> str:
    """sha256 over the names and contents of the engine's Python sources (the step and its kernels)."""
    h = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def cache_key(fingerprint: str, device: torch.device, settings: Mapping[str, str | bool | int]) -> dict[str, Any]:
    """What an entry must match to be used here: toolchain, GPU, engine, engine code, compile settings."""
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
    else:
        gpu, capability = device.type, device.type
    return {
        "format_version": CACHE_FORMAT_VERSION,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda,
        "gpu": gpu,
        "compute_capability": capability,
        "engine_fingerprint": fingerprint,
        "engine_source": source_digest(),
        "settings": dict(sorted(settings.items())),
    }


def key_digest(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def key_differences(recorded: Mapping[str, Any], here: Mapping[str, Any]) -> list[str]:
    """'name: recorded -> here' for every key field that differs."""
    return [f"{name}: {recorded.get(name)!r} -> {here.get(name)!r}" for name in sorted(set(recorded) | set(here))
            if recorded.get(name) != here.get(name)]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Restored:
    """What `CompileCache.restore` put back."""

    entry: Path
    bytes: int
    took_s: float


class CompileCache:
    """The entry of one (engine, toolchain, settings) under `root`: restore it before compiling, store it after."""

    def __init__(self, root: Path, key: Mapping[str, Any], *, log: Log | None = None,
                 save: SaveFn | None = None, load: LoadFn | None = None, triton_dir: Path | None = None) -> None:
        self.root = Path(root)
        self.triton_dir = triton_dir  # None: `triton_cache_dir()` when needed
        self.key = dict(key)
        self.digest = key_digest(self.key)
        self.log = log or (lambda msg: None)
        self._save = save or torch.compiler.save_cache_artifacts
        self._load = load or torch.compiler.load_cache_artifacts

    @property
    def engine_dir(self) -> Path:
        return self.root / str(self.key["engine_fingerprint"])[:16]

    @property
    def entry(self) -> Path:
        return self.engine_dir / self.digest[:16]

    def _triton(self) -> Path:
        if self.triton_dir is None:
            self.triton_dir = triton_cache_dir()
        return self.triton_dir

    def restore(self) -> Restored | None:
        """Put this key's artifacts into torch's and Triton's caches when a whole, matching entry exists; else
        None (logged)."""
        started = time.perf_counter()
        record_path = self.entry / RECORD_FILE
        if not record_path.is_file():
            self._log_absent()
            return None
        try:
            record = json.loads(record_path.read_text())
            differs = key_differences(record["key"], self.key)
            if differs:
                return self._ignore(f"its key differs ({'; '.join(differs)})")
            files = record["files"]
            for name, want in files.items():
                actual = _sha256(self.entry / name)
                if actual != want["sha256"]:
                    return self._ignore(f"{name} has sha256 {actual[:12]}, its record says {want['sha256'][:12]}")
            data = (self.entry / ARTIFACTS_FILE).read_bytes()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return self._ignore(f"it cannot be read: {type(exc).__name__}: {exc}")
        try:
            loaded = self._load(data)  # None: torch could not deserialize it (and logged why)
        except Exception as exc:  # noqa: BLE001 - a cache that torch cannot take is ignored, never fatal
            return self._ignore(f"torch could not load it: {type(exc).__name__}: {exc}")
        if loaded is None:
            return self._ignore("torch could not load it (torch.compiler.load_cache_artifacts returned None)")
        kernels = 0
        if TRITON_FILE in files:
            try:
                kernels = unpack_folders(self.entry / TRITON_FILE, self._triton())
            except (OSError, ValueError, tarfile.TarError) as exc:
                self.log(f"compile cache {self.entry}: {TRITON_FILE} ignored: {type(exc).__name__}: {exc}")
        with contextlib.suppress(OSError):
            os.utime(record_path)  # used now: the least recently used entries go first (`compile_cache_prune`)
        took = time.perf_counter() - started
        size = sum(int(f["bytes"]) for f in files.values())
        self.log(f"compile cache {self.entry}: restored {size:,} bytes ({kernels} Triton cache files) in {took:.2f} s")
        return Restored(self.entry, size, took)

    def store(self, since: float | None = None) -> Path | None:
        """Write what this process compiled as this key's entry (written aside, then renamed): torch's artifacts
        and, with `since` (a time.time()), the Triton cache folders written from then on. None when there is
        nothing to store or the root cannot be written (logged). An entry already there is kept."""
        if (self.entry / RECORD_FILE).is_file():
            return self.entry
        try:
            saved = self._save()
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be written costs the next load, nothing else
            self.log(f"compile cache {self.entry}: not stored: torch could not save its artifacts: "
                     f"{type(exc).__name__}: {exc}")
            return None
        if saved is None or not saved[0]:
            self.log(f"compile cache {self.entry}: nothing to store (torch recorded no compile artifacts)")
            return None
        data, info = saved
        tmp = self.engine_dir / f".{self.digest[:16]}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
            (tmp / ARTIFACTS_FILE).write_bytes(data)
            kernels = pack_new_folders(self._triton(), since, tmp / TRITON_FILE) if since is not None else 0
            files = {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size}
                     for p in sorted(tmp.iterdir()) if p.is_file()}
            record = {"key": self.key, "files": files, "triton_kernel_folders": kernels,
                      "created_unix": int(time.time()), "torch_info": _describe(info)}
            (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
            os.rename(tmp, self.entry)
        except (OSError, tarfile.TarError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if (self.entry / RECORD_FILE).is_file():  # another instance stored the same key first
                return self.entry
            self.log(f"compile cache {self.entry}: not stored: {type(exc).__name__}: {exc}")
            return None
        size = sum(f["bytes"] for f in files.values())
        self.log(f"compile cache {self.entry}: stored {size:,} bytes ({kernels} Triton kernel folders)")
        return self.entry

    def _ignore(self, why: str) -> None:
        self.log(f"compile cache {self.entry} ignored: {why}; compiling without it")

    def _log_absent(self) -> None:
        others = sorted(p for p in self.engine_dir.glob("*/" + RECORD_FILE)) if self.engine_dir.is_dir() else []
        for path in others:  # entries of this engine for another toolchain or settings: say what differs
            try:
                differs = key_differences(json.loads(path.read_text())["key"], self.key)
            except (OSError, ValueError, KeyError, TypeError):
                differs = ["unreadable record"]
            self.log(f"compile cache {path.parent} ignored: not this toolchain ({'; '.join(differs)})")
        self.log(f"compile cache {self.entry}: no entry yet; this load compiles and stores one")


def _describe(info: Any) -> Any:
    """torch's CacheInfo (artifact kinds -> keys) as JSON, or its repr."""
    for value in (info, getattr(info, "artifacts", None)):
        if isinstance(value, dict):
            try:
                return json.loads(json.dumps({str(k): [str(x) for x in v] if isinstance(v, (list, tuple)) else str(v)
                                              for k, v in value.items()}))
            except (TypeError, ValueError):
                break
    return repr(info)


def cache_root(setting: str | None, model_repository: Path | None) -> Path | None:
    """Where an `llm` model keeps compile caches: `setting` (its `compile_cache_dir` parameter) when set,
    none when it is "off", else `.compile-cache` in the root of the model repository."""
    value = (setting or "").strip()
    if value.lower() == "off":
        return None
    if value:
        return Path(value)
    return Path(model_repository).parent / DEFAULT_DIR_NAME if model_repository is not None else None


def inductor_cache_counts() -> dict[str, int]:
    """This process's FX graph cache and AOTAutograd cache hits, misses and bypasses so far (torch's counters)."""
    from torch._dynamo.utils import counters

    out = {name: int(counters["inductor"][f"fxgraph_cache_{name}"]) for name in ("hit", "miss", "bypass")}
    out.update({f"aot_{name}": int(counters["aot_autograd"][f"autograd_cache_{name}"])
                for name in ("hit", "miss", "bypass")})
    return out


def decode_step_cache(runner: Any, root: Path | None, *, pdl: bool, log: Log | None = None) -> CompileCache | None:
    """The entry for `runner`'s compiled decode step (CUDA graphs under torch.compile, `mode` "auto", `pdl`) under
    `root`; None without a root or CUDA graphs (nothing to cache)."""
    if root is None or getattr(runner, "graphs", None) is None:
        return None
    model = runner.model
    settings = {"compile": "auto", "decode_pdl": pdl, "whole_row_norms": True,
                "decode_attention": model.options.decode_attention, "decode_gemm": model.options.decode_gemm}
    return CompileCache(root, cache_key(runner.info.fingerprint, runner.device, settings), log=log,
                        triton_dir=triton_cache_dir(runner.device))


@contextlib.contextmanager
def kept(cache: CompileCache | None, log: Log | None = None) -> Iterator[Restored | None]:
    """Around a compile (and the graph captures that run it): restore `cache` first; after a compile that
    succeeded without it, store it. Logs the FX graph cache's hits/misses/bypasses of the block."""
    if cache is None:
        yield None
        return
    say = log or cache.log
    before = inductor_cache_counts()
    restored = cache.restore()
    started, since = time.perf_counter(), time.time() - 1.0  # mtimes may be coarser than time.time()
    yield restored
    after = inductor_cache_counts()
    say(f"compiled in {time.perf_counter() - started:.2f} s; FX graph cache " +
        ", ".join(f"{name} {after[name] - before[name]}" for name in after if not name.startswith("aot_")) +
        "; AOTAutograd cache " + ", ".join(f"{name[4:]} {after[name] - before[name]}" for name in after
                                           if name.startswith("aot_")))
    if restored is None:
        cache.store(since=since)
