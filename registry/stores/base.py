"""The artifact-store interface and the key layout shared by every store.

Layout under a store's root URI::

    <model_name>/<fingerprint>/manifest.json        written last: its presence means complete
    <model_name>/<fingerprint>/files/<relative path> every file of the artifact tree

Keys are content-addressed by the engine fingerprint, and a key with a manifest is never
written again (immutability); a key with files but no manifest is an interrupted upload and is
completed by the next ``put_tree``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from registry.errors import ManifestError
from registry.manifest import Manifest

MANIFEST_NAME = "manifest.json"
FILES_DIR = "files"

# progress(relative_path, bytes_just_transferred): called as bytes move (skipped files report once).
ProgressFn = Callable[[str, int], None]

_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")


@dataclass(frozen=True)
class PublishedArtifact:
    """Where an artifact lives and what it holds."""

    key: str
    uri: str
    manifest_uri: str
    manifest: Manifest
    already_existed: bool
    uploaded_files: int = 0
    skipped_files: int = 0


@runtime_checkable
class ArtifactStore(Protocol):
    """A place to publish and fetch immutable, manifest-checked artifact trees."""

    def put_tree(
        self,
        local_dir: Path,
        key: str,
        *,
        manifest_meta: Mapping[str, Any],
        progress: ProgressFn | None = None,
    ) -> PublishedArtifact:
        """Upload every file under ``local_dir`` to ``key``, then the manifest last."""
        ...

    def get_tree(self, key: str, local_dir: Path, *, progress: ProgressFn | None = None) -> Manifest:
        """Download ``key`` into ``local_dir``, verifying every file against the manifest."""
        ...

    def has_manifest(self, key: str) -> bool:
        """Whether ``key`` holds a complete artifact."""
        ...

    def read_manifest(self, key: str) -> Manifest:
        """The manifest under ``key``; IncompleteArtifactError if there is none."""
        ...

    def uri(self, key: str) -> str:
        """The URI of the artifact folder for ``key``."""
        ...

    def manifest_uri(self, key: str) -> str:
        """The URI of the manifest for ``key``."""
        ...


def check_key(key: str) -> str:
    """Validate an artifact key: '/'-separated segments of [A-Za-z0-9._=+-], no leading dot."""
    parts = key.split("/")
    if not key or any(not _SEGMENT.match(p) for p in parts):
        raise ManifestError(
            f"Invalid artifact key '{key}': expected '/'-separated segments of letters, digits and "
            "'._=+-', each starting with a letter or digit (e.g. '<model_name>/<fingerprint>')."
        )
    return key


def artifact_key(model_name: str, fingerprint: str) -> str:
    """The content-addressed key of an engine artifact: ``<model_name>/<fingerprint>``."""
    return check_key(f"{model_name}/{fingerprint}")
