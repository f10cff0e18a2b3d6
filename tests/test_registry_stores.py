"""Artifact stores against real storage: a local folder and moto's S3 server over HTTP."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from services import S3Server, s3_bucket, s3_env, s3_server  # noqa: F401

from registry.errors import (
    ArtifactExistsError,
    ChecksumMismatchError,
    IncompleteArtifactError,
    StoreConfigError,
    UploadError,
)
from registry.manifest import verify_tree
from registry.stores import ArtifactStore, LocalStore, S3Settings, S3Store, artifact_key, open_store

MIB = 1024 * 1024
KEY = artifact_key("tiny-llama", "fp0123abcd")


class Backend:
    """A store plus raw access to what it stored (to tamper with or inspect it)."""

    def __init__(self, store: ArtifactStore, write_raw: Callable[[str, bytes], None],
                 snapshot: Callable[[], dict[str, Any]]) -> None:
        self.store, self.write_raw, self.snapshot = store, write_raw, snapshot


def local_backend(root: Path) -> Backend:
    store = LocalStore(root)

    def write_raw(rel: str, data: bytes) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def snapshot() -> dict[str, Any]:
        return {p.relative_to(root).as_posix(): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}

    return Backend(store, write_raw, snapshot)


def s3_backend(s3: S3Server, bucket: str) -> Backend:
    settings = S3Settings.from_env()
    settings = S3Settings(
        endpoint_url=settings.endpoint_url, region_name=settings.region_name,
        multipart_threshold=5 * MIB, multipart_chunksize=5 * MIB, max_concurrency=2,
    )
    store = S3Store(bucket, "releases", settings=settings)
    raw = s3.client()

    def write_raw(rel: str, data: bytes) -> None:
        raw.put_object(Bucket=bucket, Key=f"releases/{rel}", Body=data)

    def snapshot() -> dict[str, Any]:
        objs = raw.list_objects_v2(Bucket=bucket).get("Contents", [])
        return {o["Key"]: (o["ETag"], o["LastModified"]) for o in objs}

    return Backend(store, write_raw, snapshot)


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "local":
        return local_backend(tmp_path / "store")
    return s3_backend(request.getfixturevalue("s3_env"), request.getfixturevalue("s3_bucket"))


def make_tree(root: Path, *, big: int = 0) -> Path:
    (root / "weights").mkdir(parents=True)
    (root / "engine.json").write_text('{"fingerprint": "fp0123abcd"}')
    (root / "weights" / "rank0.bin").write_bytes(bytes(range(256)) * 1024)
    (root / "tokenizer.json").write_text('{"vocab": {}}')
    if big:
        (root / "weights" / "big.bin").write_bytes(bytes(range(251)) * (big // 251 + 1))
    return root


def test_round_trip(backend: Backend, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    seen: dict[str, int] = {}
    published = backend.store.put_tree(src, KEY, manifest_meta={"fingerprint": "fp0123abcd"},
                                       progress=lambda p, n: seen.__setitem__(p, seen.get(p, 0) + n))
    assert not published.already_existed and published.uploaded_files == 3
    assert published.manifest_uri == published.uri + "/manifest.json"
    assert backend.store.has_manifest(KEY)
    assert seen["weights/rank0.bin"] == 256 * 1024
    manifest = backend.store.get_tree(KEY, tmp_path / "dst")
    assert manifest.meta == {"fingerprint": "fp0123abcd"}
    verify_tree(tmp_path / "dst", manifest)
    assert (tmp_path / "dst" / "engine.json").read_text() == '{"fingerprint": "fp0123abcd"}'


def test_publishing_twice_overwrites_nothing(backend: Backend, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    backend.store.put_tree(src, KEY, manifest_meta={"run": 1})
    before = backend.snapshot()
    again = backend.store.put_tree(src, KEY, manifest_meta={"run": 2})
    assert again.already_existed and again.uploaded_files == 0
    assert again.manifest.meta == {"run": 1}  # the stored record, untouched
    assert backend.snapshot() == before


def test_different_content_under_a_published_key_is_refused(backend: Backend, tmp_path: Path) -> None:
    backend.store.put_tree(make_tree(tmp_path / "a"), KEY, manifest_meta={})
    other = make_tree(tmp_path / "b")
    (other / "engine.json").write_text('{"fingerprint": "something else"}')
    before = backend.snapshot()
    with pytest.raises(ArtifactExistsError, match="engine.json") as exc:
        backend.store.put_tree(other, KEY, manifest_meta={})
    assert backend.store.uri(KEY) in str(exc.value)
    assert backend.snapshot() == before


def test_tampered_object_fails_naming_file_and_both_checksums(backend: Backend, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    published = backend.store.put_tree(src, KEY, manifest_meta={})
    data = bytearray((src / "weights" / "rank0.bin").read_bytes())
    data[1000] ^= 0xFF
    backend.write_raw(f"{KEY}/files/weights/rank0.bin", bytes(data))
    with pytest.raises(ChecksumMismatchError) as exc:
        backend.store.get_tree(KEY, tmp_path / "dst")
    message = str(exc.value)
    assert "weights/rank0.bin" in message
    assert published.manifest.by_path()["weights/rank0.bin"].sha256 in message
    assert hashlib.sha256(bytes(data)).hexdigest() in message
    assert not (tmp_path / "dst" / "weights" / "rank0.bin").exists()  # a bad file is never kept


def test_a_second_fetch_keeps_intact_local_files_and_replaces_the_others(backend: Backend, tmp_path: Path) -> None:
    """Fetching the same artifact again downloads only what the folder lacks or holds wrong: with the
    store's copy tampered, intact local files still verify (nothing downloaded), a damaged local file is
    fetched again and the tampered object is refused; with the object put back it is repaired."""
    src = make_tree(tmp_path / "src")
    backend.store.put_tree(src, KEY, manifest_meta={})
    dst = tmp_path / "dst"
    backend.store.get_tree(KEY, dst)
    weights = dst / "weights" / "rank0.bin"
    inode = weights.stat().st_ino
    intact = (src / "weights" / "rank0.bin").read_bytes()
    tampered = bytearray(intact)
    tampered[1000] ^= 0xFF
    backend.write_raw(f"{KEY}/files/weights/rank0.bin", bytes(tampered))
    manifest = backend.store.get_tree(KEY, dst)  # kept: the local copy matches the manifest
    verify_tree(dst, manifest)
    assert weights.stat().st_ino == inode
    weights.write_bytes(b"x" * len(intact))  # damaged locally, same size
    with pytest.raises(ChecksumMismatchError, match="weights/rank0.bin"):
        backend.store.get_tree(KEY, dst)
    backend.write_raw(f"{KEY}/files/weights/rank0.bin", intact)
    verify_tree(dst, backend.store.get_tree(KEY, dst))


def test_key_without_manifest_is_refused(backend: Backend, tmp_path: Path) -> None:
    backend.write_raw(f"{KEY}/files/engine.json", b"{}")
    assert not backend.store.has_manifest(KEY)
    with pytest.raises(IncompleteArtifactError, match="manifest.json"):
        backend.store.get_tree(KEY, tmp_path / "dst")


@pytest.mark.parametrize("crash", [RuntimeError, KeyboardInterrupt])
def test_interrupted_upload_is_completed_by_a_rerun(
    backend: Backend, tmp_path: Path, crash: type[BaseException]
) -> None:
    """A crash mid-upload leaves no manifest; the re-run keeps what landed and completes the rest.

    (s3transfer swallows a KeyboardInterrupt raised during a transfer: the store must notice.)
    """
    src = make_tree(tmp_path / "src")
    backend.write_raw(f"{KEY}/files/stale-from-an-old-attempt.bin", b"junk")

    def crash_on_weights(path: str, _n: int) -> None:
        if path == "weights/rank0.bin":
            raise crash("simulated crash")

    with pytest.raises(BaseException) as exc:
        backend.store.put_tree(src, KEY, manifest_meta={}, progress=crash_on_weights)
    assert isinstance(exc.value, (crash, UploadError))
    assert not backend.store.has_manifest(KEY)
    with pytest.raises(IncompleteArtifactError):
        backend.store.get_tree(KEY, tmp_path / "dst")

    published = backend.store.put_tree(src, KEY, manifest_meta={})
    assert not published.already_existed
    assert published.skipped_files == 2 and published.uploaded_files == 1  # what landed was kept
    manifest = backend.store.get_tree(KEY, tmp_path / "dst")
    verify_tree(tmp_path / "dst", manifest)  # nothing lost, the stale file gone
    assert not any("stale" in k for k in backend.snapshot())


def test_multipart_upload_of_a_large_file(s3_env: S3Server, s3_bucket: str, tmp_path: Path) -> None:  # noqa: F811
    backend = s3_backend(s3_env, s3_bucket)
    src = make_tree(tmp_path / "src", big=12 * MIB)
    backend.store.put_tree(src, KEY, manifest_meta={})
    head = s3_env.client().head_object(Bucket=s3_bucket, Key=f"releases/{KEY}/files/weights/big.bin")
    assert head["ETag"].strip('"').endswith("-3")  # 3 parts of 5 MiB at most
    manifest = backend.store.get_tree(KEY, tmp_path / "dst")
    verify_tree(tmp_path / "dst", manifest)


def test_open_store_by_uri(s3_env: S3Server, tmp_path: Path) -> None:  # noqa: F811
    local = open_store((tmp_path / "a").as_uri())
    assert isinstance(local, LocalStore) and local.uri(KEY) == (tmp_path / "a" / KEY).as_uri()
    s3 = open_store("s3://bucket/some/prefix")
    assert isinstance(s3, S3Store) and s3.uri(KEY) == f"s3://bucket/some/prefix/{KEY}"
    assert s3.settings.endpoint_url == s3_env.endpoint_url
    with pytest.raises(StoreConfigError, match=r"gs://bucket/x.*artifacts\.uri"):
        open_store("gs://bucket/x")


def test_missing_bucket_is_a_config_error(s3_env: S3Server, tmp_path: Path) -> None:  # noqa: F811
    store = S3Store("no-such-bucket", "p")
    with pytest.raises(StoreConfigError, match="no-such-bucket"):
        store.put_tree(make_tree(tmp_path / "src"), KEY, manifest_meta={})
