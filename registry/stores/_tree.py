"""The publish/fetch algorithm shared by every store, over a few storage primitives.

Publishing: build the manifest of the local tree; if the key already has a manifest, compare and
return it (or raise ArtifactExistsError); otherwise upload each file (skipping ones already
stored with the right checksum: that is how an interrupted upload resumes), delete stray files
left by an earlier attempt, and create the manifest last with create-if-absent semantics.
Fetching: refuse a key without a manifest, download each file aside, hash it, keep it only if it
matches, and report every mismatch at once.
"""

from __future__ import annotations

import logging
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from registry.errors import ArtifactExistsError, ChecksumMismatchError, FileMismatch, IncompleteArtifactError
from registry.manifest import FileEntry, Manifest, build_manifest, check_relative_path, hash_file
from registry.stores.base import FILES_DIR, MANIFEST_NAME, ProgressFn, PublishedArtifact, check_key

log = logging.getLogger(__name__)


class TreeStore(ABC):
    """Base of the concrete stores: implements ArtifactStore over storage primitives."""

    # -- primitives (paths are relative to the key; the key is validated) -----------------------

    @abstractmethod
    def uri(self, key: str) -> str:
        """The URI of the artifact folder for ``key``."""

    @abstractmethod
    def _read_bytes(self, key: str, name: str) -> bytes | None:
        """Content of ``<key>/<name>``, or None if absent."""

    @abstractmethod
    def _create_exclusive(self, key: str, name: str, data: bytes) -> bool:
        """Create ``<key>/<name>`` only if absent (atomically); False if it already existed."""

    @abstractmethod
    def _stored_matches(self, key: str, rel: str, entry: FileEntry) -> bool:
        """Whether ``<key>/files/<rel>`` already holds exactly ``entry``'s content."""

    @abstractmethod
    def _upload(self, local: Path, key: str, rel: str, entry: FileEntry, progress: ProgressFn | None) -> None:
        """Store the local file as ``<key>/files/<rel>`` (never visible half-written)."""

    @abstractmethod
    def _list_files(self, key: str) -> list[str]:
        """Relative paths stored under ``<key>/files/``."""

    @abstractmethod
    def _delete_file(self, key: str, rel: str) -> None:
        """Delete ``<key>/files/<rel>``."""

    @abstractmethod
    def _download(self, key: str, rel: str, dest: Path, progress: ProgressFn | None) -> bool:
        """Copy ``<key>/files/<rel>`` to ``dest``; False if the stored file is missing."""

    # -- ArtifactStore ----------------------------------------------------------------------------

    def manifest_uri(self, key: str) -> str:
        """The URI of the manifest for ``key``."""
        return f"{self.uri(key)}/{MANIFEST_NAME}"

    def has_manifest(self, key: str) -> bool:
        """Whether ``key`` holds a complete artifact."""
        return self._read_bytes(check_key(key), MANIFEST_NAME) is not None

    def read_manifest(self, key: str) -> Manifest:
        """The manifest under ``key``; IncompleteArtifactError if there is none."""
        data = self._read_bytes(check_key(key), MANIFEST_NAME)
        if data is None:
            raise IncompleteArtifactError(self.manifest_uri(key))
        return Manifest.from_json(data, source=self.manifest_uri(key))

    def put_tree(
        self,
        local_dir: Path,
        key: str,
        *,
        manifest_meta: Mapping[str, Any],
        progress: ProgressFn | None = None,
    ) -> PublishedArtifact:
        """Upload every file under ``local_dir`` to ``key``, then the manifest last (never overwritten)."""
        check_key(key)
        local_dir = Path(local_dir)
        manifest = build_manifest(local_dir, meta=manifest_meta)
        existing = self._existing(key, manifest)
        if existing is not None:
            return existing
        uploaded = skipped = 0
        for entry in manifest.files:
            if self._stored_matches(key, entry.path, entry):
                skipped += 1
                if progress is not None:
                    progress(entry.path, entry.size)
                continue
            self._upload(local_dir / entry.path, key, entry.path, entry, progress)
            uploaded += 1
        wanted = manifest.by_path()
        for rel in self._list_files(key):
            if rel not in wanted:
                log.info("removing stray file '%s' left by an earlier upload to %s", rel, self.uri(key))
                self._delete_file(key, rel)
        if not self._create_exclusive(key, MANIFEST_NAME, manifest.to_json().encode()):
            # Someone else completed the same key while we uploaded: same rules as above.
            existing = self._existing(key, manifest)
            assert existing is not None
            return existing
        log.info(
            "published %s: %d files uploaded, %d already present, %d bytes",
            self.uri(key), uploaded, skipped, manifest.total_size,
        )
        return PublishedArtifact(
            key=key,
            uri=self.uri(key),
            manifest_uri=self.manifest_uri(key),
            manifest=manifest,
            already_existed=False,
            uploaded_files=uploaded,
            skipped_files=skipped,
        )

    def get_tree(self, key: str, local_dir: Path, *, progress: ProgressFn | None = None) -> Manifest:
        """Download ``key`` into ``local_dir``; every file is verified against the manifest.

        A file already in ``local_dir`` with the manifest's size and sha256 (an earlier fetch of the same
        artifact: every release fetches production's engine again) is kept, not downloaded again; any
        other is replaced by the store's copy, which must match the manifest like every download."""
        manifest = self.read_manifest(key)
        local_dir = Path(local_dir)
        mismatched: list[FileMismatch] = []
        missing: list[str] = []
        for entry in manifest.files:
            dest = local_dir / check_relative_path(entry.path, setting=f"manifest {self.manifest_uri(key)}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            if _holds(dest, entry.sha256, entry.size):
                continue
            tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.partial")
            try:
                if not self._download(key, entry.path, tmp, progress):
                    missing.append(entry.path)
                    continue
                sha, size = hash_file(tmp)
                if sha != entry.sha256 or size != entry.size:
                    mismatched.append(FileMismatch(entry.path, entry.sha256, sha, entry.size, size))
                    continue
                os.replace(tmp, dest)
            finally:
                tmp.unlink(missing_ok=True)
        if mismatched or missing:
            raise ChecksumMismatchError(self.uri(key), mismatched=mismatched, missing=missing)
        return manifest

    def _existing(self, key: str, manifest: Manifest) -> PublishedArtifact | None:
        """The already published artifact under ``key`` if its content equals ``manifest``'s."""
        data = self._read_bytes(key, MANIFEST_NAME)
        if data is None:
            return None
        stored = Manifest.from_json(data, source=self.manifest_uri(key))
        differing = stored.differing_paths(manifest)
        if differing:
            raise ArtifactExistsError(self.uri(key), differing=differing)
        log.info("artifact %s already published with the same content; nothing uploaded", self.uri(key))
        return PublishedArtifact(
            key=key,
            uri=self.uri(key),
            manifest_uri=self.manifest_uri(key),
            manifest=stored,
            already_existed=True,
            skipped_files=len(stored.files),
        )


def files_prefix(key: str) -> str:
    """``<key>/files``: where the files of an artifact live."""
    return f"{key}/{FILES_DIR}"


def _holds(path: Path, sha256: str, size: int) -> bool:
    """``path`` is a file of exactly ``size`` bytes whose sha256 is ``sha256``."""
    if not path.is_file() or path.stat().st_size != size:
        return False
    return hash_file(path) == (sha256, size)
