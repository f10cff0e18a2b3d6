"""The embedded Triton: the tritonserver bundled in nvidia-pytriton, started on loopback over the spec's
model repository and left running for clients after the command ends. A small JSON record beside the
repository holds its PID and URLs; `enginewright triton stop` ends it by PID.

Its addresses are stable: the first start picks free ports (or takes `Ports` from `triton start
--http-port/--grpc-port/--metrics-port`) and the record keeps them, also after a crash or a stop, so a
restart comes back where its clients (`enginewright serve --triton-grpc ...`) expect it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Ports:
    """Ports asked for on the command line; None keeps the recorded one (or picks a free one the first time)."""

    http: int | None = None
    grpc: int | None = None
    metrics: int | None = None


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


def read_record(repository: Path) -> EmbeddedServer | None:
    """The last recorded server of ``repository``, running or not."""
    path = record_path(repository)
    if not path.is_file():
        return None
    return EmbeddedServer(**json.loads(path.read_text()))


def recorded_server(repository: Path) -> EmbeddedServer | None:
    """The recorded server if its process still runs."""
    server = read_record(repository)
    return server if server is not None and _alive(server.pid) else None


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def ports_to_use(asked: Ports, last: EmbeddedServer | None) -> Ports:
    """The ports of the next start: those asked for, else the last recorded ones, else None (a free one)."""
    if last is None:
        return asked
    return Ports(http=asked.http or _port(last.http_url), grpc=asked.grpc or _port(last.grpc_url),
                 metrics=asked.metrics or _port(last.metrics_url))


def _busy(port: int | None) -> bool:
    import socket

    if port is None:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def running_server(repository: Path) -> EmbeddedServer | None:
    """The recorded server if its process still runs and answers ready."""
    from serving.triton.control import TritonControl

    server = recorded_server(repository)
    if server is not None and TritonControl(server.http_url, request_timeout_s=5).server_ready():
        return server
    return None


def ensure_embedded(repository: Path, *, ready_timeout_s: float = 60, load_timeout_s: float = 120,
                    ports: Ports | None = None) -> EmbeddedServer:
    """Reuse the running embedded server of this repository, or start one and load what the repository
    serves (after a crash or a reboot: the live versions, as the last release left them). A restart takes
    the recorded ports (or ``ports``); the first start free ones. A running server on other ports than
    ``ports`` asks for is an error: stop it first."""
    from serving.triton.control import TritonControl
    from serving.triton.errors import TritonStartError
    from serving.triton.operations import load_served
    from serving.triton.process import clean_up_after_crash, start_triton
    from serving.triton.repository import init_repository

    repository = repository.absolute()
    asked = ports or Ports()
    server = running_server(repository)
    if server is not None:
        if ports_to_use(asked, server) != ports_to_use(Ports(), server):
            raise TritonStartError(f"the embedded Triton of {repository} runs on HTTP {server.http_url}, gRPC "
                                   f"{server.grpc_url}, metrics {server.metrics_url}, not on the ports asked for "
                                   "(--http-port/--grpc-port/--metrics-port): `enginewright triton stop` it first")
        return server
    last = read_record(repository)
    if last is not None and not _alive(last.pid):  # crashed or killed: its stubs and shared memory go first
        clean_up_after_crash(last.pid, record_path(repository).stat().st_mtime)
    use = ports_to_use(asked, last)
    busy = [f"{name} port {port}" for name, port in (("HTTP", use.http), ("gRPC", use.grpc),
                                                      ("metrics", use.metrics)) if _busy(port)]
    if busy:
        raise TritonStartError(f"cannot start the embedded Triton of {repository} where it was: {', '.join(busy)} "
                               f"in use by another process (recorded in {record_path(repository)}); free it, or "
                               "choose others with --http-port/--grpc-port/--metrics-port")
    init_repository(repository)
    proc = start_triton(repository, log_path=repository.parent / "triton.log", ready_timeout_s=ready_timeout_s,
                        http_port=use.http, grpc_port=use.grpc, metrics_port=use.metrics)
    server = EmbeddedServer(
        proc.pid, proc.http_url, proc.grpc_url, proc.metrics_url, str(repository), str(proc.log_path)
    )
    record_path(repository).write_text(json.dumps(asdict(server), indent=2))
    load_served(TritonControl(server.http_url, setting="triton.model_repository"), repository, timeout_s=load_timeout_s)
    return server


def stop_embedded(repository: Path, *, timeout_s: float = 15) -> str:
    """Stop the recorded server by PID (SIGTERM, then SIGKILL after ``timeout_s``) and return once it and every
    python stub it started are gone (TritonStopError, naming them, when some outlive the SIGKILL); one that
    had already exited (crashed) is reported, with its log, and the shared memory it left is removed."""
    repository = repository.absolute()
    path = record_path(repository)
    if not path.is_file():
        return f"no embedded Triton recorded for {repository}"
    server = EmbeddedServer(**json.loads(path.read_text()))
    if not _alive(server.pid):
        from serving.triton.process import clean_up_after_crash

        removed = clean_up_after_crash(server.pid, path.stat().st_mtime)  # the record is written at start
        return (f"Triton pid {server.pid} ({server.http_url}) had already exited; its log is {server.log_path}"
                + (f"; removed the {removed} shared-memory regions it left in /dev/shm" if removed else ""))
    from serving.triton.process import server_processes, stop_server

    processes = server_processes(server.pid)
    stop_server(server.pid, timeout_s=timeout_s)
    # the record stays (its ports are where the next start comes back); its pid is dead now
    return (f"stopped Triton pid {server.pid} ({server.http_url}): it and its {len(processes) - 1} python stub "
            f"process(es) have exited")


def embedded_status(repository: Path) -> tuple[bool, str]:
    """Whether the embedded server of ``repository`` runs and answers ready, and a line saying so."""
    server = running_server(repository.absolute())
    if server is None:
        last = read_record(repository.absolute())
        where = f" (last on HTTP {last.http_url}, gRPC {last.grpc_url}; log {last.log_path})" if last else ""
        return False, f"no embedded Triton running for {repository}{where}"
    return True, f"Triton pid {server.pid}: HTTP {server.http_url}, gRPC {server.grpc_url}, metrics {server.metrics_url}"
