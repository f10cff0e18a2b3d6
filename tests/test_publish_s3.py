"""Publishing to S3 (moto's server over HTTP) through the publish step: immutability, tampering, crashes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from services import MlflowAuthServer, make_engine_folder

from registry.auth import AuthApi, MlflowCredentials, configure_release_permissions
from registry.errors import ChecksumMismatchError, IncompleteArtifactError
from registry.manifest import hash_file
from registry.model_registry import get_version
from registry.promotion_checks import require_complete
from registry.stores import artifact_key, open_store
from tasks.publish import publish

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def pipeline(mlflow_auth_server: MlflowAuthServer, s3_env, monkeypatch: pytest.MonkeyPatch) -> MlflowAuthServer:
    for name, value in mlflow_auth_server.publisher.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ENGINEWRIGHT_S3_MULTIPART_THRESHOLD_MIB", "5")
    monkeypatch.setenv("ENGINEWRIGHT_S3_MULTIPART_CHUNKSIZE_MIB", "5")
    return mlflow_auth_server


def new_model(auth: MlflowAuthServer, name: str) -> str:
    admin = AuthApi(auth.tracking_uri, MlflowCredentials(auth.admin.username, auth.admin.password))
    configure_release_permissions(admin, name, publisher=auth.publisher.username, approvers=[auth.approver.username])
    return name


def do_publish(auth: MlflowAuthServer, model: str, engine, artifacts_uri: str):
    return publish(model_name=model, tracking_uri=auth.tracking_uri, experiment=f"exp-{model}",
                   artifacts_uri=artifacts_uri, engine_info=engine, params={"model": model}, metrics={}, reports={})


def object_versions(s3, bucket: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in s3.client().list_object_versions(Bucket=bucket).get("Versions", []):
        counts[v["Key"]] = counts.get(v["Key"], 0) + 1
    return counts


def test_same_fingerprint_twice_overwrites_nothing(pipeline: MlflowAuthServer, s3_bucket: str, tmp_path: Path) -> None:
    pipeline.s3.client().put_bucket_versioning(Bucket=s3_bucket, VersioningConfiguration={"Status": "Enabled"})
    model = new_model(pipeline, "twice-model")
    engine = make_engine_folder(tmp_path / "engine", big_mib=6, seed=3)
    uri = f"s3://{s3_bucket}/engines"
    first = do_publish(pipeline, model, engine, uri)
    before = object_versions(pipeline.s3, s3_bucket)
    second = do_publish(pipeline, model, engine, uri)
    assert second.already_existed and not first.already_existed
    assert second.version == first.version and second.manifest_uri == first.manifest_uri
    assert object_versions(pipeline.s3, s3_bucket) == before and set(before.values()) == {1}
    found = MlflowClient(pipeline.tracking_uri).search_model_versions(f"name = '{model}'")
    assert [v.version for v in found] == [first.version]


def test_tampered_object_stops_promotion(pipeline: MlflowAuthServer, s3_bucket: str, tmp_path: Path) -> None:
    model = new_model(pipeline, "tamper-model")
    engine = make_engine_folder(tmp_path / "engine", big_mib=6, seed=4)
    uri = f"s3://{s3_bucket}/engines"
    published = do_publish(pipeline, model, engine, uri)
    key = f"engines/{model}/{engine.fingerprint}/files/weights/rank1.bin"
    client = pipeline.s3.client()
    data = bytearray(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    data[1000] ^= 0x01
    client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(data))
    expected, _ = hash_file(Path(engine.path) / "weights" / "rank1.bin")
    tampered = tmp_path / "tampered.bin"
    tampered.write_bytes(bytes(data))
    actual, _ = hash_file(tampered)

    info = get_version(pipeline.tracking_uri, model, published.version)
    require_complete(uri, info)  # the manifest is there: completeness alone does not catch tampering
    with pytest.raises(ChecksumMismatchError) as caught:
        open_store(uri).get_tree(artifact_key(model, engine.fingerprint), tmp_path / "fetched")
    message = str(caught.value)
    assert "file 'weights/rank1.bin'" in message and expected in message and actual in message
    assert not (tmp_path / "fetched" / "weights" / "rank1.bin").exists()


CHILD = textwrap.dedent("""
    import sys, threading, time
    from services import FakeEngine
    from tasks.publish import publish

    moved = 0
    lock = threading.Lock()

    def progress(path, nbytes):
        # Report every chunk (multipart parts upload on several threads: one whole line at a time); once the
        # big file is well under way, hold the upload open until the test's SIGKILL arrives, so the kill
        # lands mid-upload however loaded the machine is.
        global moved
        with lock:
            sys.stdout.write(f"progress {path} {nbytes}\\n")
            sys.stdout.flush()
            moved += nbytes if path == "weights/rank0.bin" else 0
        if moved > 6 * 1024 * 1024:
            time.sleep(120)

    model, bucket, fp, path = sys.argv[1:5]
    engine = FakeEngine(fp, path, {"torch": "2.13.0", "cuda": "none"})
    publish(model_name=model, tracking_uri=sys.argv[5], experiment="exp-" + model,
            artifacts_uri=f"s3://{bucket}/engines", engine_info=engine, params={}, metrics={}, reports={},
            progress=progress)
    print("done", flush=True)
""")


def test_killed_mid_upload_then_rerun_completes(pipeline: MlflowAuthServer, s3_bucket: str, tmp_path: Path) -> None:
    model = new_model(pipeline, "killed-model")
    engine = make_engine_folder(tmp_path / "engine", big_mib=16, seed=5)
    uri = f"s3://{s3_bucket}/engines"
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}:{REPO}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, model, s3_bucket, engine.fingerprint, engine.path, pipeline.tracking_uri],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    seen: set[str] = set()
    moved = 0
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, f"publisher exited early ({proc.poll()})"
            if line.startswith("progress"):
                _, path, n = line.split()
                seen.add(path)
                if path == "weights/rank0.bin":
                    moved += int(n)
                if moved > 6 * 1024 * 1024:  # inside the big multipart upload, after other files landed
                    break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    store = open_store(uri)
    key = artifact_key(model, engine.fingerprint)
    assert not store.has_manifest(key)
    with pytest.raises(IncompleteArtifactError):
        store.get_tree(key, tmp_path / "early")

    again = do_publish(pipeline, model, engine, uri)  # the re-run, in this process
    info = get_version(pipeline.tracking_uri, model, again.version)
    manifest = require_complete(uri, info)
    assert {e.path for e in manifest.files} == {"engine.json", "tokenizer.json", "weights/rank0.bin", "weights/rank1.bin"}
    store.get_tree(key, tmp_path / "fetched")  # every file verified against the manifest
    assert (tmp_path / "fetched" / "weights" / "rank0.bin").read_bytes() == (Path(engine.path) / "weights/rank0.bin").read_bytes()
    found = MlflowClient(pipeline.tracking_uri).search_model_versions(f"name = '{model}'")
    assert len(found) == 1
