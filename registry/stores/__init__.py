"""Artifact stores: ``file://`` (LocalStore) and ``s3://`` (S3Store) behind one interface."""

from registry.stores.base import (
    FILES_DIR,
    MANIFEST_NAME,
    ArtifactStore,
    ProgressFn,
    PublishedArtifact,
    artifact_key,
    check_key,
)
from registry.stores.local import LocalStore
from registry.stores.open import open_store
from registry.stores.s3 import S3Settings, S3Store

__all__ = [
    "FILES_DIR",
    "MANIFEST_NAME",
    "ArtifactStore",
    "LocalStore",
    "ProgressFn",
    "PublishedArtifact",
    "S3Settings",
    "S3Store",
    "artifact_key",
    "check_key",
    "open_store",
]
