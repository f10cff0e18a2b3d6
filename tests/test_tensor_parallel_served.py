"""A tensor-parallel version served through real Triton (issue 52): the `llm` model's instance is rank 0 and starts
the worker rank as a process of its own; the version answers the one-rank version's greedy tokens; killing the
worker by PID fails the model's next request with an error naming the rank (at once, not a hang) and the
version rolls back to the one-rank version (its model unloaded); a worker never outlives its server, SIGKILLed."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from test_rollout_support import start_server
from triton_support import TritonServers, pid_alive

from serving.engine import EngineLimits, build_engine, convert_checkpoint
from serving.triton.client import infer_ids
from serving.triton.errors import InferenceError
from serving.triton.operations import apply_router_weights, serve_versions
from serving.triton.repository import list_versions, stage_engine_version
from tasks.rollback import restore_live
from tasks.targets import Target
from tasks.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow
NAME = "sharded"
PROMPT = [5, 17, 300, 42, 9, 11]
WORKER_MODULE = "serving.engine.parallel_worker"


def worker_pids(server_pid: int) -> list[int]:
    """The tensor-parallel workers among the server's descendants (children of its python stubs)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue

    def descends(pid: int) -> bool:
        while pid in parents and pid > 1:
            pid = parents[pid]
            if pid == server_pid:
                return True
        return False

    found = []
    for pid in parents:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if WORKER_MODULE in cmdline and descends(pid):
            found.append(pid)
    return sorted(found)


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not pid_alive(pid)


def test_a_tensor_parallel_version_serves_fails_clearly_without_its_worker_and_rolls_back(tmp_path):
    limits = EngineLimits(dtype="float32", max_batch_size=4, max_input_len=64, max_seq_len=128)
    ckpt = convert_checkpoint(make_tiny_model(tmp_path / "hf"), tmp_path / "ckpt", dtype="float32")
    one = build_engine(ckpt, tmp_path / "tp1", limits=limits).path
    two = build_engine(ckpt, tmp_path / "tp2", limits=limits, tensor_parallel=2).path
    servers = TritonServers(tmp_path)
    try:
        server = start_server(servers, tmp_path / "repository")
        repo, control = server.model_repository, server.control()
        v1 = stage_engine_version(repo, NAME, one, device_kind="cpu", parameters={"warmup": "false"})
        v2 = stage_engine_version(repo, NAME, two, device_kind="cpu", parameters={"warmup": "false"})
        serve_versions(control, repo, NAME, [v1, v2], timeout_s=180)
        apply_router_weights(control, repo, NAME, {v2: 100})
        [worker] = worker_pids(server.pid)

        want = infer_ids(server.http_url, f"{NAME}_v{v1}", PROMPT, max_tokens=8).output_ids
        got = infer_ids(server.http_url, NAME, PROMPT, max_tokens=8)
        assert got.routed_version == v2 and got.output_ids == want

        os.kill(worker, signal.SIGKILL)
        assert wait_gone(worker, 10)
        started = time.monotonic()
        with pytest.raises(InferenceError, match=rf"tensor-parallel worker rank 1 \(pid {worker}\) exited"):
            infer_ids(server.http_url, NAME, PROMPT, max_tokens=8, timeout_s=30)
        assert time.monotonic() - started < 10

        target = Target(url=server.http_url, model_repository=repo, setting="triton", grpc_url=server.grpc_url)
        restore_live([target], NAME, v1, timeout_s=60)  # the rollback's step on Triton: v2 unloaded and removed
        back = infer_ids(server.http_url, NAME, PROMPT, max_tokens=8)
        assert back.routed_version == v1 and back.output_ids == want
        assert list_versions(repo, NAME) == [v1] and worker_pids(server.pid) == []

        v3 = stage_engine_version(repo, NAME, two, device_kind="cpu", parameters={"warmup": "false"})
        serve_versions(control, repo, NAME, [v1, v3], timeout_s=180)  # the engine again: a new worker
        [again] = worker_pids(server.pid)
        os.kill(server.pid, signal.SIGKILL)
        assert wait_gone(again, 20), f"worker {again} outlived its SIGKILLed server"
    finally:
        servers.stop_all()
