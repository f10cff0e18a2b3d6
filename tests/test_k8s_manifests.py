"""The Kubernetes manifests validate against the Kubernetes schemas (strict) and keep their promises."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

K8S = Path(__file__).resolve().parents[1] / "deployments" / "k8s"
KUBERNETES_VERSION = "1.31"
KUSTOMIZATION = "kustomization.yaml"


def documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(p for p in K8S.glob("*.yaml") if p.name != KUSTOMIZATION):
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


def _overlay(folder: str) -> list[dict]:
    """The base's documents with an overlay's JSON6902 patches applied (what `kubectl apply -k` sends)."""
    overlay = yaml.safe_load((K8S / folder / KUSTOMIZATION).read_text())
    assert overlay["resources"] == [".."]
    base = yaml.safe_load((K8S / KUSTOMIZATION).read_text())
    assert sorted(base["resources"]) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != KUSTOMIZATION)
    docs = [d for _, d in documents()]
    for patch in overlay["patches"]:
        target = patch["target"]
        doc = next(d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"])
        for op in yaml.safe_load(patch["patch"]):
            *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in op["path"].split("/")[1:]]
            node = doc
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
            assert op["op"] == "replace" and last in node, op
            node[last] = op["value"]
    return docs


def test_the_tensor_parallel_2_fleet_asks_for_two_gpus_a_pod():
    docs = _overlay("tensor-parallel-2")
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    fleet = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "triton")
    resources = fleet["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "2"
    assert _by_kind("StatefulSet", "triton")["spec"]["template"]["spec"]["containers"][0]["resources"][
        "requests"]["nvidia.com/gpu"] == "1", "the base fleet is unchanged"
