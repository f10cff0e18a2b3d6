"""Compile-cache entries pile up (one per engine version and toolchain): a load removes the ones not needed.

`prune_entries(root, pruning, keep=...)` removes, under a compile-cache root (`compile_cache`'s layout,
`<root>/<fingerprint[:16]>/<key digest[:16]>/`), first every entry of an engine that is not staged (when
`pruning.staged` names the staged engines' fingerprints), then the least recently used entries (by their record's
modification time, which a restore refreshes) until the rest hold at most `pruning.max_bytes`; never `keep`, the
entry of the load that prunes. An entry is renamed aside before it is deleted, so a reader sees it whole or not at
all; a process that was about to restore it compiles instead (a cache that cannot be read is ignored). Folders
being written (dot-named) are left alone.

`pruning_for(setting, model_repository)` is the `llm` model's policy: in the repository's own `.compile-cache`,
the entries of engines no longer staged in that repository go, and the folder is capped at `DEFAULT_MAX_BYTES`; a
folder named by `compile_cache_dir` may be shared by several repositories, so there only the cap applies.

Imports: stdlib and `serving.engine.compile_cache` (torch).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from serving.engine.compile_cache import RECORD_FILE

DEFAULT_MAX_BYTES = 2 * 1024**3  # ~350 entries of the 1B engine's 5.6 MB
STAGED_ENGINES = "*/*/engine/engine.json"  # <repository>/<model>/<version>/engine/engine.json

Log = Callable[[str], None]


@dataclass(frozen=True)
class Pruning:
    """Which entries a load may remove besides its own."""

    max_bytes: int = DEFAULT_MAX_BYTES  # the least recently used go beyond this many bytes
    staged: frozenset[str] | None = None  # fingerprints of the engines whose entries stay; None: no engine's go


@dataclass(frozen=True)
class Entry:
    path: Path
    bytes: int
    used_unix: float  # the record's mtime: stored or last restored


def cache_entries(root: Path) -> list[Entry]:
    """Every whole entry under `root`, least recently used first."""
    out = []
    for record in root.glob(f"*/*/{RECORD_FILE}"):
        folder = record.parent
        if folder.name.startswith(".") or folder.parent.name.startswith("."):
            continue
        try:
            size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
            out.append(Entry(folder, size, record.stat().st_mtime))
        except OSError:  # removed meanwhile
            continue
    return sorted(out, key=lambda e: (e.used_unix, str(e.path)))


def staged_fingerprints(repository: Path) -> frozenset[str]:
    """The fingerprints in the engine folders of a Triton model repository's models (`STAGED_ENGINES`)."""
    out = set()
    for path in repository.glob(STAGED_ENGINES):
        try:
            fingerprint = json.loads(path.read_text()).get("fingerprint")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(fingerprint, str) and fingerprint:
            out.add(fingerprint)
    return frozenset(out)


def pruning_for(setting: str | None, model_repository: Path) -> Pruning | None:
    """The `llm` model's pruning for its `compile_cache_dir` `setting` (see `compile_cache.cache_root`): none when
    "off"; the cap alone for a folder it names; in the repository's own folder, the cap and the engines staged there
    (`model_repository` is the model's folder, as Triton passes it)."""
    value = (setting or "").strip()
    if value.lower() == "off":
        return None
    if value:
        return Pruning()
    staged = staged_fingerprints(Path(model_repository).parent)
    return Pruning(staged=staged or None)  # none found: another layout, so no engine's entries go for that alone


def prune_entries(root: Path, pruning: Pruning, *, keep: Path | None = None, log: Log | None = None) -> list[Path]:
    """Remove the entries under `root` that `pruning` lets go (never `keep`); returns their paths."""
    say = log or (lambda msg: None)
    if not root.is_dir():
        return []
    staged = {fp[:16] for fp in pruning.staged} if pruning.staged is not None else None
    removed: list[Path] = []
    left: list[Entry] = []
    for entry in cache_entries(root):
        if entry.path != keep and staged is not None and entry.path.parent.name not in staged:
            if _remove(entry, "its engine is no longer staged", say):
                removed.append(entry.path)
        else:
            left.append(entry)
    total = sum(e.bytes for e in left)
    for entry in left:  # least recently used first
        if total <= pruning.max_bytes:
            break
        if entry.path != keep and _remove(entry, f"the folder holds {total:,} bytes > {pruning.max_bytes:,}", say):
            removed.append(entry.path)
            total -= entry.bytes
    for engine_dir in root.iterdir():
        if engine_dir.is_dir() and not engine_dir.name.startswith(".") and not any(engine_dir.iterdir()):
            try:
                engine_dir.rmdir()
            except OSError:  # another load is writing an entry there
                pass
    return removed


def _remove(entry: Entry, why: str, say: Log) -> bool:
    aside = entry.path.with_name(f".{entry.path.name}.removing-{os.getpid()}")
    try:
        os.rename(entry.path, aside)
    except OSError as exc:  # another load removed or is using it: leave it
        say(f"compile cache {entry.path}: not removed ({why}): {type(exc).__name__}: {exc}")
        return False
    shutil.rmtree(aside, ignore_errors=True)
    say(f"compile cache {entry.path}: removed ({why}; {entry.bytes:,} bytes)")
    return True
