"""LocalStore: artifacts in a local directory (``file://`` URIs), the embedded default."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from registry.manifest import CHUNK_BYTES, FileEntry, hash_file, iter_tree
from registry.stores._tree import TreeStore
from registry.stores.base import FILES_DIR, ProgressFn, check_key


class LocalStore(TreeStore):
    """Artifact store in a local directory; files written aside then renamed, manifest last."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).absolute()

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def uri(self, key: str) -> str:
        """``file://<root>/<key>``."""
        return (self.root / check_key(key)).as_uri()

    def _path(self, key: str, name: str) -> Path:
        return self.root / key / name

    def _file_path(self, key: str, rel: str) -> Path:
        return self.root / key / FILES_DIR / rel

    def _read_bytes(self, key: str, name: str) -> bytes | None:
        try:
            return self._path(key, name).read_bytes()
        except FileNotFoundError:
            return None

    def _create_exclusive(self, key: str, name: str, data: bytes) -> bool:
        final = self._path(key, name)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.partial")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, final)  # atomic create-if-absent: fails if the manifest exists
            except FileExistsError:
                return False
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def _stored_matches(self, key: str, rel: str, entry: FileEntry) -> bool:
        path = self._file_path(key, rel)
        if not path.is_file() or path.stat().st_size != entry.size:
            return False
        return hash_file(path)[0] == entry.sha256

    def _upload(self, local: Path, key: str, rel: str, entry: FileEntry, progress: ProgressFn | None) -> None:
        dest = self._file_path(key, rel)
        dest.parent.mkdir(parents=True, exist_ok=True)
        _copy_atomic(local, dest, rel, progress)

    def _list_files(self, key: str) -> list[str]:
        base = self.root / key / FILES_DIR
        if not base.is_dir():
            return []
        return [p for p in iter_tree(base) if not p.rsplit("/", 1)[-1].endswith(".partial")]

    def _delete_file(self, key: str, rel: str) -> None:
        self._file_path(key, rel).unlink(missing_ok=True)

    def _download(self, key: str, rel: str, dest: Path, progress: ProgressFn | None) -> bool:
        src = self._file_path(key, rel)
        if not src.is_file():
            return False
        _copy(src, dest, rel, progress)  # dest is already a temp name (see TreeStore.get_tree)
        return True


def _copy(src: Path, dest: Path, rel: str, progress: ProgressFn | None) -> None:
    """Copy ``src`` to ``dest`` in chunks, reporting progress, and fsync."""
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        while chunk := fin.read(CHUNK_BYTES):
            fout.write(chunk)
            if progress is not None:
                progress(rel, len(chunk))
        fout.flush()
        os.fsync(fout.fileno())


def _copy_atomic(src: Path, dest: Path, rel: str, progress: ProgressFn | None) -> None:
    """Copy ``src`` to ``dest`` through a temp file in the same folder and ``os.replace``."""
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        _copy(src, tmp, rel, progress)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
