"""MLflow tracking and model registry against a real ``mlflow server`` and the embedded sqlite URI."""

from __future__ import annotations

import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow import MlflowClient
from services import mlflow_embedded, mlflow_server  # noqa: F401

from registry.errors import ModelVersionNotFoundError, RegistryError
from registry.model_registry import (
    ALIAS_CANARY,
    ALIAS_CANDIDATE,
    RUN_MANIFEST_PATH,
    delete_alias,
    find_version_by_fingerprint,
    get_version,
    get_version_by_alias,
    get_version_tags,
    register_engine_version,
    set_alias,
    set_version_tag,
    version_source,
    version_ui_url,
)
from registry.stores import LocalStore, artifact_key
from registry.tracking import (
    end_run,
    log_artifact_dir,
    log_artifact_file,
    log_metrics,
    log_text,
    start_release_run,
)

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Tracking:
    kind: str
    uri: str
    artifact_location: str | None


@pytest.fixture(params=["server", "embedded"])
def tracking(request: pytest.FixtureRequest) -> Tracking:
    if request.param == "server":
        return Tracking("server", request.getfixturevalue("mlflow_server").tracking_uri, None)
    emb = request.getfixturevalue("mlflow_embedded")
    return Tracking("embedded", emb.tracking_uri, emb.mlflow_artifact_location)


def start_run(tracking: Tracking, name: str) -> str:
    return start_release_run(tracking.uri, "enginewright-test", run_name=name, params={}, tags={})


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def make_engine(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "engine.json").write_text('{"fingerprint": "x"}')
    (root / "weights.bin").write_bytes(b"\x01" * 4096)
    return root


def test_release_run_records_params_metrics_artifacts_and_status(tracking: Tracking, tmp_path: Path) -> None:
    run_id = start_release_run(
        tracking.uri, "enginewright-test", run_name="release tiny", params={"dtype": "bf16", "max_batch": 8},
        tags={"fingerprint": "fp1"},
    )
    log_metrics(tracking.uri, run_id, {"throughput_tok_s": 123.5, "ttft_p50_ms": 40})
    log_metrics(tracking.uri, run_id, {"throughput_tok_s": 130.0}, step=1)
    report = tmp_path / "report.md"
    report.write_text("# gate\nok\n")
    log_artifact_file(tracking.uri, run_id, report, artifact_path="reports")
    log_artifact_dir(tracking.uri, run_id, make_engine(tmp_path / "engine"), artifact_path="engine")
    log_text(tracking.uri, run_id, "all prompts matched\n", "reports/validation.md")
    end_run(tracking.uri, run_id, "FINISHED")

    client = MlflowClient(tracking.uri)
    run = client.get_run(run_id)
    assert run.data.params == {"dtype": "bf16", "max_batch": "8"}
    assert run.data.tags["fingerprint"] == "fp1" and run.info.run_name == "release tiny"
    assert run.data.metrics["throughput_tok_s"] == 130.0
    assert [m.value for m in client.get_metric_history(run_id, "throughput_tok_s")] == [123.5, 130.0]
    assert run.info.status == "FINISHED"
    assert sorted(a.path for a in client.list_artifacts(run_id, "reports")) == [
        "reports/report.md", "reports/validation.md"]
    if tracking.artifact_location:  # embedded: run artifacts beside the db, not in ./mlruns
        assert run.info.artifact_uri.startswith(tracking.artifact_location)
    assert sorted(a.path for a in client.list_artifacts(run_id, "engine")) == ["engine/engine.json", "engine/weights.bin"]
    with pytest.raises(RegistryError, match="'DONE'"):
        end_run(tracking.uri, run_id, "DONE")


def test_register_find_and_alias_an_engine_version(tracking: Tracking, tmp_path: Path) -> None:
    model, fingerprint = unique("tiny-llama"), unique("fp")
    store = LocalStore(tmp_path / "artifacts")
    published = store.put_tree(make_engine(tmp_path / "engine"), artifact_key(model, fingerprint),
                               manifest_meta={"fingerprint": fingerprint})
    run_id = start_run(tracking, "publish")
    manifest_file = tmp_path / "manifest.json"
    manifest_file.write_text(published.manifest.to_json())
    log_artifact_file(tracking.uri, run_id, manifest_file, artifact_path=RUN_MANIFEST_PATH.rsplit("/", 1)[0])

    source = version_source(published.manifest_uri, run_id=run_id)
    assert source == f"runs:/{run_id}/engine/manifest.json"  # file:// store -> runs:/ source
    version = register_engine_version(
        tracking.uri, model, fingerprint=fingerprint, source=source, run_id=run_id,
        manifest_uri=published.manifest_uri, tags={"dtype": "bf16"},
    )
    assert register_engine_version(tracking.uri, model, fingerprint=fingerprint, source=source,
                                   run_id=run_id) == version  # idempotent by fingerprint
    assert find_version_by_fingerprint(tracking.uri, model, fingerprint) == version
    assert find_version_by_fingerprint(tracking.uri, model, "fp-unknown") is None

    info = get_version(tracking.uri, model, version)
    assert info.source == source and info.run_id == run_id and info.fingerprint == fingerprint
    assert info.manifest_uri == published.manifest_uri and info.tags["dtype"] == "bf16"

    assert get_version_by_alias(tracking.uri, model, ALIAS_CANDIDATE) is None
    set_alias(tracking.uri, model, ALIAS_CANDIDATE, version)
    assert get_version_by_alias(tracking.uri, model, ALIAS_CANDIDATE) == version
    assert get_version(tracking.uri, model, version).aliases == (ALIAS_CANDIDATE,)
    delete_alias(tracking.uri, model, ALIAS_CANDIDATE)
    assert get_version_by_alias(tracking.uri, model, ALIAS_CANDIDATE) is None
    assert get_version_by_alias(tracking.uri, unique("no-such-model"), ALIAS_CANARY) is None
    with pytest.raises(RegistryError, match="'Production'"):
        set_alias(tracking.uri, model, "Production", version)

    set_version_tag(tracking.uri, model, version, "validation", "passed")
    assert get_version_tags(tracking.uri, model, version)["validation"] == "passed"
    with pytest.raises(ModelVersionNotFoundError, match="'999'"):
        get_version(tracking.uri, model, "999")


def test_s3_manifest_uri_is_accepted_as_source(tracking: Tracking) -> None:
    model, fingerprint = unique("tiny-llama"), unique("fp")
    run_id = start_run(tracking, "s3")
    manifest_uri = f"s3://releases/engines/{model}/{fingerprint}/manifest.json"
    source = version_source(manifest_uri, run_id=run_id)
    assert source == manifest_uri
    # fingerprint and manifest URI may come in the tags alone
    version = register_engine_version(tracking.uri, model, source=source, run_id=run_id,
                                      tags={"fingerprint": fingerprint})
    info = get_version(tracking.uri, model, version)
    assert info.source == manifest_uri and info.manifest_uri == manifest_uri and info.fingerprint == fingerprint
    with pytest.raises(RegistryError, match="fingerprint"):
        register_engine_version(tracking.uri, model, source=source, run_id=run_id, tags={})


def test_file_manifest_as_source(tracking: Tracking, tmp_path: Path) -> None:
    """A server refuses local sources: the manifest is logged into the run and runs:/ registered instead."""
    model, fingerprint = unique("tiny-llama"), unique("fp")
    published = LocalStore(tmp_path / "artifacts").put_tree(
        make_engine(tmp_path / "engine"), artifact_key(model, fingerprint), manifest_meta={})
    run_id = start_run(tracking, "file")
    version = register_engine_version(tracking.uri, model, fingerprint=fingerprint,
                                      source=published.manifest_uri, run_id=run_id)
    info = get_version(tracking.uri, model, version)
    assert info.manifest_uri == published.manifest_uri
    if tracking.kind == "server":
        assert info.source == f"runs:/{run_id}/engine/manifest.json"
        logged = MlflowClient(tracking.uri).download_artifacts(run_id, "engine/manifest.json", str(tmp_path))
        assert Path(logged).read_text() == published.manifest.to_json()
        with pytest.raises(RegistryError, match="file://"):  # without a run there is no way round
            register_engine_version(tracking.uri, model, fingerprint=unique("fp"), source=published.manifest_uri)
    else:
        assert info.source == published.manifest_uri  # sqlite stores any source unvalidated


def test_ui_link_and_ui_served(mlflow_server) -> None:  # noqa: F811
    assert version_ui_url("http://127.0.0.1:5000/", "tiny llama", "3") == (
        "http://127.0.0.1:5000/#/models/tiny%20llama/versions/3?workflowType=machine_learning"
    )
    with urllib.request.urlopen(mlflow_server.ui_base + "/", timeout=10) as resp:
        assert resp.status == 200 and b"<html" in resp.read(4096).lower()


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_a_stopped_test_server_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    from services import start_mlflow_server, stop_mlflow_server

    before = set(Path("/dev/shm").iterdir())
    server = start_mlflow_server(tmp_path / "server")
    try:
        with urllib.request.urlopen(f"{server.tracking_uri}/health", timeout=5) as resp:
            assert resp.status == 200
    finally:
        stop_mlflow_server(server)
    # folders only (MLflow's job store is one): other tests' servers may map shared-memory files meanwhile
    left = sorted(str(p) for p in set(Path("/dev/shm").iterdir()) - before if p.is_dir())
    assert left == [], f"the mlflow server left {left} in /dev/shm"
