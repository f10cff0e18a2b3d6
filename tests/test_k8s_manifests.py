"""The Kubernetes manifests validate against the Kubernetes schemas (strict) and keep their promises."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

K8S = Path(__file__).resolve().parents[1] / "deployments" / "k8s"
KUBERNETES_VERSION = "1.31"


def documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(f"{path.name}:{d['kind']}/{d['metadata']['name']}", d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


@pytest.mark.parametrize(("where", "doc"), documents(), ids=[w for w, _ in documents()])
def test_manifest_is_schema_valid(where, doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_an_invalid_manifest_is_refused():
    bad = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "x"}, "spec": {"replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def _by_kind(kind: str, name: str) -> dict:
    return next(d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name)


def test_triton_fleet_is_ready_only_when_triton_is():
    fleet = _by_kind("StatefulSet", "triton")
    pod = fleet["spec"]["template"]
    assert fleet["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    container = pod["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert "--model-control-mode=explicit" in container["args"], "the promote flow drives loads explicitly"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8002"
    assert _by_kind("Service", "triton")["spec"]["clusterIP"] == "None", "stable per-pod DNS for the fleet"


def test_a_restarted_triton_pod_is_ready_only_once_the_live_versions_are_loaded():
    pod = _by_kind("StatefulSet", "triton")["spec"]["template"]["spec"]
    loader = next(c for c in pod["containers"] if c["name"] == "load-served")
    script = " ".join(loader["args"])
    assert "enginewright triton load --url http://127.0.0.1:8000 --repository /models" in script
    assert script.index("triton load") < script.index("touch /tmp/loaded"), "ready only after the load succeeded"
    assert loader["readinessProbe"]["exec"]["command"] == ["test", "-f", "/tmp/loaded"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in loader["volumeMounts"]


def test_prefect_worker_takes_credentials_from_a_secret():
    worker = _by_kind("Deployment", "prefect-worker")["spec"]["template"]["spec"]["containers"][0]
    secret_envs = [e for e in worker["env"] if "valueFrom" in e]
    assert {e["name"] for e in secret_envs} >= {"MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY"}
    assert not any("value" in e and "PASSWORD" in e["name"] for e in worker["env"])
