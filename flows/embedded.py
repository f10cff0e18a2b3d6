"""The embedded Triton: the tritonserver bundled in nvidia-pytriton, started on loopback over the spec's
model repository and left running for clients after the command ends. A small JSON record beside the
repository holds its PID and URLs; `enginewright triton stop` ends it by PID.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class EmbeddedServer:
    pid: int
    http_url: str
    grpc_url: str
    metrics_url: str
    model_repository: str
    log_path: str


def record_path(repository: Path) -> Path:
    return repository.parent / f"{repository.name}.server.json"


def _alive(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"tritonserver" in cmdline


def recorded_server(repository: Path) -> EmbeddedServer | None:
    """The recorded server if its process still runs."""
    path = record_path(repository)
    if not path.is_file():
        return None
    server = EmbeddedServer(**json.loads(path.read_text()))
    return server if _alive(server.pid) else None


def running_server(repository: Path) -> EmbeddedServer | None:
    """The recorded server if its process still runs and answers ready."""
    from serving.triton.control import TritonControl

    server = recorded_server(repository)
    if server is not None and TritonControl(server.http_url, request_timeout_s=5).server_ready():
        return server
    return None


def ensure_embedded(repository: Path, *, ready_timeout_s: float = 60, load_timeout_s: float = 120) -> EmbeddedServer:
    """Reuse the running embedded server of this repository, or start one on free loopback ports and load
    what the repository serves (after a crash or a reboot: the live versions, as the last release left them)."""
    from serving.triton.control import TritonControl
    from serving.triton.operations import load_served
    from serving.triton.process import start_triton
    from serving.triton.repository import init_repository

    repository = repository.absolute()
    server = running_server(repository)
    if server is not None:
        return server
    init_repository(repository)
    proc = start_triton(repository, log_path=repository.parent / "triton.log", ready_timeout_s=ready_timeout_s)
    server = EmbeddedServer(
        proc.pid, proc.http_url, proc.grpc_url, proc.metrics_url, str(repository), str(proc.log_path)
    )
    record_path(repository).write_text(json.dumps(asdict(server), indent=2))
    load_served(TritonControl(server.http_url, setting="triton.model_repository"), repository, timeout_s=load_timeout_s)
    return server


def stop_embedded(repository: Path, *, timeout_s: float = 15) -> str:
    """Stop the recorded server by PID (SIGTERM, then SIGKILL of its process group); one that had already
    exited (crashed) is reported, with its log, and the shared memory it left is removed."""
    repository = repository.absolute()
    path = record_path(repository)
    if not path.is_file():
        return f"no embedded Triton recorded for {repository}"
    server = EmbeddedServer(**json.loads(path.read_text()))
    if not _alive(server.pid):
        from serving.triton.process import clean_up_after_crash

        removed = clean_up_after_crash(server.pid, path.stat().st_mtime)  # the record is written at start
        path.unlink()
        return (f"Triton pid {server.pid} ({server.http_url}) had already exited; its log is {server.log_path}"
                + (f"; removed the {removed} shared-memory regions it left in /dev/shm" if removed else ""))
    os.kill(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(server.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(server.pid):
        os.killpg(server.pid, signal.SIGKILL)
    path.unlink()
    return f"stopped Triton pid {server.pid} ({server.http_url})"


def embedded_status(repository: Path) -> str:
    server = running_server(repository.absolute())
    if server is None:
        return f"no embedded Triton running for {repository}"
    return f"Triton pid {server.pid}: HTTP {server.http_url}, gRPC {server.grpc_url}, metrics {server.metrics_url}"
