"""Manifests: build, JSON round trip, verification naming the file and both checksums."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from registry.errors import ChecksumMismatchError, ManifestError
from registry.manifest import Manifest, build_manifest, verify_tree


def make_tree(root: Path) -> Path:
    (root / "weights").mkdir(parents=True)
    (root / "engine.json").write_text('{"fingerprint": "abc"}')
    (root / "weights" / "rank0.safetensors").write_bytes(bytes(range(256)) * 40)
    (root / "weights" / "empty.bin").write_bytes(b"")
    return root


def test_build_lists_every_file_sorted_with_sha256_and_size(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "engine")
    manifest = build_manifest(root, meta={"fingerprint": "abc"})
    assert [f.path for f in manifest.files] == ["engine.json", "weights/empty.bin", "weights/rank0.safetensors"]
    entry = manifest.by_path()["weights/rank0.safetensors"]
    data = (root / "weights" / "rank0.safetensors").read_bytes()
    assert entry.sha256 == hashlib.sha256(data).hexdigest() and entry.size == len(data)
    assert manifest.total_size == len(data) + len('{"fingerprint": "abc"}')
    verify_tree(root, manifest)


def test_json_round_trip_is_deterministic(tmp_path: Path) -> None:
    manifest = build_manifest(make_tree(tmp_path / "engine"), meta={"fingerprint": "abc", "n": 1})
    text = manifest.to_json()
    again = Manifest.from_json(text)
    assert again == manifest and again.to_json() == text


def test_one_changed_byte_names_the_file_and_both_checksums(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "engine")
    manifest = build_manifest(root, meta={})
    target = root / "weights" / "rank0.safetensors"
    data = bytearray(target.read_bytes())
    data[100] ^= 0x01
    target.write_bytes(bytes(data))
    expected = manifest.by_path()["weights/rank0.safetensors"].sha256
    actual = hashlib.sha256(bytes(data)).hexdigest()
    with pytest.raises(ChecksumMismatchError) as exc:
        verify_tree(root, manifest)
    message = str(exc.value)
    assert "weights/rank0.safetensors" in message and expected in message and actual in message
    assert [m.path for m in exc.value.mismatched] == ["weights/rank0.safetensors"]


def test_missing_and_extra_files_are_reported(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "engine")
    manifest = build_manifest(root, meta={})
    (root / "engine.json").unlink()
    (root / "stray.txt").write_text("x")
    with pytest.raises(ChecksumMismatchError) as exc:
        verify_tree(root, manifest)
    assert exc.value.missing == ("engine.json",) and exc.value.extra == ("stray.txt",)
    assert "engine.json" in str(exc.value) and "stray.txt" in str(exc.value)


def test_malformed_manifest_is_refused_with_its_source() -> None:
    with pytest.raises(ManifestError, match="s3://b/k/manifest.json"):
        Manifest.from_json("{}", source="s3://b/k/manifest.json")
    bad = '{"format": "enginewright.manifest/1", "files": [{"path": "../x", "sha256": "0", "size": 1}]}'
    with pytest.raises(ManifestError, match=r"\.\./x"):
        Manifest.from_json(bad)
