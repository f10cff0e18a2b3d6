"""A gray release's Triton steps under steady load: `python3 -m bench rollout` (any device).

The changes the promote flow makes to Triton, in its order, without Prefect, MLflow or the analyses (those
live in ``tasks``, which ``serving`` does not import; the CPU test ``tests/test_rollout_triton.py`` runs the
real flow): version 1 live; version 2 staged, loaded beside it (over gRPC), warmed, the router at 10, 50 and
100 with ``hold_s`` at each, then version 1 unloaded (the finish); version 3 staged, loaded, warmed, 10%,
then rolled back (router to version 2 alone, version 3 unloaded). All three are the same engine folder.
``clients`` closed-loop HTTP clients call the router from a child process the whole time. Report: per
phase requests, failed, p50 / p99 ms, and each phase's p99 over the steady phases' (before, between, after).
"""

from __future__ import annotations

import json
import multiprocessing
import random
import threading
import time
from pathlib import Path
from typing import Any

from serving.engine.timing import percentile

RELEASE = "roll"
STEADY = ("before", "between", "after")


def _client_loop(url: str, prompt: list[int], gen_len: int, stop: Any, out: list, lock: threading.Lock) -> None:
    from serving.triton.client import infer_ids

    while not stop.is_set():
        started = time.monotonic()
        try:
            r = infer_ids(url, RELEASE, prompt, max_tokens=gen_len, timeout_s=120)
            record = (started, time.monotonic() - started, r.routed_version, "")
        except Exception as exc:  # noqa: BLE001 - every failure is a data point
            record = (started, time.monotonic() - started, None, f"{type(exc).__name__}: {exc}"[:300])
        with lock:
            out.append(record)


def _load_child(url: str, clients: int, prompt_len: int, gen_len: int, vocab_size: int, stop: Any, ready: Any,
                pipe: Any) -> None:
    rng = random.Random(0)
    records: list[tuple] = []
    lock, halt = threading.Lock(), threading.Event()
    threads = [threading.Thread(target=_client_loop, daemon=True,
                                args=(url, [rng.randrange(1, vocab_size) for _ in range(prompt_len)], gen_len, halt,
                                      records, lock)) for _ in range(clients)]
    for t in threads:
        t.start()
    ready.set()
    stop.wait()
    halt.set()
    for t in threads:
        t.join(timeout=150)
    pipe.send(records)


def phase_table(records: list[tuple], marks: list[tuple[str, float]]) -> dict[str, dict[str, Any]]:
    """Per phase (from its mark to the next): requests, failed, p50/p99 ms of the answered ones, versions answering."""
    bounds = [*marks, ("end", float("inf"))]
    out = {}
    for i, (phase, start) in enumerate(bounds[:-1]):
        recs = [r for r in records if start <= r[0] < bounds[i + 1][1]]
        lat = [r[1] * 1e3 for r in recs if not r[3]]
        out[phase] = {"requests": len(recs), "failed": sum(bool(r[3]) for r in recs),
                      "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
                      "versions": {str(v): sum(r[2] == v for r in recs) for v in sorted({r[2] for r in recs
                                                                                        if r[2] is not None})},
                      "errors": sorted({r[3] for r in recs if r[3]})[:3]}
    steady = [r[1] * 1e3 for r in records if not r[3] and any(_in(r, p, bounds) for p in STEADY)]
    steady_p99 = percentile(steady, 99)
    for phase, row in out.items():
        row["p99_over_steady"] = row["p99_ms"] / steady_p99 if steady_p99 else float("nan")
    out["steady (before+between+after)"] = {"requests": len(steady), "p99_ms": steady_p99,
                                            "p50_ms": percentile(steady, 50)}
    return out


def _in(record: tuple, phase: str, bounds: list[tuple[str, float]]) -> bool:
    for i, (name, start) in enumerate(bounds[:-1]):
        if name == phase and start <= record[0] < bounds[i + 1][1]:
            return True
    return False


def _grpc_client() -> bool:
    """Whether ``tritonclient.grpc`` imports here (loads go over gRPC then; over HTTP, which stalls clients, if not)."""
    try:
        import tritonclient.grpc  # noqa: F401
    except ImportError as exc:
        print(f"tritonclient.grpc does not import ({exc}): loads go over HTTP", flush=True)
        return False
    return True


def run_rollout_bench(engine_dir: Path, work: Path, *, clients: int, prompt_len: int, gen_len: int,
                      steady_s: float, hold_s: float, parameters: dict[str, str], out_json: Path | None = None,
                      load_timeout_s: float = 300.0) -> dict[str, Any]:
    """Stage three versions of ``engine_dir``, start Triton, and run the phases under load (module docstring)."""
    from serving.engine import read_engine_info
    from serving.triton import init_repository, stage_engine_version
    from serving.triton.client import generate_ids
    from serving.triton.control import TritonControl
    from serving.triton.operations import apply_router_weights, serve_versions
    from serving.triton.process import start_triton
    from serving.triton.repository import engine_model_name, remove_folder

    vocab_size = read_engine_info(engine_dir).model.vocab_size
    # a fresh repository and log each run: versions left by an earlier run would be served in place of
    # these three (with that run's parameters) and its log lines read as this run's
    if (work / "repo").exists():
        remove_folder(work / "repo")
    (work / "triton.log").unlink(missing_ok=True)
    root = init_repository(work / "repo")
    for _ in range(3):
        stage_engine_version(root, RELEASE, engine_dir, device_kind="auto", max_queue_size=1024,
                             max_queue_delay_us=100, parameters=parameters)
    proc = start_triton(root, log_path=work / "triton.log", ready_timeout_s=120)
    control = TritonControl(proc.http_url, grpc_url=proc.grpc_url if _grpc_client() else None,
                            setting="bench rollout")
    marks: list[tuple[str, float]] = []
    steps: list[dict[str, Any]] = []
    report: dict[str, Any] = {"loads_over": "grpc" if control.grpc_url else "http", "clients": clients, "prompt_len": prompt_len, "gen_len": gen_len, "steady_s": steady_s,
                              "hold_s": hold_s, "parameters": parameters, "steps": steps}

    def step(label: str, fn: Any) -> None:
        t = time.monotonic()
        fn()
        steps.append({"step": label, "s": round(time.monotonic() - t, 3)})
        print(f"  {label}: {time.monotonic() - t:.2f} s", flush=True)

    def warm(version: int) -> None:
        for i in range(3):
            generate_ids(proc.http_url, engine_model_name(RELEASE, version), [1 + i, 2, 3], max_tokens=4,
                         timeout_s=load_timeout_s)

    def weights(w: dict[int, int]) -> None:
        apply_router_weights(control, root, RELEASE, w, timeout_s=load_timeout_s)

    def mark(phase: str) -> None:
        marks.append((phase, time.monotonic()))
        print(f"[{time.monotonic() - t0:6.1f} s] {phase}", flush=True)

    t0 = time.monotonic()
    ctx = multiprocessing.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Event()
    recv, send = ctx.Pipe(duplex=False)
    child = None
    try:
        step("load v1", lambda: serve_versions(control, root, RELEASE, [1], timeout_s=load_timeout_s))
        step("warm v1", lambda: warm(1))
        step("router v1 100%", lambda: weights({1: 100}))
        child = ctx.Process(target=_load_child, daemon=True,
                            args=(proc.http_url, clients, prompt_len, gen_len, vocab_size, stop, ready, send))
        child.start()
        ready.wait(60)
        time.sleep(min(5.0, steady_s))  # the clients' first requests (their own warm-up) stay out of the phases
        mark("before")
        time.sleep(steady_s)
        mark("rollout 1->2 (10/50/100)")
        step("load v2 beside v1", lambda: serve_versions(control, root, RELEASE, [1, 2], timeout_s=load_timeout_s))
        step("warm v2", lambda: warm(2))
        for w in ({1: 90, 2: 10}, {1: 50, 2: 50}, {1: 0, 2: 100}):
            step(f"router {w}", lambda w=w: weights(w))
            time.sleep(hold_s)
        step("router v2 alone", lambda: weights({2: 100}))
        step("unload v1", lambda: serve_versions(control, root, RELEASE, [2], timeout_s=load_timeout_s))
        mark("between")
        time.sleep(steady_s)
        mark("rollback of 3 (10%, then back)")
        step("load v3 beside v2", lambda: serve_versions(control, root, RELEASE, [2, 3], timeout_s=load_timeout_s))
        step("warm v3", lambda: warm(3))
        step("router {2: 90, 3: 10}", lambda: weights({2: 90, 3: 10}))
        time.sleep(hold_s)
        step("router v2 alone", lambda: weights({2: 100}))
        step("unload v3", lambda: serve_versions(control, root, RELEASE, [2], timeout_s=load_timeout_s))
        mark("after")
        time.sleep(steady_s)
        mark("end")
    finally:
        if child is not None:
            stop.set()
            records = recv.recv() if recv.poll(180) else []
            child.join(timeout=10)
            report["phases"] = phase_table(records, marks[:-1] if marks and marks[-1][0] == "end" else marks)
            report["requests"] = len(records)
            report["failed"] = sum(bool(r[3]) for r in records)
        proc.stop(timeout_s=20)
        if out_json is not None:
            out_json.write_text(json.dumps(report, indent=1))
    return report


def render_phases(report: dict[str, Any]) -> str:
    rows = ["| phase | requests | failed | p50 ms | p99 ms | p99 / steady p99 |", "| --- | --- | --- | --- | --- | --- |"]
    for phase, row in report.get("phases", {}).items():
        rows.append(f"| {phase} | {row['requests']} | {row.get('failed', '')} | {row['p50_ms']:.0f} | "
                    f"{row['p99_ms']:.0f} | {row.get('p99_over_steady', float('nan')):.2f} |")
    return "\n".join(rows)
