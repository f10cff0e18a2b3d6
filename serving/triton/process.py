"""Start and stop the bundled ``tritonserver`` as a child process on loopback, explicit model control.

The server runs in its own session so ``stop()`` can signal it by PID (SIGTERM, then SIGKILL after a
timeout) without touching anything else, and returns only once the server and every python stub it
started are gone (``stop_server``). CPU-only flags are added only when no GPU is visible.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from serving.triton.control import TritonControl
from serving.triton.errors import TritonStartError, TritonStopError, TritonUnreachableError
from serving.triton.install import TritonInstall, locate_triton

CPU_FLAGS = (
    "--allow-gpu-metrics=false",
    "--pinned-memory-pool-byte-size=0",
)
# Our model configs are complete and our python models define no ``auto_complete_config``: config
# auto-complete would only start and tear down a throw-away python stub per model load (~1.3 s of every
# reload on 2 CPU cores; the configs Triton serves are the same with and without it, measured).
COMMON_FLAGS = (
    "--model-control-mode=explicit",
    "--disable-auto-complete-config",
    "--exit-timeout-secs=5",
    "--metrics-config=summary_latencies=true",
    "--strict-readiness=true",
)
TMP_COPY_GLOB = "folder*"  # python backend copies of models it localises (left behind in /tmp)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS picks it)."""
    return free_ports(host, 1)[0]


def free_ports(host: str, count: int, taken: tuple[int, ...] = ()) -> list[int]:
    """`count` distinct ports free a moment ago and none of `taken`: each socket stays bound while the next
    is picked (ports picked one at a time can repeat: Triton then refused to start with gRPC and metrics
    on the same port)."""
    sockets: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind((host, 0))
            port = int(s.getsockname()[1])
            if port not in taken:
                ports.append(port)
        return ports
    finally:
        for s in sockets:
            s.close()


def gpu_available() -> bool:
    """True when torch sees a CUDA device (checked lazily; torch may be absent on a client)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _tmp_copies() -> set[Path]:
    tmp = Path("/tmp")
    uid = os.getuid()
    found: set[Path] = set()
    for p in tmp.glob(TMP_COPY_GLOB):
        try:
            if p.is_dir() and not p.is_symlink() and p.stat().st_uid == uid:
                found.add(p)
        except OSError:
            continue
    return found


SHM_REGION_PREFIX = "triton_python_backend_shm_region_"
STUB_PROCESS_NAME = "triton_python_b"  # /proc/<pid>/comm keeps 15 characters of triton_python_backend_stub
TRITON_PROCESS_NAMES = ("tritonserver", STUB_PROCESS_NAME)


def stub_resources(server_pid: int) -> tuple[set[Path], set[str]]:
    """``/tmp/folder*`` dirs and ``/dev/shm`` region names on the command lines of this server's python
    stubs (``triton_python_backend_stub <model.py> <shm region> ...``)."""
    dirs: set[Path] = set()
    regions: set[str] = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != server_pid:
                continue
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        for arg in argv[1:2]:  # argv[1] is the model.py path
            path = Path(arg.decode(errors="replace"))
            for parent in path.parents:
                if parent.parent == Path("/tmp") and parent.name.startswith("folder"):
                    dirs.add(parent)
        region = argv[2].decode(errors="replace") if len(argv) > 2 else ""
        if region.startswith(SHM_REGION_PREFIX) and "/" not in region:
            regions.add(region)
    return dirs, regions


def orphaned_regions(since_s: float, *, settle_s: float = 0.2) -> set[str]:
    """python-backend regions in ``/dev/shm``, changed since ``since_s``, that no tritonserver or python stub
    maps in two looks ``settle_s`` apart: left by a server that died without unlinking them (a live server
    maps each region it creates, at once). Empty when such a process's mappings cannot be read."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return set()
    candidates = set()
    for path in shm.glob(f"{SHM_REGION_PREFIX}*"):
        try:
            if path.stat().st_mtime >= since_s:
                candidates.add(path.name)
        except OSError:
            continue
    candidates = _unmapped(candidates)
    if candidates:
        time.sleep(settle_s)
        candidates = _unmapped(candidates)
    return candidates


def kill_stubs_left_by(server_pid: int, *, timeout_s: float = 2.0) -> int:
    """SIGKILL the python stubs still in the process group of a server that died (``server_pid``, which led
    it); return how many. Matched by group and name, so a reused PID is never killed."""
    stubs = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text()
            pgrp = int(stat.rsplit(")", 1)[1].split()[2])
            name = (proc / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue
        if pgrp == server_pid and name == STUB_PROCESS_NAME:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)
                stubs.append(int(proc.name))
    deadline = time.monotonic() + timeout_s
    while any(_has_mappings(pid) for pid in stubs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(stubs)


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (state, ppid, pgrp, ...); None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def server_processes(server_pid: int) -> dict[int, str]:
    """The server and every process of its group or started by it (its python stubs), as ``{pid: start
    time}``: the start time tells a process from a later one that reuses its PID."""
    found: dict[int, str] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        pid = int(proc.name)
        fields = _stat_fields(pid)
        if fields is None or len(fields) < 20 or fields[0] == "Z":
            continue
        if pid == server_pid or int(fields[1]) == server_pid or int(fields[2]) == server_pid:
            found[pid] = fields[19]
    return found


def _still_running(processes: dict[int, str]) -> dict[int, str]:
    """Those of ``processes`` that run (a zombie has exited; another start time is another process)."""
    alive = {}
    for pid, started in processes.items():
        fields = _stat_fields(pid)
        if fields is not None and len(fields) >= 20 and fields[0] != "Z" and fields[19] == started:
            alive[pid] = started
    return alive


def _wait_gone(server_pid: int, processes: dict[int, str], timeout_s: float) -> dict[int, str]:
    """Wait until ``processes`` (and any the server starts meanwhile) have exited; those still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        processes = _still_running(processes)
        if server_pid in processes:  # while it runs it may start a stub (never once it is gone: its PID may be reused)
            processes = {**server_processes(server_pid), **processes}
        if not processes or time.monotonic() >= deadline:
            return processes
        time.sleep(0.05)


def _describe_processes(processes: dict[int, str]) -> str:
    names = []
    for pid in sorted(processes):
        try:
            names.append(f"{pid} ({Path(f'/proc/{pid}/comm').read_text().strip()})")
        except OSError:
            names.append(str(pid))
    return ", ".join(names)


def stop_server(server_pid: int, *, timeout_s: float = 15.0, kill_timeout_s: float = 5.0,
                orphan_grace_s: float = 1.0) -> None:
    """SIGTERM the server, wait up to ``timeout_s`` for it to exit and then up to ``orphan_grace_s`` for the python
    stubs it started (a zombie has exited: its parent reaps it), SIGKILL what is left, and wait ``kill_timeout_s``
    more. Returns only when every one is gone; else TritonStopError naming the PIDs. Stubs outlive an exited
    server by up to 15 s (they notice their parent gone on a timer) while nothing needs them: the server has
    already finalized its models (`--exit-timeout-secs`), and the caller unlinks the shared memory they mapped."""
    processes = server_processes(server_pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(server_pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    server = {pid: started for pid, started in processes.items() if pid == server_pid}
    while _still_running(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _wait_gone(server_pid, processes, orphan_grace_s)
    if not left:
        return
    for pid in left:  # by PID, each checked by its start time just above; the group may be gone already
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    left = _wait_gone(server_pid, left, kill_timeout_s)
    if left:
        raise TritonStopError(f"Triton pid {server_pid}: processes {_describe_processes(left)} still run "
                              f"{timeout_s:g} s after SIGTERM and {kill_timeout_s:g} s after SIGKILL; stop them by "
                              "hand (kill -9 PID) before starting a server on the same repository")


def _has_mappings(pid: int) -> bool:
    """False once the process is gone or a zombie (its memory released)."""
    try:
        return bool(Path(f"/proc/{pid}/maps").read_text())
    except OSError:
        return False


def clean_up_after_crash(server_pid: int, since_s: float) -> int:
    """After a server that led its process group died by itself (started at ``since_s``): kill its stubs,
    the last to map its shared memory, then unlink ``orphaned_regions(since_s)``; return how many."""
    kill_stubs_left_by(server_pid)
    regions = orphaned_regions(since_s)
    for region in regions:
        Path("/dev/shm", region).unlink(missing_ok=True)
    return len(regions)


def _unmapped(names: set[str]) -> set[str]:
    """``names`` that no Triton process (server or python stub) maps."""
    for proc in Path("/proc").glob("[0-9]*"):
        if not names:
            break
        try:
            if (proc / "comm").read_text().strip() not in TRITON_PROCESS_NAMES:
                continue
            text = (proc / "maps").read_text(errors="replace")
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            continue
        except OSError:
            return set()  # a Triton process we cannot look into: nothing is certain
        names = {name for name in names if name not in text}
    return names


@dataclass
class TritonProcess:
    """A running tritonserver; use as a context manager or call ``stop()``."""

    pid: int
    http_url: str
    grpc_url: str
    metrics_url: str
    model_repository: Path
    log_path: Path
    popen: subprocess.Popen = field(repr=False)
    started_s: float = 0.0
    _tmp_before: set[Path] = field(default_factory=set, repr=False)
    _tmp_seen: set[Path] = field(default_factory=set, repr=False)
    _shm_seen: set[str] = field(default_factory=set, repr=False)

    def control(self, *, setting: str = "triton.http_url") -> TritonControl:
        return TritonControl(self.http_url, setting=setting)

    def running(self) -> bool:
        return self.popen.poll() is None

    def note_tmp_copies(self) -> None:
        """Remember the python backend's ``/tmp/folder*`` copies and ``/dev/shm`` regions used by this
        server's live stubs (a killed server leaves its regions behind)."""
        if self.running():
            dirs, regions = stub_resources(self.pid)
            self._tmp_seen |= dirs
            self._shm_seen |= regions

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM the server by PID, SIGKILL after ``timeout_s``, and return once it and its python stubs are
        gone (``stop_server``); remove its /tmp copies (and, when it had crashed, the shared memory nothing maps
        any more); return the exit code."""
        crashed = not self.running()
        self.note_tmp_copies()
        if self.running():
            stop_server(self.pid, timeout_s=timeout_s)
        self.popen.wait(timeout=timeout_s)
        self._kill_leftover_stubs()
        self._remove_tmp_copies()
        for region in self._shm_seen:  # gone already after a clean shutdown
            Path("/dev/shm", region).unlink(missing_ok=True)
        if crashed:
            clean_up_after_crash(self.pid, self.started_s)
        return int(self.popen.returncode)

    def _kill_leftover_stubs(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _remove_tmp_copies(self) -> None:
        # Only dirs this server's stubs ran from, or that appeared while it ran and hold a copy of one of
        # its repository's models (config.pbtxt identical to one in our repository).
        ours = set(self._tmp_seen)
        configs = {p.read_bytes() for p in self.model_repository.glob("*/config.pbtxt") if p.is_file()}
        for cand in _tmp_copies() - self._tmp_before:
            try:
                if cand.stat().st_mtime < self.started_s:
                    continue
                cfg = cand / "config.pbtxt"
                if cfg.is_file() and cfg.read_bytes() in configs:
                    ours.add(cand)
            except OSError:
                continue
        for path in ours:
            shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> TritonProcess:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def build_command(install: TritonInstall, model_repository: Path, *, host: str, http_port: int,
                  grpc_port: int, metrics_port: int, gpu: bool, extra_args: tuple[str, ...] = ()) -> list[str]:
    """The tritonserver argv for one loopback server."""
    args = [
        str(install.server_bin),
        f"--model-repository={model_repository}",
        f"--backend-directory={install.backends_dir}",
        f"--http-address={host}", f"--http-port={http_port}",
        f"--grpc-address={host}", f"--grpc-port={grpc_port}",
        f"--metrics-address={host}", f"--metrics-port={metrics_port}",
        *COMMON_FLAGS,
    ]
    if not gpu:
        args.extend(CPU_FLAGS)
    args.extend(extra_args)
    return args


def start_triton(
    model_repository: Path,
    *,
    host: str = "127.0.0.1",
    http_port: int | None = None,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    log_path: Path,
    ready_timeout_s: float = 30.0,
    load_models: tuple[str, ...] = (),
    extra_args: tuple[str, ...] = (),
    install: TritonInstall | None = None,
) -> TritonProcess:
    """Start tritonserver on ``model_repository`` and wait until ``/v2/health/ready`` answers."""
    model_repository = Path(model_repository).resolve()
    if not model_repository.is_dir():
        raise TritonStartError(f"model repository {model_repository} (argument model_repository) is not a folder")
    install = install or locate_triton()
    asked = (http_port, grpc_port, metrics_port)
    picked = iter(free_ports(host, sum(p is None or p == 0 for p in asked), taken=tuple(p for p in asked if p)))
    ports = [p or next(picked) for p in asked]
    gpu = gpu_available()
    argv = build_command(install, model_repository, host=host, http_port=ports[0], grpc_port=ports[1],
                         metrics_port=ports[2], gpu=gpu,
                         extra_args=tuple(f"--load-model={m}" for m in load_models) + tuple(extra_args))
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_before = _tmp_copies()
    started = time.time()
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(argv, env=install.env, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    proc = TritonProcess(
        pid=popen.pid,
        http_url=f"http://{host}:{ports[0]}",
        grpc_url=f"{host}:{ports[1]}",
        metrics_url=f"http://{host}:{ports[2]}",
        model_repository=model_repository,
        log_path=log_path,
        popen=popen,
        started_s=started,
        _tmp_before=tmp_before,
    )
    control = proc.control(setting="start_triton(http_port)")
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if not proc.running():
            proc.stop()
            raise TritonStartError(
                f"tritonserver exited with code {popen.returncode} while starting on {proc.http_url} "
                f"(repository {model_repository}); log {log_path}:\n{_tail(log_path)}"
            )
        if control.server_ready():
            return proc
        if time.monotonic() > deadline:
            proc.stop()
            raise TritonStartError(
                f"tritonserver at {proc.http_url} was not ready within {ready_timeout_s:g} s "
                f"(argument ready_timeout_s); log {log_path}:\n{_tail(log_path)}"
            )
        time.sleep(0.05)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


__all__ = [
    "TritonProcess",
    "TritonUnreachableError",
    "build_command",
    "free_port",
    "gpu_available",
    "start_triton",
]
