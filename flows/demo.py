"""`enginewright demo`: the whole job on embedded defaults, with nothing to set up.

A tiny Llama checkpoint is made offline; release 1 builds, gates and publishes it and goes live;
release 2 (same weights, a larger batch limit, so a new fingerprint) is gray-released over it
10 -> 50 -> 100 percent while requests flow. MLflow is a sqlite file, artifacts a local folder,
Triton the server bundled in nvidia-pytriton on 127.0.0.1, left running for clients.
"""

from __future__ import annotations

import json
from pathlib import Path

from flows.run import Outcome, run_promote, run_release
from flows.spec import ReleaseSpec, parse_spec


def demo_spec(state: Path, *, max_batch_size: int) -> ReleaseSpec:
    from registry.embedded import embedded_locations

    where = embedded_locations(state)
    return parse_spec(
        {
            "source": {"checkpoint": str(state / "tiny-llama-hf")},
            "engine": {"kind": "torch", "dtype": "float32", "max_batch_size": max_batch_size,
                       "max_input_len": 128, "max_seq_len": 256},
            "validation": {"max_new_tokens": 16},
            "perf": {"batch_size": 4, "input_len": 32, "output_len": 32, "iterations": 3,
                     "slo": {"min_output_tokens_per_s": 20, "max_ttft_p50_ms": 5000, "max_tpot_p50_ms": 500}},
            "mlflow": {"tracking_uri": where.tracking_uri, "model_name": "tiny-llama"},
            "artifacts": {"uri": where.artifacts_uri},
            "approval": {"mode": "auto"},
            "triton": {"model_repository": str(state / "triton-repository"), "load_timeout_s": 120},
            "rollout": {
                "concurrency": 2,
                "steps": [
                    {"set_weight": 10}, {"analysis": {"requests": 16}},
                    {"set_weight": 50}, {"analysis": {"requests": 16}},
                    {"set_weight": 100}, {"analysis": {"requests": 16}},
                ],
            },
            "work_dir": str(state / "work"),
        },
        origin="embedded demo spec",
    )


def release_and_promote(spec: ReleaseSpec, title: str) -> tuple[Outcome, Outcome | None]:
    print(f"\n=== {title}", flush=True)
    released = run_release(spec)
    print(released.summary(), flush=True)
    if not released.ok:
        return released, None
    promoted = run_promote(spec, released.result.published.version)
    print(promoted.summary(), flush=True)
    return released, promoted


def run_demo(state_dir: Path) -> int:
    from tasks.tiny_model import make_tiny_model

    state = state_dir.absolute()
    checkpoint = state / "tiny-llama-hf"
    if not (checkpoint / "config.json").is_file():
        make_tiny_model(checkpoint, arch="llama", seed=0)
        print(f"tiny Llama checkpoint written to {checkpoint}")

    first = release_and_promote(demo_spec(state, max_batch_size=8), "release 1: tiny-llama, max_batch_size 8")
    if not (first[1] and first[1].ok):
        return 1
    spec = demo_spec(state, max_batch_size=16)
    second = release_and_promote(spec, "release 2: same weights, max_batch_size 16, gray release over 1")
    if not (second[1] and second[1].ok):
        return 1
    print(summary(spec, second[0], second[1]))
    return 0


def summary(spec: ReleaseSpec, released: Outcome, promoted: Outcome) -> str:
    """What a person wants to see at the end: the version, its fingerprint, the gates and where it serves."""
    from flows.embedded import recorded_server

    rel, prom = released.result, promoted.result
    repository = spec.triton.model_repository.absolute()
    server = recorded_server(repository)
    endpoint = prom.endpoints[0]
    example = json.dumps({"inputs": [
        {"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["The capital of France is"]},
        {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [16]}]})
    grpc = f"gRPC {server.grpc_url}, metrics {server.metrics_url}" if server else "embedded server not found"
    return "\n".join([
        "",
        "=== demo finished",
        (f"promoted:     MLflow model {prom.model_name} version {prom.version} (alias production), "
         f"approved by {prom.approved_by}"),
        f"fingerprint:  {prom.fingerprint}",
        "validation:   " + ", ".join(f"{k.removeprefix('validation_')}={v:.4g}" for k, v in rel.validation_metrics.items()),
        "performance:  " + ", ".join(f"{k.removeprefix('perf_')}={v:.4g}" for k, v in rel.perf_metrics.items()),
        (f"rollout:      {prom.rollout.outcome}: {len(prom.rollout.records)} requests, "
         f"{prom.rollout.metrics['rollout_failed_requests']} failed; timeline {prom.timeline_png}"),
        f"live Triton:  {endpoint} (model {prom.model_name}; {grpc})",
        f"try it:       curl -s {endpoint}/v2/models/{prom.model_name}/infer -d '{example}'",
        f"stop it:      .venv/bin/enginewright triton stop --repository {_relative(repository)}",
        f"MLflow UI:    .venv/bin/mlflow ui --backend-store-uri {spec.mlflow.tracking_uri} --host 127.0.0.1 --port 5000",
    ])


def _relative(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
