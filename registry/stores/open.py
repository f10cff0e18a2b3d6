"""open_store: an ArtifactStore from a URI (the ``artifacts.uri`` setting)."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

from registry.errors import StoreConfigError
from registry.stores.base import ArtifactStore
from registry.stores.local import LocalStore
from registry.stores.s3 import S3Settings, S3Store


def open_store(uri: str, *, s3_settings: S3Settings | None = None) -> ArtifactStore:
    """``file:///abs/dir`` -> LocalStore, ``s3://bucket/prefix`` -> S3Store; anything else is an error."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise StoreConfigError(
                f"Unsupported artifact store URI '{uri}' (setting artifacts.uri): file URIs must be "
                "absolute and local, e.g. 'file:///var/lib/enginewright/artifacts'."
            )
        return LocalStore(Path(urllib.parse.unquote(parsed.path)))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise StoreConfigError(
                f"Artifact store URI '{uri}' (setting artifacts.uri) names no bucket: expected "
                "'s3://<bucket>/<prefix>'."
            )
        return S3Store(parsed.netloc, parsed.path.strip("/"), settings=s3_settings)
    raise StoreConfigError(
        f"Unsupported artifact store URI '{uri}' (setting artifacts.uri): scheme "
        f"'{parsed.scheme or '<none>'}' is not one of 'file', 's3'."
    )
