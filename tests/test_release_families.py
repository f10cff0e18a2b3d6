"""Every architecture family through the real release flow: one tiny checkpoint per name in
`tasks.tiny_model.FAMILY_ARCHS` (a family stream appends its name there), each converted, built, validated
against HF transformers, perf-gated and published, with real services shared by the whole module: the
session's `mlflow server` on loopback, moto's S3 server over HTTP (the engine artifacts) and real Prefect.

The leanest spec that still runs every gate: one short prompt and one short passage, the envelope's one long
prompt and a wide batch of two, a perf measurement of two rounds. Each family is its own registered model, the
first of its name, so there is no production to compare with (the fixed evaluation and the A/B are skipped,
and say so: tests/test_end_to_end.py and tests/test_release_smollm2.py run those against production).
Approval and promotion are the same code for every family (tests/test_end_to_end.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from services import MlflowServer, S3Server, point_at_s3

from flows.release import ReleaseResult, release_flow
from flows.spec import ReleaseSpec, parse_spec
from registry import model_registry as mr
from registry import tracking
from tasks.tiny_model import FAMILY_ARCHS, make_tiny_model

pytestmark = pytest.mark.slow

ARTIFACT_PREFIX = "engines"


@dataclass(frozen=True)
class Services:
    root: Path
    tracking_uri: str
    s3: S3Server
    bucket: str


@pytest.fixture(scope="module")
def services(tmp_path_factory, prefect_harness, mlflow_server: MlflowServer, s3_server: S3Server) -> Iterator[Services]:
    """One bucket, one MLflow server, one Prefect API for every family; the S3 endpoint and credentials in the
    environment for the module (the publish step and the production lookup read them there)."""
    with pytest.MonkeyPatch.context() as env:
        point_at_s3(env, s3_server)
        bucket = f"families-{uuid.uuid4().hex[:8]}"
        s3_server.client().create_bucket(Bucket=bucket)
        yield Services(tmp_path_factory.mktemp("release-families"), mlflow_server.tracking_uri, s3_server, bucket)


def family_spec(services: Services, arch: str, checkpoint: Path, model: str) -> ReleaseSpec:
    return parse_spec({
        "source": {"checkpoint": str(checkpoint)},
        "engine": {"dtype": "float32", "max_batch_size": 2, "max_input_len": 32, "max_seq_len": 48},
        "validation": {"prompts": ["The capital of France is"], "max_new_tokens": 4,
                       "passages": ["Rain fell on the river and the river ran to the sea."],
                       "envelope": {"long_prompts": 1, "wide_batch": True}},
        "perf": {"batch_size": 1, "input_len": 4, "output_len": 2, "warmup": 0, "iterations": 2, "max_iterations": 2},
        "mlflow": {"tracking_uri": services.tracking_uri, "model_name": model},
        "artifacts": {"uri": f"s3://{services.bucket}/{ARTIFACT_PREFIX}"},
        "approval": {"mode": "auto"},
        "work_dir": str(services.root / arch / "work"),
    })


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_family_release_passes_its_gates_and_publishes(arch: str, services: Services) -> None:
    checkpoint = make_tiny_model(services.root / arch / "hf", arch=arch, seed=0)
    model = f"family-{arch}-{uuid.uuid4().hex[:6]}"
    spec = family_spec(services, arch, checkpoint, model)

    state = release_flow(spec, return_state=True)

    assert state.is_completed(), f"{arch}: {state.message}"
    released: ReleaseResult = state.result()
    published = released.published
    assert not published.already_existed and released.cache_hits == []
    assert released.validation_metrics["validation_top1_agreement"] >= 0.99, released.validation_metrics
    assert released.perf_metrics["perf_output_tokens_per_s"] > 0, released.perf_metrics
    reports = {p.name for p in released.report_dir.iterdir()}
    assert {"validation.md", "performance.md", "release-report.md"} <= reports, reports
    assert "PASSED" in (released.report_dir / "validation.md").read_text()

    source = json.loads(config_json(checkpoint))["architectures"]
    engine_record = engine_checkpoint_meta(spec)
    assert engine_record["source"]["architectures"] == source, "the engine was converted as its own family"

    info = mr.get_version(spec.mlflow.tracking_uri, model, published.version)
    assert info.fingerprint == published.fingerprint
    assert tracking.run_metrics(spec.mlflow.tracking_uri, published.run_id)["validation_top1_agreement"] >= 0.99

    key_root = f"{ARTIFACT_PREFIX}/{model}/{published.fingerprint}"
    s3 = services.s3.client()
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=services.bucket, Prefix=key_root)["Contents"]}
    assert f"{key_root}/manifest.json" in keys, sorted(keys)
    manifest = json.loads(s3.get_object(Bucket=services.bucket, Key=f"{key_root}/manifest.json")["Body"].read())
    assert {f"{key_root}/files/{entry['path']}" for entry in manifest["files"]} <= keys, "every listed file uploaded"


def config_json(checkpoint: Path) -> str:
    return (checkpoint / "config.json").read_text()


def engine_checkpoint_meta(spec: ReleaseSpec) -> dict:
    from serving.engine.convert import read_checkpoint_meta

    converted = [p.parent for p in (spec.work_dir).rglob("checkpoint.json")]
    assert len(converted) == 1, converted
    return read_checkpoint_meta(converted[0])
