"""Shared helpers of the rollout tests (no tests here): publish tiny engines into a local artifact store
and a sqlite MLflow registry without the release flow, start servers, build specs, make a first release,
check that a fleet is consistent, and a bounded load generator that reports latency percentiles per phase."""

from __future__ import annotations

import re
import time
from pathlib import Path

from rollout_load import LoadProcess
from triton_support import TritonServers

from flows.promote import PromoteResult, promote
from flows.spec import ReleaseSpec, parse_spec
from registry import model_registry as mr
from registry.stores import artifact_key, open_store
from serving.engine import read_engine_info
from serving.triton.client import infer_ids
from serving.triton.process import TritonProcess
from serving.triton.repository import (
    init_repository,
    list_versions,
    router_weights,
    served_versions,
)
from tasks.promote_spec import SetWeight
from tasks.rollout_state import read_journal
from tasks.targets import Target
from tasks.traffic import RequestRecord


def start_server(servers: TritonServers, repository: Path) -> TritonProcess:
    """A Triton over a fresh repository, started (and later stopped by PID) by ``servers``."""
    return servers.start(init_repository(repository))


def first_release(spec: ReleaseSpec, version: str = "1") -> PromoteResult:
    """Promote the first version of a model: with no live version to compare or shift from, the gray steps
    would only reload the router at 100% again, so the plan is the one step ``set_weight: 100``."""
    return promote(spec, version, rollout=spec.rollout.model_copy(update={"steps": [SetWeight(set_weight=100)]}))


def publish(tmp: Path, name: str, engine_dir: Path) -> str:
    """Upload ``engine_dir`` to the local store under its fingerprint and register it: the MLflow version."""
    fingerprint = read_engine_info(engine_dir).fingerprint
    store = open_store((tmp / "artifacts").as_uri())
    key = artifact_key(name, fingerprint)
    store.put_tree(engine_dir, key, manifest_meta={"model_name": name})
    return mr.register_engine_version(mlflow_uri(tmp), name, source=store.manifest_uri(key), fingerprint=fingerprint)


def mlflow_uri(tmp: Path) -> str:
    return f"sqlite:///{tmp / 'mlflow.db'}"


def make_spec(tmp: Path, name: str, servers: list, *, steps: list[dict], engine_parameters: dict | None = None,
              warmup_requests: int = 3, **rollout) -> ReleaseSpec:
    return parse_spec({
        "source": {"checkpoint": str(tmp)},
        "mlflow": {"tracking_uri": mlflow_uri(tmp), "model_name": name},
        "artifacts": {"uri": (tmp / "artifacts").as_uri()},
        "approval": {"mode": "auto"},
        "triton": {"endpoints": [{"url": s.http_url, "model_repository": str(s.model_repository),
                                  "metrics_url": s.metrics_url, "grpc_url": s.grpc_url} for s in servers],
                   "device": "cpu", "load_timeout_s": 90, "request_timeout_s": 30, "warmup_requests": warmup_requests,
                   "engine_parameters": engine_parameters or {"engine_loader": "tasks.fault_injection:load_engine"}},
        "rollout": {"steps": steps, "concurrency": 1, "hold": {"timeout_s": 20, "poll_s": 0.5}, **rollout},
        "work_dir": str(tmp / "work"),
    })


def targets_of(spec: ReleaseSpec) -> list[Target]:
    from tasks.targets import resolve_targets

    return resolve_targets(spec.triton)


def fleet_state(spec: ReleaseSpec) -> dict:
    """Everything that must agree, per endpoint, plus MLflow's aliases."""
    name, uri = spec.model_name, spec.mlflow.tracking_uri
    out = {"endpoints": []}
    for t in targets_of(spec):
        ready = sorted(int(m.name.removeprefix(f"{name}_v")) for m in t.control().repository_index()
                       if m.state == "READY" and re.fullmatch(rf"{re.escape(name)}_v\d+", m.name))
        routed = {infer_ids(t.url, name, [3, 4, 5], max_tokens=2, timeout_s=30).routed_version for _ in range(4)}
        out["endpoints"].append({"weights": router_weights(t.model_repository, name),
                                 "served": served_versions(t.model_repository, name),
                                 "folders": list_versions(t.model_repository, name), "ready": ready,
                                 "routed": sorted(routed),
                                 "leftovers": sorted(p.name for p in t.model_repository.iterdir()
                                                     if p.is_dir() and p.name.startswith((".staging", ".removing"))),
                                 "legacy": (t.model_repository / f"{name}_engine").exists()})
    journal = read_journal([t.model_repository for t in targets_of(spec)], name)
    out["journal"] = None if journal is None else (journal.phase, journal.candidate, journal.live)
    out["production"] = mr.get_version_by_alias(uri, name, mr.ALIAS_PRODUCTION)
    out["canary"] = mr.get_version_by_alias(uri, name, mr.ALIAS_CANARY)
    return out


def assert_consistent(spec: ReleaseSpec, version: int, *, production: bool = True) -> dict:
    """Every endpoint routes to, serves, holds and has loaded exactly ``version``; the journal is terminal."""
    state = fleet_state(spec)
    for ep in state["endpoints"]:
        assert ep == {"weights": {version: 100}, "served": [version], "folders": [version], "ready": [version],
                      "routed": [version], "leftovers": [], "legacy": False}, state
    assert state["journal"] is None or state["journal"][0] in ("done", "aborted", "interrupted"), state
    assert state["canary"] is None, state
    if production:
        assert state["production"] == str(version), state
    return state


LOADING = re.compile(r'"loading: ([^:"]+):\d+"')
ENGINE_INIT = re.compile(r'"\[(\S+) v\d+\] engine [0-9a-f]+ loaded from ')
UNLOADED = re.compile(r"\"successfully unloaded '([^']+)'")


class TritonLog:
    """Triton's log read in slices: what it printed since the previous ``take``."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = Path(path), 0

    def take(self) -> str:
        text = self.path.read_text(errors="replace")
        piece, self.offset = text[self.offset:], len(text)
        return piece

    @staticmethod
    def loads(text: str, release: str) -> list[str]:
        """Engine models Triton started loading (``loading: <release>_v<N>:1``), in order."""
        return [m for m in LOADING.findall(text) if re.fullmatch(rf"{re.escape(release)}_v\d+", m)]

    @staticmethod
    def engine_inits(text: str) -> list[str]:
        """Models whose llm initialized an engine (its ``engine <fingerprint> loaded from`` line), in order."""
        return ENGINE_INIT.findall(text)

    @staticmethod
    def unloads(text: str) -> list[str]:
        return UNLOADED.findall(text)


class Load:
    """A steady, bounded stream of requests through the router, with named phases, sent from a process of its
    own (``rollout_load``: the controller in this process would otherwise add its GIL waits to the latencies)."""

    def __init__(self, urls: list[str], name: str, *, concurrency: int = 2, max_requests: int = 20_000,
                 max_seconds: float = 400) -> None:
        self.proc = LoadProcess(urls, name, concurrency=concurrency, max_requests=max_requests,
                                max_seconds=max_seconds)
        self.marks: list[tuple[str, float]] = []

    def __enter__(self) -> Load:  # noqa: PYI034
        self.proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.stop()

    def wait_for(self, count: int, *, timeout_s: float) -> None:
        self.proc.wait_for(count, timeout_s=timeout_s)

    def records(self) -> list[RequestRecord]:
        """Every request, once the load has stopped (the ``with`` block has ended)."""
        return self.proc.stop()

    def mark(self, phase: str) -> None:
        self.marks.append((phase, time.monotonic() - self.proc.t0))

    def phases(self) -> dict[str, list[RequestRecord]]:
        records = self.records()
        bounds = [*self.marks, ("end", float("inf"))]
        return {phase: [r for r in records if start <= r.started_s < bounds[i + 1][1]]
                for i, (phase, start) in enumerate(bounds[:-1])}

    def table(self) -> str:
        rows = ["| phase | requests | failed | p50 ms | p99 ms | versions |", "| --- | --- | --- | --- | --- | --- |"]
        for phase, recs in self.phases().items():
            lat = sorted(r.latency_s * 1e3 for r in recs)
            p50, p99 = (_pct(lat, q) for q in (0.5, 0.99))
            versions = {v: sum(r.version == v for r in recs) for v in sorted({r.version for r in recs if r.version})}
            rows.append(f"| {phase} | {len(recs)} | {sum(not r.ok for r in recs)} | {p50:.1f} | {p99:.1f} "
                        f"| {versions} |")
        return "\n".join(rows)


def p99_ms(records: list[RequestRecord]) -> float:
    return _pct(sorted(r.latency_s * 1e3 for r in records), 0.99)


def _pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))] if sorted_values else float("nan")
