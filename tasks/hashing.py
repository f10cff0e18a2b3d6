"""Content hashes that key every step's output, so a re-run finds finished work instead of redoing it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from serving.engine.build import sha256_file as file_sha256  # the engine's own file hash


def tree_digest(root: Path) -> str:
    """sha256 over every file's relative path and content hash, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(root).as_posix()}\0{file_sha256(path)}\n".encode())
    return digest.hexdigest()


def value_digest(value: Any) -> str:
    """sha256 of a JSON-serialisable value in canonical form."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
