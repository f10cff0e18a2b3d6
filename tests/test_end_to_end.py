"""The whole release, end to end: release and promote flows against a real Triton process, real Prefect
(`prefect_test_harness`) and a real MLflow store, with a deliberately broken build beside it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flows.promote import PromoteResult, promote_flow
from flows.release import ReleaseResult, release_flow
from flows.spec import ReleaseSpec, parse_spec
from registry import model_registry as mr
from registry import tracking
from registry._client import mlflow_client
from registry.manifest import Manifest
from serving.engine import load_engine
from serving.triton.client import infer_ids
from serving.triton.process import start_triton
from serving.triton.repository import init_repository, router_weights
from tasks.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow

MODEL = "tiny-e2e"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("hf") / "tiny", seed=0)


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    repo = init_repository(tmp_path_factory.mktemp("triton") / "repository")
    server = start_triton(repo, log_path=repo.parent / "triton.log")
    yield server
    server.stop()


def make_spec(tmp: Path, checkpoint: Path, triton, **overrides) -> ReleaseSpec:
    data = {
        "source": {"checkpoint": str(checkpoint)},
        "engine": {"dtype": "float32", "max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128},
        "validation": {"max_new_tokens": 8, "prompts": ["The capital of France is", "Once upon a time", "def f(x):"]},
        # the A/B is not what this test judges (tests/test_gates.py and test_gates_evidence.py do): on a loaded
        # 2-core machine an equal engine's rounds against a 0.90 budget mostly end undecided, which refuses
        "perf": {"batch_size": 2, "input_len": 8, "output_len": 4, "iterations": 2, "max_slowdown": 0.5},
        "mlflow": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "model_name": MODEL},
        "artifacts": {"uri": (tmp / "artifacts").as_uri()},
        "approval": {"mode": "auto"},
        "triton": {"endpoints": [{"url": triton.http_url, "model_repository": str(triton.model_repository)}]},
        "rollout": {"steps": [{"set_weight": 10}, {"analysis": {"requests": 6}}, {"set_weight": 50},
                              {"analysis": {"requests": 6}}, {"set_weight": 100}, {"analysis": {"requests": 6}}]},
        "work_dir": str(tmp / "work"),
    }
    data.update(overrides)
    return parse_spec(data)


def test_release_and_promote_end_to_end(tmp_path, checkpoint, triton, prefect_harness):
    spec = make_spec(tmp_path, checkpoint, triton)
    state = release_flow(spec, return_state=True)
    assert state.is_completed(), state.message
    released: ReleaseResult = state.result()
    published = released.published

    info = mr.get_version(spec.mlflow.tracking_uri, MODEL, published.version)
    assert info.fingerprint == published.fingerprint
    assert set(info.tags) == set(mr.VERSION_TAGS), "machines read a few tags; people read the description"
    figures = tracking.run_metrics(spec.mlflow.tracking_uri, published.run_id)
    assert figures["validation_top1_agreement"] >= 0.99 and figures["perf_output_tokens_per_s"] > 0
    assert "candidate" in info.aliases
    page = mlflow_client(spec.mlflow.tracking_uri).get_model_version(MODEL, published.version).description
    assert page.startswith("**Gates passed.** Approving makes it the first live version") and "| validation |" in page
    assert f"torch {torch.__version__.split('+')[0]}" in page
    run_files = {a.path for a in mlflow_client(spec.mlflow.tracking_uri).list_artifacts(published.run_id)}
    assert "report" in run_files and "reports" not in run_files, run_files

    store_root = tmp_path / "artifacts" / MODEL / published.fingerprint
    manifest = Manifest.from_json((store_root / "manifest.json").read_text())
    assert manifest.files, "manifest lists no files"
    from tasks.hashing import file_sha256

    for entry in manifest.files:
        assert file_sha256(store_root / "files" / entry.path) == entry.sha256, entry.path

    promoted_state = promote_flow(spec, published.version, return_state=True)
    assert promoted_state.is_completed(), promoted_state.message
    promoted: PromoteResult = promoted_state.result()
    version = int(published.version)
    assert router_weights(triton.model_repository, MODEL) == {version: 100}
    assert promoted.rollout.metrics["rollout_failed_requests"] == 0
    assert promoted.timeline_png.is_file()
    assert "production" in mr.get_version(spec.mlflow.tracking_uri, MODEL, published.version).aliases

    runner = load_engine(Path(released.report_dir).parents[1] / "engines" / _engine_key(spec))
    prompt = [5, 17, 42, 99, 7]
    expected = runner.generate([prompt], max_new_tokens=8)[0].token_ids
    served = infer_ids(triton.http_url, MODEL, prompt, max_tokens=8)
    assert served.output_ids == expected
    assert served.routed_version == version

    # A second build of the same weights (new limits -> new fingerprint) is gray-released over the first.
    spec2 = make_spec(tmp_path, checkpoint, triton,
                      engine={"dtype": "float32", "max_batch_size": 8, "max_input_len": 64, "max_seq_len": 128})
    released2: ReleaseResult = release_flow(spec2, return_state=True).result()
    assert released2.published.version != published.version
    promoted2: PromoteResult = promote_flow(spec2, released2.published.version, return_state=True).result()
    v2 = int(released2.published.version)
    review = (released2.report_dir / "release-report.md").read_text()
    assert f"against production (version {published.version}, speed and fixed evaluation measured in this run)" \
        in review, "production's engine is fetched and measured beside the candidate"
    assert "Fixed evaluation: **passed**" in review and "## Fixed evaluation against production: PASSED" in review
    assert "| output tokens/s |" in review and "| top-1 agreement | 1 | 1 | same |" in review
    page2 = mlflow_client(spec.mlflow.tracking_uri).get_model_version(MODEL, released2.published.version).description
    assert f"### Against version {published.version}, which it would replace" in page2
    assert "fixed evaluation passed" in page2 and f"| performance | throughput / production v{published.version} " \
        "(same run) |" in page2
    for image in ("latency.png", "validation-divergence.png"):
        assert f"]({image})" in review
        assert (released2.report_dir / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert router_weights(triton.model_repository, MODEL) == {v2: 100}
    assert {r.version for r in promoted2.rollout.records} == {version, v2}, "both versions served during rollout"
    assert promoted2.rollout.metrics["rollout_failed_requests"] == 0
    assert infer_ids(triton.http_url, MODEL, prompt, max_tokens=8).output_ids == expected


def _engine_key(spec: ReleaseSpec) -> str:
    engines = sorted((spec.work_dir / "engines").iterdir())
    return engines[0].name


def test_broken_build_fails_validation_and_publishes_nothing(tmp_path, checkpoint, triton, prefect_harness,
                                                            monkeypatch):
    """A converter bug that swaps gate and up inside the fused w13 weight: the gate must catch it."""
    from serving.engine.models import llama

    table = llama.HF_TO_ENGINE  # the registry's entries share it
    gate, up = "model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"
    monkeypatch.setitem(table, gate, (table[gate][0], 1, 2))
    monkeypatch.setitem(table, up, (table[up][0], 0, 2))

    spec = make_spec(tmp_path, checkpoint, triton)
    state = release_flow(spec, return_state=True)

    assert state.is_failed()
    assert "validation gate failed" in state.message and "Nothing was published" in state.message
    report = next((spec.work_dir / "reports").rglob("validation.md")).read_text()
    assert "FAILED" in report
    assert "| diverged | token " in report, report  # which prompt diverged, at which token, both tokens
    from mlflow import MlflowClient

    assert MlflowClient(spec.mlflow.tracking_uri).search_model_versions(f"name = '{MODEL}'") == []
    assert not (tmp_path / "artifacts" / MODEL).exists()
