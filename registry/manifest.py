"""Manifests: the sha256 and size of every file of an artifact tree.

A manifest is written last when an artifact is published, so its presence means the upload
finished; on download every file is checked against it. Paths are relative POSIX paths, sorted.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from registry.errors import ChecksumMismatchError, FileMismatch, ManifestError

MANIFEST_FORMAT = "enginewright.manifest/1"
CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class FileEntry:
    """One file of an artifact: relative POSIX path, sha256 (hex) and size in bytes."""

    path: str
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    """Every file of an artifact tree plus free-form metadata (fingerprint, model name, ...)."""

    files: tuple[FileEntry, ...]
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def total_size(self) -> int:
        """Sum of the file sizes in bytes."""
        return sum(f.size for f in self.files)

    def by_path(self) -> dict[str, FileEntry]:
        """Entries keyed by relative path."""
        return {f.path: f for f in self.files}

    def differing_paths(self, other: Manifest) -> list[str]:
        """Paths whose presence, checksum or size differ between the two manifests (meta ignored)."""
        mine, theirs = self.by_path(), other.by_path()
        return sorted(p for p in mine.keys() | theirs.keys() if mine.get(p) != theirs.get(p))

    def to_json(self) -> str:
        """Deterministic JSON text (sorted keys, files sorted by path)."""
        doc = {
            "format": MANIFEST_FORMAT,
            "meta": dict(self.meta),
            "total_size": self.total_size,
            "files": [{"path": f.path, "sha256": f.sha256, "size": f.size} for f in self.files],
        }
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "<manifest>") -> Manifest:
        """Parse and validate manifest JSON; ``source`` names where it came from in errors."""
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise ManifestError(f"Manifest at '{source}' is not valid JSON: {e}") from e
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise ManifestError(
                f"Manifest at '{source}' has format '{found}', expected '{MANIFEST_FORMAT}'."
            )
        try:
            files = tuple(
                FileEntry(path=str(f["path"]), sha256=str(f["sha256"]), size=int(f["size"]))
                for f in doc["files"]
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"Manifest at '{source}' has a malformed 'files' list: {e!r}") from e
        for f in files:
            check_relative_path(f.path, setting=f"files[].path in manifest '{source}'")
        return cls(files=tuple(sorted(files, key=lambda f: f.path)), meta=dict(doc.get("meta") or {}))


def check_relative_path(path: str, *, setting: str) -> str:
    """Refuse absolute paths, '..', empty segments and backslashes; return the path unchanged."""
    parts = path.split("/")
    if not path or path.startswith("/") or "\\" in path or any(p in ("", ".", "..") for p in parts):
        raise ManifestError(
            f"Invalid relative path '{path}' (from {setting}): expected a relative POSIX path "
            "without '.', '..' or empty segments."
        )
    return path


def hash_stream(stream: BinaryIO) -> tuple[str, int]:
    """sha256 hex digest and byte count of a binary stream, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    size = 0
    while chunk := stream.read(CHUNK_BYTES):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def hash_file(path: Path) -> tuple[str, int]:
    """sha256 hex digest and size of one file."""
    with open(path, "rb") as f:
        return hash_stream(f)


def iter_tree(root: Path) -> Iterator[str]:
    """Relative POSIX paths of every regular file under ``root`` (symlinks to files followed), sorted."""
    found: list[str] = []
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            full = Path(dirpath, name)
            if full.is_file():
                found.append(PurePosixPath(full.relative_to(root).as_posix()).as_posix())
    return iter(sorted(found))


def build_manifest(root: Path, *, meta: Mapping[str, Any]) -> Manifest:
    """Manifest of every file under ``root`` (sha256 + size, relative POSIX paths, sorted)."""
    root = Path(root)
    if not root.is_dir():
        raise ManifestError(f"Cannot build a manifest of '{root}': not a directory.")
    entries = []
    for rel in iter_tree(root):
        sha, size = hash_file(root / rel)
        entries.append(FileEntry(path=rel, sha256=sha, size=size))
    try:
        json.dumps(dict(meta))
    except TypeError as e:
        raise ManifestError(f"Manifest meta for '{root}' is not JSON-serializable: {e}") from e
    return Manifest(files=tuple(entries), meta=dict(meta))


def verify_tree(root: Path, manifest: Manifest) -> None:
    """Check every file under ``root`` against ``manifest``; raise ChecksumMismatchError on any difference."""
    root = Path(root)
    expected = manifest.by_path()
    present = set(iter_tree(root)) if root.is_dir() else set()
    mismatched = []
    for path, entry in expected.items():
        if path not in present:
            continue
        sha, size = hash_file(root / path)
        if sha != entry.sha256 or size != entry.size:
            mismatched.append(FileMismatch(path, entry.sha256, sha, entry.size, size))
    missing = sorted(expected.keys() - present)
    extra = sorted(present - expected.keys())
    if mismatched or missing or extra:
        raise ChecksumMismatchError(str(root), mismatched=mismatched, missing=missing, extra=extra)
